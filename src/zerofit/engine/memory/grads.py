"""Gradients: their buffers and their way down to the host (a part).

A streamed unit's gradient is summed in fp32 in a device slot of the gradient pool while its backward runs
over the micro-batches ([Note: slot reuse], store.py); a resident unit's in its own buffer. A host-optimized
unit's complete gradient goes down on the download stream into a pinned staging buffer the CPU worker takes
its update from, or, with deferred updates, into the unit's host buffer where it waits for the global norm.
Which of these happens to a complete gradient is the step's decision (step/optimizer_step.py); this part holds the
buffers, each unit's gradient record (``Unit.grads``: store.GradState, changed only here), the sum of every backward
into them (:meth:`Grads.accumulate`), the squared norms that come down with them, and the running count of
non-finite gradients ([Note: non-finite gradients without a norm], step/optimizer_step.py).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from zerofit.engine.device import Device
from zerofit.engine.memory.store import Home, HostArena, SlotPool, Unit

if TYPE_CHECKING:
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.plan.plan import Plan
    from zerofit.engine.step.timeline import Timeline
    from zerofit.engine.update.worker import HostWorker


class Grads:
    """State: the gradient slot ``pool`` (streamed units), the pinned ``staging`` buffers and which are free, the
    deferred gradients' ``host_grads`` (each rank's shard), each unit's squared norm taken on the device
    (``sq_norms``) and each block's downloaded one (``block_sq``, for speculation), and the non-finite count:
    ``bad_run`` (the step's running count, device), ``bad_dev`` (its snapshot per unit, device) and ``bad_host``
    (the snapshots that came down with the gradients)."""

    def __init__(
        self,
        dev: Device,
        ranks: Ranks,
        worker: HostWorker,
        clock: Timeline,
        plan: Plan,
        units: list[Unit],
        *,
        deferred: bool,
        pinned: bool,
        speculating: bool,
        arenas: list,
    ) -> None:
        self.dev, self.worker, self.clock, self.deferred = dev, worker, clock, deferred
        blocks = units[1:]
        streamed = [u for u in blocks if u.home is Home.STREAMED]
        cap = max((ranks.padded(u.numel) for u in streamed), default=0)
        # [Note: sharded units]: a gradient slot also holds the reduce-scattered shard, after the padded gradient
        gcap = cap + (max((ranks.shard_size(u.numel) for u in streamed), default=0) if ranks.many else 0)
        # a streamed unit that trains nothing takes no gradient slot ([Note: frozen parameters], store.py)
        self.pool = (
            SlotPool(dev, plan.grad_slots, gcap, torch.float32, self._evicted)
            if any(u.trains for u in streamed)
            else None
        )
        host_units = [u for u in units if not u.optimizer_on_device and u.trains]
        scap = max((u.shard.hi - u.shard.lo for u in host_units), default=0)  # a rank downloads its shard only
        self.staging: list[torch.Tensor] = []  # (scap,) fp32, pinned host each
        if host_units:
            a = HostArena(plan.staging_buffers * scap, torch.float32, pinned)
            arenas.append(a)
            self.staging = [a.take(scap) for _ in range(plan.staging_buffers)]
        self._free = list(range(len(self.staging)))
        self._cv = threading.Condition()
        # (L,) fp64 host: each block's squared gradient norm, downloaded with its gradient (speculation)
        self.block_sq = torch.zeros(max(len(blocks), 1), dtype=torch.float64, pin_memory=pinned and speculating)
        # [Note: non-finite gradients without a norm]: per unit, the step's running count of non-finite
        # gradients up to and including it; on the device, and as its gradient's download brings it down
        n = len(units)
        self.bad_run = torch.zeros((), dtype=torch.float32, device=dev.device)  # () fp32, device
        self.bad_dev = torch.zeros(n, dtype=torch.float32, device=dev.device)  # (units,) fp32, device
        self.bad_host = torch.zeros(n, dtype=torch.float32, pin_memory=pinned)  # (units,) fp32, host
        self.host_grads: dict[int, torch.Tensor] = {}  # deferred: id(unit) -> (hi - lo,) fp32 host
        waiting = [u for u in host_units if u.swap is None]  # swapped units: [Note: gradients on the disk]
        if deferred and waiting:  # each rank's shard of the gradients that wait for the norm
            a = HostArena(sum(u.shard.hi - u.shard.lo for u in waiting), torch.float32, pinned)
            arenas.append(a)
            for u in waiting:
                self.host_grads[id(u)] = a.take(u.shard.hi - u.shard.lo)
        self.sq_norms: dict[int, torch.Tensor] = {}  # id(unit) -> () fp64, device: its squared norm

    # ------------------------------------------------------------------ device buffers

    def buffer(self, unit: Unit) -> torch.Tensor | None:
        """The buffer the unit's gradient of this step is summed into: its own (resident), or a slot (None: a
        streamed unit that trains nothing)."""
        if unit.home is Home.RESIDENT or not unit.trains:  # a unit that trains nothing has an empty one
            return unit.grads.tensor
        assert self.pool is not None  # a streamed unit trains: the gradient slots exist
        slot = self.pool.take()
        self.dev.wait(self.dev.compute, slot.free_event)  # [Note: slot reuse]
        slot.tenant, unit.grads.slot = unit, slot
        unit.grads.tensor = slot.tensor[: unit.numel]
        unit.grads.fresh = True
        return unit.grads.tensor

    def accumulate(self, unit: Unit, dst: torch.Tensor | None, grads: list, names: list[str]) -> None:
        """dst (fp32 flat) += grads, or = grads on the first write of a step. ``dst`` None: a streamed unit that
        trains nothing (Grads.buffer), whose backward hands over no gradients."""
        views = unit.layout.views(dst) if dst is not None else {}
        pairs = [(views[n], g) for n, g in zip(names, grads) if g is not None]
        if not pairs:
            return
        assert dst is not None  # (pairs are views of it)
        d, g = [p[0] for p in pairs], [p[1] for p in pairs]
        if unit.grads.fresh:
            if len(pairs) < len(unit.layout.names):
                dst.zero_()
            torch._foreach_copy_(d, g)
            unit.grads.fresh = False
        else:
            torch._foreach_add_(d, g)

    def restart(self, unit: Unit) -> None:
        """The unit's gradient was taken whole (the shell's update on the device): the next write copies."""
        unit.grads.fresh = True

    def host_written(self, unit: Unit) -> bool:
        """A gradient goes into the unit's host buffer (or, FULL_SHARD on the GPUs, its device shard): whether it is
        the step's first, to be copied rather than added."""
        first, unit.grads.host_fresh = unit.grads.host_fresh, False
        return first

    def host_taken(self, units: list[Unit]) -> None:
        """The units' host gradients were taken by their updates: the next step's first write copies."""
        for u in units:
            u.grads.host_fresh = True

    def _evicted(self, unit: Unit) -> None:
        """The pool gave the unit's gradient slot to another: it holds none."""
        unit.grads.slot = unit.grads.tensor = None

    def release_slot(self, unit: Unit, event) -> None:
        """The unit's gradient is read (``event``: after its last reader): its slot goes back to the pool; the next
        gradient write starts fresh."""
        slot = unit.grads.slot
        if slot is not None:
            slot.free_event, slot.tenant = event, None
            unit.grads.slot = unit.grads.tensor = None
        unit.grads.fresh = True

    def flag(self, unit: Unit, grad: torch.Tensor) -> None:
        """Count ``grad`` (on the device, compute stream) into the step's running count of non-finite gradients
        and snapshot the count for ``unit``: [Note: non-finite gradients without a norm], step/optimizer_step.py."""
        bad = torch.isfinite(grad.sum()).logical_not()
        torch.maximum(self.bad_run, bad.to(self.bad_run.dtype), out=self.bad_run)
        k = unit.index + 1
        self.bad_dev[k : k + 1].copy_(self.bad_run.view(1))

    def flag_of(self, unit: Unit) -> torch.Tensor:
        """The unit's snapshot of the running count, on the device: a device update's ``found_inf``."""
        return self.bad_dev[unit.index + 1]

    # ------------------------------------------------------------------ down to the host

    def send_down(self, unit: Unit, grad: torch.Tensor, dst: torch.Tensor, block_sq: torch.Tensor | None):
        """The unit's device gradient into host ``dst`` on the download stream, after the compute that wrote it
        (with its squared norm into ``block_sq`` for speculation); its gradient slot goes back. Returns the
        download's event."""
        ev_compute = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.download):
            self.dev.wait(self.dev.download, ev_compute)
            with self.dev.timed("download", self.dev.download, unit.name):
                dst.narrow(0, 0, grad.numel()).copy_(grad, non_blocking=True)
                if block_sq is not None:
                    self.block_sq[unit.index : unit.index + 1].copy_(block_sq.view(1), non_blocking=True)
                if not self.deferred:  # [Note: non-finite gradients without a norm]
                    k = unit.index + 1
                    self.bad_host[k : k + 1].copy_(self.bad_dev[k : k + 1], non_blocking=True)
            done = self.dev.record(self.dev.download)
        self.release_slot(unit, done)
        return done

    def take_staging(self) -> torch.Tensor:
        """A free pinned staging buffer; the main thread waits for the worker to give one back."""
        with self._cv:
            waited = self.worker.wait_until(lambda: bool(self._free), self._cv.wait) or 0.0
            i = self._free.pop(0)
        if waited > 1e-4:
            self.clock.add_wait(waited, "staging")
        return self.staging[i]

    def give_staging(self, buf: torch.Tensor) -> None:
        """``buf`` (a staging buffer) is free again (the worker thread calls it after its update)."""
        for i, s in enumerate(self.staging):
            if s.data_ptr() == buf.data_ptr():
                with self._cv:
                    self._free.append(i)
                    self._cv.notify()
                return

    # ------------------------------------------------------------------ resets

    def discard(self, units: list[Unit], host_units: list[Unit]) -> None:
        """Forget this step's gradients (a skipped or dropped step): the next writes start fresh."""
        self.bad_run.zero_()  # [Note: non-finite gradients without a norm]
        self.bad_dev.zero_()
        for u in units:
            u.grads.fresh = True
            if u.optimizer_on_device and u.grads.tensor is not None:
                u.grads.tensor.zero_()
            if u.shard.state:
                u.grads.host_fresh = True
        for u in host_units:
            u.grads.host_fresh = True
        self.sq_norms.clear()

    def reset(self) -> None:
        """A dropped step, once the worker is drained: every staging buffer is free (one taken by the failed step
        may never have been handed on)."""
        with self._cv:
            self._free = list(range(len(self.staging)))

    def restart_all(self, units: list[Unit]) -> None:
        """The masters were written from outside (a checkpoint load): resident gradients are zeroed (enqueued; the
        caller waits for the device next) and every unit's next write copies ([Note: engine consistency after a
        load], store.py)."""
        for u in units:
            if u.home is Home.RESIDENT and u.grads.tensor is not None:
                u.grads.tensor.zero_()
            u.grads.fresh = u.grads.host_fresh = True

    def weights_loaded(self) -> None:
        """The masters were written from outside (a checkpoint load; the device is idle): no slot holds a gradient,
        no partial norm stands."""
        if self.pool is not None:
            self.pool.empty()
        self.sq_norms.clear()

    def drop(self) -> None:
        """Let go of the device buffers (a closed or failed engine)."""
        self.pool = None

    def reset_transfers(self, units: list[Unit]) -> None:
        """No copy is in flight (the caller waited for the device): every gradient slot is empty and no streamed
        unit holds one ([Note: slot reuse])."""
        if self.pool is not None:
            self.pool.empty()
        for u in units:
            if u.home is Home.STREAMED:
                u.grads.slot, u.grads.tensor = None, None
