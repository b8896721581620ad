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

[Note: nodes hold the state whole]
Several nodes (torchrun ``--nnodes``, an srun job over several nodes: ``WORLD_SIZE`` a multiple of
``LOCAL_WORLD_SIZE``, ranks numbered node by node) run the *hybrid* layout, FSDP's ``HYBRID_SHARD``: each node
holds the whole training state in its own host memory, shared by its ranks exactly as on one host (its arenas are
its own: the memfd of the node's local rank 0), and the units are cut into one shard per rank of the node
(``local_world`` shards; ``bounds`` by ``local_rank``). A block's 16-bit weights are all-gathered inside the node
(``gather_group``); its gradient is reduce-scattered inside the node and then all-reduced across the nodes for
each shard (``cross_group``: the ranks of the same local rank), so every node holds the same summed shard and
applies the same update: the nodes stay identical without ever sending weights. The norm's squares are summed
over the node's ranks only (``all_reduce``: every node has them alike); replicated gradients, losses and flags
over every rank (``all_reduce_world``). Checkpoints: rank 0 writes the whole tensors from its node's state, every
rank loads a checkpoint into its node's (a checkpoint from N nodes loads on M). What crosses the nodes per step:
each rank's shard of every host-optimized gradient, all-reduced (about 2 (n-1)/n x 4 bytes per parameter per node
in fp32), and the replicated units' gradients. The *full* layout ([Note: nodes hold a slice of the state],
node_slices.py) shards the host state across the nodes instead: ``use_layout("full")``.

[Note: a failing rank] and [Note: a rank that dies]: rank_failures.py.

[Note: a process group that lives]
A process may make several engines in turn (train, then evaluate; a sweep). The process group is made once
and lives for the process: an engine that finds no group makes it, and its ``close()`` leaves it; the next
engine finds it and reuses it, with the two groups of its own (gathers, reduce-scatters), which are made once
per default group and kept with it. zerofit destroys the group it made at interpreter exit (``_at_exit``),
after the engines: it is a ``weakref.finalize`` made when zerofit first makes a group (or watches an engine),
and finalizers run at exit newest first, so every engine's own ([Note: engine lifecycle], lifecycle.py: its
CPU worker stopped and joined, its key no longer polled) runs before it, each engine made after it. Then
``_at_exit`` stops and joins the monitor thread and destroys the group. (Releasing an engine issues no
collective, so even the other order would be safe.) A later engine reuses the group as it is, with the first engine's
``distributed_timeout_s`` and backend (a mismatch of backend and device is logged).

Why not destroy and make it again: ``init_process_group`` names the default group ``"0"`` again (its counter
is reset by ``destroy_process_group``) and its subgroups ``"1"``, ``"2"``, so a second group over the same store
writes under the keys of the first: torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) lives as long as
the job, and rank 0's own store (``MASTER_PORT``, multi-tenant) as long as anything in rank 0 holds it. A rank
that makes its second group first can read its peers' stale entries (``Connection refused``) or wait for a rank
still in the first group (a hang): under ``torch.distributed.run``, 2 hangs in 2 launches of three engines.

When a group must be made again (the program destroyed it with ``dist.destroy_process_group()`` between
engines), it is made over the same base store, which zerofit keeps for the process (so rank 0's server never
goes away under a rank that already connected to it), under a prefix no earlier group used:
``zerofit/<TORCHELASTIC_RESTART_COUNT>/group<k>`` for the k-th group zerofit makes in this process. Its
subgroups are made afresh (``new_group`` puts their keys under the default group's store, hence under the same
new prefix). A group the program made itself is used as it is, and never destroyed by zerofit.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from zerofit.engine.distributed import slurm
from zerofit.engine.distributed.rank_failures import FAILED, RankFailures

log = logging.getLogger("zerofit")

_JOIN_S = 5.0  # how long the exit waits for the monitor thread to end (it polls every second)


def _restart() -> str:
    """torchrun's restart count: the agent's store lives across restarts, so every key zerofit writes names it."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


class _Process:
    """What zerofit keeps for the life of the process: [Note: a process group that lives]."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards ``live`` (the monitor thread reads it)
        self.monitor: threading.Thread | None = None  # [Note: a failing rank]: one per process
        self.stop = threading.Event()
        self.store: dist.Store | None = None  # the base store (torchrun's env://) of every group zerofit makes
        self.rank = self.world = 0  # as the rendezvous read them
        self.made = 0  # the groups zerofit made in this process (their store prefixes)
        # the default group zerofit made last; destroyed at exit if still the default
        self.group: dist.ProcessGroup | None = None
        self.subgroups: tuple | None = None  # (default group, gather group, reduce group, cross-node group)
        self.world_groups: tuple | None = None  # (default group, gather group, reduce group) of every rank: the
        #                                          full layout ([Note: nodes hold a slice of the state])
        self.engines = 0  # engines of several ranks made in this process (their failure keys)
        self.live: weakref.WeakSet = weakref.WeakSet()  # the open engines' Ranks, whose keys the monitor polls
        self.at_exit: weakref.finalize | None = None  # stops the monitor and destroys the group at exit

    def finalize_at_exit(self) -> None:
        """At exit, after every engine's finalizer (all made later than this one): ``_at_exit``."""
        if self.at_exit is None:
            self.at_exit = weakref.finalize(self, _at_exit)

    def watch(self, r: Ranks) -> None:
        """Poll ``r``'s failure key every second until it closes (the thread is started once)."""
        self.finalize_at_exit()
        with self.lock:
            self.live.add(r)
        if self.monitor is None or not self.monitor.is_alive():
            self.stop.clear()
            self.monitor = threading.Thread(target=self._poll, name="zerofit-rank-monitor", daemon=True)
            self.monitor.start()

    def unwatch(self, r: Ranks) -> None:
        with self.lock:
            self.live.discard(r)

    def _poll(self) -> None:
        while not self.stop.wait(1.0):
            with self.lock:
                ranks = list(self.live)
            for r in ranks:
                r._beat()
                r._check_peers()
            del ranks

    def make_group(self, backend: str, timeout: timedelta) -> None:
        """The default group, made over the base store under a prefix no earlier group of this process used."""
        if self.store is None:  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
            self.store, self.rank, self.world = next(dist.rendezvous("env://", timeout=timeout))
            self.store.set_timeout(timeout)
        self.made += 1
        store = dist.PrefixStore(f"zerofit/{_restart()}/group{self.made}", self.store)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        self.group = dist.distributed_c10d._get_default_group()
        self.finalize_at_exit()

    def groups(self, world: int, local_world: int, rank: int, layout: str = "hybrid") -> tuple:
        """The gather and reduce groups of this rank's node and its cross-node group (the ranks of the same local
        rank on every node; None on one node) of the current default group: made at its first engine, then
        reused. Every rank makes every node's groups, in the same order, as ``new_group`` requires. The full
        layout on several nodes: a gather and a reduce group of every rank, no cross-node group."""
        default = dist.distributed_c10d._get_default_group()
        live = dist.distributed_c10d._world.pg_map
        if layout == "full" and world > local_world:
            kept = self.world_groups
            if kept is None or kept[0] is not default or not all(g in live for g in kept[1:]):
                everyone = list(range(world))
                kept = self.world_groups = (default, dist.new_group(everyone), dist.new_group(everyone))
            return kept[1], kept[2], None
        kept = self.subgroups
        if kept is not None and kept[0] is default and all(g in live for g in kept[1:] if g is not None):
            return kept[1:]
        nodes = world // local_world
        node, local = divmod(rank, local_world)
        gather = reduce = cross = None
        for n in range(nodes):
            members = list(range(n * local_world, (n + 1) * local_world))
            g, r = dist.new_group(members), dist.new_group(members)
            if n == node:
                gather, reduce = g, r
        if nodes > 1:
            for i in range(local_world):
                c = dist.new_group([n * local_world + i for n in range(nodes)])
                if i == local:
                    cross = c
        self.subgroups = (default, gather, reduce, cross)
        return gather, reduce, cross


_PROCESS = _Process()


def _at_exit() -> None:
    """The monitor stopped and joined, then the group zerofit made destroyed (if it is still the default group).
    At exit, after the engines' own finalizers."""
    p = _PROCESS
    with p.lock:
        ranks = list(p.live)
    for r in ranks:
        r.close()
    p.stop.set()
    if p.monitor is not None:
        p.monitor.join(_JOIN_S)
        if p.monitor.is_alive():
            log.warning("zerofit: the failure monitor did not end within %.0f s", _JOIN_S)
    try:
        if p.group is not None and dist.is_initialized() and dist.distributed_c10d._get_default_group() is p.group:
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - at exit: say it, never raise
        log.debug("zerofit: destroying the process group at exit: %r", e)
    p.group = p.subgroups = p.world_groups = p.store = None


def _close_all(fds: list) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(eq=False)  # one engine's: compared and hashed by identity (_Process.live)
class Ranks(RankFailures):
    """The process group as the engine sees it. ``world == 1``: a single process (every method a no-op)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world: int = 1
    gather_group: object = None  # this node's ranks ([Note: nodes hold the state whole])
    reduce_group: object = None  # this node's ranks
    owns_group: bool = False  # this engine made the default group (which outlives it: [Note: a process
    #                                   group that lives])
    failed_key: str = FAILED  # this engine's failure key in the group's store ([Note: a failing rank])
    cross_group: object = None  # this local rank on every node; None on one node (and in the full layout)
    layout: str = "hybrid"  # several nodes: "hybrid" or "full" (use_layout); one node: either, the same
    _stop: threading.Event = field(default_factory=threading.Event)  # closed: the monitor lets it be
    _mappings: list = field(default_factory=list)
    _fds: list = field(default_factory=list)  # local rank 0: the memfds it made (held_bytes reads them)
    _beats: int = 0  # this rank's heartbeat ([Note: a rank that dies])
    _heard: dict = field(default_factory=dict)  # rank -> (its last heartbeat, when it last moved: monotonic)

    @property
    def many(self) -> bool:
        return self.world > 1

    @property
    def nodes(self) -> int:
        return self.world // self.local_world

    @property
    def node(self) -> int:
        return self.rank // self.local_world

    @property
    def full(self) -> bool:
        """The full layout on several nodes: the units cut into one shard per rank of every node, each node's
        host memory holding its ranks' shards ([Note: nodes hold a slice of the state], node_slices.py)."""
        return self.layout == "full" and self.nodes > 1

    @property
    def shards(self) -> int:
        """The shards a unit is cut into: one per rank of the node (hybrid, one node), of the world (full)."""
        return self.world if self.full else self.local_world

    @property
    def shard_rank(self) -> int:
        """Which of them is this rank's."""
        return self.rank if self.full else self.local_rank

    def use_layout(self, layout: str, asked: str = "auto") -> None:
        """Run the nodes' ``layout`` (the planner's choice, every rank the same; a collective on several nodes:
        the full layout's groups of every rank are made at its first engine), logged by name with ``asked``, the
        config's ``nodes_layout``."""
        if layout not in ("hybrid", "full"):
            raise ValueError(f"nodes_layout {layout!r}: hybrid or full")
        self.layout = layout
        if self.nodes > 1:
            self.gather_group, self.reduce_group, self.cross_group = _PROCESS.groups(
                self.world, self.local_world, self.rank, layout
            )
            log.info(
                "zerofit: %d nodes of %d ranks, the %s layout (nodes_layout %s): %s",
                self.nodes,
                self.local_world,
                layout,
                asked,
                "each node holds the whole state, gradients all-reduced across the nodes"
                if layout == "hybrid"
                else f"each node holds 1/{self.nodes} of the host state, weights gathered across the nodes",
            )

    @property
    def _world_group(self):
        """Every rank: on one node the reduce group (as before nodes), else the default group."""
        return self.reduce_group if self.nodes == 1 else None

    @property
    def who(self) -> str:
        """This rank as a failure names it: ``rank 3``, with several nodes ``rank 3 (node 1)``."""
        return f"rank {self.rank}" + (f" (node {self.node})" if self.nodes > 1 else "")

    # ------------------------------------------------------------------ set-up

    @classmethod
    def setup(cls, device_type: str, timeout_s: float, bind_cores: bool = True) -> Ranks:
        """The process group from the environment ``torchrun`` sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        ...), or the one the caller (or an earlier engine) already made; NCCL for GPUs, gloo for the CPU. One
        process: ``Ranks()``. Under ``srun`` SLURM's variables stand for torchrun's ([Note: srun is a launcher
        too], slurm.py). [Note: a process group that lives]."""
        slurm.adopt()
        if not dist.is_available() or (not dist.is_initialized() and not _launched()):
            return cls()
        owns = False
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        backend = "nccl" if device_type == "cuda" else "gloo"
        if not dist.is_initialized():
            _PROCESS.make_group(backend, timedelta(seconds=timeout_s))
            owns = True
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            return cls(owns_group=owns)
        if backend not in str(dist.get_backend()):  # a group an earlier engine (or the script) made for other tensors
            log.warning(
                "zerofit: the process group's backend is %s, and this engine's tensors are on %s (%s "
                "expected): its collectives may fail or be slow. Make the group for both before the first "
                "engine: torch.distributed.init_process_group('cpu:gloo,cuda:nccl')",
                dist.get_backend(),
                device_type,
                backend,
            )
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        if world % local_world or rank // local_world * local_world + local_rank != rank:
            raise NotImplementedError(
                f"WORLD_SIZE {world}, LOCAL_WORLD_SIZE {local_world}, RANK {rank}, LOCAL_RANK {local_rank}: zerofit "
                "runs the same number of ranks on every node, numbered node by node (as torchrun and srun do)"
            )
        gather, reduce, cross = _PROCESS.groups(world, local_world, rank)
        _PROCESS.engines += 1
        r = cls(
            world,
            rank,
            local_rank,
            local_world,
            gather,
            reduce,
            owns,
            f"{FAILED}/{_restart()}/{_PROCESS.engines}",
            cross_group=cross,
        )
        log.info("zerofit: rank %d of %d, %d torch threads", rank, world, r._share_cores(bind_cores))
        _PROCESS.watch(r)
        return r

    def _share_cores(self, bind: bool) -> int:
        """[Note: a rank's cores] torchrun sets OMP_NUM_THREADS=1 for every rank when there are several, which
        makes a CPU optimizer single-threaded without a word. Each rank gets its share of this process's cores
        (``ZEROFIT_THREADS_PER_RANK`` overrides), bound to a disjoint set of them when there are enough."""
        cores = (
            sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        )
        n = int(os.environ.get("ZEROFIT_THREADS_PER_RANK", "0")) or max(1, len(cores) // self.local_world)
        if bind and len(cores) >= n * self.local_world:
            mine = cores[self.local_rank * n : (self.local_rank + 1) * n]
            os.sched_setaffinity(0, mine)
        torch.set_num_threads(n)
        return n

    # ------------------------------------------------------------------ shards

    def shard_size(self, numel: int) -> int:
        return -(-numel // self.shards)

    def padded(self, numel: int) -> int:
        """Device buffers of a unit hold this many elements: one equal shard per rank of the node (of the world
        in the full layout)."""
        return self.shard_size(numel) * self.shards

    def bounds(self, numel: int) -> tuple[int, int]:
        """This rank's shard ``[lo, hi)`` of a unit of ``numel`` elements (empty past the end): its node's
        ``local_rank``-th ([Note: nodes hold the state whole]), the world's ``rank``-th in the full layout."""
        s = self.shard_size(numel)
        lo = min(self.shard_rank * s, numel)
        return lo, min(lo + s, numel)

    def node_bounds(self, numel: int) -> tuple[int, int]:
        """This node's slice ``[lo, hi)`` of a unit's host state: its ranks' shards in the full layout, the whole
        unit else ([Note: nodes hold a slice of the state], node_slices.py)."""
        if not self.full:
            return 0, numel
        s = self.shard_size(numel) * self.local_world
        lo = min(self.node * s, numel)
        return lo, min(lo + s, numel)

    # ------------------------------------------------------------------ collectives

    def gather(self, full: torch.Tensor, numel: int) -> None:
        """``full`` (at least ``padded(numel)`` elements) holds this rank's shard in place; fill in the rest."""
        s = self.shard_size(numel)
        out = full[: s * self.shards]
        mine = out[self.shard_rank * s : (self.shard_rank + 1) * s]
        if out.device.type == "cpu":  # gloo: no in-place gather
            mine = mine.clone()
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, mine, group=self.gather_group)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, numel: int) -> None:
        """``out`` (shard-sized) = this rank's shard of the sum of every rank's ``full`` (padded): reduce-scattered
        inside the node, then (several nodes) all-reduced across the nodes ([Note: nodes hold the state whole]);
        over every rank in the full layout."""
        s = self.shard_size(numel)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out[:s], full[: s * self.shards], group=self.reduce_group)
        if self.cross_group is not None:
            dist.all_reduce(out[:s], group=self.cross_group)

    def all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """The sum over the ranks that hold the shards: of what each holds of them (a norm's squares). Hybrid:
        this node's ranks, since every node holds them alike once the gradients are reduced ([Note: nodes hold
        the state whole]); full: every rank."""
        if self.shards > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.reduce_group)
        return t

    def all_reduce_world(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """The sum over every rank (every node's): replicated gradients, losses, flags."""
        if self.many:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self._world_group)
        return t

    def broadcast(self, t: torch.Tensor) -> None:
        if self.many:
            dist.broadcast(t, 0, group=self._world_group)

    def barrier(self) -> None:
        if self.many:
            dist.barrier(group=self._world_group)

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
        path = self.objects(path)[self.rank - self.local_rank]  # this node's local rank 0's
        if fd is None:
            fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            self.barrier()  # every rank has it open before the creator lets go of its descriptor
            if self.local_rank == 0:
                if not self._fds:
                    weakref.finalize(self, _close_all, self._fds)
                self._fds.append(fd)  # kept while this engine's ranks live: held_bytes reads its pages
            else:
                os.close(fd)
        self._mappings.append(mm)  # the mapping outlives every tensor that views it (module parameters)
        return torch.frombuffer(mm, dtype=dtype, count=max(numel, 1))[:numel]

    def held_bytes(self) -> int | None:
        """The bytes of host memory this node's shared arenas hold now (their memfds' allocated pages; local rank
        0 only, else None): the whole state in the hybrid layout, the node's slice of it in the full one."""
        if self.local_rank != 0 or not self.many:
            return None
        return sum(os.fstat(fd).st_blocks * 512 for fd in self._fds)

    def close(self) -> None:
        """This engine's key is no longer polled. The process group stays: the next engine of this process reuses
        it ([Note: a process group that lives]). Idempotent."""
        if not self._stop.is_set() and self.many:
            try:  # the others' monitors: this rank closed, it did not die ([Note: a rank that dies])
                self._store().set(self._alive_key(self.rank), "closed")
            except Exception:  # noqa: BLE001
                pass
        self._stop.set()
        _PROCESS.unwatch(self)
