"""NodeSlices: the full layout's host state, each node holding its slice of it (a part, owned by Sharding).

[Note: nodes hold a slice of the state]
The *full* layout on several nodes (``nodes_layout: full``; FSDP's FULL_SHARD or SHARD_GRAD_OP across nodes,
DeepSpeed's ZeRO stages 1-3 across nodes) cuts every unit into one shard per rank of the world, ``s = ceil(numel
/ world)``, rank r owning ``[r*s, (r+1)*s)`` (``Ranks.bounds``): node n's ranks own the node's slice ``[n*k*s,
(n+1)*k*s)`` of k ranks per node (``Ranks.node_bounds``). A block's 16-bit weights are all-gathered over every rank
(each rank uploads its shard), its gradient reduce-scattered over every rank, the norm's squares summed over every
rank; no gradient is all-reduced across the nodes. The host-optimized units' master and moments keep their shape
(each unit's buffers whole, in the node's shared arenas, [Note: sharded units] in ranks.py), so every index is the
one a single node uses; but a node only ever reads and writes its slice, and the pages of the other slices are
never backed: local rank 0 writes a unit whole when it is built (from the model or its files), then hands the
other slices' pages back to the kernel (``MADV_REMOVE`` on the memfd mapping: the file's pages themselves are
freed, for every rank that maps it). So a node's memory holds 1/N of the masters and moments (``held_bytes``:
the memfds' allocated pages, what the tests measure), at most a page either side of its slice more per buffer,
and each node's CPU updates only its 1/N.

What reads or writes the whole state works within ``Sharding.full_state`` as on one node: each host unit's master
and moments are gathered over every rank into the arenas (``gather``; a checkpoint save only into node 0's, whose
rank 0 writes it), and the other slices are handed back when the block ends (``trim``). So for the length of a
save, node 0 holds the whole state, and for the length of a load (it writes whole tensors) every node does: a
state larger than one host's memory trains in the full layout, and is saved and loaded from a host that can
hold it (not checked before the gather: a host that cannot fails as any allocation does). ``engine.module``
gathers the masters into every node (the module's parameters whole), and they are handed back after the next
step's first gather (``Streamer.begin_upload``: every rank is in the step then, none reading them): the module is
read between steps and is current when read, as on one node. A read of a handed-back page backs it again (shared memory
has no zero page), so every hand-back waits until the node's ranks are done reading: ``full_state`` with a barrier,
engine.module's behind that gather.

The frozen weights (LoRA's base) stay whole on every node: they have no state to shard. With pinned memory only
the node's slices are page-locked (page-rounded, merged ranges): page-locking the whole arena would back every
page of it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import TYPE_CHECKING

import torch

from zerofit.engine.memory.store import Home, Unit

if TYPE_CHECKING:
    from zerofit.engine.device import Device
    from zerofit.engine.distributed.ranks import Ranks


_PAGE = mmap.PAGESIZE
_MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)
_libc = ctypes.CDLL(None, use_errno=True)
_KINDS = ("master", "exp_avg", "exp_avg_sq")


def free_pages(t: torch.Tensor) -> None:
    """Hand back to the kernel the whole pages inside ``t``'s memory (a view of a shared memfd mapping): they read
    as zeros again, and back nothing until touched (a read backs a page too: shared memory has no zero page)."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    a, b = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if b > a and _libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_REMOVE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_REMOVE) of {b - a} bytes: {os.strerror(err)}")


def free_outside(ranks, t: torch.Tensor) -> None:
    """Hand back the pages of ``t`` (a unit's whole host buffer) outside this node's slice."""
    lo, hi = ranks.node_bounds(t.numel())
    free_pages(t[:lo])
    free_pages(t[hi:])


def gathered(u: Unit) -> bool:
    """A unit whose host state each node updates a slice of: host-optimized, trained, in host memory."""
    return not u.optimizer_on_device and u.numel > 0 and u.swap is None


def sliced(u: Unit) -> bool:
    """One whose other slices are handed back: streamed (a resident one's 16-bit weights may be its master itself,
    on the CPU, gathered whole after each update: the shell stays whole)."""
    return gathered(u) and u.home is Home.STREAMED


class NodeSlices:
    """State: ``whole``, the buffers gathered whole outside a ``full_state`` block (engine.module's masters) and
    not handed back yet; ``pinned``, the page-locked ranges of the node's slices. Inert unless ``ranks.full``."""

    def __init__(self, dev: Device, ranks: Ranks) -> None:
        self.dev, self.ranks = dev, ranks
        self.whole = False
        self.pinned: list[int] = []  # base addresses registered with cudaHostRegister

    @property
    def on(self) -> bool:
        return self.ranks.full

    def gather(self, units: list[Unit], kinds=_KINDS, everywhere: bool = True) -> None:
        """Each sliced unit's ``kinds`` made whole in the node's arenas from every rank's shard (collective: every
        rank, the same units in the same order); written by local rank 0 of every node, or with ``everywhere``
        false of node 0 only (a save: its rank 0 writes). Through the device (NCCL carries device tensors)."""
        r = self.ranks
        for u in (u for u in units if gathered(u)):
            buf = torch.zeros(r.padded(u.numel), dtype=torch.float32, device=self.dev.device)
            for kind in kinds:
                t = getattr(u, kind)
                buf[u.shard.lo : u.shard.hi].copy_(t[u.shard.lo : u.shard.hi])
                r.gather(buf, u.numel)
                if r.local_rank == 0 and (everywhere or r.node == 0):
                    t.copy_(buf[: u.numel])
        r.barrier()  # written before any rank reads them

    def trim(self, units: list[Unit]) -> None:
        """The other nodes' slices handed back (local rank 0 of each node; the pages are the node's)."""
        self.whole = False
        if self.ranks.local_rank != 0:
            return
        for u in (u for u in units if sliced(u)):
            for kind in _KINDS:
                free_outside(self.ranks, getattr(u, kind))

    def module_gathered(self, units: list[Unit]) -> None:
        """engine.module: the masters whole on every node until the next upload."""
        self.gather(units, ("master",))
        self.whole = True

    def written_whole(self) -> None:
        """The module's parameters were written whole (the user's ``load_state_dict``): hand back at the next upload."""
        self.whole = self.on

    def before_upload(self, units: list[Unit]) -> None:
        """The first gather after engine.module: its gathered masters handed back (no rank reads them now)."""
        if self.whole:
            self.trim(units)

    def pin(self, units: list[Unit]) -> None:
        """Page-lock the node's slices of the sliced units' buffers (merged page ranges)."""
        spans = []
        for u in (u for u in units if sliced(u)):
            lo, hi = self.ranks.node_bounds(u.numel)
            for kind in _KINDS:
                t = getattr(u, kind)
                a = t.data_ptr() + lo * 4
                spans.append((a // _PAGE * _PAGE, -(-(a + (hi - lo) * 4) // _PAGE) * _PAGE))
        spans.sort()
        merged: list[list[int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in merged:
            rc = int(torch.cuda.cudart().cudaHostRegister(a, b - a, 0))
            if rc != 0:
                raise RuntimeError(f"cudaHostRegister of {b - a} bytes failed with CUDA error {rc}")
            self.pinned.append(a)

    def close(self) -> None:
        """Undo the page-locking (an arena's close: Lifecycle releases it with the arenas)."""
        for a in self.pinned:
            torch.cuda.cudart().cudaHostUnregister(a)
        self.pinned.clear()
