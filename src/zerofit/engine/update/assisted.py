"""The device's share of the host-optimized units' updates: assisted updates (a part).

[Note: assisted updates]
With deferred updates (clipping, fp16) every update waits for the global norm, and the CPU alone
could only overlap them with the next forward. So some streamed blocks (``plan.assisted_blocks``,
a fraction spread evenly) are updated by the device instead, on the upload stream, as the next
forward uploads them: master, moments and host gradient go up (16 B/param), AdamW runs there, the
new weights are cast into the slot and master and moments go back down (12 B/param). The CPU
worker and the copy engines then share the work.

The state moves in chunks through ASSIST_SETS sets of chunk buffers, so that one chunk's download
overlaps the next chunk's upload (both copy engines busy) and the buffers take a fraction of a
block. A set is refilled only after the download stream's event for its previous chunk. AdamW is
elementwise, so per-chunk calls give the whole-block result bitwise; each call gets its own copy
of the step count (the kernel increments it). The unit's next upload (and any host read of its
master) waits on ``master_event``, the event after its last chunk went down.

[Note: assisted updates in the backward]
With immediate updates (no clipping, bf16/fp32) a host-optimized block is updated while the backward
goes on, and when the CPU's AdamW is slower than the backward's blocks (the CPU updates every
parameter when the device is short: the shell's optimizer on the host, as for a 3B model at 8 GiB) the gradient
buffers fill and the backward waits for the CPU. So when the buffers fit beside the plan, the device
updates a share of the streamed blocks (``plan.assisted_blocks``) itself, right after their gradient
is complete: master and moments go up (12 B/param; the gradient is already there, in its slot, and
is not sent down), AdamW runs on the upload stream, master and moments go back down (12 B/param),
in the chunks of [Note: assisted updates]. The copy engines, mostly idle in the backward, take work off
the CPU. The gradient slot is free once the last chunk's AdamW has read it; the unit's next upload
(and any host read of its master) waits on ``master_event``, as for a deferred assisted update. Its
``updated`` flag is never cleared: the CPU worker does not touch the unit.

The shell, with its optimizer on the host (its state did not fit the device): its gradient is complete only at
the end of the backward, and its update then sits on the step's critical path: gradient down, the CPU's AdamW,
master up again. Where the device has the assisted updates' buffers it updates the shell itself instead, from the
gradient where it is, casting the new weights straight into the shell's 16-bit copy: only master and moments
cross PCIe (12 B/param each way, both copy engines busy), no CPU pass, no upload after it. The next forward's
compute waits for it (Streamer.refresh_shell), and so does the next write of the shell's gradient, which comes
after.

[Note: no host wait in an enqueue]
Enqueueing a device update never waits on the host: its step count is filled on the device (a fill, not a
copy). A copy from pageable memory waits for the stream to drain (here: the compute that wrote ``grad``, or
every upload queued before), and the compute stream would then sit idle while the chunks are enqueued (a few ms
per assisted block in a 3B model's backward: docs/benchmarks.md, assisted updates in the backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zerofit.engine.memory.store import CopyLabel, HostArena, Unit
from zerofit.engine.plan.search import ASSIST_SETS, assist_chunk
from zerofit.engine.update.unit_adamw import unit_adamw
from zerofit.optim.hyper import Hyper

if TYPE_CHECKING:
    from zerofit.engine.device import Device, Event
    from zerofit.engine.lifecycle import Lifecycle
    from zerofit.engine.memory.copies16 import Copies16
    from zerofit.engine.memory.grads import Grads
    from zerofit.engine.plan.engine_plan import Planning
    from zerofit.engine.step.timeline import Timeline
    from zerofit.engine.update.worker import HostWorker


class DeviceUpdates:
    """State: ``buffers``, ASSIST_SETS sets of (chunk,) fp32 device buffers (master, exp_avg, exp_avg_sq, and with
    deferred updates the gradient; None without assisted updates), ``free``: per set the event after its last
    chunk went down, ``next``: the set the next chunk takes; ``cast``: per set, (chunk,) compute dtype, the new
    weights cast on their way into a 16-bit host copy; ``shell_updated``: the upload stream's event after the
    shell's update on the device."""

    def __init__(
        self,
        dev: Device,
        lifecycle: Lifecycle,
        planning: Planning,
        grads: Grads,
        copies16: Copies16,
        *,
        streamed: bool,
        cap: int,
        deferred: bool,
        dtype: torch.dtype,
        pinned: bool,
        worker: HostWorker,
        clock: Timeline,
        arenas: list,
    ) -> None:
        self.dev, self.lifecycle, self.planning, self.grads, self.copies16 = dev, lifecycle, planning, grads, copies16
        self.deferred, self.dtype, self.pinned = deferred, dtype, pinned
        self.worker, self.clock, self.arenas = worker, clock, arenas
        self.buffers: list[list[torch.Tensor]] | None = None
        self.free: list[Event | None] = []  # per set
        self.next = 0
        self.cast: list[torch.Tensor] | None = None
        self.shell_updated: Event | None = None
        if planning.plan.assisted_updates and streamed:
            chunk = assist_chunk(cap)
            n = 4 if deferred else 3
            self.buffers = [
                [torch.empty(chunk, dtype=torch.float32, device=dev.device) for _ in range(n)]
                for _ in range(ASSIST_SETS)
            ]
            self.free = [None] * ASSIST_SETS

    def reset(self) -> None:
        """No copy in flight (the caller waited for the device): every set is free."""
        if self.buffers is not None:
            self.free = [None] * len(self.buffers)

    def drop(self) -> None:
        """Let go of the device buffers (a closed or failed engine)."""
        self.buffers, self.free, self.cast = None, [], None

    def assisted(self, unit: Unit) -> bool:
        """Whether the device updates this unit (see [Note: assisted updates])."""
        return self.buffers is not None and unit.index in self.planning.plan.assisted_blocks

    @property
    def shell_assisted(self) -> bool:
        """Whether the device updates the shell at the end of the backward."""
        return self.buffers is not None and self.planning.plan.assisted_shell

    def cast_for_copies(self, blocks: list[Unit]) -> None:
        """The streamed blocks have 16-bit host copies now ([Note: 16-bit copies after the update], copies16.py):
        the device's updates cast their new weights for them, and the blocks it now updates too (a larger share:
        copies_fraction) get their moments in pinned memory, as materialize.py placed the planned share's (a
        pageable copy runs at a seventh of the speed and blocks the host). Once, before the first DeepSpeed-style
        backward."""
        if self.buffers is None:
            return
        self.cast = [torch.empty(s[0].numel(), dtype=self.dtype, device=self.dev.device) for s in self.buffers]
        if not self.pinned:
            return
        # (assisted blocks are streamed, host-optimized and off the disk tier: the planner's choice)
        movers = []
        for u in blocks:
            if u.index in self.planning.plan.assisted_blocks:
                assert u.exp_avg is not None  # every unit's moments are made at materialize
                if not u.exp_avg.is_pinned():
                    movers.append(u)
        if not movers:
            return
        self.worker.drain()  # no CPU update of the last step still reads or writes them
        self.dev.synchronize()
        arena = HostArena(2 * sum(u.numel for u in movers), torch.float32, True)
        self.arenas.append(arena)
        for u in movers:
            for name in ("exp_avg", "exp_avg_sq"):
                t = arena.take(u.numel)
                t.copy_(getattr(u, name))
                setattr(u, name, t)
        self.clock.note_host()

    # ------------------------------------------------------------------ the updates

    def assisted_update(self, unit: Unit, dst: torch.Tensor | None) -> None:
        """[Note: assisted updates]: the unit's pending deferred update, on the upload stream (the caller's
        current stream) as the next forward uploads it, the new weights cast into ``dst``."""
        # [Note: failure semantics]: an error before this unit's update is fully enqueued leaves it torn
        assert unit.updates.pending is not None  # the caller found one pending
        factor, hypers = unit.updates.pending
        with self.lifecycle.applying():
            unit.updates.pending = None
            self.device_adamw(unit, None, hypers, factor, dst, cast16=self.copies16.label(unit, now=True))

    def in_backward(self, unit: Unit, grad: torch.Tensor, hypers: tuple[Hyper, ...]) -> None:
        """[Note: assisted updates in the backward]: the unit's update from its gradient in its slot, which goes
        back once the last chunk's AdamW has read it."""
        read = self.after_compute(
            unit, grad, None, hypers, cast16=self.copies16.label(unit), found_inf=self.grads.flag_of(unit)
        )
        self.grads.release_slot(unit, read)

    def shell(self, u: Unit, hypers: tuple[Hyper, ...]) -> None:
        """The shell's update on the device from its complete gradient, the new weights cast into its 16-bit
        device copy (see the module docstring)."""
        assert u.grads.tensor is not None  # its gradient, complete (the end of the backward)
        self.grads.flag(u, u.grads.tensor)
        self.shell_updated = self.after_compute(u, u.grads.tensor, u.dev16, hypers, found_inf=self.grads.flag_of(u))
        self.grads.restart(u)

    def take_shell_update(self) -> Event | None:
        """The event after the shell's last update on the device, once (the next forward's compute waits on it)."""
        ev, self.shell_updated = self.shell_updated, None
        return ev

    def after_compute(
        self,
        unit: Unit,
        grad: torch.Tensor,
        dst: torch.Tensor | None,
        hypers: tuple[Hyper, ...],
        cast16: CopyLabel | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Event | None:
        """device_adamw on the upload stream from the unit's device gradient, once the compute stream's work
        so far (which wrote it) is done; returns the event after its last read of ``grad``. ``found_inf``: a
        device scalar, nonzero to leave the state as it is ([Note: non-finite gradients without a norm])."""
        ev = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.upload):
            self.dev.wait(self.dev.upload, ev)
            return self.device_adamw(unit, grad, hypers, 1.0, dst, cast16=cast16, found_inf=found_inf)

    def device_adamw(
        self,
        unit: Unit,
        grad: torch.Tensor | None,
        hypers: tuple[Hyper, ...],
        factor: float,
        dst: torch.Tensor | None,
        cast16: CopyLabel | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Event | None:
        """The unit's AdamW step on the device, its state moving up and down in chunks ([Note: assisted
        updates]). ``grad``: the unit's gradient on the device, or None to bring the host gradient up with
        the state. ``dst``: a slot to cast the new weights into, or None. ``cast16``: a label
        (Copies16.label): the new weights, cast, also go down into the unit's 16-bit host copy ([Note: 16-bit
        copies after the update]). Enqueued on the upload stream (the caller's current stream); returns the
        upload stream's event after the last chunk's AdamW (the last read of ``grad``)."""
        lo, hi = unit.shard.lo, unit.shard.hi  # this rank's shard ([Note: sharded units]); host_grad holds just that
        assert self.buffers is not None  # the device takes a share of the updates (assisted)
        assert unit.master is not None and unit.exp_avg is not None and unit.exp_avg_sq is not None
        assert unit.step is not None  # a host unit's optimizer state
        chunk = self.buffers[0][0].numel()
        host_grad = self.grads.host_grads[id(unit)] if grad is None else None
        # [Note: no host wait in an enqueue]: a fill, not a copy
        step0 = torch.full((), float(unit.step), dtype=unit.step.dtype, device=self.dev.device)
        done = up = None
        for off in range(lo, hi, chunk):
            k = min(chunk, hi - off)
            i = self.next
            self.next = (i + 1) % len(self.buffers)
            p, m, v = (b[:k] for b in self.buffers[i][:3])
            with self.dev.timed("upload", self.dev.upload, f"{unit.name}+adamw"):
                self.dev.wait(self.dev.upload, self.free[i])  # the set's previous chunk went down
                p.copy_(unit.master[off : off + k], non_blocking=True)
                m.copy_(unit.exp_avg[off : off + k], non_blocking=True)
                v.copy_(unit.exp_avg_sq[off : off + k], non_blocking=True)
                if grad is None:
                    assert host_grad is not None  # (grad is None)
                    g = self.buffers[i][3][:k]
                    g.copy_(host_grad[off - lo : off - lo + k], non_blocking=True)
                else:
                    g = grad[off - lo : off - lo + k]
                # a chunk may straddle a border between parameter groups: unit_adamw cuts it there
                unit_adamw(unit, p, g, m, v, step0.clone(), hypers, factor, start=off, found_inf=found_inf)
                if dst is not None:
                    dst[off : off + k].copy_(p)
                if cast16 is not None:
                    assert self.cast is not None  # cast_for_copies ran
                    w16 = self.cast[i][:k]
                    w16.copy_(p)
            up = self.dev.record(self.dev.upload)
            with self.dev.on(self.dev.download):
                self.dev.wait(self.dev.download, up)
                with self.dev.timed("download", self.dev.download, f"{unit.name}+state"):
                    unit.master[off : off + k].copy_(p, non_blocking=True)
                    unit.exp_avg[off : off + k].copy_(m, non_blocking=True)
                    unit.exp_avg_sq[off : off + k].copy_(v, non_blocking=True)
                    if cast16 is not None:
                        assert unit.host16 is not None  # the copy ``cast16`` labels
                        unit.host16[off : off + k].copy_(w16, non_blocking=True)
                done = self.free[i] = self.dev.record(self.dev.download)
        unit.step.add_(1)
        unit.updates.master_event = done
        if cast16 is not None:  # the next upload waits on master_event first: the copy is complete then
            unit.copy16.made(cast16, done)
        return up

    def weights_loaded(self, units: list[Unit]) -> None:
        """The masters were written from outside (a checkpoint load; the caller waited for every update): no
        assisted update is pending, no download into a master is in flight."""
        for u in units:
            u.updates.pending = u.updates.master_event = None

    def flush(self, units: list[Unit]) -> None:
        """Apply every pending assisted update now (a host reader wants the masters)."""
        pending = [u for u in units if u.updates.pending is not None]
        for u in pending:
            with self.dev.on(self.dev.upload):
                self.dev.wait(self.dev.upload, u.updates.master_event)
                self.assisted_update(u, None)
        if pending or any(u.updates.master_event is not None for u in units):
            self.dev.synchronize()
            for u in units:
                u.updates.master_event = None
