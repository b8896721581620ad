"""The engine's lifecycle: its states, the errors of a closed or failed engine, what it must release, and
how Ctrl-C is held back to a point where the state is consistent.

[Note: engine lifecycle]
An engine holds what Python's garbage collector does not order for it: the CPU optimizer thread,
page-locked host memory (``cudaHostRegister``) and the process's GPU memory cap. :class:`EngineResources`
releases them exactly once, at whichever comes first: ``engine.close()`` (or the end of a ``with``
block), the engine being garbage collected, or the interpreter's exit. The last two go through
``weakref.finalize``, which runs at exit from ``atexit``, while threads and CUDA still work; never
through ``__del__``, whose order against CUDA's own teardown at shutdown is undefined.

Why it matters: a daemon thread that is still inside a torch op when the interpreter finalizes is ended
by ``pthread_exit`` as soon as it takes the GIL back (Python <= 3.13). That forced unwind crosses a C++
``noexcept`` frame (the GIL guard's destructor in torch's bindings), and the process aborts with
``terminate called without an active exception`` (exit status 134). After the last step of a run the
worker is typically still applying that step's CPU updates, and after an error in a step it may be in
the middle of any of them: hence the abort after training and after a failed ``train_batch``. Releasing
first stops the thread (it finishes the task it is running, skips the queued ones, and is joined), waits
for the device, and only then unpins the memory and lifts the cap.

[Note: failure semantics]
Every public call runs under ``Lifecycle.guard``. An error there (any exception,
``KeyboardInterrupt`` included) is handled by the state the engine was in when it happened:

* ``OPEN``: nothing of the step was applied (the forward, the loss, the backward before any update, a
  refused plan, an out-of-memory error, a non-finite gradient norm). The step's transient state is
  dropped (its gradients, the pending micro-batch, the DeepSpeed-style micro-step count: an accumulation
  in progress starts again, staging buffers, device slots) and the original error propagates, with a
  note. Every weight and moment is as before the step and the engine is usable: bitwise, except after
  speculative updates (clipping, [Note: speculative updates] in update/speculation.py), which the discard rolls
  back algebraically, to fp32 rounding.
* ``APPLYING``: some units already hold the new step and others not (without clipping the CPU updates
  blocks during the backward, which is what hides its cost). AdamW cannot be undone bitwise, and keeping
  a copy to restore would cost a pass over all host state per step, so the engine becomes ``FAILED``.
* a failure of the CPU optimizer thread (:class:`~zerofit.engine.update.worker.WorkerError`): its update may
  be torn, and it may belong to a step that already returned: ``FAILED`` too.

A ``FAILED`` engine has released its resources and raises :class:`EngineFailedError` (chained to the
original error) from the failing call and from every later one: resume from the last checkpoint. (A
checkpoint load that fails after it began copying fails the engine the same way: ``Engine.load_checkpoint``.)

[Note: Ctrl-C inside a step]
During a public call from the main thread, while SIGINT has Python's default handler, the engine holds
Ctrl-C back: the first SIGINT only sets a flag. While nothing of the step is applied, the step stops at
its next block boundary (``Lifecycle.safe_point``) with ``KeyboardInterrupt``, and the failure semantics
above leave the state untouched. Once its updates began, the step runs to its end (at most the rest of
the backward and the optimizer step), and ``KeyboardInterrupt`` is raised as the call returns: the step
is then fully applied. A second SIGINT raises at once, wherever the step is (the engine may then fail).
A program that installed its own SIGINT handler keeps it; what it raises goes through the same guard.
SIGTERM is held back the same way while its handler is ``signal.default_int_handler`` (a program opts in
with ``signal.signal(signal.SIGTERM, signal.default_int_handler)``; SIGTERM's own default, SIG_DFL, still
ends the process). ``zerofit train`` installs its own handler for both ([Note: signals of a run],
train/signals.py): it lets the step finish, so that its checkpoint resumes bitwise.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import signal
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zerofit.engine.device import Device
from zerofit.engine.disk.tier import DiskTierError
from zerofit.engine.memory.store import HostArena
from zerofit.engine.update.worker import HostWorker, WorkerError
from zerofit.errors import ZerofitError

if TYPE_CHECKING:
    from zerofit.engine.disk.tier import DiskTier
    from zerofit.engine.distributed.node_slices import NodeSlices
    from zerofit.engine.distributed.ranks import Ranks

log = logging.getLogger("zerofit")

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # [Note: Ctrl-C inside a step]: while default_int_handler


class EngineState(enum.Enum):
    """What an engine's weights and optimizer state hold, and what an error would do to them."""

    OPEN = (
        "usable: every unit's master weights and moments hold the last applied optimizer step (updates "
        "of that step may still be running on the CPU worker or pending on the device; blocks of the step "
        "in progress may hold a speculative update, which a discard rolls back); the gradients of a step "
        "in progress may be accumulating. An error drops that step and leaves the engine OPEN."
    )
    APPLYING = (
        "an optimizer step's updates are being applied: some units may hold the new step and others "
        "the old one. An error now leaves the engine FAILED."
    )
    FAILED = (
        "an error interrupted APPLYING, or the CPU worker failed: weights and moments are no longer "
        "consistent. Resources are released; every call raises EngineFailedError."
    )
    CLOSED = (
        "close() ran: pending updates were applied and copied into the module's parameters, resources "
        "released; every call except `module` raises EngineClosedError."
    )


class EngineClosedError(ZerofitError, RuntimeError):
    """The engine was closed: it holds no device buffers and no CPU optimizer any more."""


class EngineFailedError(EngineClosedError):
    """A step failed after some of its updates were applied (or the CPU optimizer thread failed): the
    weights and optimizer state are inconsistent, and the engine refuses every call. See
    [Note: failure semantics]."""


def closed_message() -> str:
    return (
        "this engine was closed (engine.close(), or the end of its `with` block): it holds no device "
        "buffers and no CPU optimizer any more. Create a new one with zerofit.initialize(...) to train "
        "again (its model keeps the final weights: engine.module is still readable)"
    )


def failed_message(cause: str | None) -> str:
    # ``cause``: Lifecycle.failure, set whenever the state is FAILED
    return (
        f"the engine failed ({cause}) while it was changing its weights and optimizer state (an optimizer "
        "step, or a checkpoint load), which are now applied only in part: that step was not applied "
        "completely, and this engine cannot be used any more. Create a new engine and resume from the last "
        "checkpoint"
    )


@dataclass
class EngineResources:
    """What an engine must release, held apart from the engine so that ``weakref.finalize`` can release
    it without keeping the engine alive. See [Note: engine lifecycle]."""

    device: Device
    worker: HostWorker | None = None
    arenas: list[HostArena | NodeSlices] = field(default_factory=list)  # pinned host memory, unpinned on release
    capped: bool = False  # set_per_process_memory_fraction applied
    tier: DiskTier | None = None  # the disk tier (disk.py): its file removed
    ranks: Ranks | None = None  # its monitor stopped, its group closed
    locks: dict = field(default_factory=dict)  # checkpoint folders held (checkpoint/lock.py)
    released: bool = False

    def cap_gpu(self, max_gpu_memory: int) -> None:
        """Enforce the plan's GPU cap on the allocator (lifted at release). Running close to a cap, expandable
        segments keep fragmentation from turning into an out-of-memory error."""
        dev = self.device.device
        set_alloc = (
            getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        )
        set_alloc("expandable_segments:True")
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, max_gpu_memory / total), dev)
        self.capped = True

    def release(self) -> None:
        """Stop the worker, wait for the device, lift the GPU cap, unpin host memory. Idempotent; never
        raises (it runs at interpreter exit): problems are logged."""
        if self.released:
            return
        self.released = True
        if self.worker is not None and not self.worker.close():
            log.warning("zerofit: the CPU optimizer thread did not stop within 60 s; leaving it")
        try:
            self.device.synchronize()  # no copy into or out of pinned memory is in flight when it is unpinned
        except Exception as e:  # a CUDA error is sticky: what follows may fail too, and is logged
            log.warning("zerofit: waiting for the device at release failed: %r", e)
        if self.capped:
            try:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device.device)
            except Exception as e:
                log.warning("zerofit: lifting the GPU memory cap failed: %r", e)
            self.capped = False
        if self.tier is not None:
            try:
                self.tier.close()
            except Exception as e:
                log.warning("zerofit: removing the disk tier's swap file failed: %r", e)
        for arena in self.arenas:
            try:
                arena.close()
            except Exception as e:  # a NodeSlices has no single tensor: its ranges are named by the class
                what = (
                    f"{arena.tensor.numel() * arena.tensor.element_size()} bytes"
                    if isinstance(arena, HostArena)
                    else "the node's slices"
                )
                log.warning("zerofit: unpinning %s of host memory failed: %r", what, e)
        if self.ranks is not None:
            self.ranks.close()
        for lock in self.locks.values():  # [Note: one writer per folder]: another engine may save there now
            lock.release()
        self.locks.clear()


class InterruptDeferral:
    """Holds SIGINT (and SIGTERM) back during a call, as [Note: Ctrl-C inside a step] describes."""

    def __init__(self) -> None:
        self.pending = False  # a Ctrl-C arrived during the current call and was held back
        self.signal = "Ctrl-C"  # which one, in words
        self._active = False

    @contextlib.contextmanager
    def deferred(self):
        """Hold Ctrl-C back for the call; raise KeyboardInterrupt as it returns if one arrived.

        Only the outermost call acts (calls nest: close() waits), only on the main thread, and only for the
        signals (SIGINT, SIGTERM) whose handler is Python's default SIGINT handler."""
        held = (
            ()
            if self._active or threading.current_thread() is not threading.main_thread()
            else [s for s in HELD_SIGNALS if signal.getsignal(s) is signal.default_int_handler]
        )
        if not held:
            yield
            return
        self._active, self.pending = True, False
        previous = {s: signal.signal(s, self._handler) for s in held}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._active = False
            interrupted, self.pending = self.pending, False
        if interrupted:  # reached only when the call completed: its step is applied in full
            raise KeyboardInterrupt(
                f"{self.signal} during a step whose updates had begun: zerofit finished the "
                "step first, so the engine is consistent"
            )

    def _handler(self, signum, frame) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.pending:
            raise KeyboardInterrupt(f"second {name}: stopped at once")
        self.pending, self.signal = True, name
        log.warning(
            "zerofit: %s: stopping at the next safe point of this step "
            "(%s again stops at once, which may leave the engine failed)",
            name,
            name,
        )


class Lifecycle:
    """The engine's state machine (a part): its state, the error that failed it, Ctrl-C held back, and what it must
    release. One method per transition; :meth:`call` is the guard every public call runs under. The engine gives
    it, per call, what a failure does to the step: ``discard`` (drop the step in progress, nothing of it applied:
    the parts' ``reset()``; or only the transfers in flight) and ``drop`` (let go of every device buffer)."""

    def __init__(self, owner: object, device: Device, ranks: Ranks | None = None) -> None:
        """-> OPEN, with the resources to release registered for ``owner``'s garbage collection and exit."""
        self.state = EngineState.OPEN
        self.failure: str | None = None  # FAILED: the error that failed the engine, in words
        self.ranks = ranks
        self.interrupts = InterruptDeferral()
        self.resources = EngineResources(device, ranks=ranks)
        weakref.finalize(owner, self.resources.release)  # holds the resources, not the engine

    def check_open(self) -> None:
        """Refuse a call on a closed or failed engine, saying what to do."""
        if self.state is EngineState.FAILED:
            raise EngineFailedError(failed_message(self.failure))
        if self.state is EngineState.CLOSED:
            raise EngineClosedError(closed_message())

    @contextlib.contextmanager
    def call(self, discard, drop, dropped_step: bool = True):
        """A public call: Ctrl-C held back ([Note: Ctrl-C inside a step]), errors handled by :meth:`guard`."""
        with self.interrupts.deferred(), self.guard(discard, drop, dropped_step):
            yield

    @contextlib.contextmanager
    def guard(self, discard, drop, dropped_step: bool = True):
        """[Note: failure semantics]. ``discard()``: what an error in OPEN drops (the step in progress, for training
        calls; otherwise only the transfers in flight, so a DeepSpeed-style accumulation survives); ``drop()``:
        the device buffers of an engine that fails. ``dropped_step``: which of the two the note says."""
        try:
            yield
        except BaseException as err:
            ranks = self.ranks
            if ranks is not None and ranks.many and self.state not in (EngineState.FAILED, EngineState.CLOSED):
                # [Note: a failing rank] (ranks.py): the other ranks cannot go on without this one
                peer = ranks.peer_error(err)
                ranks.fail(err)
                self.fail(peer, drop)
                if peer is not err:
                    raise peer from err
                raise
            if self.state in (EngineState.FAILED, EngineState.CLOSED):
                raise  # a nested call handled it
            if self.state is EngineState.APPLYING or isinstance(err, (WorkerError, DiskTierError)):
                self.fail(err, drop)
                if isinstance(err, Exception):
                    raise EngineFailedError(failed_message(self.failure)) from err
                _add_note(err, "zerofit: " + failed_message(self.failure))
                raise  # KeyboardInterrupt, SystemExit keep their meaning
            try:
                discard()
            except BaseException as again:
                self.fail(again, drop)
                raise EngineFailedError(failed_message(self.failure)) from err
            _add_note(
                err,
                "zerofit: this step was not applied: its gradients were dropped (with those of any "
                "DeepSpeed-style micro-batches accumulated since the last optimizer step); every weight and "
                "moment is as before it, and the engine is usable"
                if dropped_step
                else "zerofit: nothing was applied; the engine is usable",
            )
            raise

    def begin_applying(self) -> None:
        """OPEN -> APPLYING: the step's first update is about to run; from here an error fails the engine."""
        self.state = EngineState.APPLYING

    def end_applying(self) -> None:
        """APPLYING -> OPEN: the step is applied (or its last updates are in flight on the worker)."""
        self.state = EngineState.OPEN

    @contextlib.contextmanager
    def applying(self):
        """APPLYING for the block (one unit's update being enqueued), then the state as it was before."""
        before, self.state = self.state, EngineState.APPLYING
        yield
        self.state = before

    def safe_point(self) -> None:
        """[Note: Ctrl-C inside a step]: a held-back Ctrl-C stops the step here while nothing of it is applied
        (an attribute read on the hot path)."""
        if self.interrupts.pending and self.state is EngineState.OPEN:
            raise KeyboardInterrupt(
                f"{self.interrupts.signal}: the step stopped before any of its updates; nothing was applied"
            )

    def fail(self, err: BaseException, drop) -> None:
        """-> FAILED: release everything (``drop()``: the device buffers); every later call raises
        EngineFailedError naming ``err``."""
        self.failure = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        self.state = EngineState.FAILED
        self.resources.release()
        drop()

    def close(self, finish, reset, drop) -> None:
        """Run ``finish()`` (apply pending updates, leave the final weights in the module's parameters) under the
        guard, then -> CLOSED: resources released, ``drop()``. Idempotent, and a no-op on a failed engine
        (already released). See [Note: engine lifecycle]."""
        if self.state in (EngineState.FAILED, EngineState.CLOSED):
            return
        try:
            with self.call(reset, drop, dropped_step=False):
                finish()
        finally:
            # finish() may have failed the engine: mypy keeps the narrowing of self.state from above across the call
            if self.state is not EngineState.FAILED:  # type: ignore[comparison-overlap]  # -> CLOSED
                self.state = EngineState.CLOSED
                self.resources.release()
                drop()


def _add_note(err: BaseException, note: str) -> None:
    """Attach ``note`` to ``err``'s traceback display (Python 3.11+; a no-op before)."""
    if hasattr(err, "add_note") and note not in getattr(err, "__notes__", ()):
        err.add_note(note)
