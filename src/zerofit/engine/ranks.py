"""Ranks: one engine per process over the GPUs of one host (``torchrun``), the training state held once.

[Note: sharded units]
With N ranks every unit's flat buffers are cut into N equal shards (``s = ceil(numel / N)``; the device
buffers are padded to ``N * s``); rank r owns ``[r*s, min((r+1)*s, numel))``. What lives where:

- the host state of host-optimized units (fp32 master, Adam moments) is in arenas *shared* by the host's
  ranks (a ``memfd`` each rank maps), so host memory holds it once; each rank writes only its own shard.
  ``engine.module``, checkpoints and export read the whole tensors there, after a barrier.
- a rank uploads only its shard of a streamed block's master into its slot, then the GPUs all-gather the
  rest (NVLink); a block's gradient is reduce-scattered on the GPUs and each rank downloads only its
  shard, which its CPU worker updates. The rank that updates a shard is the one that uploads it, so no rank
  ever waits for another's CPU. The gradients that wait for the global norm (clipping, fp16) are private
  and shard-sized.
- units whose optimizer runs on the device (resident blocks, a device-optimized shell) are replicated:
  their gradients are all-reduced and every rank applies the same update.
- the global norm: each rank's squared norm of its shards, all-reduced, plus the replicated units' once.
  An fp16 overflow anywhere makes the norm non-finite on every rank: all skip the step together.

Collectives must be issued in the same order on every rank. They are issued from the main thread only, in
the blocks' forward and backward order; a prefetch therefore waits for a block whose CPU update is still
running (with one rank it passes over it), and gathers and reduce-scatters go through two process groups of
their own, so that a prefetch's gather never queues behind a gradient's reduce-scatter.

[Note: a failing rank]
A collective blocks until every rank joins it, so an exception on one rank would leave the others waiting
forever. An error inside a zerofit call on any rank is recorded in the process group's store (the first one
wins) and the rank goes on raising. Every rank runs a monitor thread that polls that key: when another rank
has failed, it logs the rank and the cause, gives the main thread a grace period to fail on its own (a gloo
peer that exited closes its sockets at once), and then ends the process with status 1. No rank hangs, and
each names the rank that failed first and why.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("zerofit")

_FAILED = "zerofit/failed"
_GRACE_S = 10.0


class RankFailedError(RuntimeError):
    """Another rank failed: this one cannot go on (its next collective would wait forever)."""


def _launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class Ranks:
    """The process group as the engine sees it. ``world == 1``: a single process (every method a no-op)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world: int = 1
    gather_group: object = None
    reduce_group: object = None
    owns_group: bool = False          # initialize created the default group: destroyed when the engine closes
    _monitor: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _mappings: list = field(default_factory=list)

    @property
    def many(self) -> bool:
        return self.world > 1

    # ------------------------------------------------------------------ set-up

    @classmethod
    def setup(cls, device_type: str, timeout_s: float, bind_cores: bool = True) -> "Ranks":
        """The process group from the environment ``torchrun`` sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        ...), or the one the caller already made; NCCL for GPUs, gloo for the CPU. One process: ``Ranks()``."""
        if not dist.is_available() or (not dist.is_initialized() and not _launched()):
            return cls()
        owns = False
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
            owns = True
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            return cls(owns_group=owns)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if local_world != world:
            raise NotImplementedError(
                f"zerofit runs its ranks on one host for now (WORLD_SIZE {world}, LOCAL_WORLD_SIZE {local_world}): "
                "the host state is shared by the host's ranks ([Note: sharded units], zerofit/engine/ranks.py)")
        gather = dist.new_group(list(range(world)))
        reduce = dist.new_group(list(range(world)))
        r = cls(world, rank, int(os.environ.get("LOCAL_RANK", str(rank))), local_world, gather, reduce, owns)
        log.info("zerofit: rank %d of %d, %d torch threads", rank, world, r._share_cores(bind_cores))
        r._start_monitor()
        return r

    def _share_cores(self, bind: bool) -> int:
        """[Note: a rank's cores] torchrun sets OMP_NUM_THREADS=1 for every rank when there are several, which
        makes a CPU optimizer single-threaded without a word. Each rank gets its share of this process's cores
        (``ZEROFIT_THREADS_PER_RANK`` overrides), bound to a disjoint set of them when there are enough."""
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        n = int(os.environ.get("ZEROFIT_THREADS_PER_RANK", "0")) or max(1, len(cores) // self.local_world)
        if bind and len(cores) >= n * self.local_world:
            mine = cores[self.local_rank * n:(self.local_rank + 1) * n]
            os.sched_setaffinity(0, mine)
        torch.set_num_threads(n)
        return n

    # ------------------------------------------------------------------ shards

    def shard_size(self, numel: int) -> int:
        return -(-numel // self.world)

    def padded(self, numel: int) -> int:
        """Device buffers of a unit hold this many elements: N equal shards."""
        return self.shard_size(numel) * self.world

    def bounds(self, numel: int) -> tuple[int, int]:
        """This rank's shard ``[lo, hi)`` of a unit of ``numel`` elements (empty past the end)."""
        s = self.shard_size(numel)
        lo = min(self.rank * s, numel)
        return lo, min(lo + s, numel)

    # ------------------------------------------------------------------ collectives

    def gather(self, full: torch.Tensor, numel: int) -> None:
        """``full`` (at least ``padded(numel)`` elements) holds this rank's shard in place; fill in the rest."""
        s = self.shard_size(numel)
        out = full[: s * self.world]
        mine = out[self.rank * s:(self.rank + 1) * s]
        if out.device.type == "cpu":       # gloo: no in-place gather
            mine = mine.clone()
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, mine, group=self.gather_group)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, numel: int) -> None:
        """``out`` (shard-sized) = this rank's shard of the sum of every rank's ``full`` (padded)."""
        s = self.shard_size(numel)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out[:s], full[: s * self.world], group=self.reduce_group)

    def all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.many:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.reduce_group)
        return t

    def broadcast(self, t: torch.Tensor) -> None:
        if self.many:
            dist.broadcast(t, 0, group=self.reduce_group)

    def barrier(self) -> None:
        if self.many:
            dist.barrier(group=self.reduce_group)

    def objects(self, value) -> list:
        """Every rank's ``value`` (pickled), in rank order."""
        if not self.many:
            return [value]
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    # ------------------------------------------------------------------ shared host memory

    def shared(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``numel`` elements that every rank of this host maps (zeros at first). Collective:
        every rank calls it in the same order. Local rank 0 creates a ``memfd``; the others open it through
        ``/proc/<pid>/fd``."""
        nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
        fd = None
        if self.local_rank == 0:
            fd = os.memfd_create("zerofit-state", 0)
            os.ftruncate(fd, nbytes)
            path = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            path = None
        path = self.objects(path)[0]
        if fd is None:
            fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            self.barrier()          # every rank has it open before the creator lets go of its descriptor
            os.close(fd)
        self._mappings.append(mm)   # the mapping outlives every tensor that views it (module parameters)
        return torch.frombuffer(mm, dtype=dtype, count=max(numel, 1))[:numel]

    # ------------------------------------------------------------------ failures: [Note: a failing rank]

    def _store(self):
        return dist.distributed_c10d._get_default_store()

    def fail(self, err: BaseException) -> None:
        """Record this rank's failure (the first failure of the group wins)."""
        if not self.many or isinstance(err, RankFailedError):
            return
        cause = f"rank {self.rank}: {type(err).__name__}: {err}"
        try:
            self._store().compare_set(_FAILED, "", cause)
        except Exception as e:       # noqa: BLE001 - the store may be gone already
            log.debug("zerofit: could not record the failure: %r", e)

    def failure(self) -> str | None:
        """The first recorded failure of any rank, or None."""
        if not self.many:
            return None
        try:
            store = self._store()
            if store.check([_FAILED]):
                value = store.get(_FAILED).decode()
                return value or None
        except Exception:            # noqa: BLE001
            return None
        return None

    def peer_error(self, err: BaseException) -> BaseException:
        """An error a collective raised, named after the rank that failed first when one did."""
        cause = self.failure()
        if cause and not cause.startswith(f"rank {self.rank}:"):
            return RankFailedError(f"another rank failed first ({cause}); this rank (rank {self.rank}) stops too")
        return err

    def _start_monitor(self) -> None:
        def watch():
            while not self._stop.wait(1.0):
                cause = self.failure()
                if cause and not cause.startswith(f"rank {self.rank}:"):
                    print(f"zerofit: rank {self.rank}: another rank failed ({cause}); ending this rank in "
                          f"{_GRACE_S:.0f} s unless it ends by itself", file=sys.stderr, flush=True)
                    if self._stop.wait(_GRACE_S):
                        return
                    print(f"zerofit: rank {self.rank}: exiting (status 1) after the failure of {cause}",
                          file=sys.stderr, flush=True)
                    os._exit(1)
        self._monitor = threading.Thread(target=watch, name=f"zerofit-rank{self.rank}-monitor", daemon=True)
        self._monitor.start()

    def close(self) -> None:
        """Stop the monitor; destroy the process group if the engine made it."""
        self._stop.set()
        if self.owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:     # noqa: BLE001
                log.debug("zerofit: destroying the process group: %r", e)
            self.owns_group = False
