"""The training engine: one optimizer step over many micro-batches, block-major.

A step (``train_batch``) runs in this order, with every block's weights crossing
PCIe at most twice (forward, backward) however many micro-batches there are:

1. pre pass (shell up to block 0) for every micro-batch;
2. forward, block by block; each block runs *all* micro-batches while its
   weights are on the device, keeping each micro-batch's block input as its
   checkpoint (no autograd graph is kept);
3. post pass (final norm, head, loss) and its backward, per micro-batch;
4. backward, block by block in reverse: recompute each micro-batch's block from
   its checkpoint and backpropagate; the block's fp32 gradient, summed over the
   micro-batches on the device, then goes down to the host (streamed units) where
   the CPU worker updates it while the device computes the blocks before it;
5. backward of the pre pass, then the shell's and resident blocks' updates on
   the device.

When the update needs the whole gradient first (global-norm clipping, fp16
overflow check), host updates are *deferred*: gradients wait in per-unit host
buffers and the updates run after the norm is known, in forward order, so the
next step's forward waits only on the blocks still being updated.

Lifecycle and errors (lifecycle.py): an :class:`EngineState` says whether an error would leave the
weights as before the step (OPEN) or torn (APPLYING, then FAILED); see [Note: engine lifecycle],
[Note: failure semantics] and [Note: Ctrl-C inside a step].
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

import psutil
import torch
from torch import nn
from torch.func import functional_call

from zerofit.config.schema import ZerofitConfig
from zerofit.engine.adapter import Adapter, PreResult, backward_into, block_output, loss_of, post_in_chunks
from zerofit.engine.batch import BatchSpec, check_micro_batches, scores_tokens, to_device, vocab_of
from zerofit.engine.device import Device
from zerofit.engine.deepspeed_api import DeepSpeedStyleAPI
from zerofit.engine.deepspeed_surface import DeepSpeedSurface
from zerofit.engine.lifecycle import EngineLifecycle, EngineState
from zerofit.engine.offload_states import OffloadStates
from zerofit.engine.recovery import StepRecovery
from zerofit.engine.groups import resolve_groups
from zerofit.engine import split_adamw
from zerofit.engine.optimizer import HostWorker, Hyper, unit_adamw, wait_event, waiting
from zerofit.engine.materialize import build_units, model_shape, param_table, release_originals
from zerofit.engine.disk import DiskTier, SwapFile, free_bytes, tier_buffers, tier_chunk
from zerofit.engine.disk import layout as disk_layout
from zerofit.engine.ranks import Ranks
from zerofit.engine.planner import (ASSIST_SETS, CKPT_AHEAD, SPLIT_FRACTION, TIER_BUFFERS, BatchShape, ModelShape,
                                    Plan, assist_chunk, fmt_bytes, make_plan, offloaded_blocks,
                                    offloaded_checkpoints)
from zerofit.engine.speculation import Speculation
from zerofit.engine.store import Home, HostArena, Slot, SlotPool, Unit, WeightState

_SPECULATE_FIRST = -(2**40)   # worker priority of speculation tasks ([Note: speculative updates])
_DISK_LAST = 2**40            # worker priority of disk-tier updates: after the in-memory ones, FIFO among
                              # themselves, the order the tier reads ahead in ([Note: disk updates in order])
_MOMENTS_LAST = 2**41         # moments passes: after every update the next forward needs, the last block first
                              # (the backward needs its gradient buffer first): [Note: moments after the forward]
_DISK_FIELDS = {"moments": ("exp_avg", "exp_avg_sq"), "all": ("master", "exp_avg", "exp_avg_sq")}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger("zerofit")


def _loss_scaler(config: ZerofitConfig):
    from zerofit.optim.loss_scaler import make_loss_scaler

    return make_loss_scaler(config.fp16)


@dataclass
class _Micro:
    """State of one micro-batch between the forward and the backward."""

    batch: dict
    pre: PreResult
    ckpts: list = field(default_factory=list)   # (B, T, H) input of each block, compute dtype, device
    rng: list = field(default_factory=list)     # RNG state before each block (models with dropout)
    graphs: list = field(default_factory=list)  # checkpointing off: (x, leaves, y) per block, graph kept
    shell_leaves: dict = field(default_factory=dict)
    grad: torch.Tensor | None = None            # gradient w.r.t. the current block boundary
    output: object = None


def split_wanted(config: ZerofitConfig, on_cuda: bool, deferred: bool) -> bool:
    """Whether the config asks for deferred host updates in two passes (``offload.split_updates``; None: on a
    GPU): [Note: moments after the forward], split_adamw.py."""
    split = config.offload.split_updates
    return deferred and (on_cuda if split is None else split)


def split_updates(config: ZerofitConfig, on_cuda: bool, deferred: bool) -> bool:
    """Whether they run in two passes: asked for, and the kernel built (building it now on first use)."""
    return split_wanted(config, on_cuda, deferred) and split_adamw.available()


def placement_kept(plan: Plan) -> dict:
    """make_plan's arguments that keep ``plan``'s placement (resident blocks, shell optimizer, staging, disk tier,
    floor) in a new plan: the engine's replans and ``zerofit estimate``'s plan with 16-bit host copies."""
    return dict(resident_blocks=plan.resident_blocks, shell_on_device=plan.shell_optimizer_on_device,
                fixed_staging=plan.staging_buffers, disk_placement=plan.disk_of,
                floor=(plan.loss_chunks > 1, plan.offload_checkpoints, bool(plan.stage_numel), plan.checkpoint_every),
                disk_budget=plan.disk_budget)     # measured before the swap file took its share of the disk


def cast_copies(config: ZerofitConfig, dtype: torch.dtype, on_cuda: bool, deferred: bool) -> bool:
    """Whether split updates write the 16-bit cast first ([Note: the master behind its cast], split_adamw.py):
    bf16 compute on one rank, where the streamed blocks can have 16-bit host copies (_host16_possible)."""
    return (split_updates(config, on_cuda, deferred) and dtype == torch.bfloat16 and config.world_size == 1
            and config.offload.copies_after_update)


def assisted_fraction(config: ZerofitConfig, on_cuda: bool, deferred: bool) -> float:
    """The device's share of the streamed blocks' updates: the configured one, or with split updates and none
    configured, SPLIT_FRACTION (the CPU's share costs less on the forward's path then)."""
    off = config.offload
    if "assisted_fraction" not in off.model_fields_set and split_updates(config, on_cuda, deferred):
        return SPLIT_FRACTION
    return off.assisted_fraction


def plan_args(config: ZerofitConfig, dtype: torch.dtype, on_cuda: bool, deferred: bool) -> dict:
    """make_plan's arguments that follow from the config and the device: the engine's and ``zerofit estimate``'s."""
    off = config.offload
    disk = "nvme" in (off.param_device, off.optimizer_device)
    # several ranks: the GPU-resident units' optimizer state is sharded ([Note: sharded device state])
    shards = config.world_size if config.world_size > 1 and config.sharding != "NO_SHARD" else 1
    on_gpus = device_state(config)
    return dict(compute_dtype=dtype, on_cuda=on_cuda, deferred_updates=deferred, shards=shards,
                ranks=config.world_size, device_state=on_gpus,
                checkpointing=config.activation_checkpointing, stream_params=off.param_device != "none" or on_gpus,
                prefetch_depth=off.prefetch_depth, assisted_fraction=assisted_fraction(config, on_cuda, deferred),
                assisted_updates=off.assisted_updates,
                disk=disk, disk_budget=free_bytes(off.nvme_path) if disk else None,
                disk_blocks=off.disk_blocks, disk_weights=off.disk_weights, loss_chunks=off.loss_chunks,
                floor=(None if off.loss_chunks is None and off.offload_checkpoints is None
                       and off.checkpoint_every is None
                       else ((off.loss_chunks or 1) > 1, bool(off.offload_checkpoints), False,
                             off.checkpoint_every or 1)))


def _world_size() -> int:
    """The number of ranks of the process group (made, or described by torchrun's environment)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def default_host_budget() -> int:
    """The host budget when ``max_host_memory`` is not set: the memory available now, less a tenth (at least
    4 GiB) for what the plan does not count: the CUDA context and libraries' growth, the page cache the
    disk tier and checkpoints pass through, the rest of the machine. A plan of every available byte was
    killed by the kernel's out-of-memory killer on the 13B shape (docs/benchmarks.md)."""
    avail = psutil.virtual_memory().available
    return max(avail - max(avail // 10, 4 << 30), avail // 2)


def device_state(config: ZerofitConfig) -> bool:
    """FULL_SHARD (ZeRO stage 3) on several ranks without offload: every block streams from the GPUs' shards of
    its state ([Note: sharded device state])."""
    return (config.world_size > 1 and config.sharding == "FULL_SHARD" and config.offload.param_device == "none"
            and config.activation_checkpointing)


def placement_args(config: ZerofitConfig, num_blocks: int) -> dict:
    """The first plan's placement settings from the config (no optimizer offload: every unit resident)."""
    off = config.offload
    if device_state(config):
        return dict(resident_blocks=0, shell_on_device=True)
    return dict(resident_blocks=num_blocks if off.optimizer_device == "none" else off.resident_blocks,
                shell_on_device={"auto": None, "device": True, "host": False}[off.shell_optimizer])


def plan_batch(config: ZerofitConfig, model: nn.Module, seq_len: int | None) -> BatchShape:
    """The batch the first plan is made for: the config's, with ``seq_len`` (None: the model's context, at most
    2048)."""
    if seq_len is None:
        seq_len = config.seq_len
    if seq_len is None:
        mcfg = getattr(model, "config", None)
        seq_len = min(getattr(mcfg, "max_position_embeddings", None) or getattr(mcfg, "n_positions", None)
                      or 2048, 2048)
    return BatchShape(config.micro_batch_size, seq_len, config.gradient_accumulation_steps)


class Engine(OffloadStates, EngineLifecycle, StepRecovery, DeepSpeedSurface, DeepSpeedStyleAPI):
    """See the module docstring. Build with :func:`zerofit.initialize`."""

    @classmethod
    def create(cls, model, config=None, *, param_groups=None, **overrides) -> "Engine":
        """``model``: an ``nn.Module`` (real or on the meta device) or the path of a Hugging Face model
        directory, built on the meta device and filled from its safetensors files (zerofit.models).
        ``param_groups``: torch.optim-style groups ([Note: parameter groups], groups.py)."""
        from zerofit.config import load_config

        if "world_size" not in overrides:      # several ranks (torchrun): the batch triple counts them
            world = _world_size()
            if world > 1:
                overrides["world_size"] = world
        loaded = load_config(config, **overrides)   # a bad config fails before any file is read
        source = None
        if isinstance(model, (str, os.PathLike)):
            from zerofit.models import ModelDir

            source = ModelDir.open(model)
            model = source.build_meta()
        if loaded.notices:
            from zerofit.config import format_report

            logging.getLogger("zerofit").warning("configuration notes:\n%s", format_report(loaded.notices))
        return cls(model, loaded.config, report=loaded.report, source=source, param_groups=param_groups)

    def __init__(self, model: nn.Module, config: ZerofitConfig, report=(), device: torch.device | str | None = None,
                 adapter: str | None = None, source=None, param_groups=None):
        self.config = config
        self.source_dir = source.path if source is not None else None   # the model directory it was loaded from
        self._source = source
        self.report = list(report)
        self.dtype = _DTYPES[config.precision]
        want = str(device) if device is not None else config.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(want)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was asked for but torch sees no CUDA GPU")
        # [Note: sharded units] (ranks.py): the process group torchrun describes, one GPU per rank
        self.ranks = Ranks.setup(dev.type, config.distributed_timeout_s)
        if self.ranks.many:
            self._check_ranks(config)
            if dev.type == "cuda":
                dev = torch.device("cuda", self.ranks.local_rank)
        if dev.type == "cuda":
            dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self.dev = Device.create(dev)
        self._adapter_kind = adapter or config.adapter
        self.adapter = Adapter(model, self._adapter_kind)
        self._model = model
        from zerofit.checkpoint.model_files import model_dtype
        self.model_dtype = model_dtype(model, source)   # the user's model's dtype, before fp32 masters: exports keep it
        self._table = param_table(model, self.adapter)
        # [Note: parameter groups] (groups.py): refused here, before anything is allocated
        self.param_groups = resolve_groups(param_groups, self._table, config.optimizer)
        self._group_of = {n: i for i, g in enumerate(self.param_groups) for n in g.names}
        # [Note: frozen parameters] (store.py): what no group trains (requires_grad=False, or in no group)
        self.frozen = frozenset(self._table.canonical) - set(self._group_of)
        # the global gradient norm is needed for clipping and for fp16's overflow check; either one
        # makes every host update wait for it (deferred updates)
        self._needs_norm = config.gradient_clipping > 0 or config.precision == "fp16"
        self.deferred = self._needs_norm
        # [Note: speculative updates] (speculation.py): clipping without fp16 may update during the backward
        self._can_speculate = (config.gradient_clipping > 0 and config.precision != "fp16"
                               and config.offload.speculative_updates
                               and all(Speculation.usable(*g.optimizer.betas) for g in self.param_groups))
        self._speculate_next = True       # the last step was not clipped (or there was none)
        # [Note: moments after the forward] (split_adamw.py): deferred host updates in two passes
        self._split = split_updates(config, self.dev.is_cuda, self.deferred)
        # [Note: the master behind its cast]: the streamed blocks get 16-bit host copies at the first update
        self._cast_first = self._split and cast_copies(config, self.dtype, self.dev.is_cuda, self.deferred)
        if split_wanted(config, self.dev.is_cuda, self.deferred) and not self._split:
            log.warning("zerofit: offload.split_updates: the kernel could not be built (%s); the fused kernel "
                        "updates in one pass", split_adamw.why_unavailable())
        self._spec: Speculation | None = None
        self.speculation_stats = {"held": 0, "rolled_back": 0, "waited": 0}   # steps by outcome
        self.scaler = _loss_scaler(config) if config.precision == "fp16" else None
        self.global_step = 0
        self.skipped_steps = 0
        self._timeline: dict[str, float] = {}
        self._trace: list[dict] | tuple = []     # the last step's trace, or what trace() builds it from
        self._wait_spans: list[tuple] = []
        self._origin = None
        self._micro_steps = 0     # DeepSpeed-style API: micro-batches since the last optimizer step
        self._boundary_override: bool | None = None   # set_gradient_accumulation_boundary()
        self._held: list[_Micro] = []   # DeepSpeed-style API: micro-batches whose block backward waits for the boundary
        self._announced: list[tuple] = []   # (batch, _Micro) announced by forward_window(), not yet called for
        self._offered: list[dict] | None = None   # a window the engine's own training loader read ahead
        self.window_stats = {"announced": 0, "mismatched": 0}   # forward_window() calls; calls that dropped one
        self._shell_updated = None   # the upload stream's event after the shell's update on the device
        self._ckpt_arena: HostArena | None = None   # [Note: offloaded checkpoints]
        self._ckpt_g = 0
        self._ckpt_ready: dict = {}
        self._ckpt_every = 1      # [Note: checkpoints every k blocks]: the step in progress's
        self._host16_epoch = 0    # [Note: 16-bit copies for extra forwards]: bumped whenever masters may change
        self._host16_next = None  # [Note: 16-bit copies after the update]: the label valid after the last step's bump
        self._kept: dict[int, Slot] = {}   # [Note: a window keeps some blocks]: id(unit) -> its slot in gradient memory
        self._assist16 = None     # per assist set, (chunk,) compute dtype: the device update's new weights, cast
        self._host16_fill = False   # the forward in progress fills host16 copies (more forwards of the window follow)
        self._pending: _Micro | None = None
        self._host_grads: dict[int, torch.Tensor] = {}     # deferred: (hi - lo,) fp32 host, the rank's shard
        self._padded_grad: dict[int, torch.Tensor] = {}    # several ranks: resident host-optimized units' gradients
        self._dev_shard_grad: dict[int, torch.Tensor] = {}  # FULL_SHARD, no offload: streamed units' gradient shards
        self._sq_norms: dict[int, torch.Tensor] = {}
        self._mirror_stale = False
        self._peak_host = 0
        self._checked_shape = None
        self._shape = model_shape(model, self.adapter, self._table)
        self.plan = self._plan(self._shape, config.seq_len)   # may refuse: nothing allocated yet
        self._open_lifecycle(self.dev)    # [Note: engine lifecycle]: from here on, released exactly once
        self._resources.ranks = self.ranks
        self._arenas = self._resources.arenas
        if self.dev.is_cuda and config.max_gpu_memory:
            # The plan fits: enforce the cap on the allocator. Running close to a cap, expandable
            # segments keep fragmentation from turning into an out-of-memory error.
            set_alloc = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
                torch.cuda.memory._set_allocator_settings
            set_alloc("expandable_segments:True")
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, config.max_gpu_memory / total), dev)
            self._resources.capped = True
        self.worker = self._resources.worker = HostWorker()
        self._tier: DiskTier | None = None
        try:
            self._tier = self._resources.tier = self._open_tier()
            self._build_buffers()
            self._chunk_loss_ok = self._probe_chunked_loss()
        except BaseException:
            self._resources.release()
            raise
        self._batch_spec = BatchSpec.of(model, vocab_of(model, self._shape.vocab), self.dev.device)
        self._log_placement()
        if self.dev.is_cuda:
            torch.cuda.reset_peak_memory_stats(dev)

    # ------------------------------------------------------------------ ranks

    def _check_ranks(self, config: ZerofitConfig) -> None:
        """What several ranks cannot do yet is refused here, before anything is allocated."""
        r = self.ranks
        if config.world_size != r.world:
            raise ValueError(f"the config's world_size is {config.world_size} but {r.world} ranks run: build the "
                             "config with zerofit.initialize (it reads WORLD_SIZE) or pass world_size="
                             f"{r.world} to load_config")
        off = config.offload
        if "nvme" in (off.param_device, off.optimizer_device):
            raise ValueError("the NVMe tier runs on one rank for now: with several ranks use offload device 'cpu' "
                             "(the host's ranks share one copy of the state in host memory)")

    # ------------------------------------------------------------------ planning and materialization

    @property
    def _shell_host_opt(self) -> bool:
        """The shell's optimizer runs on the host (its weights stay resident on the device)."""
        return not self.plan.shell_optimizer_on_device

    def _plan_args(self) -> dict:
        """make_plan's arguments that follow from the config and the device (one place for all plans)."""
        return plan_args(self.config, self.dtype, self.dev.is_cuda, self.deferred)

    def _replan(self, batch: BatchShape, **changes) -> Plan:
        """A plan for ``batch`` with the current placement kept (resident blocks, shell optimizer, staging)."""
        args = self._plan_args() | dict(
            device_budget=self.plan.device_budget, host_budget=self.plan.host_budget, **placement_kept(self.plan),
            host16=any(u.host16 is not None and u.swap != "all" for u in self.blocks))
        # the disk's speed was measured on the swap file once, at initialize: it stays with the plan
        plan = make_plan(self._shape, batch, **(args | changes))
        return dataclasses.replace(plan, disk_speed=self.plan.disk_speed)

    def _plan(self, shape: ModelShape, seq_len: int | None) -> Plan:
        cfg = self.config
        self._plan_batch = plan_batch(cfg, self._model, seq_len)
        dev_budget = None
        if self.dev.is_cuda:
            free, total = torch.cuda.mem_get_info(self.dev.device)
            dev_budget = min(cfg.max_gpu_memory or total, total) - (total - free - torch.cuda.memory_reserved())
        host_budget = cfg.max_host_memory or default_host_budget()
        if self.ranks.many:     # every rank must make the same plan: the collectives follow the units' homes
            budgets = self.ranks.objects((dev_budget, host_budget))
            dev_budget = None if dev_budget is None else min(b[0] for b in budgets)
            host_budget = budgets[0][1]
        return make_plan(shape, self._plan_batch, device_budget=dev_budget,
                         host_budget=host_budget,
                         chunkable_loss=self.adapter.chunkable_loss,
                         **placement_args(cfg, self.adapter.num_blocks), **self._plan_args())

    def _build_buffers(self) -> None:
        """Materialize the units (materialize.py), then the device slots and pinned gradient buffers."""
        plan, cb = self.plan, self.dtype
        pinned = self.dev.is_cuda and self.config.offload.pin_memory
        ranks = self.ranks
        self.units, arenas = build_units(self._model, self.adapter, self._table, plan, self.dev.device, cb, pinned,
                                         source=self._source, group_of=self._group_of, tier=self._tier, ranks=ranks,
                                         on_device_unit=self._share_device_unit if ranks.many else None,
                                         frozen=self.frozen)
        self._source = None   # the files are read: keep only their folder (source_dir)
        self._table = release_originals(self._model, self._table)    # the user's tensors are copied: let go
        self._arenas.extend(arenas)
        self.shell, self.blocks = self.units[0], self.units[1:]     # each unit's shard [lo, hi): build_units
        if ranks.many:
            self._share_units()
        streamed = [u for u in self.blocks if u.home is Home.STREAMED]
        cap = max((ranks.padded(u.numel) for u in streamed), default=0)
        wcap = max((u.frozen_at + u.frozen_numel if u.frozen else ranks.padded(u.numel) for u in streamed),
                   default=0)   # a weight slot holds the frozen weights too, after the trained ones
        # [Note: sharded units]: a gradient slot also holds the reduce-scattered shard, after the padded gradient
        gcap = cap + (max((ranks.shard_size(u.numel) for u in streamed), default=0) if ranks.many else 0)
        self.weight_pool = SlotPool(self.dev, plan.weight_slots, wcap, cb) if streamed else None
        self.grad_pool = SlotPool(self.dev, plan.grad_slots, gcap, torch.float32) if streamed else None
        uploaded = streamed + ([self.shell] if self._shell_host_opt else [])
        ucap = plan.stage_numel or max((u.numel for u in (streamed or uploaded)), default=0)
        self._upload_stage = (torch.empty(ucap, dtype=torch.float32, device=self.dev.device)  # (ucap,) fp32
                              if uploaded and cb != torch.float32 else None)
        self._assist = self._assist16 = None
        if plan.assisted_updates and streamed:
            self._alloc_assist(cap)
        host_units = [u for u in self.units if not u.optimizer_on_device]
        scap = max((u.hi - u.lo for u in host_units), default=0)     # a rank downloads its shard only
        self._staging: list[torch.Tensor] = []   # (scap,) fp32, pinned host each
        if host_units:
            a = HostArena(plan.staging_buffers * scap, torch.float32, pinned)
            self._arenas.append(a)
            self._staging = [a.take(scap) for _ in range(plan.staging_buffers)]
        self._staging_free = list(range(len(self._staging)))
        self._staging_cv = threading.Condition()
        # (L,) fp64 host: each block's squared gradient norm, downloaded with its gradient (speculation)
        self._block_sq = torch.zeros(max(len(self.blocks), 1), dtype=torch.float64,
                                     pin_memory=pinned and self._can_speculate)
        # [Note: non-finite gradients without a norm]: per unit, the step's running count of non-finite
        # gradients up to and including it; on the device, and as its gradient's download brings it down
        n = len(self.units)
        self._bad_run = torch.zeros((), dtype=torch.float32, device=self.dev.device)     # () fp32, device
        self._bad_dev = torch.zeros(n, dtype=torch.float32, device=self.dev.device)      # (units,) fp32, device
        self._bad_host = torch.zeros(n, dtype=torch.float32, pin_memory=pinned)          # (units,) fp32, host
        waiting = [u for u in host_units if u.swap is None]    # swapped units: [Note: gradients on the disk]
        if self.deferred and waiting:     # each rank's shard of the gradients that wait for the norm
            a = HostArena(sum(u.hi - u.lo for u in waiting), torch.float32, pinned)
            self._arenas.append(a)
            for u in waiting:
                self._host_grads[id(u)] = a.take(u.hi - u.lo)
        self._note_host()

    def _share_units(self) -> None:
        """[Note: sharded units] after materialization: every rank starts from local rank 0's weights. The host
        state (shared) was written by rank 0 alone: once it is there, the other ranks' device copies of it are
        refreshed; replicated device-optimized units are broadcast from rank 0. Device buffers that take part
        in a gather or a reduce-scatter get their padding (and a gradient buffer the room for its shard)."""
        r = self.ranks
        r.barrier()
        for u in self.units:
            if u.optimizer_on_device:     # done as it was built: _share_device_unit
                continue
            if u.home is Home.RESIDENT:      # host-optimized but kept on the device: gathered after each update
                self._pad_resident(u, u.master)
        r.barrier()

    def _pad_resident(self, u: Unit, weights: torch.Tensor) -> None:
        """A resident unit whose 16-bit weights are all-gathered and whose gradient is reduce-scattered: ``dev16``
        (a copy of ``weights``) padded to N shards, and a gradient buffer with room for its shard after the
        padded gradient ([Note: sharded units])."""
        r, n = self.ranks, u.numel
        dev16 = torch.empty(r.padded(n), dtype=self.dtype, device=self.dev.device)     # (padded,) compute dtype
        dev16[:n].copy_(weights)
        u.dev16 = dev16[:n]
        g = torch.zeros(r.padded(n) + r.shard_size(n), dtype=torch.float32, device=self.dev.device)
        self._padded_grad[id(u)] = g
        u.grad = g[:n]

    def _share_device_unit(self, u: Unit) -> None:
        """A device-optimized unit, as soon as materialization built it (every rank, in the same order): rank 0's
        weights everywhere, then sharded unless NO_SHARD ([Note: sharded device state])."""
        self.ranks.broadcast(u.master)
        if u.dev16 is not None and u.dev16 is not u.master:
            u.dev16.copy_(u.master)
        if u.host is not u.master:
            u.host.copy_(u.master)
        if self.config.sharding != "NO_SHARD":
            self._shard_device_unit(u)

    def _shard_device_unit(self, u: Unit) -> None:
        """[Note: sharded device state]
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
        The host mirror stays whole; it, checkpoints and export gather the shards (``_full_state``)."""
        if u.home is Home.STREAMED:       # FULL_SHARD without offload: weights only in slots, gathered per use
            self._dev_shard_grad[id(u)] = torch.zeros(u.hi - u.lo, device=self.dev.device)   # summed per step
        else:
            self._pad_resident(u, u.dev16)
        u.master = u.master[u.lo:u.hi].clone()                                # (hi - lo,) fp32, device
        u.exp_avg = torch.zeros_like(u.master)
        u.exp_avg_sq = torch.zeros_like(u.master)
        u.shard_state = True

    def _gather_full(self, u: Unit, t: torch.Tensor) -> torch.Tensor:
        """A sharded device unit's whole ``t`` (its shard on every rank), on the host (fp32). Collective."""
        buf = torch.zeros(self.ranks.padded(u.numel), dtype=torch.float32, device=self.dev.device)
        buf[u.lo:u.hi].copy_(t)
        self.ranks.gather(buf, u.numel)
        return buf[: u.numel].to("cpu")

    @contextlib.contextmanager
    def _full_state(self, write_back: bool):
        """Within the block, sharded device units ([Note: sharded device state]) show their whole master and
        moments, gathered into the host mirror and host buffers, to what reads or writes whole tensors
        (checkpoints, export, master_state_dict). ``write_back``: afterwards each rank takes its shard of
        what is there (a checkpoint load wrote it). Collective."""
        units = [u for u in self.units if u.shard_state]
        kept = []
        for u in units:
            kept.append((u.master, u.exp_avg, u.exp_avg_sq))
            master, m, v = (self._gather_full(u, t) for t in kept[-1])
            u.host.copy_(master)
            u.master, u.exp_avg, u.exp_avg_sq = u.host, m, v
        try:
            yield
        finally:
            for u, (master, m, v) in zip(units, kept):
                if write_back:
                    for dst, src in ((master, u.master), (m, u.exp_avg), (v, u.exp_avg_sq)):
                        dst.copy_(src[u.lo:u.hi])
                u.master, u.exp_avg, u.exp_avg_sq = master, m, v

    def _open_tier(self) -> DiskTier | None:
        """The disk tier the plan asks for: its file reserved under ``offload.nvme_path`` and its speed measured
        (preflight: a path that cannot hold it fails here, before anything else is allocated)."""
        plan = self.plan
        if not plan.disk_blocks:
            return None
        if self.frozen:
            raise ValueError(f"the NVMe tier cannot hold a model with frozen parameters yet ({len(self.frozen)} "
                             "tensors have requires_grad=False or are in no parameter group): give the host budget "
                             "room for the plan (max_host_memory), or offload the optimizer to 'cpu' instead of "
                             "'nvme'")
        off = self.config.offload
        grad = ("grad",) if self.deferred else ()    # [Note: gradients on the disk]
        regions, nbytes = disk_layout([(i, self._shape.block_numels[i], _DISK_FIELDS[m] + grad)
                                       for i, m in plan.disk_blocks])
        file = SwapFile(off.nvme_path, nbytes, threads=off.nvme_queue_depth, block_bytes=off.nvme_block_size)
        try:
            w, r = file.measure()
            mb = max(self._shape.block_numels)
            tier = DiskTier(file, regions, tier_chunk(mb), tier_buffers(mb, TIER_BUFFERS))
        except BaseException:
            file.close()
            raise
        self.plan = dataclasses.replace(plan, disk_speed=(w, r))
        log.info("zerofit: NVMe tier: %s, %s reserved%s; measured there: write %.2f GB/s, read %.2f GB/s",
                 file.path, fmt_bytes(file.nbytes), "" if file.direct else
                 " (O_DIRECT refused by this file system: buffered I/O)", w, r)
        if not file.direct:
            log.warning("zerofit: %s does not accept O_DIRECT: the disk tier uses buffered I/O (the page cache "
                        "takes host memory and the speed differs)", file.path)
        if file.reused:
            log.info("zerofit: reused the swap file a previous run left in %s", file.folder)
        return tier

    @property
    def disk_speed(self) -> dict:
        """The disk tier's write and read speed measured on its swap file at initialize ({} without a tier)."""
        if self._tier is None:
            return {}
        w, r = self.plan.disk_speed
        return {"write_gb_per_s": w, "read_gb_per_s": r, "direct_io": self._tier.file.direct}

    def _probe_chunked_loss(self) -> bool:
        """Whether the model's head and loss run on a chunk of the final hidden state ([Note: a smaller GPU
        floor], planner.py): tried once, on 4 tokens, with the shell's own device weights. A model that reshapes
        the hidden state by the input's length after its blocks (GPT-2) fails it; the plan is then made again
        without chunks, before step 0 (refused if the device cannot hold the whole logits)."""
        if self.plan.loss_chunks <= 1:
            return False           # not planned: nothing to probe
        if not (self.adapter.streaming and self.adapter.chunkable_loss):
            ok = False
        else:
            dev = self.dev.device
            ids = torch.zeros(1, 4, dtype=torch.long, device=dev)
            lab = torch.zeros(1, 2, dtype=torch.long, device=dev)
            final = torch.zeros(1, 2, self._shape.hidden, dtype=self.dtype, device=dev)
            try:
                with torch.no_grad():
                    out = self.adapter.post(self._shell_call(self._leaves(self.shell, grad=False)),
                                            {"input_ids": ids, "labels": lab, "shift_labels": lab,
                                             "num_items_in_batch": torch.tensor(2, device=dev)}, final)
                loss = loss_of(out)
                logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", None)
                ok = loss.dim() == 0 and (logits is None or logits.shape[1] == 2)
            except Exception as e:     # noqa: BLE001 - any failure: this model's loss is not chunked
                log.info("zerofit: the head and loss cannot run over token chunks for this model (%s: %s)",
                         type(e).__name__, e)
                ok = False
        if not ok and self.plan.loss_chunks > 1:
            self.plan = self._replan(self._plan_batch, floor=(False, True, bool(self.plan.stage_numel),
                                                             self.plan.checkpoint_every))
            log.info("zerofit: re-planned without loss chunks:\n%s", self.plan.describe())
        return ok

    def _alloc_assist(self, cap: int) -> None:
        """[Note: assisted updates]: ASSIST_SETS sets of (chunk,) fp32 device buffers (master, exp_avg,
        exp_avg_sq, and with deferred updates the gradient), each with the event after which its last chunk
        went down."""
        chunk = assist_chunk(cap)
        n = 4 if self.deferred else 3
        self._assist = [[torch.empty(chunk, dtype=torch.float32, device=self.dev.device) for _ in range(n)]
                        for _ in range(ASSIST_SETS)]
        self._assist_free = [None] * ASSIST_SETS
        self._assist_next = 0

    def _note_host(self) -> None:
        self._peak_host = max(self._peak_host, psutil.Process().memory_info().rss)

    # ------------------------------------------------------------------ weight transitions (streamed units)

    def _begin_upload(self, unit: Unit, protect: tuple, wait: bool = True) -> bool:
        """ON_HOST -> UPLOADING: take a slot (never one of ``protect``), enqueue the copy.

        The unit's pending CPU update must be done first: with ``wait`` the host blocks on it (the unit
        is needed now), without it a prefetch of a unit still being updated is skipped (tried again later)."""
        if unit.home is Home.RESIDENT or unit.state is not WeightState.ON_HOST:
            return True
        if not unit.updated.is_set() and not wait:
            return False
        self._wait_updated(unit)
        slot = self._kept.get(id(unit)) or self.weight_pool.take(protect)   # [Note: a window keeps some blocks]
        dst = slot.tensor[: unit.numel]
        with self.dev.on(self.dev.upload):
            self.dev.wait(self.dev.upload, slot.free_event)       # [Note: slot reuse]
            self.dev.wait(self.dev.upload, slot.read_event)
            slot.read_event = self._upload(unit, dst)
            if self.ranks.many and unit.numel:   # [Note: sharded units]: the rank uploaded its shard; the GPUs share the rest
                with self.dev.timed("upload", self.dev.upload, f"{unit.name}(gather)"):
                    self.ranks.gather(slot.tensor, unit.numel)
            if unit.frozen is not None:          # [Note: frozen parameters]: after the trained weights, whole
                self._upload_frozen(unit, slot.tensor[unit.frozen_at:unit.frozen_at + unit.frozen_numel])
            unit.ready_event = self.dev.record(self.dev.upload)
        slot.tenant, unit.slot, unit.state = unit, slot, WeightState.UPLOADING
        return True

    def _upload(self, unit: Unit, dst: torch.Tensor | None):
        """Copy the unit's fp32 master into ``dst`` (compute dtype) on the upload stream. See [Note: fp32 uploads].

        A unit with a pending assisted update is updated on the way. See [Note: assisted updates].
        With a valid 16-bit host copy, that is uploaded instead; a forward that fills the copies sends the
        cast weights down into it ([Note: 16-bit copies for extra forwards]). Returns the event of a
        download that reads ``dst`` (the slot must outlive it), or None."""
        self.dev.wait(self.dev.upload, unit.master_event)
        if unit.shard_state:      # [Note: sharded device state]: the rank's shard, from its GPU (cast)
            with self.dev.timed("upload", self.dev.upload, f"{unit.name}(shard)"):
                dst[unit.lo:unit.hi].copy_(unit.master)
            return None
        if unit.pending_update is not None:
            self._assisted_update(unit, dst)
            return None
        if unit.swap == "all" or self._host16_valid(unit):
            with self.dev.timed("upload", self.dev.upload, f"{unit.name}(16)"):
                self.dev.wait(self.dev.upload, unit.host16_event)
                dst.copy_(unit.host16, non_blocking=True)
            return None
        if unit.master_behind:      # [Note: the master behind its cast]: its 16-bit copy went stale first
            self._await_moments(unit)
        lo, hi = unit.lo, unit.hi     # the whole unit, or this rank's shard ([Note: sharded units])
        with self.dev.timed("upload", self.dev.upload, unit.name):
            if dst.dtype == torch.float32:
                dst[lo:hi].copy_(unit.master[lo:hi], non_blocking=True)
            else:   # one buffer: the upload stream runs in order; a unit larger than it (the shell) in pieces
                cap = self._upload_stage.numel()
                for a in range(lo, hi, cap):
                    k = min(cap, hi - a)
                    stage = self._upload_stage[:k]
                    stage.copy_(unit.master[a:a + k], non_blocking=True)
                    dst[a:a + k].copy_(stage)
        if unit.host16 is None or not self._host16_fill:
            return None
        up = self.dev.record(self.dev.upload)
        with self.dev.on(self.dev.download):
            self.dev.wait(self.dev.download, up)
            with self.dev.timed("download", self.dev.download, f"{unit.name}(16)"):
                unit.host16.copy_(dst, non_blocking=True)
            unit.host16_event = self.dev.record(self.dev.download)
        unit.host16_epoch = self._host16_epoch
        return unit.host16_event

    def _upload_frozen(self, unit: Unit, dst: torch.Tensor) -> None:
        """The unit's frozen weights (fp32 host) into ``dst`` (compute dtype) on the upload stream: in place, or
        through the upload stage in pieces as _upload does ([Note: frozen parameters], store.py)."""
        src = unit.frozen_host
        with self.dev.timed("upload", self.dev.upload, f"{unit.name}(frozen)"):
            if dst.dtype == src.dtype:
                dst.copy_(src, non_blocking=True)
                return
            cap = self._upload_stage.numel()
            for a in range(0, src.numel(), cap):
                k = min(cap, src.numel() - a)
                stage = self._upload_stage[:k]
                stage.copy_(src[a:a + k], non_blocking=True)
                dst[a:a + k].copy_(stage)

    def _host16_valid(self, unit: Unit) -> bool:
        """Whether ``unit.host16`` holds the weights the master holds now ([Note: 16-bit copies for extra
        forwards], [Note: 16-bit copies after the update])."""
        e = unit.host16_epoch
        return unit.host16 is not None and (e == self._host16_epoch or (e is not None and e == self._host16_next))

    def _weights_changed(self) -> None:
        """Masters may change other than by the optimizer step (a rollback, a checkpoint load): every 16-bit
        host copy goes stale, those made after an update too."""
        self._host16_epoch += 1
        self._host16_next = None

    def _cast16_label(self, unit: Unit, now: bool = False):
        """[Note: 16-bit copies after the update]: the label of a 16-bit copy made right after this unit's update,
        or None when none is made: one valid from the coming optimizer step's move of the weights epoch (an
        update during the backward), or with ``now``, valid at once (a deferred update, after that move)."""
        # (no copies with several ranks: _host16_possible)
        if unit.host16 is None or unit.swap is not None or not self.config.offload.copies_after_update:
            return None
        return self._host16_epoch if now else ("after", self._host16_epoch)

    def _assisted_update(self, unit: Unit, dst: torch.Tensor | None) -> None:
        """[Note: assisted updates]
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
        master) waits on ``master_event``, the event after its last chunk went down."""
        # [Note: failure semantics]: an error before this unit's update is fully enqueued leaves it torn
        before, self.state = self.state, EngineState.APPLYING
        factor, hypers = unit.pending_update
        unit.pending_update = None
        self._device_adamw(unit, None, hypers, factor, dst, cast16=self._cast16_label(unit, now=True))
        self.state = before

    def _assist_in_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        """[Note: assisted updates in the backward]
        With immediate updates (no clipping, bf16/fp32) a host-optimized block is updated while the backward
        goes on, and when the CPU's AdamW is slower than the backward's blocks (the CPU updates every
        parameter when the device is short: the shell's optimizer on the host, W1 at 8 GiB) the gradient
        buffers fill and the backward waits for the CPU. So when the buffers fit beside the plan, the device
        updates a share of the streamed blocks (``plan.assisted_blocks``) itself, right after their gradient
        is complete: master and moments go up (12 B/param; the gradient is already there, in its slot, and
        is not sent down), AdamW runs on the upload stream, master and moments go back down (12 B/param),
        in the chunks of [Note: assisted updates]. The copy engines, mostly idle in the backward, take work off
        the CPU. The gradient slot is free once the last chunk's AdamW has read it; the unit's next upload
        (and any host read of its master) waits on ``master_event``, as for a deferred assisted update. Its
        ``updated`` flag is never cleared: the CPU worker does not touch the unit."""
        read = self._adamw_after_compute(unit, grad, None, cast16=self._cast16_label(unit),
                                         found_inf=self._bad_dev[unit.index + 1])
        slot = unit.grad_slot
        slot.free_event, slot.tenant = read, None
        unit.grad_slot, unit.grad, unit.grad_fresh = None, None, True

    def _assist_shell(self) -> None:
        """[Note: assisted updates in the backward], the shell: with its optimizer on the host (its state did not
        fit the device), its gradient is complete only at the end of the backward, and its update then sits on
        the step's critical path: gradient down, the CPU's AdamW, master up again. Where the device has the
        assisted updates' buffers it updates the shell itself instead, from the gradient where it is, casting
        the new weights straight into the shell's 16-bit copy: only master and moments cross PCIe (12 B/param
        each way, both copy engines busy), no CPU pass, no upload after it. The next forward's compute waits
        for it (``_refresh_shell``), and so does the next write of the shell's gradient, which comes after."""
        u = self.shell
        self._flag_nonfinite(u, u.grad)
        self._shell_updated = self._adamw_after_compute(u, u.grad, u.dev16, found_inf=self._bad_dev[0])
        u.grad_fresh = True

    def _adamw_after_compute(self, unit: Unit, grad: torch.Tensor, dst: torch.Tensor | None, cast16=None,
                             found_inf: torch.Tensor | None = None):
        """_device_adamw on the upload stream from the unit's device gradient, once the compute stream's work
        so far (which wrote it) is done; returns the event after its last read of ``grad``. ``found_inf``: a
        device scalar, nonzero to leave the state as it is ([Note: non-finite gradients without a norm])."""
        ev = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.upload):
            self.dev.wait(self.dev.upload, ev)
            return self._device_adamw(unit, grad, self._hyper(), 1.0, dst, cast16=cast16, found_inf=found_inf)

    def _device_adamw(self, unit: Unit, grad: torch.Tensor | None, hypers, factor: float,
                      dst: torch.Tensor | None, cast16=None, found_inf: torch.Tensor | None = None):
        """The unit's AdamW step on the device, its state moving up and down in chunks ([Note: assisted
        updates]). ``grad``: the unit's gradient on the device, or None to bring the host gradient up with
        the state. ``dst``: a slot to cast the new weights into, or None. ``cast16``: a label
        (_cast16_label): the new weights, cast, also go down into the unit's 16-bit host copy ([Note: 16-bit
        copies after the update]). Enqueued on the upload stream (the caller's current stream); returns the
        upload stream's event after the last chunk's AdamW (the last read of ``grad``)."""
        lo, hi = unit.lo, unit.hi     # this rank's shard ([Note: sharded units]); host_grad holds just that
        chunk = self._assist[0][0].numel()
        host_grad = self._host_grads[id(unit)] if grad is None else None
        # [Note: no host wait in an enqueue]: a fill, not a copy. A copy from pageable memory waits for the
        # stream to drain (here: the compute that wrote ``grad``, or every upload queued before), and the
        # compute stream would then sit idle while the chunks below are enqueued.
        step0 = torch.full((), float(unit.step), dtype=unit.step.dtype, device=self.dev.device)
        done = up = None
        for off in range(lo, hi, chunk):
            k = min(chunk, hi - off)
            i = self._assist_next
            self._assist_next = (i + 1) % len(self._assist)
            p, m, v = (b[:k] for b in self._assist[i][:3])
            with self.dev.timed("upload", self.dev.upload, f"{unit.name}+adamw"):
                self.dev.wait(self.dev.upload, self._assist_free[i])   # the set's previous chunk went down
                p.copy_(unit.master[off:off + k], non_blocking=True)
                m.copy_(unit.exp_avg[off:off + k], non_blocking=True)
                v.copy_(unit.exp_avg_sq[off:off + k], non_blocking=True)
                if grad is None:
                    g = self._assist[i][3][:k]
                    g.copy_(host_grad[off - lo:off - lo + k], non_blocking=True)
                else:
                    g = grad[off - lo:off - lo + k]
                # a chunk may straddle a border between parameter groups: unit_adamw cuts it there
                unit_adamw(unit, p, g, m, v, step0.clone(), hypers, factor, start=off, found_inf=found_inf)
                if dst is not None:
                    dst[off:off + k].copy_(p)
                if cast16 is not None:
                    w16 = self._assist16[i][:k]
                    w16.copy_(p)
            up = self.dev.record(self.dev.upload)
            with self.dev.on(self.dev.download):
                self.dev.wait(self.dev.download, up)
                with self.dev.timed("download", self.dev.download, f"{unit.name}+state"):
                    unit.master[off:off + k].copy_(p, non_blocking=True)
                    unit.exp_avg[off:off + k].copy_(m, non_blocking=True)
                    unit.exp_avg_sq[off:off + k].copy_(v, non_blocking=True)
                    if cast16 is not None:
                        unit.host16[off:off + k].copy_(w16, non_blocking=True)
                done = self._assist_free[i] = self.dev.record(self.dev.download)
        unit.step.add_(1)
        unit.master_event = done
        if cast16 is not None:      # the next upload waits on master_event first: the copy is complete then
            unit.host16_epoch, unit.host16_event = cast16, done
        return up

    def _flush_assisted(self) -> None:
        """Apply every pending assisted update now (a host reader wants the masters)."""
        pending = [u for u in self.units if u.pending_update is not None]
        for u in pending:
            with self.dev.on(self.dev.upload):
                self._upload(u, None)
        if pending or any(u.master_event is not None for u in self.units):
            self.dev.synchronize()
            for u in self.units:
                u.master_event = None

    def _window(self, order: list[Unit], pos: int) -> tuple:
        """The units needed from ``pos`` on that fit in the slots: the ones a slot must not be taken from."""
        return tuple(order[pos: pos + self.plan.weight_slots])

    def _acquire(self, order: list[Unit], pos: int) -> None:
        """UPLOADING -> ON_DEVICE for ``order[pos]``: the compute stream waits for its upload."""
        unit = order[pos]
        if unit.home is Home.RESIDENT:
            return
        if unit.state is WeightState.ON_HOST:
            self._begin_upload(unit, self._window(order, pos))
        if unit.state is WeightState.UPLOADING:
            self.dev.wait(self.dev.compute, unit.ready_event)
            unit.state = WeightState.ON_DEVICE

    def _release(self, unit: Unit) -> None:
        """The compute stream is done reading the unit's slot for now (the slot keeps it until taken)."""
        if unit.home is Home.STREAMED and unit.slot is not None:
            unit.slot.free_event = self.dev.record(self.dev.compute)

    def _evict(self, unit: Unit) -> None:
        """ON_DEVICE -> ON_HOST: the slot copy is about to go stale (an update is coming); drop it."""
        if unit.home is Home.STREAMED and unit.slot is not None:
            unit.slot.tenant = None
            unit.slot, unit.state = None, WeightState.ON_HOST

    def _prefetch(self, order: list[Unit], pos: int) -> None:
        """Enqueue the uploads of the next units in ``order`` that are ready, as far as the slots allow."""
        depth = self.plan.weight_slots - 1
        for u in order[pos + 1: pos + 1 + depth]:
            # a unit whose CPU update is still running is passed over, not waited for: the ones after it
            # (an assisted update, say) keep the copy engines busy meanwhile; it is uploaded when acquired
            # several ranks: the gathers must come in the same order on every rank ([Note: sharded units])
            self._begin_upload(u, self._window(order, pos), wait=self.ranks.many)

    def _wait_updated(self, unit: Unit) -> None:
        if not unit.updated.is_set():
            t = time.perf_counter()
            while not unit.updated.wait(0.05):
                self.worker.check()
            self._add_time("wait", time.perf_counter() - t, label=unit.name)
        self.worker.check()

    # ------------------------------------------------------------------ compute helpers

    def _shell_call(self, leaves: dict):
        params = {**leaves, **self.shell.buffers}
        return lambda kw: functional_call(self._model, params, (), kw, strict=False)

    def _leaves(self, unit: Unit, grad: bool) -> dict[str, torch.Tensor]:
        """The unit's device tensors by name for ``functional_call``; with ``grad``, its trained weights as leaves
        that take a gradient (frozen ones never do: [Note: frozen parameters])."""
        views = unit.layout.views(unit.device_weights())
        if grad:
            views = {k: v.detach().requires_grad_(True) for k, v in views.items()}
        return {**views, **unit.frozen_weights(), **unit.buffers}

    def _block(self, unit: Unit, leaves: dict, x: torch.Tensor, call) -> torch.Tensor:
        module = self.adapter.blocks[unit.index]
        return block_output(functional_call(module, leaves, (x, *call.args), call.kwargs, strict=False))

    @contextlib.contextmanager
    def _rng(self, state):
        """Replay a saved RNG state for a recompute, leaving the outer stream untouched."""
        if state is None:
            yield
            return
        devices = [self.dev.device] if self.dev.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(state[0])
            if self.dev.is_cuda:
                torch.cuda.set_rng_state(state[1], self.dev.device)
            yield

    def _rng_state(self):
        if not (self.adapter.has_dropout and self._model.training):
            return None
        return (torch.get_rng_state(), torch.cuda.get_rng_state(self.dev.device) if self.dev.is_cuda else None)

    def _to_device(self, batch: dict) -> dict:
        return to_device(batch, self.dev.device)      # token ids as int64: [Note: token ids of any integer dtype]

    def _accumulate(self, unit: Unit, dst: torch.Tensor, grads: list, names: list[str]) -> None:
        """dst (fp32 flat) += grads, or = grads on the first write of a step."""
        views = unit.layout.views(dst)
        pairs = [(views[n], g) for n, g in zip(names, grads) if g is not None]
        if not pairs:
            return
        d, g = [p[0] for p in pairs], [p[1] for p in pairs]
        if unit.grad_fresh:
            if len(pairs) < len(unit.layout.names):
                dst.zero_()
            torch._foreach_copy_(d, g)
            unit.grad_fresh = False
        else:
            torch._foreach_add_(d, g)

    # ------------------------------------------------------------------ the step

    def _ensure_plan(self, micro_batches: list[dict]) -> None:
        """Check the plan against the real batch shape before the first step allocates activations."""
        ids = micro_batches[0].get("input_ids")
        if ids is None or self._checked_shape == tuple(ids.shape):
            return
        batch = BatchShape(ids.shape[0], ids.shape[-1], max(len(micro_batches), self.config.gradient_accumulation_steps))
        check = self._replan(batch)   # PlanError before anything of this step is allocated
        self._checked_shape = tuple(ids.shape)
        self._plan_batch = batch
        self.batch_plan = check     # the plan's prediction for the batch actually trained

    def _checkpoint_args(self) -> dict:
        """How a training forward keeps its block checkpoints, as the plan for the batch says ([Note: offloaded
        checkpoints], [Note: checkpoints every k blocks]): train_batch, and the DeepSpeed-shaped loop's window,
        whose blocks' backward waits for the boundary with every micro-batch's checkpoints kept until then."""
        plan = getattr(self, "batch_plan", self.plan)
        streaming = self.adapter.streaming
        return dict(offload=plan.offload_checkpoints and streaming, every=plan.checkpoint_every if streaming else 1)

    def _forward(self, micro_batches: list[dict], *, shell_grad: bool, offload: bool = False,
                 every: int | None = None, first: int = 0) -> list[_Micro]:
        """Pre pass and block-major forward; returns per-micro-batch state with block checkpoints (with
        ``offload``, most of them in pinned host memory: [Note: offloaded checkpoints]; with ``every`` > 1,
        only every ``every``-th block's: [Note: checkpoints every k blocks]). A training forward gives ``every``
        (it holds for the window's backward; an evaluation forward in the middle of a window leaves it) and
        ``first``, its first micro-batch's place in the window (the DeepSpeed-shaped loop's forwards come one at a
        time)."""
        if every is not None:
            self._ckpt_every = every
        every = every or 1
        self._refresh_shell()
        leaves = self._leaves(self.shell, grad=shell_grad)
        micros = []
        with self.dev.timed("compute", label="pre"):
            for mb in micro_batches:
                batch = self._to_device(mb)
                with torch.set_grad_enabled(shell_grad):
                    pre = self.adapter.pre(self._shell_call(leaves), batch) if self.adapter.streaming else None
                micros.append(_Micro(batch, pre, shell_leaves=leaves))
        if not self.adapter.streaming:
            return micros
        xs = [m.pre.hidden.detach() for m in micros]
        order = self.blocks
        for pos, unit in enumerate(order):
            self._safe_point()
            self._acquire(order, pos)
            self._prefetch(order, pos)
            keep_graph = not self.config.activation_checkpointing
            leaves_b = self._leaves(unit, grad=keep_graph)
            with self.dev.timed("compute", label=unit.name), torch.set_grad_enabled(keep_graph):
                for m, micro in enumerate(micros):
                    micro.ckpts.append(xs[m] if unit.index % every == 0 else None)
                    micro.rng.append(self._rng_state())
                    if keep_graph:   # all blocks are resident (the planner's rule): the graph may hold their weights
                        x = xs[m].requires_grad_(True)
                        y = self._block(unit, leaves_b, x, micro.pre.calls[unit.index])
                        micro.graphs.append((x, leaves_b, y))
                        xs[m] = y.detach()
                    else:
                        xs[m] = self._block(unit, leaves_b, xs[m], micro.pre.calls[unit.index])
            self._release(unit)
            if offload and self._offloaded(unit.index):
                self._ckpt_down(micros, unit.index, first)
        for micro, x in zip(micros, xs):
            micro.grad = x      # holds the final hidden state until the post pass
        return micros

    # [Note: offloaded checkpoints]
    # With plan.offload_checkpoints, the inputs each block kept for its backward go down to a pinned host arena,
    # G micro-batches' worth (train_batch, or a DeepSpeed-shaped window, whose forwards come one at a time:
    # ``first`` places each), right after the block's forward (download stream, after the compute that wrote them;
    # ``record_stream`` keeps the allocator from reusing the device memory before the copy has read it), except
    # block 0's (it is the pre pass's output, alive anyway) and the last two's (needed first). The backward
    # brings each block's back up on the upload stream CKPT_AHEAD blocks ahead, into memory allocated on the
    # compute stream before the upload stream is told to wait for it, and the compute stream waits on the upload
    # before using them. A host slot is rewritten only by the next step's forward, which the compute stream
    # orders after this step's uploads of it.
    #
    # Two blocks ahead, not one: a block updated on the device in the backward ([Note: assisted updates in the
    # backward]) queues its state's chunks on the upload stream right after its compute, and a checkpoint
    # enqueued one block ahead sat behind them. W1 at 8 GiB (ebd8986, its trace) waited ~8 ms before each block
    # that followed an assisted one (nine of them in its backward). Two ahead, the next block's checkpoint is
    # enqueued before those chunks: 1.342 -> 1.299 s/step (ebd8986 -> 23bacce, docs/benchmarks.md). On the
    # device at once: block 0's, the one computing, the two coming up (within the planner's CKPT_ON_DEVICE).

    def _offloaded(self, index: int) -> bool:
        return index in offloaded_blocks(len(self.blocks), self._ckpt_every)

    def _ckpt_slot(self, index: int) -> int:
        """Block ``index``'s place among the offloaded checkpoints."""
        return offloaded_blocks(len(self.blocks), self._ckpt_every).index(index)

    def _ckpt_view(self, index: int, m: int, like: torch.Tensor) -> torch.Tensor:
        """The pinned host slot of block ``index``'s checkpoint of micro-batch ``m`` (the arena grows to the
        batch the first time)."""
        n = like.numel()
        G = self._ckpt_g
        need = offloaded_checkpoints(len(self.blocks), self._ckpt_every) * G * n
        arena = self._ckpt_arena
        if arena is None or arena.tensor.numel() < need or arena.tensor.dtype != like.dtype:
            if arena is not None:       # a larger batch than before: the smaller arena goes
                self.dev.synchronize()
                self._arenas.remove(arena)
                arena.close()
            arena = self._ckpt_arena = HostArena(need, like.dtype, self.dev.is_cuda and self.config.offload.pin_memory)
            self._arenas.append(arena)
        off = (self._ckpt_slot(index) * G + m) * n
        return arena.tensor[off:off + n].view(like.shape)

    def _ckpt_down(self, micros: list[_Micro], index: int, first: int = 0) -> None:
        # the arena's layout is per window of G micro-batches (the DeepSpeed-shaped loop's come one at a time)
        self._ckpt_g = max(self._ckpt_g, first + len(micros), self.config.gradient_accumulation_steps)
        ev = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.download):
            self.dev.wait(self.dev.download, ev)
            with self.dev.timed("download", self.dev.download, f"ckpt[{index}]"):
                for m, micro in enumerate(micros, start=first):
                    x = micro.ckpts[index]
                    h = self._ckpt_view(index, m, x)
                    h.copy_(x, non_blocking=True)
                    if self.dev.is_cuda:
                        x.record_stream(self.dev.download)
                    micro.ckpts[index] = h

    def _ckpt_up(self, micros: list[_Micro], index: int) -> None:
        """Block ``index``'s checkpoints back on the device (enqueued; ``_ckpt_wait`` before use)."""
        first = micros[0].ckpts[index] if index >= 0 and micros else None
        if first is None or first.device == self.dev.device:
            return
        outs = [torch.empty(mc.ckpts[index].shape, dtype=mc.ckpts[index].dtype, device=self.dev.device)
                for mc in micros]
        ev = self.dev.record(self.dev.compute)     # after the allocations: their memory is free on the device
        with self.dev.on(self.dev.upload):
            self.dev.wait(self.dev.upload, ev)
            with self.dev.timed("upload", self.dev.upload, f"ckpt[{index}]"):
                for mc, d in zip(micros, outs):
                    d.copy_(mc.ckpts[index], non_blocking=True)
                    mc.ckpts[index] = d
            self._ckpt_ready[index] = self.dev.record(self.dev.upload)

    def _ckpt_wait(self, index: int) -> None:
        ev = self._ckpt_ready.pop(index, None)
        if ev is not None:
            self.dev.wait(self.dev.compute, ev)

    def _begin_speculation(self) -> None:
        """Before a step's block backward: whether its host updates speculate ([Note: speculative updates])."""
        if self._can_speculate and self.adapter.streaming:
            if self._speculate_next:
                self._spec = Speculation(self.config.gradient_clipping ** 2)
            else:
                self.speculation_stats["waited"] += 1

    def _post(self, micro: _Micro):
        """Post pass with autograd: returns (output, x_L leaf)."""
        if not self.adapter.streaming:
            return self.adapter.full(self._shell_call(micro.shell_leaves), micro.batch), None
        final = micro.grad.detach().requires_grad_(True)
        devices = [self.dev.device] if self.dev.is_cuda else []
        with torch.random.fork_rng(devices=devices, enabled=self.adapter.has_dropout):
            out = self.adapter.post(self._shell_call(micro.shell_leaves), micro.batch, final)
        return out, final

    def _post_backward(self, micro: _Micro, loss: torch.Tensor, final: torch.Tensor | None, seed_scale: float):
        names = list(self.shell.layout.names)
        reached = []

        def accumulate(grads):
            reached.append(any(g is not None for g in grads))
            self._accumulate(self.shell, self.shell.grad, grads, names)

        got = backward_into(loss * seed_scale, [final] if final is not None else [],
                            [micro.shell_leaves[n] for n in names], accumulate)
        if (final is not None and got[0] is None) or (final is None and not reached[0]):
            raise RuntimeError("backward(loss): the loss does not depend on the engine's last forward (a loss of an "
                               "earlier forward, whose graph the next forward dropped, or of another model); call "
                               "backward() on what the last engine(...) call returned")
        if final is not None:
            (micro.grad,) = got

    def _post_chunked(self, micro: _Micro, seed_scale: float, chunks: int) -> torch.Tensor:
        """The post pass and its backward over token chunks (adapter.post_in_chunks); returns the micro-batch's
        loss, its final hidden state's gradient in ``micro.grad``."""
        names = list(self.shell.layout.names)
        devices = [self.dev.device] if self.dev.is_cuda else []
        micro.grad, total = post_in_chunks(
            self.adapter, self._shell_call(micro.shell_leaves), micro.batch, micro.grad.detach(),
            [micro.shell_leaves[n] for n in names], seed_scale, chunks,
            lambda grads: self._accumulate(self.shell, self.shell.grad, grads, names),
            fork_rng=lambda: torch.random.fork_rng(devices=devices, enabled=self.adapter.has_dropout))   # as _post
        return total

    def _backward_steps(self) -> list[tuple[Unit, bool]]:
        """The backward's blocks in turn, (unit, recompute): in reverse; with checkpoints every k blocks, each
        segment's recomputed inputs first ([Note: checkpoints every k blocks])."""
        every, L = self._ckpt_every, len(self.blocks)
        if every == 1:
            return [(u, False) for u in reversed(self.blocks)]
        steps = []
        for start in reversed(range(0, L, every)):
            end = min(start + every, L)
            steps += [(self.blocks[i], True) for i in range(start, end - 1)]
            steps += [(self.blocks[i], False) for i in reversed(range(start, end))]
        return steps

    # [Note: checkpoints every k blocks]
    # Every micro-batch of a step keeps its blocks' inputs until the step's backward (block-major order): 32
    # micro-batches of the 7B shape keep 34 GB. With plan.checkpoint_every = k (the planner's
    # last resort, or offload.checkpoint_every) the forward keeps the inputs of blocks 0, k, 2k, ... only. The
    # backward takes the segments from the last: it first runs the forward of the segment's blocks but its last,
    # block-major over the micro-batches as the forward did and with the same RNG states, which gives the others'
    # inputs again, then the segment's backward as before, each block recomputed from its input. The inputs are
    # the forward's bitwise (the same kernels on the same inputs), so are the gradients and the updates. Cost: a
    # forward more of k - 1 blocks in k and their weights uploaded once more; the memory: 1/k of the checkpoints,
    # and a segment's k - 1 inputs at a time on the device. The backward's block order, and so the updates'
    # order, is unchanged.

    def _recompute_inputs(self, micros: list[_Micro], unit: Unit) -> None:
        """[Note: checkpoints every k blocks]: block ``unit``'s forward again from its input, for the next block's
        input, every micro-batch."""
        self._ckpt_up(micros, unit.index)
        self._ckpt_wait(unit.index)
        leaves = self._leaves(unit, grad=False)
        with self.dev.timed("compute", label=f"{unit.name}(inputs)"), torch.no_grad():
            for micro in micros:
                with self._rng(micro.rng[unit.index]):
                    y = self._block(unit, leaves, micro.ckpts[unit.index], micro.pre.calls[unit.index])
                micro.ckpts[unit.index + 1] = y

    def _backward_blocks(self, micros: list[_Micro]) -> None:
        steps = self._backward_steps()
        order = [u for u, _ in steps]
        if not self.deferred or self._spec is not None:     # the updates start during this backward
            self._expect_updates(list(reversed(self.blocks)), grads_written=False)
        for pos, (unit, recompute) in enumerate(steps):
            self._safe_point()
            self._acquire(order, pos)
            self._prefetch(order, pos)
            if recompute:
                self._recompute_inputs(micros, unit)
                self._release(unit)
                continue
            gdst = self._grad_buffer(unit)
            names = list(unit.layout.names)
            self._ckpt_up(micros, unit.index)             # [Note: offloaded checkpoints] (no-op otherwise)
            self._ckpt_wait(unit.index)
            for ahead in range(1, CKPT_AHEAD + 1):        # each a no-op but the farthest, already enqueued
                self._ckpt_up(micros, unit.index - ahead)
            with self.dev.timed("compute", label=unit.name):
                for micro in micros:
                    self._block_backward(unit, micro, names, gdst)
            self._release(unit)
            self._evict(unit)
            self._unit_grads_done(unit)
        names = list(self.shell.layout.names)
        for micro in micros:   # backward of the pre pass into the shell's gradient
            if names and micro.pre.hidden.requires_grad:     # else nothing before block 0 trains
                with self.dev.timed("compute", label="pre"):
                    backward_into(micro.pre.hidden, [], [micro.shell_leaves[n] for n in names],
                                  lambda g: self._accumulate(self.shell, self.shell.grad, g, names), micro.grad)
            micro.grad = None

    def _block_backward(self, unit: Unit, micro: _Micro, names: list[str], gdst: torch.Tensor) -> None:
        """One micro-batch's backward through block ``unit``: its input's gradient into ``micro.grad``, its weights'
        added into ``gdst``; the recomputed input and output and the weight gradients go when it returns ([Note: one
        micro-batch's gradients at a time], adapter.py)."""
        if micro.graphs:
            x, leaves, y = micro.graphs[unit.index]
            micro.graphs[unit.index] = None
        else:   # recompute the block from its checkpoint, replaying its RNG state
            x = micro.ckpts[unit.index].detach().requires_grad_(True)
            leaves = self._leaves(unit, grad=True)
            with torch.enable_grad(), self._rng(micro.rng[unit.index]):
                y = self._block(unit, leaves, x, micro.pre.calls[unit.index])
        (micro.grad,) = backward_into(y, [x], [leaves[n] for n in names],
                                      lambda g: self._accumulate(unit, gdst, g, names), micro.grad)
        micro.ckpts[unit.index] = None

    def _grad_buffer(self, unit: Unit) -> torch.Tensor:
        if unit.home is Home.RESIDENT or not unit.trains:    # a unit that trains nothing has an empty one
            return unit.grad
        slot = self.grad_pool.take()
        self.dev.wait(self.dev.compute, slot.free_event)          # [Note: slot reuse]
        slot.tenant, unit.grad_slot = unit, slot
        unit.grad = slot.tensor[: unit.numel]
        unit.grad_fresh = True
        return unit.grad

    def _unit_grads_done(self, unit: Unit) -> None:
        """A streamed unit's gradient for this micro-step is complete on the device: send it to the host."""
        if not unit.trains:       # [Note: frozen parameters]: no gradient, no update
            return
        if unit.shard_state and unit.home is Home.STREAMED:
            self._keep_grad_shard(unit)
            return
        if unit.optimizer_on_device:
            return
        grad = unit.grad
        unit.host16_epoch = -1     # its update may start now: the 16-bit copy goes stale
        self._await_moments(unit)  # [Note: moments after the forward]: its host gradient buffer is free then
        if self.deferred and unit.swap is not None:
            self._stash_grad(unit, grad)
            return
        if not self.deferred and self._assisted(unit):     # [Note: assisted updates in the backward]
            self._flag_nonfinite(unit, grad)
            self._begin_applying()
            self._assist_in_backward(unit, grad)
            return
        if self.ranks.many:
            grad = self._reduce_scatter(unit)
        if not self.deferred:
            self._flag_nonfinite(unit, grad)      # the gradient its update takes: this rank's shard
        host = self._host_grads.get(id(unit))
        fresh_host = host is not None and unit.host_grad_fresh
        if fresh_host:     # the whole gradient goes straight into the unit's host buffer; its norm is taken here
            dst = host
            unit.host_grad_fresh = False
            if self._needs_norm:
                self._sq_norms[id(unit)] = torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
        else:              # staging: either an immediate update, or an add into the host buffer
            dst = self._take_staging()
            self._sq_norms.pop(id(unit), None)
        speculate = fresh_host and self._spec is not None and unit.index >= 0
        done = self._send_down(unit, grad, dst, self._sq_norms[id(unit)] if speculate else None)
        if self.deferred:
            if not fresh_host:   # DeepSpeed-style accumulation across micro-steps
                self.worker.submit(self._task_add(host, dst, done), label=f"add[{unit.name}]")
            elif speculate:      # [Note: speculative updates]
                unit.updated.clear()
                # FIFO, ahead of every other task: the partial norm sums in backward order, so which blocks
                # are speculated depends on the data only, never on the worker's timing (bitwise reproducible)
                self.worker.submit(self._task_speculate(unit, self._spec, done, self._hyper()), _SPECULATE_FIRST,
                                   label=f"speculate[{unit.name}]")
        else:
            self._begin_applying()   # this block is updated now, while the backward goes on
            unit.updated.clear()
            self.worker.submit(self._task_update(unit, dst, done, self._hyper(), 1.0, release=True,
                                                 cast16=self._cast16_label(unit), flag=unit.index + 1),
                               self._priority(unit), label=f"adamw[{unit.name}]",
                               ready=None if unit.swap else done.query)     # [Note: ready tasks first]

    # [Note: non-finite gradients without a norm]
    # With clipping (or fp16) every update waits for the global norm, and a non-finite one refuses the step (or
    # skips it) before anything is applied. Without them the CPU updates each block as its gradient comes down,
    # during the backward, and a non-finite gradient would be applied, making every weight non-finite. So each
    # unit's gradient is summed on the device as it is handed over (a sum is non-finite if an element is, or if
    # the gradient is too large to sum: then too it is refused), into the step's running count, a snapshot of
    # which goes down with the gradient (``_bad_dev`` -> ``_bad_host``, one element). An update runs only if
    # nothing up to and including its unit was non-finite: the CPU worker reads the flag after the download it
    # waits for anyway; a device update takes it as the fused kernel's ``found_inf`` (torch's GradScaler
    # protocol: the state stays as it is). The units updated at the step's end, on the device, run only after
    # the host has read the step's count (one device sync, before their AdamW kernels are enqueued). A step
    # with a non-finite gradient is then refused with FloatingPointError, every weight and moment as before it,
    # like a clipped step's; only when a non-finite gradient comes after blocks were updated (the loss finite,
    # a gradient of an early block overflowing) is the state torn, and the engine fails (EngineFailedError,
    # [Note: failure semantics]). Cost: a read of each gradient on the device, which a norm would read too.

    def _flag_nonfinite(self, unit: Unit, grad: torch.Tensor) -> None:
        """Count ``grad`` (on the device, compute stream) into the step's running count of non-finite gradients
        and snapshot the count for ``unit``: [Note: non-finite gradients without a norm]."""
        bad = torch.isfinite(grad.sum()).logical_not()
        torch.maximum(self._bad_run, bad.to(self._bad_run.dtype), out=self._bad_run)
        k = unit.index + 1
        self._bad_dev[k:k + 1].copy_(self._bad_run.view(1))

    def _refuse_nonfinite(self, host_units: list[Unit], device_units: list[Unit], shell_assisted: bool) -> None:
        """A step with a non-finite gradient and no norm ([Note: non-finite gradients without a norm]): refused,
        every weight and moment as before it, or, when some units took its update, torn (the engine fails)."""
        self.worker.drain()            # every update task of the step ran (or skipped)
        self.dev.synchronize()
        flags = self._bad_dev.to("cpu")
        applied = [u for u in host_units if not flags[u.index + 1]]
        if self.ranks.many:     # every rank decides alike
            torn = bool(self.ranks.all_reduce(torch.tensor([float(len(applied))], device=self.dev.device)).item())
        else:
            torn = bool(applied)
        for u in host_units:    # the device's updates in the backward counted their step on the host first
            if flags[u.index + 1] and (self._assisted(u) or (u is self.shell and shell_assisted)):
                u.step.sub_(1)
        order = [*reversed(host_units), *device_units]       # the order the backward handed the gradients over
        first = next((u.name for u in order if flags[u.index + 1]), None)
        where = f"first at {first}" if first else "on another rank"
        msg = (f"non-finite gradients at step {self.global_step} ({where}; no gradient clipping, so no norm "
               "was taken)")
        if torn:
            raise FloatingPointError(f"{msg}, after {len(applied)} units took the step's update: the state is "
                                     "torn. Resume from the last checkpoint (and lower the learning rate, or set "
                                     "gradient_clipping)")
        self._end_applying()      # nothing was applied: the step is dropped as before its updates
        raise FloatingPointError(f"{msg}: the step was not applied, every weight and moment is as before it. "
                                 "Lower the learning rate, check the data, or set gradient_clipping")

    def _keep_grad_shard(self, unit: Unit) -> None:
        """[Note: sharded device state] (FULL_SHARD, no offload): the block's gradient is reduce-scattered and this
        rank's shard summed into the unit's gradient shard on the GPU; the gradient slot goes back at once."""
        g = self._reduce_scatter(unit)
        acc = self._dev_shard_grad[id(unit)]
        if unit.host_grad_fresh:
            acc.copy_(g)
            unit.host_grad_fresh = False
        else:
            acc.add_(g)
        slot = unit.grad_slot
        slot.free_event = self.dev.record(self.dev.compute)
        slot.tenant, unit.grad_slot, unit.grad, unit.grad_fresh = None, None, None, True

    def _reduce_scatter(self, unit: Unit) -> torch.Tensor:
        """[Note: sharded units]: the sum over the ranks of this rank's shard of the unit's gradient, on the device
        (in the room after the padded gradient in its buffer, so it lives as long as the gradient slot)."""
        r = self.ranks
        full = unit.grad_slot.tensor if unit.grad_slot is not None else self._padded_grad[id(unit)]
        p, s = r.padded(unit.numel), r.shard_size(unit.numel)
        full[unit.numel:p].zero_()
        out = full[p:p + s]
        with self.dev.timed("compute", label=f"{unit.name}(reduce-scatter)"):
            r.reduce_scatter(out, full, unit.numel)
        return out[: unit.hi - unit.lo]

    def _send_down(self, unit: Unit, grad: torch.Tensor, dst: torch.Tensor, block_sq: torch.Tensor | None):
        """The unit's device gradient into host ``dst`` on the download stream, after the compute that wrote it
        (with its squared norm into ``_block_sq`` for speculation); its gradient slot goes back. Returns the
        download's event."""
        ev_compute = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.download):
            self.dev.wait(self.dev.download, ev_compute)
            with self.dev.timed("download", self.dev.download, unit.name):
                dst.narrow(0, 0, grad.numel()).copy_(grad, non_blocking=True)
                if block_sq is not None:
                    self._block_sq[unit.index:unit.index + 1].copy_(block_sq.view(1), non_blocking=True)
                if not self.deferred:      # [Note: non-finite gradients without a norm]
                    k = unit.index + 1
                    self._bad_host[k:k + 1].copy_(self._bad_dev[k:k + 1], non_blocking=True)
            done = self.dev.record(self.dev.download)
        if unit.grad_slot is not None:
            unit.grad_slot.free_event = done
            unit.grad_slot.tenant = None
            unit.grad_slot = None
            unit.grad = None
        unit.grad_fresh = True
        return done

    def _stash_grad(self, unit: Unit, grad: torch.Tensor) -> None:
        """[Note: gradients on the disk]
        With deferred updates (clipping, fp16) every host unit's gradient waits for the global norm. A unit on
        the disk tier keeps it on the disk, beside its state (a "grad" field of its region), instead of in a
        host buffer as large as the unit: it comes down into a staging buffer with its squared norm (taken on
        the device), and the worker writes it out chunk by chunk (``DiskTier.acquire(..., write_only=)``); the
        update later reads it with the state. The blocks' backward hands each block's gradient over once per
        optimizer step, so it is written once. The tier must not read a unit's chunks ahead before its gradient
        is written (it would read the last step's): only this task announces such a unit's update (under
        speculation, which updates it next), or the step's end after ``worker.drain()``."""
        if not unit.host_grad_fresh:
            raise RuntimeError(f"{unit.name}: a second gradient in one optimizer step for a unit whose gradient "
                               "waits on the disk")
        unit.host_grad_fresh = False
        sq = torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
        self._sq_norms[id(unit)] = sq
        dst = self._take_staging()
        speculate = self._spec is not None
        done = self._send_down(unit, grad, dst, sq if speculate else None)
        tier, key = self._tier, unit.index

        def stash():
            wait_event(done)       # [Note: the worker's waits]
            for c, (a, k) in enumerate(tier.chunks(key)):
                with waiting("disk"):
                    f = tier.acquire(key, c, write_only=("grad",))
                f["grad"].copy_(dst.narrow(0, a, k))
                tier.release(key, c)
            self._give_staging(dst)
            if speculate:
                tier.expect([key])       # its speculative update is the worker's next task for it
        self.worker.submit(stash, _SPECULATE_FIRST, label=f"stash-grad[{unit.name}]")
        if speculate:     # as _unit_grads_done: not ``updated`` until its settle task ran
            unit.updated.clear()
            self.worker.submit(self._task_speculate(unit, self._spec, done, self._hyper()), _SPECULATE_FIRST,
                               label=f"speculate[{unit.name}]")

    def _take_staging(self) -> torch.Tensor:
        with self._staging_cv:
            t = time.perf_counter()
            while not self._staging_free:
                self._staging_cv.wait(0.05)
                self.worker.check()
            waited = time.perf_counter() - t
            i = self._staging_free.pop(0)
        if waited > 1e-4:
            self._add_time("wait", waited, label="staging")
        return self._staging[i]

    def _give_staging(self, buf: torch.Tensor) -> None:
        for i, s in enumerate(self._staging):
            if s.data_ptr() == buf.data_ptr():
                with self._staging_cv:
                    self._staging_free.append(i)
                    self._staging_cv.notify()
                return

    def _task_add(self, host: torch.Tensor, staging: torch.Tensor, event):
        def run():
            wait_event(event)       # [Note: the worker's waits]
            host.add_(staging.narrow(0, 0, host.numel()))
            self._give_staging(staging)
        return run

    def _apply(self, unit: Unit, grad: torch.Tensor | None, ops: list[tuple], part: str | None = None) -> None:
        """Run ``ops`` ((hypers, factor, inverse), in turn) on a host unit's state: the AdamW step, or a rollback
        and a redo; ``part``: one pass of a split step (unit_adamw; in-memory units only). A unit on the disk tier
        is streamed chunk by chunk ([Note: chunked updates], disk.py): each chunk read (ahead), updated, its
        16-bit copy refreshed ("all"), written back (behind)."""
        if unit.swap is None:
            lo, hi = unit.lo, unit.hi     # the whole unit, or this rank's shard ([Note: sharded units])
            out16 = unit.host16[lo:hi] if part == "cast" else None
            threads = (split_adamw.rest_threads(self.config.offload.rest_pass_threads)
                       if part in ("moments", "rest") else None)
            for hypers, factor, inverse in ops:
                unit_adamw(unit, unit.master[lo:hi], grad, unit.exp_avg[lo:hi], unit.exp_avg_sq[lo:hi], unit.step,
                           hypers, factor, start=lo, inverse=inverse, part=part, out16=out16, threads=threads)
            return
        assert part is None, "a unit on the disk tier is updated in one pass"
        tier, key = self._tier, unit.index
        step0 = unit.step.clone()
        s = step0
        for c, (a, k) in enumerate(tier.chunks(key)):
            with waiting("disk"):       # [Note: the worker's waits]
                f = tier.acquire(key, c)
            p = f["master"] if unit.swap == "all" else unit.master[a:a + k]
            g = f["grad"] if grad is None else grad[a:a + k]       # [Note: gradients on the disk]
            s = step0.clone()
            for hypers, factor, inverse in ops:
                unit_adamw(unit, p, g, f["exp_avg"], f["exp_avg_sq"], s, hypers, factor, start=a,
                           inverse=inverse)
            if unit.swap == "all":
                unit.host16[a:a + k].copy_(p)
            tier.release(key, c)
        unit.step.copy_(s)

    def _priority(self, unit: Unit) -> int:
        """[Note: disk updates in order]
        The worker runs waiting updates lowest block first (needed first by the next forward), but disk-tier
        updates in the order they were submitted, after the in-memory ones: the order the engine told the
        tier to read ahead in (``DiskTier.expect``), so that the chunks read ahead are the ones taken next."""
        return _DISK_LAST if unit.swap else unit.index

    def _expect_updates(self, units, grads_written: bool = True) -> None:
        """Tell the disk tier which swapped units' updates come next, in order (it reads their state ahead).
        With gradients on the disk, only once they are written (``grads_written``): [Note: gradients on the
        disk]."""
        if self._tier is not None and (grads_written or not self.deferred):
            self._tier.expect([u.index for u in units if u.swap])

    def _task_update(self, unit: Unit, grad: torch.Tensor, event, hypers: tuple[Hyper, ...], factor: float,
                     release: bool, cast16=None, split: bool = False, flag: int | None = None):
        """The worker's AdamW step of a host unit; with ``cast16`` (a label: _cast16_label) its new weights are
        then cast into its 16-bit host copy ([Note: 16-bit copies after the update]). ``split``: the step's first
        pass only, the caller queues the second (_task_moments); with ``cast16`` too, that first pass writes the
        cast alone ([Note: the master behind its cast])."""
        def run():
            wait_event(event)       # [Note: the worker's waits]
            if flag is not None and float(self._bad_host[flag]):    # [Note: non-finite gradients without a norm]
                if release:
                    self._give_staging(grad)
                unit.updated.set()
                return
            g = grad.narrow(0, 0, unit.hi - unit.lo) if grad is not None else None
            if split and cast16 is not None:
                self._apply(unit, g, [(hypers, factor, False)], part="cast")
            else:
                self._apply(unit, g, [(hypers, factor, False)], part="master" if split else None)
                if cast16 is not None:
                    unit.host16.copy_(unit.master)
            if release:
                self._give_staging(grad)
            if cast16 is not None:
                unit.host16_epoch = cast16      # read by the main thread only after ``updated``
            unit.updated.set()
        return run

    def _task_moments(self, unit: Unit, grad: torch.Tensor, hypers: tuple[Hyper, ...], factor: float,
                      with_master: bool = False):
        """[Note: moments after the forward]: the second pass of the unit's last update, queued behind every
        update (the worker runs its first pass first): the moments, and ``with_master`` the master too ([Note:
        the master behind its cast]). Until it has run, the unit's gradient buffer and moments (and then its
        master) are not touched: _await_moments."""
        def run():
            self._apply(unit, grad.narrow(0, 0, unit.hi - unit.lo), [(hypers, factor, False)],
                        part="rest" if with_master else "moments")
            unit.moments_done.set()
        return run

    def _await_moments(self, unit: Unit) -> None:
        """[Note: moments after the forward]
        A unit updated in two passes keeps the gradient its moments pass reads in its host buffer until that pass
        has run (the worker runs it after the updates the forward needed, while the post pass and the backward
        go on, the last block first). The unit's next gradient must not come down into that buffer before: wait
        for it here (rarely: the backward reaches the unit later). Every other reader of the moments (a
        checkpoint, the next update, a rollback) drains the worker first."""
        if not unit.moments_done.is_set():
            t = time.perf_counter()
            while not unit.moments_done.wait(0.05):
                self.worker.check()
            self._add_time("wait", time.perf_counter() - t, label=f"moments[{unit.name}]")

    def _task_speculate(self, unit: Unit, spec: Speculation, event, hypers: tuple[Hyper, ...]):
        """[Note: speculative updates]: update with factor 1 unless the partial norm already proves clipping.
        The unit stays not ``updated`` until its settle task has run: only that one decides what the master is."""
        def run():
            wait_event(event)       # [Note: the worker's waits]
            if spec.admit(float(self._block_sq[unit.index])):
                self._apply(unit, self._host_grads.get(id(unit)), [(hypers, 1.0, False)])
                spec.speculated.add(id(unit))
        return run

    def _task_settle(self, unit: Unit, spec: Speculation, event, hypers: tuple[Hyper, ...], factor: float | None):
        """After a speculative backward, once the norm is known (``factor``: the gradient's factor, None for a
        non-finite norm): keep a speculative update, redo it with the true factor, roll it back, or (for a
        block the worker did not speculate on) apply the deferred update. Runs after the block's
        speculation task (same priority, submitted later)."""
        def run():
            wait_event(event)       # [Note: the worker's waits]
            grad = self._host_grads.get(id(unit))      # None: on the disk ([Note: gradients on the disk])
            held = id(unit) in spec.speculated
            ops = [(hypers, 1.0, True)] if held and factor != 1.0 else []
            if factor is not None and not (held and factor == 1.0):
                ops.append((hypers, factor, False))
            if ops:
                self._apply(unit, grad, ops)
            unit.updated.set()
        return run

    def _hyper(self) -> tuple[Hyper, ...]:
        """This step's AdamW hyperparameters, one per parameter group.

        [Note: group learning rates]
        The schedule gives the lr of ``optimizer.lr``; a group with its own lr takes the same multiplier,
        ``lr * lr_at(step) / optimizer.lr``, as ``LambdaLR`` with ``make_lambda`` (and DeepSpeed's
        WarmupCosineLR) scale each group's initial lr; DeepSpeed's WarmupLR and WarmupDecayLR would instead set
        every group to the schedule's one lr. A group with the config's lr gets ``lr_at(step)`` itself, bitwise
        what it was before groups existed. A client scheduler, DeepSpeed's OneCycle/LRRangeTest and DeepSpeed's
        warm-ups over groups of their own lr take theirs from ``engine_hypers`` ([Note: a client scheduler drives
        the engine's lr], optim/client_schedule.py)."""
        from zerofit.optim.client_schedule import engine_hypers
        from zerofit.optim.schedules import lr_at

        hypers = engine_hypers(self)
        if hypers is not None:
            return hypers
        base = self.config.optimizer.lr
        lr = lr_at(self.global_step, base, self.config.scheduler)
        return tuple(Hyper.of(g.optimizer, lr if g.optimizer.lr == base else g.optimizer.lr * (lr / base))
                     for g in self.param_groups)

    def _refresh_shell(self) -> None:
        """A host-optimized shell: wait for its update and upload it into dev16 before use.

        Waiting for the update also orders the next step's writes into ``shell.grad`` after the
        download that read it: the update task synchronized on that download's event first."""
        if not self._shell_host_opt:
            return
        u = self.shell
        if self._shell_updated is not None:     # updated on the device: [Note: assisted updates in the backward]
            self.dev.wait(self.dev.compute, self._shell_updated)
            self._shell_updated = None
        if getattr(u, "dirty", False):
            self._wait_updated(u)
            with self.dev.on(self.dev.upload):
                self._upload(u, u.dev16)
                if self.ranks.many:     # [Note: sharded units]
                    self.ranks.gather(u.dev16.as_strided((self.ranks.padded(u.numel),), (1,)), u.numel)
                ev = self.dev.record(self.dev.upload)
            self.dev.wait(self.dev.compute, ev)
            u.dirty = False

    def _assisted(self, unit: Unit) -> bool:
        """Whether the device updates this unit (see [Note: assisted updates])."""
        return self._assist is not None and unit.index in self.plan.assisted_blocks

    def _discard_grads(self, host_units: list[Unit]) -> None:
        """Forget this step's gradients (a skipped step): the next writes start fresh."""
        self._bad_run.zero_()       # [Note: non-finite gradients without a norm]
        self._bad_dev.zero_()
        for u in self.units:
            u.grad_fresh = True
            if u.optimizer_on_device and u.grad is not None:
                u.grad.zero_()
            if u.shard_state:
                u.host_grad_fresh = True
        for u in host_units:
            u.host_grad_fresh = True
        self._sq_norms.clear()

    def _finish_step(self) -> bool:
        """Apply the optimizer step to every unit. Returns False if the step was skipped (fp16 overflow)."""
        hypers = self._hyper()
        factor = 1.0
        skip = False
        # [Note: 16-bit copies for extra forwards]: the weights change from here; the copies made right after
        # this step's updates are the ones valid now ([Note: 16-bit copies after the update])
        self._host16_next = ("after", self._host16_epoch)
        self._host16_epoch += 1
        device_units = [u for u in self.units if u.optimizer_on_device and u.trains]
        host_units = [u for u in self.units if not u.optimizer_on_device and u.trains]
        # the shell's gradient is complete only now: send it down if its optimizer is on the host
        shell_assisted = self._assist is not None and self.plan.assisted_shell
        if self._shell_host_opt and not self.shell.grad_fresh:
            if shell_assisted:     # [Note: assisted updates in the backward]
                self._begin_applying()
                self._assist_shell()
            else:
                self._unit_grads_done(self.shell)
        spec, self._spec = self._spec, None
        if self.deferred and spec is None:
            self.worker.drain()        # host-side accumulations are done
        dev_grads = {}      # [Note: sharded device state]: each sharded device unit's gradient shard
        if self.ranks.many:     # [Note: sharded units]: replicated units take the sum of every rank's gradient
            with self.dev.timed("compute", label="all-reduce"):
                for u in device_units:
                    if u.shard_state and u.home is Home.STREAMED:     # reduce-scattered in the backward
                        dev_grads[id(u)] = self._dev_shard_grad[id(u)]
                    elif u.shard_state:
                        dev_grads[id(u)] = self._reduce_scatter(u)
                    else:
                        self.ranks.all_reduce(u.grad)
        if not self.deferred:     # [Note: non-finite gradients without a norm]
            for u in device_units:
                self._flag_nonfinite(u, dev_grads.get(id(u), u.grad))
            bad = self.ranks.all_reduce(self._bad_run.reshape(1).clone()) if self.ranks.many else self._bad_run
            if float(bad):        # a device sync, before the device's AdamW kernels are enqueued
                self._refuse_nonfinite(host_units, device_units, shell_assisted)
        if self._needs_norm:
            sq = [torch.linalg.vector_norm(u.grad, dtype=torch.float64) ** 2 for u in device_units
                  if not u.shard_state]
            shards = [torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in dev_grads.values()]
            for u in host_units:
                s = self._sq_norms.pop(id(u), None)
                if s is None:   # accumulated on the host over several micro-steps
                    s = torch.linalg.vector_norm(self._host_grads[id(u)], dtype=torch.float64) ** 2
                shards.append(s.to(self.dev.device))
            if self.ranks.many:     # each rank holds its shards' squares: summed over the ranks
                part = torch.stack(shards).sum() if shards else torch.zeros((), dtype=torch.float64,
                                                                             device=self.dev.device)
                shards = [self.ranks.all_reduce(part.reshape(1)).reshape(())]
            sq += shards
            total = torch.stack(sq).sum().sqrt().item() if sq else 0.0    # a device sync
            scale = self.scaler.scale if self.scaler else 1.0
            try:
                if self.scaler is not None:
                    skip = self.scaler.update(not math.isfinite(total))
                elif not math.isfinite(total):
                    raise FloatingPointError(f"gradient norm is {total} at step {self.global_step}")
            except Exception:
                if spec is not None:     # undo the speculative updates: the step is not applied
                    self._settle(spec, host_units, hypers, None)
                    self.worker.drain()
                self._discard_grads(host_units)    # a caller that goes on starts from clean gradients
                raise
            norm = total / scale
            self.last_grad_norm = norm
            factor = 1.0 / scale
            clip = self.config.gradient_clipping
            if clip > 0 and math.isfinite(norm):
                coef = clip / (norm + 1e-6)
                if coef < 1.0:
                    factor *= coef
            self._speculate_next = factor == 1.0 / scale    # [Note: speculative updates]: after a clipped step, wait
        for u in host_units:
            u.host_grad_fresh = True
        if skip:
            self.skipped_steps += 1
            self._discard_grads(host_units)
            return False
        self._begin_applying()
        for u in device_units:
            u.grad_fresh = True
            with self.dev.timed("compute", label=f"optimizer[{u.name}]"):
                if u.shard_state:     # [Note: sharded device state]
                    unit_adamw(u, u.master, dev_grads[id(u)], u.exp_avg, u.exp_avg_sq, u.step, hypers, factor,
                               start=u.lo)
                    if u.home is Home.STREAMED:     # the next upload (gather) of it waits for this update
                        u.host_grad_fresh = True
                        u.master_event = self.dev.record(self.dev.compute)
                        continue
                    u.dev16[u.lo:u.hi].copy_(u.master)
                    self.ranks.gather(u.dev16.as_strided((self.ranks.padded(u.numel),), (1,)), u.numel)
                    continue
                unit_adamw(u, u.master, u.grad, u.exp_avg, u.exp_avg_sq, u.step, hypers, factor)
                if u.dev16 is not u.master:
                    u.dev16.copy_(u.master)
        if device_units:
            self._mirror_stale = True
        if spec is not None:
            self._settle(spec, host_units, hypers, factor)
        elif self.deferred:
            if (self._cast_first and self._host16_possible()     # [Note: the master behind its cast]
                    and any(u.home is Home.STREAMED and u.swap is None for u in self.blocks)):
                self._enable_host16()
            ev = self.dev.record(self.dev.download)
            self._expect_updates(host_units)
            for u in host_units:          # forward order: the next forward needs block 0 first
                if self._assisted(u):     # [Note: assisted updates]
                    u.pending_update = (factor, hypers)
                    continue
                u.updated.clear()
                grad = self._host_grads.get(id(u))
                split = self._split and u.swap is None     # [Note: moments after the forward]
                cast16 = self._cast16_label(u, now=True) if split else None
                self.worker.submit(self._task_update(u, grad, ev, hypers, factor, release=False, split=split,
                                                     cast16=cast16),
                                   self._priority(u), label=f"adamw[{u.name}]")
                if split:
                    u.moments_done.clear()
                    u.master_behind = cast16 is not None
                    self.worker.submit(self._task_moments(u, grad, hypers, factor, with_master=u.master_behind),
                                       _MOMENTS_LAST - u.index, label=f"moments[{u.name}]")
        if self._shell_host_opt and not shell_assisted:
            self.shell.dirty = True
        return True

    def _settle(self, spec: Speculation, host_units: list[Unit], hypers: tuple[Hyper, ...],
                factor: float | None) -> None:
        """Queue each host unit's settle task (see _task_settle) and decide whether the next step speculates."""
        clipped = factor != 1.0
        ev = self.dev.record(self.dev.download)
        if clipped:       # the speculated blocks are read again (rolled back and redone), in forward order
            self._expect_updates(host_units, grads_written=False)
        for u in host_units:
            u.updated.clear()
            self.worker.submit(self._task_settle(u, spec, ev, hypers, factor), self._priority(u),
                               label=f"settle[{u.name}]")
        self.speculation_stats["rolled_back" if clipped else "held"] += 1

    # ------------------------------------------------------------------ public API

    def train_batch(self, micro_batches: list[dict]) -> float:
        """One optimizer step over ``micro_batches`` (dicts of input_ids, labels, optional attention_mask).

        Gradients are averaged over the micro-batches (each micro-batch loss / G), as plain
        PyTorch gradient accumulation. Returns the mean loss (a float; one device sync).
        An error leaves the engine as [Note: failure semantics] (lifecycle.py) says."""
        self._check_open()
        self._drop_unused_forward()
        if self._micro_steps or self._pending is not None or self._announced:
            raise RuntimeError("train_batch called in the middle of a DeepSpeed-style accumulation "
                               "(a forward without backward(), or micro-batches without step()); finish it first")
        try:
            check_micro_batches(micro_batches, self._batch_spec)
        except Exception as e:
            self.ranks.fail(e)      # [Note: a failing rank]: the others would wait for this one's collectives
            raise
        with self._call(discard_step=True):
            return self._with_fallback(lambda: self._train_batch(micro_batches))

    def _train_batch(self, micro_batches: list[dict]) -> float:
        self._ensure_plan(micro_batches)
        self._begin_speculation()
        t0, worker0 = self._start_clock()
        G = len(micro_batches) * self.ranks.world    # the gradient is the mean over every rank's micro-batches
        scale = self.scaler.scale if self.scaler else 1.0
        plan = getattr(self, "batch_plan", self.plan)
        self._ckpt_ready = {}
        micros = self._forward(micro_batches, shell_grad=True, **self._checkpoint_args())
        chunks = plan.loss_chunks if self.adapter.streaming and self._chunk_loss_ok else 1
        losses = []
        for micro in micros:
            self._safe_point()
            with self.dev.timed("compute", label="post"):
                if chunks > 1:
                    loss = self._post_chunked(micro, scale / G, chunks)
                else:
                    out, final = self._post(micro)
                    loss = loss_of(out)
                    del out    # the logits are not needed for the backward: free them first
                    self._post_backward(micro, loss, final, scale / G)
            losses.append(loss.detach())
        if self.adapter.streaming:
            self._backward_blocks(micros)
        del micros
        # the reported loss is over the micro-batches that score tokens: one whose labels are all -100 has a loss of
        # 0/0 (NaN) and no gradient (a prompt longer than the window); its zero gradient still counts in the 1/G
        scored = [loss for loss, mb in zip(losses, micro_batches) if scores_tokens(mb)]
        mean = torch.stack(scored).float().mean() if scored else torch.full((), math.nan, device=self.dev.device)
        if self.ranks.many:     # the loss of the global batch, the same on every rank
            part = torch.stack([mean.nan_to_num(0.0) * len(scored), torch.tensor(float(len(scored)),
                                                                               device=self.dev.device)])
            total, count = self.ranks.all_reduce(part).tolist()
            mean = torch.tensor(total / count if count else math.nan)
        applied = self._finish_step()
        loss_value = mean.item()              # the step's one device sync
        self._end_step(t0, worker0, applied)
        return loss_value

    def _start_clock(self) -> tuple[float, tuple[float, float]]:
        """The step's clocks start: wall time, the worker's working and waiting seconds, the device trace's
        origin."""
        self.dev.intervals.clear()     # regions between steps (evaluation forwards) belong to no step
        self.worker.drain_spans()
        self._timeline, self._wait_spans = {}, []
        self._origin = self.dev.mark()
        return time.perf_counter(), (self.worker.busy_seconds, self.worker.wait_seconds)

    def _end_step(self, t0: float, worker0: tuple[float, float], applied: bool) -> None:
        if applied:
            self.global_step += 1
        self.dev.synchronize()
        tl, intervals = self.dev.drain_intervals()
        tl["optimizer"] = self.worker.busy_seconds - worker0[0]       # [Note: the worker's waits]
        tl["optimizer_wait"] = self.worker.wait_seconds - worker0[1]
        tl["wait"] = self._timeline.get("wait", 0.0)
        tl["step"] = time.perf_counter() - t0
        for k in ("compute", "upload", "download"):
            tl.setdefault(k, 0.0)
        self._timeline = tl
        host = self.worker.drain_spans()
        if self._tier is not None:
            host += [("disk", label, a, b) for label, a, b in self._tier.drain_spans()]
        host += [("wait", label, a, b) for label, a, b in self._wait_spans]
        self._trace = (intervals, self._origin, host, t0)    # built by trace(), if anyone asks
        self._note_host()
        self._end_applying()

    def _add_time(self, key: str, seconds: float, label: str | None = None) -> None:
        self._timeline[key] = self._timeline.get(key, 0.0) + seconds
        if label is not None:
            end = time.perf_counter()
            self._wait_spans.append((label, end - seconds, end))

    def trace(self) -> list[dict]:
        """The last step's timeline interval by interval: {lane, label, start, end} in seconds from the
        step's start. Lanes: compute, upload, download (device streams; from CUDA events), cpu (the host
        optimizer thread's tasks, working), cpu wait (those tasks waiting for a gradient or the disk: [Note: the
        worker's waits]), disk (the tier's reads and writes) and wait (the main thread blocked on the CPU
        optimizer or on pinned buffers). Device and
        host intervals come from different clocks that start together: compare them to a millisecond. A CPU
        task of the previous step still running when this one started has a negative start."""
        if isinstance(self._trace, tuple):
            intervals, origin, host, t0 = self._trace
            trace = self.dev.trace_of(intervals, origin)
            trace += [{"lane": lane, "label": label, "start": round(a - t0, 6), "end": round(b - t0, 6)}
                      for lane, label, a, b in host if b >= t0]
            self._trace = sorted(trace, key=lambda e: (e["lane"], e["start"]))
        return list(self._trace)

    def timeline(self) -> dict[str, float]:
        """Seconds per phase of the last step: step (wall), compute (device), upload, download,
        optimizer (the CPU worker working), optimizer_wait (its tasks waiting for a gradient or the disk),
        wait (the main thread blocked on the CPU optimizer or pinned buffers)."""
        return dict(self._timeline)

    # ------------------------------------------------------------------ access

    def wait(self) -> None:
        """Block until every pending update (host, or assisted on the device) is applied."""
        self._check_open()
        with self._call(discard_step=False):
            self._apply_pending()

    @property
    def module(self) -> nn.Module:
        """The model, with its current weights (fp32, on the host; usable for eval and export).
        Still readable after close(), which left the final weights there."""
        if self.state is EngineState.CLOSED:
            return self._model
        self._check_open()
        with self._call(discard_step=False):
            self._apply_pending("engine.module")     # [Note: engine.module is a collective]
            self._sync_host_weights()
        return self._model

    @property
    def device(self) -> torch.device:
        return self.dev.device

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by parameter name (host copies); frozen parameters as they are."""
        self._check_open()
        with self._call(discard_step=False):
            self._apply_pending()
            out = {}
            with self._full_state(write_back=False):      # [Note: sharded device state]
                for u in self.units:
                    prefix = "" if u.index < 0 else self.adapter.block_prefix(u.index) + "."
                    views = u.layout.views(u.master)
                    if u.frozen is not None:               # [Note: frozen parameters]: as they were
                        views.update(u.frozen.views(u.frozen_host))
                    for n, v in views.items():
                        out[prefix + n] = v.detach().to("cpu", copy=True)
        return out

    # checkpoints and export: thin delegates to zerofit.checkpoint (docs/checkpoints.md)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False) -> str:
        """DeepSpeed's save_checkpoint: the whole training state in ``save_dir/<tag>`` (default
        ``global_step{N}``), written atomically, then ``latest`` names it. Returns the folder.
        ``exclude_frozen_parameters``: leave out the weights of the frozen parameters (DeepSpeed's meaning)."""
        from zerofit.checkpoint.state import save

        if not save_dir:           # as DeepSpeed 0.19.8
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        return str(self._on_rank0(lambda: save(self, save_dir, tag, client_state, save_latest,
                                               exclude_frozen=exclude_frozen_parameters)))

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load_checkpoint (its arguments, in its order): ``(path, client_state)``; ``(None, None)``
        with a warning when ``tag`` is None and ``load_dir`` has no ``latest``. DeepSpeed's options that would
        load less than the whole state are refused by name (deepspeed_surface.py)."""
        from zerofit.checkpoint.state import load

        self._check_deepspeed_load_options(load_module_strict, load_lr_scheduler_states, load_module_only,
                                           custom_load_fn)
        self.wait()
        with self._full_state(write_back=True):      # [Note: sharded device state]
            out = load(self, load_dir, tag, load_optimizer_states)
        # several ranks: each wrote the same checkpoint into the shared host state; none trains on before all did
        self.ranks.barrier()
        return out

    def _on_rank0(self, write):
        """Several ranks ([Note: sharded units]): every rank calls; once every rank's updates are applied, rank 0
        writes the whole tensors from the shared host state and the others wait for its outcome (an error on
        rank 0 is raised on every rank). One rank: ``write()``."""
        if not self.ranks.many:
            return write()
        self.wait()
        result, err = None, None
        with self._full_state(write_back=False):     # [Note: sharded device state]
            if self.ranks.rank == 0:
                self._solo = True         # the writer's own waits are not collectives
                try:
                    result = write()
                except Exception as e:      # noqa: BLE001 - raised below, on every rank
                    err = e
                finally:
                    self._solo = False
            said = self.ranks.objects((str(result), None if err is None else f"{type(err).__name__}: {err}")
                                      if self.ranks.rank == 0 else None)[0]
        if err is not None:
            raise err
        if said[1] is not None:
            raise RuntimeError(f"rank 0 failed to write: {said[1]}")
        return said[0]

    def save_pretrained(self, out_dir, dtype=None, max_shard_size="5GB") -> str:
        """The current weights as a Hugging Face model directory, streamed tensor by tensor; in ``dtype``
        (bf16, fp16, fp32), by default the model's own (``self.model_dtype``)."""
        from zerofit.checkpoint.export import save_pretrained

        return str(self._on_rank0(lambda: save_pretrained(self, out_dir, dtype, max_shard_size)))

    def memory_stats(self) -> dict[str, int]:
        self._note_host()
        return {"gpu_peak_bytes": torch.cuda.max_memory_allocated(self.dev.device) if self.dev.is_cuda else 0,
                "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(self.dev.device) if self.dev.is_cuda else 0,
                # the caching allocator freed its cache and retried an allocation (each a device sync)
                "gpu_alloc_retries": (torch.cuda.memory_stats(self.dev.device).get("num_alloc_retries", 0)
                                      if self.dev.is_cuda else 0),
                "gpu_predicted_bytes": getattr(self, "batch_plan", self.plan).device_total,
                "host_bytes": psutil.Process().memory_info().rss,
                "host_peak_bytes": self._peak_host,
                "host_predicted_bytes": self.plan.host_total}

    def train(self, mode: bool = True):
        self._model.train(mode)
        return self

    def eval(self):
        return self.train(False)
