"""Sharding: the units' device buffers with several ranks (a part; ranks.py has the process group and the
collectives, [Note: sharded units]).

[Note: sharded device state]
With several ranks and sharding other than NO_SHARD (FSDP's FULL_SHARD and SHARD_GRAD_OP, ZeRO stages
2 and 3), a unit the planner keeps on the GPU with its optimizer holds its fp32 master and moments for
its shard only: its gradient is reduce-scattered, each rank updates its shard on the GPU, casts it into
its part of ``dev16`` and the GPUs all-gather ``dev16`` (the 16-bit weights stay whole on every GPU,
as SHARD_GRAD_OP keeps them: the blocks a plan streams are the ones whose weights are sharded too).
With FULL_SHARD and no offload (``plan.device_state``) every block streams instead, from the GPUs:
each rank casts its master shard into its slot and the GPUs all-gather the rest before each use (the
upload waits for the update through ``master_event``); the block's gradient is reduce-scattered as soon
as its backward ends and summed into a gradient shard, and its slot is free again: each GPU holds 20
B/param / N of state plus a few slots, as FSDP2's ``fully_shard``.
The host mirror stays whole; it, checkpoints and export gather the shards (:meth:`Sharding.full_state`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from zerofit.engine.device import Device
from zerofit.engine.distributed.node_slices import NodeSlices
from zerofit.engine.memory.store import Home, Unit

if TYPE_CHECKING:
    from zerofit.engine.distributed.ranks import Ranks


class Sharding:
    """State: ``padded_grad``, the gradient buffers (padded, with room for the shard) of resident host-optimized
    units; ``shard_grad``, the summed gradient shards of streamed units whose state is on the GPUs (FULL_SHARD
    without offload). With one rank it holds nothing and nothing calls it."""

    def __init__(self, dev: Device, ranks: Ranks, dtype: torch.dtype, mode: str) -> None:
        self.dev, self.ranks, self.dtype, self.mode = dev, ranks, dtype, mode
        self.padded_grad: dict[int, torch.Tensor] = {}  # id(unit) -> (padded + shard,) fp32, device
        self.shard_grad: dict[int, torch.Tensor] = {}  # id(unit) -> (hi - lo,) fp32, device: summed per step
        self.writing_alone = False  # rank 0 writes a checkpoint: its own waits are not collectives
        self.slices = NodeSlices(dev, ranks)  # the full layout's host state ([Note: nodes hold a slice of the state])

    def share_units(self, units: list[Unit]) -> None:
        """[Note: sharded units] after materialization: every rank starts from local rank 0's weights. The host
        state (shared) was written by rank 0 alone: once it is there, the other ranks' device copies of it are
        refreshed; replicated device-optimized units are broadcast from rank 0. Device buffers that take part
        in a gather or a reduce-scatter get their padding (and a gradient buffer the room for its shard)."""
        r = self.ranks
        r.barrier()
        for u in units:
            if u.optimizer_on_device:  # done as it was built: share_device_unit
                continue
            if u.home is Home.RESIDENT:  # host-optimized but kept on the device: gathered after each update
                assert u.master is not None  # materialized
                self._pad_resident(u, u.master)
        r.barrier()

    def _pad_resident(self, u: Unit, weights: torch.Tensor) -> None:
        """A resident unit whose 16-bit weights are all-gathered and whose gradient is reduce-scattered: ``dev16``
        (a copy of ``weights``) padded to N shards, and a gradient buffer with room for its shard after the
        padded gradient ([Note: sharded units])."""
        r, n = self.ranks, u.numel
        dev16 = torch.empty(r.padded(n), dtype=self.dtype, device=self.dev.device)  # (padded,) compute dtype
        dev16[:n].copy_(weights)
        u.dev16 = dev16[:n]
        g = torch.zeros(r.padded(n) + r.shard_size(n), dtype=torch.float32, device=self.dev.device)
        self.padded_grad[id(u)] = g
        u.grads.own(g[:n])

    def share_device_unit(self, u: Unit) -> None:
        """A device-optimized unit, as soon as materialization built it (every rank, in the same order): rank 0's
        weights everywhere, then sharded unless NO_SHARD ([Note: sharded device state])."""
        assert u.master is not None and u.host is not None  # materialized
        self.ranks.broadcast(u.master)
        if u.dev16 is not None and u.dev16 is not u.master:
            u.dev16.copy_(u.master)
        if u.host is not u.master:
            u.host.copy_(u.master)
        if self.mode != "NO_SHARD":
            self._shard_device_unit(u)

    def _shard_device_unit(self, u: Unit) -> None:
        """[Note: sharded device state]: master and moments of the rank's shard only."""
        assert u.master is not None  # materialized
        if u.home is Home.STREAMED:  # FULL_SHARD without offload: weights only in slots, gathered per use
            self.shard_grad[id(u)] = torch.zeros(u.shard.hi - u.shard.lo, device=self.dev.device)  # summed per step
        else:
            assert u.dev16 is not None  # resident
            self._pad_resident(u, u.dev16)
        u.master = u.master[u.shard.lo : u.shard.hi].clone()  # (hi - lo,) fp32, device
        u.exp_avg = torch.zeros_like(u.master)
        u.exp_avg_sq = torch.zeros_like(u.master)
        u.shard.state = True

    def reduce_scatter(self, unit: Unit) -> torch.Tensor:
        """[Note: sharded units]: the sum over the ranks of this rank's shard of the unit's gradient, on the device
        (in the room after the padded gradient in its buffer, so it lives as long as the gradient slot)."""
        r = self.ranks
        full = unit.grads.slot.tensor if unit.grads.slot is not None else self.padded_grad[id(unit)]
        p, s = r.padded(unit.numel), r.shard_size(unit.numel)
        full[unit.numel : p].zero_()
        out = full[p : p + s]
        with self.dev.timed("compute", label=f"{unit.name}(reduce-scatter)"):
            r.reduce_scatter(out, full, unit.numel)
        return out[: unit.shard.hi - unit.shard.lo]

    def keep_shard(self, unit: Unit, first: bool) -> None:
        """[Note: sharded device state] (FULL_SHARD, no offload): the block's gradient is reduce-scattered and this
        rank's shard summed into the unit's gradient shard on the GPU (its gradient slot can go back at once)."""
        g = self.reduce_scatter(unit)
        acc = self.shard_grad[id(unit)]
        if first:  # the step's first gradient of the unit (Grads.host_written)
            acc.copy_(g)
        else:
            acc.add_(g)

    def gather_full(self, u: Unit, t: torch.Tensor) -> torch.Tensor:
        """A sharded device unit's whole ``t`` (its shard on every rank), on the host (fp32). Collective."""
        buf = torch.zeros(self.ranks.padded(u.numel), dtype=torch.float32, device=self.dev.device)
        buf[u.shard.lo : u.shard.hi].copy_(t)
        self.ranks.gather(buf, u.numel)
        return buf[: u.numel].to("cpu")

    def gather_dev16(self, u: Unit) -> None:
        """A unit's 16-bit device weights, each rank's shard written in place, made whole on every rank."""
        assert u.dev16 is not None  # a resident unit's (the shell's, or a device-optimized one's)
        self.ranks.gather(u.dev16.as_strided((self.ranks.padded(u.numel),), (1,)), u.numel)

    def on_rank0(self, units: list[Unit], wait, write):
        """Several ranks ([Note: sharded units]): every rank calls; once every rank's updates are applied
        (``wait()``), rank 0 writes the whole tensors from the shared host state and the others wait for its
        outcome (an error on rank 0 is raised on every rank). One rank: ``write()``."""
        if not self.ranks.many:
            return write()
        wait()
        result, err = None, None
        with self.full_state(units, write_back=False, everywhere=False):  # [Note: sharded device state]
            if self.ranks.rank == 0:
                self.writing_alone = True
                try:
                    result = write()
                except Exception as e:  # noqa: BLE001 - raised below, on every rank
                    err = e
                finally:
                    self.writing_alone = False
            said = self.ranks.objects(
                (str(result), None if err is None else f"{type(err).__name__}: {err}") if self.ranks.rank == 0 else None
            )[0]
        if err is not None:
            raise err
        if said[1] is not None:
            raise RuntimeError(f"rank 0 failed to write: {said[1]}")
        return said[0]

    @contextlib.contextmanager
    def full_state(self, units: list[Unit], write_back: bool, everywhere: bool = True):
        """Within the block, sharded device units ([Note: sharded device state]) show their whole master and
        moments, gathered into the host mirror and host buffers, to what reads or writes whole tensors
        (checkpoints, export, master_state_dict). ``write_back``: afterwards each rank takes its shard of
        what is there (a checkpoint load wrote it). Collective. The full layout's host units likewise, in the
        node's arenas ([Note: nodes hold a slice of the state], node_slices.py): gathered unless the block
        writes them (``write_back``), into node 0's only unless ``everywhere``, handed back after."""
        if self.slices.on and not write_back:
            self.slices.gather(units, everywhere=everywhere)
        try:
            with self._device_full_state(units, write_back):
                yield
        finally:
            if self.slices.on:  # every rank of the node done reading them first (a read of a freed page backs it)
                self.ranks.barrier()
                self.slices.trim(units)

    @contextlib.contextmanager
    def _device_full_state(self, units: list[Unit], write_back: bool):
        units = [u for u in units if u.shard.state]
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for u in units:
            assert u.master is not None and u.exp_avg is not None and u.exp_avg_sq is not None
            assert u.host is not None  # an open engine's sharded device unit
            kept.append((u.master, u.exp_avg, u.exp_avg_sq))
            master, m, v = (self.gather_full(u, t) for t in kept[-1])
            u.host.copy_(master)
            u.master, u.exp_avg, u.exp_avg_sq = u.host, m, v
        try:
            yield
        finally:
            for u, (master, m, v) in zip(units, kept):
                if write_back:
                    for dst, src in ((master, u.master), (m, u.exp_avg), (v, u.exp_avg_sq)):
                        assert src is not None  # the whole state set above (a load writes into it)
                        dst.copy_(src[u.shard.lo : u.shard.hi])
                u.master, u.exp_avg, u.exp_avg_sq = master, m, v
