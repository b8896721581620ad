"""The CPU worker's tasks: each host-optimized unit's update, when and in which order (a part).

A unit's update is a task on the worker (update/worker.py): its AdamW step (:meth:`HostUpdates.apply`, also
chunk by chunk through the disk tier), or its first pass with the second queued behind every update ([Note:
moments after the forward], split_adamw.py), a speculative update and its settling ([Note: speculative
updates], speculation.py), a gradient added into its host buffer (the DeepSpeed-shaped loop's accumulation).
Each task waits for its gradient's download first ([Note: the worker's waits]) and sets the unit's
``updated`` event when the master holds the update; the main thread waits for it before the unit's next upload
(:meth:`HostUpdates.wait_updated`).

[Note: disk updates in order]
The worker runs waiting updates lowest block first (needed first by the next forward), but disk-tier
updates in the order they were submitted, after the in-memory ones: the order the engine told the
tier to read ahead in (``DiskTier.expect``), so that the chunks read ahead are the ones taken next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zerofit.engine.memory.store import CopyLabel, Unit
from zerofit.engine.update import split_adamw
from zerofit.engine.update.speculation import Speculation
from zerofit.engine.update.unit_adamw import unit_adamw
from zerofit.engine.update.worker import HostWorker, wait_event, waiting
from zerofit.optim.hyper import Hyper

if TYPE_CHECKING:
    from zerofit.engine.device import Event
    from zerofit.engine.disk.tier import DiskTier
    from zerofit.engine.memory.grads import Grads
    from zerofit.engine.step.timeline import Timeline


SPECULATE_FIRST = -(2**40)  # worker priority of speculation tasks ([Note: speculative updates])
DISK_LAST = 2**40  # worker priority of disk-tier updates: after the in-memory ones, FIFO among
# themselves, the order the tier reads ahead in ([Note: disk updates in order])
MOMENTS_LAST = 2**41  # moments passes: after every update the next forward needs, the last block first
# (the backward needs its gradient buffer first): [Note: moments after the forward]


class HostUpdates:
    """The tasks the step queues on the worker, and the main thread's waits for them. State: none of its own
    beyond its settings (``split``: deferred updates run in two passes; ``rest_threads``: the second pass's
    threads); the units' ``updated`` and ``moments_done`` events say what is pending."""

    def __init__(
        self,
        worker: HostWorker,
        grads: Grads,
        tier: DiskTier | None,
        clock: Timeline,
        *,
        deferred: bool,
        split: bool,
        rest_threads: int | None,
    ) -> None:
        self.worker, self.grads, self.tier, self.clock = worker, grads, tier, clock
        self.deferred, self.split, self.rest_threads = deferred, split, rest_threads

    def wait_updated(self, unit: Unit) -> None:
        """The main thread waits for the unit's pending CPU update (its next upload reads the master)."""
        waited = self.worker.wait_until(unit.updates.updated.is_set, unit.updates.updated.wait)
        if waited is not None:
            self.clock.add_wait(waited, unit.name)
        self.worker.check()

    def task_add(self, host: torch.Tensor, staging: torch.Tensor, event: Event) -> Callable[[], None]:
        def run():
            wait_event(event)  # [Note: the worker's waits]
            host.add_(staging.narrow(0, 0, host.numel()))
            self.grads.give_staging(staging)

        return run

    def apply(self, unit: Unit, grad: torch.Tensor | None, ops: list[tuple], part: str | None = None) -> None:
        """Run ``ops`` ((hypers, factor, inverse), in turn) on a host unit's state: the AdamW step, or a rollback
        and a redo; ``part``: one pass of a split step (unit_adamw; in-memory units only). A unit on the disk tier
        is streamed chunk by chunk ([Note: chunked updates], disk.py): each chunk read (ahead), updated, its
        16-bit copy refreshed ("all"), written back (behind)."""
        assert unit.master is not None and unit.exp_avg is not None and unit.exp_avg_sq is not None
        assert unit.step is not None  # a host unit's optimizer state (in memory, or views of the disk tier's file)
        if unit.swap is None:
            assert grad is not None  # only a unit on the disk tier has its gradient there
            lo, hi = unit.shard.lo, unit.shard.hi  # the whole unit, or this rank's shard ([Note: sharded units])
            out16 = None
            if part == "cast":  # the first pass writes the 16-bit copy alone ([Note: the master behind its cast])
                assert unit.host16 is not None
                out16 = unit.host16[lo:hi]
            threads = split_adamw.rest_threads(self.rest_threads) if part in ("moments", "rest") else None
            for hypers, factor, inverse in ops:
                unit_adamw(
                    unit,
                    unit.master[lo:hi],
                    grad,
                    unit.exp_avg[lo:hi],
                    unit.exp_avg_sq[lo:hi],
                    unit.step,
                    hypers,
                    factor,
                    start=lo,
                    inverse=inverse,
                    part=part,
                    out16=out16,
                    threads=threads,
                )
            return
        assert part is None, "a unit on the disk tier is updated in one pass"
        tier, key = self.tier, unit.index
        assert tier is not None  # the unit is on it
        step0 = unit.step.clone()
        s = step0
        for c, (a, k) in enumerate(tier.chunks(key)):
            with waiting("disk"):  # [Note: the worker's waits]
                f = tier.acquire(key, c)
            p = f["master"] if unit.swap == "all" else unit.master[a : a + k]
            g = f["grad"] if grad is None else grad[a : a + k]  # [Note: gradients on the disk]
            s = step0.clone()
            for hypers, factor, inverse in ops:
                unit_adamw(unit, p, g, f["exp_avg"], f["exp_avg_sq"], s, hypers, factor, start=a, inverse=inverse)
            if unit.swap == "all":
                assert unit.host16 is not None  # its upload source
                unit.host16[a : a + k].copy_(p)
            tier.release(key, c)
        unit.step.copy_(s)

    def priority(self, unit: Unit) -> int:
        """The unit's place in the worker's queue: [Note: disk updates in order]."""
        return DISK_LAST if unit.swap else unit.index

    def expect(self, units, grads_written: bool = True) -> None:
        """Tell the disk tier which swapped units' updates come next, in order (it reads their state ahead).
        With gradients on the disk, only once they are written (``grads_written``): [Note: gradients on the
        disk]."""
        if self.tier is not None and (grads_written or not self.deferred):
            self.tier.expect([u.index for u in units if u.swap])

    def task_update(
        self,
        unit: Unit,
        grad: torch.Tensor | None,
        event: Event,
        hypers: tuple[Hyper, ...],
        factor: float,
        release: bool,
        cast16: CopyLabel | None = None,
        split: bool = False,
        flag: int | None = None,
        before: Callable[[], None] | None = None,
        cast: Speculation | None = None,
    ) -> Callable[[], None]:
        """The worker's AdamW step of a host unit; with ``cast16`` (a label: Copies16.label) its new weights are
        then cast into its 16-bit host copy ([Note: 16-bit copies after the update]). ``split``: the step's first
        pass only, the caller queues the second (task_moments); with ``cast16`` too, that first pass writes the
        cast alone ([Note: the master behind its cast]). ``before``: run first, once the gradient is down (the
        user's clip multiply: [Note: the user's clip on the device], torch_clip.py). ``cast``: a speculation whose
        cast of this unit, if the worker made it, this first pass keeps ([Note: a speculated cast])."""

        def run():
            wait_event(event)  # [Note: the worker's waits]
            if cast is not None and id(unit) in cast.speculated:  # (split, cast16: Step._queue_deferred)
                assert unit.step is not None and cast16 is not None
                unit.step.add_(1)  # the first pass counts the step
                unit.copy16.made(cast16)
                unit.updates.updated.set()
                return
            if before is not None:
                before()
            if flag is not None and float(self.grads.bad_host[flag]):  # [Note: non-finite gradients without a norm]
                if release:
                    assert grad is not None  # ``release``: the staging buffer it came down into
                    self.grads.give_staging(grad)
                unit.updates.updated.set()
                return
            g = grad.narrow(0, 0, unit.shard.hi - unit.shard.lo) if grad is not None else None
            if split and cast16 is not None:
                self.apply(unit, g, [(hypers, factor, False)], part="cast")
            else:
                self.apply(unit, g, [(hypers, factor, False)], part="master" if split else None)
                if cast16 is not None:
                    assert unit.host16 is not None and unit.master is not None  # a 16-bit copy is kept
                    unit.host16.copy_(unit.master)
            if release:
                assert grad is not None  # as above
                self.grads.give_staging(grad)
            if cast16 is not None:
                unit.copy16.made(cast16)  # read by the main thread only after ``updated``
            unit.updates.updated.set()

        return run

    def task_moments(
        self, unit: Unit, grad: torch.Tensor, hypers: tuple[Hyper, ...], factor: float, with_master: bool = False
    ) -> Callable[[], None]:
        """[Note: moments after the forward]: the second pass of the unit's last update, queued behind every
        update (the worker runs its first pass first): the moments, and ``with_master`` the master too ([Note:
        the master behind its cast]). Until it has run, the unit's gradient buffer and moments (and then its
        master) are not touched: await_moments."""

        def run():
            self.apply(
                unit,
                grad.narrow(0, 0, unit.shard.hi - unit.shard.lo),
                [(hypers, factor, False)],
                part="rest" if with_master else "moments",
            )
            unit.updates.moments_done.set()

        return run

    def await_moments(self, unit: Unit) -> None:
        """A unit updated in two passes ([Note: moments after the forward], split_adamw.py) keeps the gradient its
        moments pass reads in its host buffer until that pass has run (the worker runs it after the updates the forward
        needed, while the post pass and the backward go on, the last block first). The unit's next gradient must not
        come down into that buffer before: wait for it here (rarely: the backward reaches the unit later). Every other
        reader of the moments (a checkpoint, the next update, a rollback) drains the worker first."""
        waited = self.worker.wait_until(unit.updates.moments_done.is_set, unit.updates.moments_done.wait)
        if waited is not None:
            self.clock.add_wait(waited, f"moments[{unit.name}]")

    def task_speculate(
        self, unit: Unit, spec: Speculation, event: Event, hypers: tuple[Hyper, ...]
    ) -> Callable[[], None]:
        """[Note: speculative updates]: update with factor 1 unless the partial norm already proves clipping.
        The unit stays not ``updated`` until its settle task has run: only that one decides what the master is."""

        def run():
            wait_event(event)  # [Note: the worker's waits]
            if spec.admit(float(self.grads.block_sq[unit.index])):
                self.apply(unit, self.grads.host_grads.get(id(unit)), [(hypers, 1.0, False)])
                spec.speculated.add(id(unit))

        return run

    def task_cast(self, unit: Unit, spec: Speculation, event: Event) -> Callable[[], None]:
        """[Note: a speculated cast]: the unit's first pass with factor 1 into its 16-bit copy, unless the partial
        norm already proves the clip; the unit's master, moments and step stay as they are (its step counted on a
        copy)."""

        def run():
            wait_event(event)  # [Note: the worker's waits]
            if not spec.admit(float(self.grads.block_sq[unit.index])):
                return
            assert unit.master is not None and unit.exp_avg is not None and unit.exp_avg_sq is not None
            assert unit.step is not None and unit.host16 is not None and spec.hypers is not None  # (Step.unit_done)
            grad = self.grads.host_grads[id(unit)]
            n = unit.master.numel()
            unit_adamw(
                unit,
                unit.master,
                grad.narrow(0, 0, n),
                unit.exp_avg,
                unit.exp_avg_sq,
                unit.step.clone(),
                spec.hypers,
                1.0,
                part="cast",
                out16=unit.host16[:n],
            )
            spec.speculated.add(id(unit))

        return run

    def task_settle(
        self, unit: Unit, spec: Speculation, event: Event, hypers: tuple[Hyper, ...], factor: float | None
    ) -> Callable[[], None]:
        """After a speculative backward, once the norm is known (``factor``: the gradient's factor, None for a
        non-finite norm): keep a speculative update, redo it with the true factor, roll it back, or (for a
        block the worker did not speculate on) apply the deferred update. Runs after the block's
        speculation task (same priority, submitted later)."""

        def run():
            wait_event(event)  # [Note: the worker's waits]
            grad = self.grads.host_grads.get(id(unit))  # None: on the disk ([Note: gradients on the disk])
            held = id(unit) in spec.speculated
            ops = [(hypers, 1.0, True)] if held and factor != 1.0 else []
            if factor is not None and not (held and factor == 1.0):
                ops.append((hypers, factor, False))
            if ops:
                self.apply(unit, grad, ops)
            unit.updates.updated.set()

        return run
