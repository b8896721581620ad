"""The optimizer step (a part): what happens to each unit's gradient as it completes, and the step's end.

As the backward completes a unit's gradient (:meth:`Step.unit_done`) it is reduce-scattered (several ranks),
updated on the device (an assisted block), sent down for the CPU worker's update at once (immediate updates),
or kept for the norm (deferred updates: in the unit's host buffer, or on the disk); with speculation the worker
updates it early anyway. At the end (:meth:`Step.finish`) the shell's gradient is handed over, the norm taken
(clipping, fp16's overflow check), a non-finite step refused, the device-optimized units updated and the
deferred host updates queued in forward order.

[Note: non-finite gradients without a norm]
With clipping (or fp16) every update waits for the global norm, and a non-finite one refuses the step (or
skips it) before anything is applied. Without them the CPU updates each block as its gradient comes down,
during the backward, and a non-finite gradient would be applied, making every weight non-finite. So each
unit's gradient is summed on the device as it is handed over (a sum is non-finite if an element is, or if
the gradient is too large to sum: then too it is refused), into the step's running count, a snapshot of
which goes down with the gradient (``Grads.bad_dev`` -> ``Grads.bad_host``, one element). An update runs only
if nothing up to and including its unit was non-finite: the CPU worker reads the flag after the download it
waits for anyway; a device update takes it as the fused kernel's ``found_inf`` (torch's GradScaler
protocol: the state stays as it is). The units updated at the step's end, on the device, run only after
the host has read the step's count: one device sync per step, before their AdamW kernels are enqueued
([Note: events, not device syncs], device.py). A step with a non-finite gradient is then refused with
FloatingPointError, every weight and moment as before it, like a clipped step's; only when a non-finite
gradient comes after blocks were updated (the loss finite, a gradient of an early block overflowing) is the
state torn, and the engine fails (EngineFailedError, [Note: failure semantics]). Cost: a read of each
gradient on the device, which a norm would read too.

[Note: gradients on the disk]
With deferred updates (clipping, fp16) every host unit's gradient waits for the global norm. A unit on
the disk tier keeps it on the disk, beside its state (a "grad" field of its region), instead of in a
host buffer as large as the unit: it comes down into a staging buffer with its squared norm (taken on
the device), and the worker writes it out chunk by chunk (``DiskTier.acquire(..., write_only=)``); the
update later reads it with the state. The blocks' backward hands each block's gradient over once per
optimizer step, so it is written once. The tier must not read a unit's chunks ahead before its gradient
is written (it would read the last step's): only this task announces such a unit's update (under
speculation, which updates it next), or the step's end after ``worker.drain()``.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

import torch

from zerofit.engine.memory.store import Home, Unit
from zerofit.engine.step.torch_clip import TorchClip
from zerofit.engine.update.host import MOMENTS_LAST, SPECULATE_FIRST, HostUpdates
from zerofit.engine.update.speculation import Speculation, Speculator
from zerofit.engine.update.unit_adamw import unit_adamw
from zerofit.engine.update.worker import HostWorker, wait_event, waiting

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.engine.device import Device
    from zerofit.engine.disk.tier import DiskTier
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.distributed.sharding import Sharding
    from zerofit.engine.lifecycle import Lifecycle
    from zerofit.engine.memory.copies16 import Copies16
    from zerofit.engine.memory.grads import Grads
    from zerofit.engine.memory.streamer import Streamer
    from zerofit.engine.step.hypers import Hypers
    from zerofit.engine.update.assisted import DeviceUpdates
    from zerofit.optim.hyper import Hyper
    from zerofit.optim.loss_scaler import LossScaler


class GradRoute(Enum):
    """Where a unit's complete gradient goes (:meth:`Step.unit_done`): decided per unit from the plan, once for
    each plan (at build and at each replan: :meth:`Step.route`), not on every micro-batch."""

    FROZEN = "no gradient: nothing is trained ([Note: frozen parameters])"
    SHARD = "kept as this rank's shard on the device ([Note: sharded device state])"
    DEVICE = "stays for the device's AdamW at the step's end"
    DISK = "down and onto the disk tier, for the deferred update ([Note: gradients on the disk])"
    ASSISTED = "the device's update of it, in the backward ([Note: assisted updates in the backward])"
    HOST = "down to the host: an update, an add into the host buffer, or a speculation"


class Prepared(NamedTuple):
    """A step up to its updates (:meth:`Step.prepare`), what :meth:`Step.apply` needs."""

    skip: bool  # fp16 overflow: not applied
    norm: float | None  # the global gradient norm (deferred updates)
    factor: float  # times each gradient in the update (unscaling, clipping)
    device_units: list[Unit]
    host_units: list[Unit]
    dev_grads: dict[int, torch.Tensor]  # id(unit) -> its gradient shard ([Note: sharded device state])
    spec: Speculation | None  # the speculation being settled, or None
    shell_host: bool
    shell_assisted: bool


class Step:
    """State: ``mirror_stale``, whether the host mirrors of device-optimized units (what the module's parameters
    view) are older than their masters; the rest is the parts it drives and the step's records kept by others
    (the speculation record: Speculator; gradients: Grads; the step count and settings: Hypers)."""

    def __init__(
        self,
        *,
        config: ZerofitConfig,
        dev: Device,
        ranks: Ranks,
        lifecycle: Lifecycle,
        worker: HostWorker,
        tier: DiskTier | None,
        units: list[Unit],
        grads: Grads,
        sharding: Sharding,
        host_updates: HostUpdates,
        device_updates: DeviceUpdates,
        copies16: Copies16,
        streamer: Streamer,
        speculator: Speculator,
        hypers: Hypers,
        scaler: LossScaler | None,
        deferred: bool,
        cast_first: bool,
    ) -> None:
        self.config, self.dev, self.ranks, self.lifecycle, self.worker, self.tier = (
            config,
            dev,
            ranks,
            lifecycle,
            worker,
            tier,
        )
        self.units, self.shell, self.blocks = units, units[0], units[1:]
        self.grads, self.sharding, self.host, self.device = grads, sharding, host_updates, device_updates
        self.copies16, self.streamer, self.speculator, self.hypers, self.scaler = (
            copies16,
            streamer,
            speculator,
            hypers,
            scaler,
        )
        self.deferred, self.cast_first = deferred, cast_first
        self.mirror_stale = False
        self._routes: dict[int, GradRoute] = {}
        self._routed_plan: object = None  # the plan the routes were decided for
        self.torch_clip = TorchClip(dev, grads, ranks)  # the user's loop: torch's clip arithmetic

    def host_units(self) -> list[Unit]:
        """The units the CPU worker updates (their optimizer state in host memory or on the disk)."""
        return [u for u in self.units if not u.optimizer_on_device and u.trains]

    # ------------------------------------------------------------------ the gradient hand-off

    def _route_of(self, unit: Unit) -> GradRoute:
        if not unit.trains:
            return GradRoute.FROZEN
        if unit.shard.state and unit.home is Home.STREAMED:
            return GradRoute.SHARD
        if unit.optimizer_on_device:
            return GradRoute.DEVICE
        if self.deferred and unit.swap is not None:
            return GradRoute.DISK
        if not self.deferred and self.device.assisted(unit):
            return GradRoute.ASSISTED
        return GradRoute.HOST

    def route(self, unit: Unit) -> GradRoute:
        """``unit``'s gradient route under the current plan: decided again only for another plan (a replan can
        give the device a larger share of the updates)."""
        plan = self.device.planning.plan
        if plan is not self._routed_plan:
            self._routes = {id(u): self._route_of(u) for u in self.units}
            self._routed_plan = plan
        return self._routes[id(unit)]

    def unit_done(self, unit: Unit) -> None:
        """A unit's gradient for this micro-step is complete on the device: hand it on (:class:`GradRoute`)."""
        route = self.route(unit)
        if route is GradRoute.FROZEN or route is GradRoute.DEVICE:
            return
        if route is GradRoute.SHARD:
            self.sharding.keep_shard(unit, first=self.grads.host_written(unit))  # the slot goes back at once
            self.grads.release_slot(unit, self.dev.record(self.dev.compute))
            return
        grad = unit.grads.tensor
        assert grad is not None  # a trained unit's gradient of this micro-step, complete
        self.copies16.stale(unit)  # its update may start now
        self.host.await_moments(unit)  # [Note: moments after the forward]: its host gradient buffer is free then
        if route is GradRoute.DISK:
            self._stash(unit, grad)
            return
        if route is GradRoute.ASSISTED:
            self.grads.flag(unit, grad)
            self.lifecycle.begin_applying()
            self.device.in_backward(unit, grad, self.hypers.for_step())
            return
        if self.ranks.many:
            grad = self.sharding.reduce_scatter(unit)
        if not self.deferred:
            self.grads.flag(unit, grad)  # the gradient its update takes: this rank's shard
        host = self.grads.host_grads.get(id(unit))
        fresh_host = host is not None and self.grads.host_written(unit)
        spec = self.speculator.current
        if fresh_host:  # the whole gradient goes straight into the unit's host buffer; its norm is taken here
            assert host is not None  # (fresh_host)
            dst = host
            if self.deferred:
                self.grads.sq_norms[id(unit)] = torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
                self.torch_clip.note(unit, grad)  # [Note: the user's clip on the device], torch_clip.py
        else:  # staging: either an immediate update, or an add into the host buffer
            dst = self.grads.take_staging()
            self.grads.sq_norms.pop(id(unit), None)
            self.torch_clip.forget(unit)
        speculate = fresh_host and spec is not None and unit.index >= 0
        casting = spec is not None and spec.cast  # [Note: a speculated cast]
        if speculate and casting:  # only a block with its 16-bit copy
            speculate = unit.host16 is not None and unit.swap is None and not self.device.assisted(unit)
        done = self.grads.send_down(unit, grad, dst, self.grads.sq_norms[id(unit)] if speculate else None)
        if self.deferred:
            if not fresh_host:  # DeepSpeed-style accumulation across micro-steps
                assert host is not None  # deferred: a unit off the disk has its host gradient buffer (Grads)
                self.worker.submit(self.host.task_add(host, dst, done), label=f"add[{unit.name}]")
                if casting:  # a cast made before this add is of a part of the gradient
                    assert spec is not None  # (casting)
                    spec.void = True
            elif speculate and casting:  # FIFO first, as below; the unit stays ``updated``
                assert spec is not None  # (casting)
                self.worker.submit(self.host.task_cast(unit, spec, done), SPECULATE_FIRST, label=f"cast[{unit.name}]")
            elif speculate:  # [Note: speculative updates]
                assert spec is not None  # (speculate)
                unit.updates.updated.clear()
                # FIFO, ahead of every other task: the partial norm sums in backward order, so which blocks
                # are speculated depends on the data only, never on the worker's timing (bitwise reproducible)
                self.worker.submit(
                    self.host.task_speculate(unit, spec, done, self.hypers.for_step()),
                    SPECULATE_FIRST,
                    label=f"speculate[{unit.name}]",
                )
        else:
            self.lifecycle.begin_applying()  # this block is updated now, while the backward goes on
            unit.updates.updated.clear()
            self.worker.submit(
                self.host.task_update(
                    unit,
                    dst,
                    done,
                    self.hypers.for_step(),
                    1.0,
                    release=True,
                    cast16=self.copies16.label(unit),
                    flag=unit.index + 1,
                ),
                self.host.priority(unit),
                label=f"adamw[{unit.name}]",
                ready=None if unit.swap else done.query,
            )  # [Note: ready tasks first]

    def _stash(self, unit: Unit, grad: torch.Tensor) -> None:
        """[Note: gradients on the disk]: a swapped unit's deferred gradient goes down and onto the disk."""
        if not self.grads.host_written(unit):
            raise RuntimeError(
                f"{unit.name}: a second gradient in one optimizer step for a unit whose gradient waits on the disk"
            )
        sq = torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
        self.grads.sq_norms[id(unit)] = sq
        dst = self.grads.take_staging()
        spec = self.speculator.current
        speculate = spec is not None and not spec.cast  # a unit on the disk has no 16-bit copy to cast into
        done = self.grads.send_down(unit, grad, dst, sq if speculate else None)
        tier, key, grads = self.tier, unit.index, self.grads
        assert tier is not None  # the unit is on the disk tier

        def stash():
            wait_event(done)  # [Note: the worker's waits]
            for c, (a, k) in enumerate(tier.chunks(key)):
                with waiting("disk"):
                    f = tier.acquire(key, c, write_only=("grad",))
                f["grad"].copy_(dst.narrow(0, a, k))
                tier.release(key, c)
            grads.give_staging(dst)
            if speculate:
                tier.expect([key])  # its speculative update is the worker's next task for it

        self.worker.submit(stash, SPECULATE_FIRST, label=f"stash-grad[{unit.name}]")
        if speculate:  # as unit_done: not ``updated`` until its settle task ran
            assert spec is not None  # (speculate)
            unit.updates.updated.clear()
            self.worker.submit(
                self.host.task_speculate(unit, spec, done, self.hypers.for_step()),
                SPECULATE_FIRST,
                label=f"speculate[{unit.name}]",
            )

    # ------------------------------------------------------------------ the step's end

    def finish(self) -> tuple[bool, float | None]:
        """Apply the optimizer step to every unit: (applied, the global gradient norm where one was taken).
        Not applied: skipped for an fp16 overflow (every weight and moment as before)."""
        return self.apply(self.prepare())

    def prepare(self) -> Prepared:
        """The step up to its updates: every gradient complete, the global norm and the clip factor (deferred
        updates). The user's loop takes its ``clip_grad_norm_`` here and :meth:`apply` at ``optimizer.step()``
        ([Note: the user's loop drives the engine], userloop); the AdamW settings are read in :meth:`apply`."""
        factor = 1.0
        skip = False
        norm = None
        # [Note: 16-bit copies for extra forwards]: the weights change from here; the copies made right after
        # this step's updates are the ones valid now ([Note: 16-bit copies after the update])
        self.copies16.step_moves()
        device_units = [u for u in self.units if u.optimizer_on_device and u.trains]
        host_units = self.host_units()
        # the shell's gradient is complete only now: send it down if its optimizer is on the host
        shell_assisted = self.device.shell_assisted
        shell_host = not self.shell.optimizer_on_device
        if shell_host and not self.shell.grads.fresh:
            if shell_assisted:  # [Note: assisted updates in the backward]
                self.lifecycle.begin_applying()
                self.device.shell(self.shell, self.hypers.for_step())
            else:
                self.unit_done(self.shell)
        spec = self.speculator.take()
        if self.deferred and spec is None:
            self.worker.drain()  # host-side accumulations are done
        dev_grads = {}  # [Note: sharded device state]: each sharded device unit's gradient shard
        if self.ranks.many:  # [Note: sharded units]: replicated units take the sum of every rank's gradient
            with self.dev.timed("compute", label="all-reduce"):
                for u in device_units:
                    if u.shard.state and u.home is Home.STREAMED:  # reduce-scattered in the backward
                        dev_grads[id(u)] = self.sharding.shard_grad[id(u)]
                    elif u.shard.state:
                        dev_grads[id(u)] = self.sharding.reduce_scatter(u)
                    else:
                        assert u.grads.tensor is not None  # a trained device unit's gradient, complete
                        self.ranks.all_reduce_world(u.grads.tensor)
        if not self.deferred:  # [Note: non-finite gradients without a norm]
            for u in device_units:
                grad = dev_grads.get(id(u), u.grads.tensor)
                assert grad is not None  # a trained device unit's gradient, or its shard
                self.grads.flag(u, grad)
            bad = self.grads.bad_run
            bad = self.ranks.all_reduce_world(bad.reshape(1).clone()) if self.ranks.many else bad
            if float(bad):  # a device sync, before the device's AdamW kernels are enqueued
                self._refuse_nonfinite(host_units, device_units, shell_assisted)
        if self.deferred:
            total = self._global_norm(device_units, host_units, dev_grads)  # a device sync
            scale = self.scaler.scale if self.scaler else 1.0
            try:
                if self.scaler is not None:
                    skip = self.scaler.update(not math.isfinite(total))
                elif not math.isfinite(total):
                    raise FloatingPointError(f"gradient norm is {total} at step {self.hypers.global_step}")
            except Exception:
                if spec is not None:  # undo the speculative updates: the step is not applied
                    self.drop(spec)
                self.discard_grads()  # a caller that goes on starts from clean gradients
                raise
            norm = total / scale
            factor = 1.0 / scale
            clip = self.config.gradient_clipping
            if clip > 0 and math.isfinite(norm):
                coef = clip / (norm + 1e-6)
                if coef < 1.0:
                    factor *= coef
            self.speculator.norm_taken(clipped=factor != 1.0 / scale)  # [Note: speculative updates]
        self.grads.host_taken(host_units)
        return Prepared(skip, norm, factor, device_units, host_units, dev_grads, spec, shell_host, shell_assisted)

    def apply(self, prepared: Prepared) -> tuple[bool, float | None]:
        """The step's updates, after :meth:`prepare`: (applied, the global norm where one was taken)."""
        skip, norm, factor, device_units, host_units, dev_grads, spec, shell_host, shell_assisted = prepared
        if skip:
            self.discard_grads()
            return False, norm
        hypers = self.hypers.for_step()
        updates = spec is not None and not spec.cast  # a speculation of updates, settled here
        if updates or not self.deferred:  # the clip's multiplies wait for deferred updates only
            self.torch_clip.settle()
        self.lifecycle.begin_applying()
        self._device_updates(device_units, hypers, factor, dev_grads)
        if updates:
            assert spec is not None  # (updates)
            self.settle(spec, host_units, hypers, factor)
        elif self.deferred:
            cast = spec if spec is not None and not spec.void and factor == 1.0 and spec.hypers == hypers else None
            self._queue_deferred(host_units, hypers, factor, cast)
        if shell_host and not shell_assisted:
            self.streamer.shell_updating()
        return True, norm

    def grad_views(self, prepared: Prepared | None = None) -> list[torch.Tensor]:
        """The step's gradient of every trained parameter, in the model's order (several ranks: each unit's flat
        shard), after :meth:`prepare`: the user's loop unscales them as torch does (TorchClip.views)."""
        if prepared is not None:
            self._void_casts(prepared.spec)  # they may be written
        return self.torch_clip.views(prepared.dev_grads if prepared is not None else None)

    def clip_as_torch(self, max_norm: float, prepared: Prepared) -> float:
        """``torch.nn.utils.clip_grad_norm_``'s arithmetic over the step's gradients (the user's loop: bitwise the
        plain loop's clipped gradients; several ranks: FSDP's; [Note: the user's clip on the device]), after
        :meth:`prepare`. Returns the norm."""
        if self.torch_clip.waiting:  # a second clip: the first one's multiplies are done first
            self._void_casts(prepared.spec)
        return self.torch_clip.clip(max_norm, prepared.dev_grads)

    def _void_casts(self, spec: Speculation | None) -> None:
        """[Note: a speculated cast]: the host gradients are about to change in place; the casts made from them
        finish first, and none is kept."""
        if spec is not None and spec.cast and not spec.void:
            self.worker.drain()
            spec.void = True

    def _global_norm(
        self, device_units: list[Unit], host_units: list[Unit], dev_grads: dict[int, torch.Tensor]
    ) -> float:
        """The global gradient norm, fp64 (each rank's shards' squares summed over the ranks); a device sync."""
        sq = [
            torch.linalg.vector_norm(u.grads.tensor, dtype=torch.float64) ** 2
            for u in device_units
            if not u.shard.state
        ]
        shards = [torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in dev_grads.values()]
        for u in host_units:
            s = self.grads.sq_norms.pop(id(u), None)
            if s is None:  # accumulated on the host over several micro-steps
                s = torch.linalg.vector_norm(self.grads.host_grads[id(u)], dtype=torch.float64) ** 2
            shards.append(s.to(self.dev.device))
        if self.ranks.many:  # each rank holds its shards' squares: summed over the ranks
            part = torch.stack(shards).sum() if shards else torch.zeros((), dtype=torch.float64, device=self.dev.device)
            shards = [self.ranks.all_reduce(part.reshape(1)).reshape(())]
        sq += shards
        return torch.stack(sq).sum().sqrt().item() if sq else 0.0

    def _device_updates(
        self, device_units: list[Unit], hypers: tuple[Hyper, ...], factor: float, dev_grads: dict[int, torch.Tensor]
    ) -> None:
        """The device-optimized units' AdamW on the compute stream (each rank its shard, then gathered)."""
        for u in device_units:
            self.grads.restart(u)
            m, ea, eas, st = u.master, u.exp_avg, u.exp_avg_sq, u.step
            assert m is not None and ea is not None and eas is not None and st is not None  # an open engine's unit
            with self.dev.timed("compute", label=f"optimizer[{u.name}]"):
                if u.shard.state:  # [Note: sharded device state]
                    unit_adamw(u, m, dev_grads[id(u)], ea, eas, st, hypers, factor, start=u.shard.lo)
                    if u.home is Home.STREAMED:  # the next upload (gather) of it waits for this update
                        self.grads.host_taken([u])
                        u.updates.master_event = self.dev.record(self.dev.compute)
                        continue
                    assert u.dev16 is not None  # a resident device-optimized unit
                    u.dev16[u.shard.lo : u.shard.hi].copy_(m)
                    self.sharding.gather_dev16(u)
                    continue
                assert u.grads.tensor is not None  # its complete gradient
                unit_adamw(u, m, u.grads.tensor, ea, eas, st, hypers, factor)
                if u.dev16 is not None and u.dev16 is not m:
                    u.dev16.copy_(m)
        if device_units:
            self.mirror_stale = True

    def _queue_deferred(
        self, host_units: list[Unit], hypers: tuple[Hyper, ...], factor: float, cast: Speculation | None = None
    ) -> None:
        """The deferred host updates, in forward order (the next forward needs block 0 first): the device's share
        pending for the next upload ([Note: assisted updates]), the CPU's on the worker (in two passes: [Note:
        moments after the forward]; the first writing the 16-bit cast alone: [Note: the master behind its
        cast], which gives the streamed blocks their 16-bit copies first). ``cast``: a speculation whose casts
        a unit whose gradient the clip left as it was keeps ([Note: a speculated cast])."""
        if (
            self.cast_first
            and self.copies16.possible()
            and any(u.home is Home.STREAMED and u.swap is None for u in self.blocks)
        ):
            self.copies16.enable(self.device)
        ev = self.dev.record(self.dev.download)
        self.host.expect(host_units)
        for u in host_units:
            multiply = self.torch_clip.pending(u)  # [Note: the user's clip on the device]
            if self.device.assisted(u):
                if multiply is not None:
                    ev.synchronize()
                    multiply()
                u.updates.pending = (factor, hypers)
                continue
            u.updates.updated.clear()
            grad = self.grads.host_grads.get(id(u))
            split = self.host.split and u.swap is None
            cast16 = self.copies16.label(u, now=True) if split else None
            self.worker.submit(
                self.host.task_update(
                    u,
                    grad,
                    ev,
                    hypers,
                    factor,
                    release=False,
                    split=split,
                    cast16=cast16,
                    before=multiply,
                    cast=cast if multiply is None and cast16 is not None else None,
                ),
                self.host.priority(u),
                label=f"adamw[{u.name}]",
            )
            if split:
                assert grad is not None  # off the disk: its host gradient buffer
                u.updates.moments_done.clear()
                u.updates.master_behind = cast16 is not None
                self.worker.submit(
                    self.host.task_moments(u, grad, hypers, factor, with_master=u.updates.master_behind),
                    MOMENTS_LAST - u.index,
                    label=f"moments[{u.name}]",
                )

    def settle(self, spec: Speculation, host_units: list[Unit], hypers, factor: float | None) -> None:
        """Queue each host unit's settle task (HostUpdates.task_settle) and count how the speculation went."""
        clipped = factor != 1.0
        ev = self.dev.record(self.dev.download)
        if clipped:  # the speculated blocks are read again (rolled back and redone), in forward order
            self.host.expect(host_units, grads_written=False)
        for u in host_units:
            u.updates.updated.clear()
            self.worker.submit(
                self.host.task_settle(u, spec, ev, hypers, factor), self.host.priority(u), label=f"settle[{u.name}]"
            )
        self.speculator.settled(clipped)

    def _refuse_nonfinite(self, host_units: list[Unit], device_units: list[Unit], shell_assisted: bool) -> None:
        """A step with a non-finite gradient and no norm ([Note: non-finite gradients without a norm]): refused,
        every weight and moment as before it, or, when some units took its update, torn (the engine fails)."""
        self.worker.drain()  # every update task of the step ran (or skipped)
        self.dev.synchronize()
        flags = self.grads.bad_dev.to("cpu")
        applied = [u for u in host_units if not flags[u.index + 1]]
        if self.ranks.many:  # every rank decides alike
            torn = bool(self.ranks.all_reduce_world(torch.tensor([float(len(applied))], device=self.dev.device)).item())
        else:
            torn = bool(applied)
        for u in host_units:  # the device's updates in the backward counted their step on the host first
            if flags[u.index + 1] and (self.device.assisted(u) or (u is self.shell and shell_assisted)):
                assert u.step is not None  # a host unit's step count
                u.step.sub_(1)
        order = [*reversed(host_units), *device_units]  # the order the backward handed the gradients over
        first = next((u.name for u in order if flags[u.index + 1]), None)
        where = f"first at {first}" if first else "on another rank"
        msg = (
            f"non-finite gradients at step {self.hypers.global_step} ({where}; no gradient clipping, so no norm "
            "was taken)"
        )
        if torn:
            raise FloatingPointError(
                f"{msg}, after {len(applied)} units took the step's update: the state is "
                "torn. Resume from the last checkpoint (and lower the learning rate, or set "
                "gradient_clipping)"
            )
        self.lifecycle.end_applying()  # nothing was applied: the step is dropped as before its updates
        raise FloatingPointError(
            f"{msg}: the step was not applied, every weight and moment is as before it. "
            "Lower the learning rate, check the data, or set gradient_clipping"
        )

    # ------------------------------------------------------------------ resets

    def discard_grads(self) -> None:
        """Forget this step's gradients (a skipped step): the next writes start fresh."""
        self.torch_clip.discard()
        self.grads.discard(self.units, self.host_units())

    def drop(self, spec: Speculation) -> None:
        """A speculation whose step is not applied: its updates undone (its casts changed nothing), the worker
        drained."""
        if not spec.cast:
            self.settle(spec, self.host_units(), self.hypers.for_step(), None)
        self.worker.drain()

    def discard(self) -> None:
        """Drop the step in progress (nothing of it applied): its speculative updates are undone (the worker
        drained after), its gradients forgotten. The caller drained the worker and reset the transfers first."""
        spec = self.speculator.take()
        if spec is not None:  # [Note: speculative updates]: undo what the worker updated early
            self.drop(spec)
        self.torch_clip.discard()
        self.grads.discard(self.units, [u for u in self.units if not u.optimizer_on_device])

    def weights_loaded(self) -> None:
        """The masters were written from outside and copied into the mirrors (store.recast_from_masters): none is
        behind; nothing of a clip waits."""
        self.mirror_stale = False
        self.torch_clip.discard()

    def mirrors_behind(self) -> None:
        """The device masters moved without the mirrors (the module's parameters): sync_mirrors copies them."""
        self.mirror_stale = True

    def sync_mirrors(self) -> None:
        """The module's parameters (host views) take the current weights of device-optimized units."""
        if self.mirror_stale and (self.dev.is_cuda or any(u.shard.state for u in self.units)):
            for u in self.units:
                assert u.host is not None and u.master is not None  # an open engine's units
                if u.shard.state:  # [Note: sharded device state]: gathered from every rank (a collective)
                    u.host.copy_(self.sharding.gather_full(u, u.master))
                elif u.optimizer_on_device and u.host is not u.master:
                    u.host.copy_(u.master)
        self.mirror_stale = False
