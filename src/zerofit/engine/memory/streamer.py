"""The streamer: streamed units' weights ON_HOST -> UPLOADING -> ON_DEVICE (a part; store.WeightState).

A streamed unit borrows a device weight slot while it computes ([Note: slot reuse], store.py): its upload takes
a slot (never one the units needed next hold), copies its weights up on the upload stream (the fp32 master cast
on the device: [Note: fp32 uploads], materialize.py; or its valid 16-bit host copy; or its shard and a gather;
its pending device update on the way: [Note: assisted updates], update/assisted.py), and the compute stream waits
for it before the first use. Prefetch keeps the next ones uploading. A window of DeepSpeed-shaped forwards keeps
some blocks in slots carved from the idle gradient buffers ([Note: a window keeps some blocks]).

[Note: a window keeps some blocks]
Between a window's first forward and its boundary the gradient buffers (the gradient pool: fp32, a block each)
are idle: the blocks' backward, their only user, waits for the boundary. Each holds two blocks' 16-bit weights
(one in fp32), so the first forward uploads that many streamed blocks into slots carved from them, where
they stay, and the window's later forwards find them on the device instead of uploading them again: no
device memory beyond the plan's. Kept are the streamed blocks just before the last weight_slots ones,
which the pool slots still hold when the boundary's backward begins. At the boundary, before the backward
takes the gradient buffers, the kept blocks go back to ON_HOST (the backward uploads them as usual); the
compute stream's reads of them come before its first gradient write (one stream), the downloads that read
them into host copies are waited for, and the first upload into a carved slot waits for the gradient
buffer's last reader (its free_event). A failed step empties every slot, these too ([Note: slot reuse]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zerofit.engine.disk.tier import frozen_key
from zerofit.engine.memory.store import Home, Slot, SlotPool, Unit, WeightState

if TYPE_CHECKING:
    from zerofit.engine.device import Device, Event
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.distributed.sharding import Sharding
    from zerofit.engine.memory.copies16 import Copies16
    from zerofit.engine.plan.engine_plan import Planning
    from zerofit.engine.update.assisted import DeviceUpdates
    from zerofit.engine.update.host import HostUpdates


class Streamer:
    """State: the weight slot ``pool`` (None when nothing streams), the fp32 upload ``stage`` (compute dtype other
    than fp32: the master goes up through it, a unit larger than it in pieces), and ``kept``: the blocks a
    window keeps in slots carved from the gradient buffers (id(unit) -> slot)."""

    def __init__(
        self,
        dev: Device,
        ranks: Ranks,
        planning: Planning,
        units: list[Unit],
        *,
        dtype: torch.dtype,
        host_updates: HostUpdates,
        device_updates: DeviceUpdates,
        copies16: Copies16,
        sharding: Sharding,
        keep_blocks: bool,
    ) -> None:
        self.dev, self.ranks, self.planning, self.dtype = dev, ranks, planning, dtype
        self.host_updates, self.device_updates, self.copies16, self.sharding = (
            host_updates,
            device_updates,
            copies16,
            sharding,
        )
        self.shell, self.blocks = units[0], units[1:]
        self.units = units
        self.keep_allowed = keep_blocks
        plan = planning.plan
        streamed = [u for u in self.blocks if u.home is Home.STREAMED]
        wcap = max(
            (u.frozen_at + u.frozen_numel if u.frozen else ranks.padded(u.numel) for u in streamed), default=0
        )  # a weight slot holds the frozen weights too, after the trained ones
        self.pool = SlotPool(dev, plan.weight_slots, wcap, dtype, Streamer.evicted) if streamed else None
        uploaded = streamed + ([self.shell] if not plan.shell_optimizer_on_device else [])
        ucap = plan.stage_numel or max((u.numel for u in (streamed or uploaded)), default=0)
        self.stage = (
            torch.empty(ucap, dtype=torch.float32, device=dev.device)  # (ucap,) fp32
            if uploaded and dtype != torch.float32
            else None
        )
        self.kept: dict[int, Slot] = {}
        # [Note: an NF4 base] (nf4.py): a streamed block's packed 4-bit weights go up here, then are dequantized
        # into its slot (the upload stream runs in order: one stage serves every block)
        nf4 = max((u.nf4.nbytes for u in streamed if u.nf4 is not None), default=0)
        self.nf4_stage = (
            torch.empty(nf4, dtype=torch.uint8, device=dev.device)  # (bytes,) uint8
            if nf4 and dev.is_cuda
            else None
        )

    @property
    def shell_host_optimized(self) -> bool:
        """The shell's optimizer runs on the host (its weights stay resident on the device)."""
        return not self.planning.plan.shell_optimizer_on_device

    def reset(self) -> None:
        """No copy or kernel is in flight (the caller waited for the device): every slot is empty and every
        streamed unit ON_HOST, to be uploaded again when next needed (see [Note: slot reuse])."""
        self.kept = {}  # its slots were carved from the gradient buffers
        self._all_on_host()

    def _all_on_host(self) -> None:
        """Every slot empty, every streamed unit ON_HOST without a slot (the device idle: the caller waited)."""
        if self.pool is not None:
            self.pool.empty()
        for u in self.blocks:
            if u.home is Home.STREAMED:
                u.streamed.slot, u.streamed.state, u.streamed.ready_event = None, WeightState.ON_HOST, None

    def weights_loaded(self) -> None:
        """The masters were written from outside (a checkpoint load; the device is idle): no slot holds a weight,
        every streamed unit is ON_HOST, and a host-optimized resident shell is uploaded again before its next use
        ([Note: engine consistency after a load], store.py)."""
        self._all_on_host()  # (a window's kept blocks stay: a load comes between windows)
        if not self.shell.optimizer_on_device and self.shell.home is Home.RESIDENT:
            self.shell.streamed.dirty = True

    def shell_updating(self) -> None:
        """A host-optimized resident shell's update is queued on the host: its device weights go stale, and the next
        forward uploads it after the update (:meth:`refresh_shell`)."""
        self.shell.streamed.dirty = True

    @staticmethod
    def evicted(unit: Unit) -> None:
        """The pool gave the unit's slot to another: its weights are on the host only."""
        unit.streamed.state, unit.streamed.slot = WeightState.ON_HOST, None

    def drop(self) -> None:
        """Let go of the device buffers (a closed or failed engine)."""
        self.pool = self.stage = self.nf4_stage = None
        self.kept = {}

    # ------------------------------------------------------------------ transitions

    def begin_upload(self, unit: Unit, protect: tuple, wait: bool = True) -> bool:
        """ON_HOST -> UPLOADING: take a slot (never one of ``protect``), enqueue the copy.

        The unit's pending CPU update must be done first: with ``wait`` the host blocks on it (the unit
        is needed now), without it a prefetch of a unit still being updated is skipped (tried again later)."""
        if unit.home is Home.RESIDENT or unit.streamed.state is not WeightState.ON_HOST:
            return True
        assert (
            unit.updates.updated is not None and self.pool is not None
        )  # set at materialize; a streamed unit has a pool
        if not unit.updates.updated.is_set() and not wait:
            return False
        self.host_updates.wait_updated(unit)
        slot = self.kept.get(id(unit)) or self.pool.take(protect)  # [Note: a window keeps some blocks]
        dst = slot.tensor[: unit.numel]
        with self.dev.on(self.dev.upload):
            self.dev.wait(self.dev.upload, slot.free_event)  # [Note: slot reuse]
            self.dev.wait(self.dev.upload, slot.read_event)
            slot.read_event = self.upload(unit, dst)
            if (
                self.ranks.many and unit.numel
            ):  # [Note: sharded units]: the rank uploaded its shard; the GPUs share the rest
                with self.dev.timed("upload", self.dev.upload, f"{unit.name}(gather)"):
                    self.ranks.gather(slot.tensor, unit.numel)
                # [Note: nodes hold a slice of the state]: engine.module's gathered masters handed back, every rank
                # in the step now (none reading them)
                self.sharding.slices.before_upload(self.units)
            if unit.frozen is not None:  # [Note: frozen parameters]: after the trained weights, whole
                self._upload_frozen(unit, slot.tensor[unit.frozen_at : unit.frozen_at + unit.frozen_numel])
            unit.streamed.ready_event = self.dev.record(self.dev.upload)
        slot.tenant, unit.streamed.slot, unit.streamed.state = unit, slot, WeightState.UPLOADING
        return True

    def upload(self, unit: Unit, dst: torch.Tensor) -> Event | None:
        """Copy the unit's fp32 master into ``dst`` (compute dtype) on the upload stream. See [Note: fp32 uploads].

        A unit with a pending assisted update is updated on the way. See [Note: assisted updates].
        With a valid 16-bit host copy, that is uploaded instead; a forward that fills the copies sends the
        cast weights down into it ([Note: 16-bit copies for extra forwards]). Returns the event of a
        download that reads ``dst`` (the slot must outlive it), or None."""
        self.dev.wait(self.dev.upload, unit.updates.master_event)
        assert unit.master is not None  # an open engine's units hold their masters
        if unit.shard.state:  # [Note: sharded device state]: the rank's shard, from its GPU (cast)
            with self.dev.timed("upload", self.dev.upload, f"{unit.name}(shard)"):
                dst[unit.shard.lo : unit.shard.hi].copy_(unit.master)
            return None
        if unit.updates.pending is not None:
            self.device_updates.assisted_update(unit, dst)
            return None
        if unit.swap == "all" or self.copies16.valid(unit):
            with self.dev.timed("upload", self.dev.upload, f"{unit.name}(16)"):
                self.dev.wait(self.dev.upload, unit.copy16.event)
                assert unit.host16 is not None  # the disk tier's upload source, or a valid copy
                dst.copy_(unit.host16, non_blocking=True)
            return None
        if unit.updates.master_behind:  # [Note: the master behind its cast]: its 16-bit copy went stale first
            self.host_updates.await_moments(unit)
        lo, hi = unit.shard.lo, unit.shard.hi  # the whole unit, or this rank's shard ([Note: sharded units])
        with self.dev.timed("upload", self.dev.upload, unit.name):
            if dst.dtype == torch.float32:
                dst[lo:hi].copy_(unit.master[lo:hi], non_blocking=True)
            else:  # one buffer: the upload stream runs in order; a unit larger than it (the shell) in pieces
                assert self.stage is not None  # made for every uploaded unit in a 16-bit compute dtype
                cap = self.stage.numel()
                for a in range(lo, hi, cap):
                    k = min(cap, hi - a)
                    stage = self.stage[:k]
                    stage.copy_(unit.master[a : a + k], non_blocking=True)
                    dst[a : a + k].copy_(stage)
        if unit.host16 is None or not self.copies16.fill:
            return None
        up = self.dev.record(self.dev.upload)
        with self.dev.on(self.dev.download):
            self.dev.wait(self.dev.download, up)
            with self.dev.timed("download", self.dev.download, f"{unit.name}(16)"):
                unit.host16.copy_(dst, non_blocking=True)
            filled = self.dev.record(self.dev.download)
        self.copies16.filled(unit, filled)
        return filled

    def _upload_frozen(self, unit: Unit, dst: torch.Tensor) -> None:
        """The unit's frozen weights (fp32 host) into ``dst`` (compute dtype) on the upload stream: in place, or
        through the upload stage in pieces as upload does ([Note: frozen parameters], store.py); those held in
        NF4 packed, then dequantized on the device ([Note: an NF4 base], nf4.py)."""
        src = unit.frozen_host
        assert src is not None  # made with the frozen layout (materialize.py)
        if unit.frozen_disk:  # [Note: a frozen base on the disk] (disk.py): chunk by chunk from the tier
            tier, key, n = self.host_updates.tier, frozen_key(unit.index), src.numel()
            assert tier is not None  # frozen_disk: the unit's frozen weights are in the tier
            with self.dev.timed("upload", self.dev.upload, f"{unit.name}(frozen disk)"):
                for c, (a, _) in enumerate(tier.chunks(key)):
                    chunk = tier.acquire(key, c)["w16"].view(src.dtype)
                    lo = a * 4 // src.element_size()
                    hi = min(lo + chunk.numel(), n)
                    dst[lo:hi].copy_(chunk[: hi - lo])  # (a pageable buffer: the copy is done when it returns)
                    tier.release(key, c, write=False)
            return
        if unit.nf4 is not None:
            q = unit.nf4
            with self.dev.timed("upload", self.dev.upload, f"{unit.name}(nf4)"):
                packed = q.host
                if self.nf4_stage is not None:
                    packed = self.nf4_stage[: q.nbytes]
                    packed.copy_(q.host, non_blocking=True)
                q.dequantize(packed, dst)
            dst = dst[: src.numel()]
        with self.dev.timed("upload", self.dev.upload, f"{unit.name}(frozen)"):
            if dst.dtype == src.dtype:
                dst.copy_(src, non_blocking=True)
                return
            assert self.stage is not None  # a frozen unit streams: the stage was made for it
            cap = self.stage.numel()
            for a in range(0, src.numel(), cap):
                k = min(cap, src.numel() - a)
                stage = self.stage[:k]
                stage.copy_(src[a : a + k], non_blocking=True)
                dst[a : a + k].copy_(stage)

    def _window(self, order: list[Unit], pos: int) -> tuple:
        """The units needed from ``pos`` on that fit in the slots: the ones a slot must not be taken from."""
        return tuple(order[pos : pos + self.planning.plan.weight_slots])

    def acquire(self, order: list[Unit], pos: int) -> None:
        """UPLOADING -> ON_DEVICE for ``order[pos]``: the compute stream waits for its upload."""
        unit = order[pos]
        if unit.home is Home.RESIDENT:
            return
        if unit.streamed.state is WeightState.ON_HOST:
            self.begin_upload(unit, self._window(order, pos))
        if unit.streamed.state is WeightState.UPLOADING:
            self.dev.wait(self.dev.compute, unit.streamed.ready_event)
            unit.streamed.state = WeightState.ON_DEVICE

    def release(self, unit: Unit) -> None:
        """The compute stream is done reading the unit's slot for now (the slot keeps it until taken)."""
        if unit.home is Home.STREAMED and unit.streamed.slot is not None:
            unit.streamed.slot.free_event = self.dev.record(self.dev.compute)

    def evict(self, unit: Unit) -> None:
        """ON_DEVICE -> ON_HOST: the slot copy is about to go stale (an update is coming); drop it."""
        if unit.home is Home.STREAMED and unit.streamed.slot is not None:
            unit.streamed.slot.tenant = None
            unit.streamed.slot, unit.streamed.state = None, WeightState.ON_HOST

    def prefetch(self, order: list[Unit], pos: int) -> None:
        """Enqueue the uploads of the next units in ``order`` that are ready, as far as the slots allow."""
        depth = self.planning.plan.weight_slots - 1
        tier = self.host_updates.tier
        if tier is not None:  # [Note: a frozen base on the disk]: read the next ones' frozen weights ahead
            ahead = [
                frozen_key(u.index)
                for u in order[pos + 1 : pos + 2 + depth]
                if u.frozen_disk and u.streamed.state is WeightState.ON_HOST
            ]
            if ahead:
                tier.expect(ahead)
        for u in order[pos + 1 : pos + 1 + depth]:
            # a unit whose CPU update is still running is passed over, not waited for: the ones after it
            # (an assisted update, say) keep the copy engines busy meanwhile; it is uploaded when acquired
            # several ranks: the gathers must come in the same order on every rank ([Note: sharded units])
            self.begin_upload(u, self._window(order, pos), wait=self.ranks.many)

    def refresh_shell(self) -> None:
        """A host-optimized shell: wait for its update and upload it into dev16 before use.

        Waiting for the update also orders the next step's writes into ``shell.grad`` after the
        download that read it: the update task synchronized on that download's event first."""
        if not self.shell_host_optimized:
            return
        u = self.shell
        updated = self.device_updates.take_shell_update()
        if updated is not None:  # updated on the device: [Note: assisted updates in the backward]
            self.dev.wait(self.dev.compute, updated)
        if u.streamed.dirty:
            self.host_updates.wait_updated(u)
            with self.dev.on(self.dev.upload):
                assert u.dev16 is not None  # the shell is resident
                self.upload(u, u.dev16)
                if self.ranks.many:  # [Note: sharded units]
                    self.sharding.gather_dev16(u)
                ev = self.dev.record(self.dev.upload)
            self.dev.wait(self.dev.compute, ev)
            u.streamed.dirty = False

    # ------------------------------------------------------------------ a window of DeepSpeed-shaped forwards

    def prefetch_first_blocks(self) -> None:
        """Another forward of this window follows: start uploading its first streamed blocks now (into the
        slots the last blocks just left: [Note: slot reuse] orders it after their compute), so that forward
        does not begin by waiting for PCIe."""
        streamed = [u for u in self.blocks if u.home is Home.STREAMED]
        window = tuple(streamed[: self.planning.plan.weight_slots])
        for u in streamed[: max(self.planning.plan.weight_slots - 1, 1)]:
            if not self.begin_upload(u, window, wait=self.ranks.many):  # ranks: [Note: sharded units]
                break

    def keep_blocks(self, grad_pool: SlotPool | None) -> None:
        """At a window's first forward, with more forwards to come: carve slots for some streamed blocks out of
        the idle gradient buffers ([Note: a window keeps some blocks])."""
        if (
            self.kept
            or not self.keep_allowed
            or grad_pool is None
            or self.ranks.many
            or any(g.tenant is not None for g in grad_pool.slots)
        ):
            return
        assert self.pool is not None  # a window keeps streamed blocks: the pool exists
        cap = self.pool.slots[0].tensor.numel()
        slots = []
        for g in grad_pool.slots:
            room = g.tensor.view(self.dtype)  # (2 x capacity,) in 16-bit, (capacity,) in fp32
            for j in range(room.numel() // cap):
                slots.append(Slot(room[j * cap : (j + 1) * cap], free_event=g.free_event))
        streamed = [u for u in self.blocks if u.home is Home.STREAMED]
        candidates = streamed[: max(len(streamed) - self.planning.plan.weight_slots, 0)]
        keep = candidates[max(len(candidates) - len(slots), 0) :]
        for u, slot in zip(keep, slots):
            if u.streamed.state is not WeightState.ON_HOST:  # in a pool slot (prefetched): give that slot back first
                self.evict(u)
            self.kept[id(u)] = slot

    def beyond_pool(self) -> list[Unit]:
        """The streamed blocks the pool's slots cannot hold at once, in order (the first ones past its count)."""
        streamed = [u for u in self.blocks if u.home is Home.STREAMED]
        return streamed[: max(len(streamed) - len(self.pool.slots), 0)] if self.pool is not None else []

    def keep_for_generation(self, count: int) -> bool:
        """[Note: generation keeps blocks] (plan/generation.py): ``count`` of :meth:`beyond_pool` get fresh device
        slots of their own for a generation: each is uploaded once and stays until :meth:`return_kept`. Returns
        whether it kept any (never while a window keeps blocks)."""
        if count <= 0 or self.kept or self.pool is None:
            return False
        cap = self.pool.slots[0].tensor.numel()
        for u in self.beyond_pool()[:count]:
            if u.streamed.state is not WeightState.ON_HOST:  # in a pool slot: it moves to its own
                self.evict(u)
            self.kept[id(u)] = Slot(torch.empty(cap, dtype=self.dtype, device=self.dev.device))
        return bool(self.kept)

    def return_kept(self) -> None:
        """The window's forwards are done: the kept blocks' slots go back to being gradient memory."""
        kept, self.kept = self.kept, {}
        for slot in kept.values():
            self.dev.wait(self.dev.compute, slot.read_event)  # a download filling a host copy from it
            if slot.tenant is not None:
                self.evict(slot.tenant)
