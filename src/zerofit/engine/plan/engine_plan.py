"""Planning: the config and the device as the planner's inputs, and the engine's plan (a part).

:func:`planner_inputs` turns a config, a model's adapter and the budgets into ``make_plan``'s arguments: the
engine's first plan and ``zerofit estimate``'s come from it, so the estimate plans what the engine will. The
other functions here are the config's reading that both share (the compute dtype, deferred and split updates,
the device's share of the updates, the batch a first plan is made for, the host budget).

:class:`Planning` owns the engine's plan: the first one, the replans that keep its placement (for the batch
actually trained, for 16-bit host copies, without loss chunks), and which of them the step in progress follows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import psutil
import torch

from zerofit.config.schema import ZerofitConfig
from zerofit.engine.disk.tier import DiskTier, SwapFile, free_bytes, frozen_key, tier_buffers, tier_chunk
from zerofit.engine.disk.tier import layout as disk_layout
from zerofit.engine.plan.search import (
    SPLIT_FRACTION,
    TIER_BUFFERS,
    BatchShape,
    ModelShape,
    Plan,
    PlanError,
    fmt_bytes,
    make_plan,
    placement_warnings,
)
from zerofit.engine.update import split_adamw
from zerofit.engine.update.speculation import Speculation

if TYPE_CHECKING:
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.model.adapter import Adapter


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DISK_FIELDS = {"moments": ("exp_avg", "exp_avg_sq"), "all": ("master", "exp_avg", "exp_avg_sq")}
log = logging.getLogger("zerofit")
LEARN_WINDOW = 4  # micro-batches the user's loop's default plan keeps room for ([Note: room for a learnt window])


# ---------------------------------------------------------------------------------------------- the config, read once


def needs_norm(config: ZerofitConfig) -> bool:
    """Whether every step needs the global gradient norm first: clipping, or fp16's overflow check. Either one
    makes every host update wait for it (deferred updates)."""
    return config.gradient_clipping > 0 or config.precision == "fp16"


def split_wanted(config: ZerofitConfig, on_cuda: bool, deferred: bool) -> bool:
    """Whether the config asks for deferred host updates in two passes (``offload.split_updates``; None: on a
    GPU): [Note: moments after the forward], update/split_adamw.py."""
    split = config.offload.split_updates
    return deferred and (on_cuda if split is None else split)


def split_updates(config: ZerofitConfig, on_cuda: bool, deferred: bool) -> bool:
    """Whether they run in two passes: asked for, and the kernel built (building it now on first use)."""
    return split_wanted(config, on_cuda, deferred) and split_adamw.available()


def cast_copies(config: ZerofitConfig, dtype: torch.dtype, on_cuda: bool, deferred: bool) -> bool:
    """Whether split updates write the 16-bit cast first ([Note: the master behind its cast], update/split_adamw.py):
    bf16 compute on one rank, where the streamed blocks can have 16-bit host copies (Copies16.possible)."""
    return (
        split_updates(config, on_cuda, deferred)
        and dtype == torch.bfloat16
        and config.world_size == 1
        and config.offload.copies_after_update
    )


def assisted_fraction(config: ZerofitConfig, on_cuda: bool, deferred: bool) -> float:
    """The device's share of the streamed blocks' updates: the configured one, or with split updates and none
    configured, SPLIT_FRACTION (the CPU's share costs less on the forward's path then)."""
    off = config.offload
    if "assisted_fraction" not in off.model_fields_set and split_updates(config, on_cuda, deferred):
        return SPLIT_FRACTION
    return off.assisted_fraction


def device_state(config: ZerofitConfig) -> bool:
    """FULL_SHARD (ZeRO stage 3) on several ranks without offload: every block streams from the GPUs' shards of
    its state ([Note: sharded device state], sharding.py)."""
    return (
        config.world_size > 1
        and config.sharding == "FULL_SHARD"
        and config.offload.param_device == "none"
        and config.activation_checkpointing
    )


def plan_args(config: ZerofitConfig, dtype: torch.dtype, on_cuda: bool, deferred: bool) -> dict:
    """make_plan's arguments that follow from the config and the device: every plan's, the engine's and
    ``zerofit estimate``'s."""
    off = config.offload
    disk = "nvme" in (off.param_device, off.optimizer_device)
    # several ranks: the GPU-resident units' optimizer state is sharded ([Note: sharded device state])
    # (several nodes: a node's ranks share the shards, [Note: nodes hold the state whole], ranks.py)
    per_node = min(config.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size)))
    shards = per_node if config.world_size > 1 and config.sharding != "NO_SHARD" else 1
    on_gpus = device_state(config)
    return dict(
        compute_dtype=dtype,
        on_cuda=on_cuda,
        deferred_updates=deferred,
        shards=shards,
        ranks=config.world_size,
        device_state=on_gpus,
        checkpointing=config.activation_checkpointing,
        stream_params=off.param_device != "none" or on_gpus,
        prefetch_depth=off.prefetch_depth,
        assisted_fraction=assisted_fraction(config, on_cuda, deferred),
        assisted_updates=off.assisted_updates,
        disk=disk,
        disk_budget=free_bytes(off.nvme_path) if disk else None,
        disk_blocks=off.disk_blocks,
        disk_weights=off.disk_weights,
        loss_chunks=off.loss_chunks,
        sequence_tile=off.sequence_tile,
        disk_frozen_blocks=off.disk_frozen_blocks,
        floor=(
            None
            if off.loss_chunks is None and off.offload_checkpoints is None and off.checkpoint_every is None
            else ((off.loss_chunks or 1) > 1, bool(off.offload_checkpoints), False, off.checkpoint_every or 1)
        ),
    )


def placement_args(config: ZerofitConfig, num_blocks: int) -> dict:
    """The first plan's placement settings from the config (no optimizer offload: every unit resident)."""
    off = config.offload
    if device_state(config):
        return dict(resident_blocks=0, shell_on_device=True)
    return dict(
        resident_blocks=num_blocks if off.optimizer_device == "none" else off.resident_blocks,
        shell_on_device={"auto": None, "device": True, "host": False}[off.shell_optimizer],
    )


def placement_kept(plan: Plan) -> dict:
    """make_plan's arguments that keep ``plan``'s placement (resident blocks, shell optimizer, staging, disk tier,
    floor) in a new plan: the engine's replans and ``zerofit estimate``'s plan with 16-bit host copies."""
    return dict(
        resident_blocks=plan.resident_blocks,
        shell_on_device=plan.shell_optimizer_on_device,
        fixed_staging=plan.staging_buffers,
        disk_placement=plan.disk_of,
        disk_frozen_blocks=len(plan.disk_frozen),
        floor=(plan.loss_chunks > 1, plan.offload_checkpoints, bool(plan.stage_numel), plan.checkpoint_every)
        + kept_tile(plan),
        disk_budget=plan.disk_budget,  # measured before the swap file took its share of the disk
        host_share=plan.host_share,
    )  # the nodes' layout ([Note: nodes hold a slice of the state])


def kept_tile(plan: Plan) -> tuple:
    """The floor's tile element of a replan that keeps ``plan``'s MLP tile ([Note: MLP over sequence tiles]):
    none when it has none (the replan may then choose one, for a longer batch)."""
    return (plan.sequence_tile,) if plan.sequence_tile else ()


def plan_batch(config: ZerofitConfig, model, seq_len: int | None) -> BatchShape:
    """The batch the first plan is made for: the config's, with ``seq_len`` (None: the model's context, at most
    2048)."""
    if seq_len is None:
        seq_len = config.seq_len
    if seq_len is None:
        mcfg = getattr(model, "config", None)
        seq_len = min(
            getattr(mcfg, "max_position_embeddings", None) or getattr(mcfg, "n_positions", None) or 2048, 2048
        )
    return BatchShape(config.micro_batch_size, seq_len, config.gradient_accumulation_steps)


def default_host_budget() -> int:
    """The host budget when ``max_host_memory`` is not set: the memory available now, less a tenth (at least
    4 GiB) for what the plan does not count: the CUDA context and libraries' growth, the page cache the
    disk tier and checkpoints pass through, the rest of the machine. A plan of every available byte was
    killed by the kernel's out-of-memory killer on the 13B shape (docs/benchmarks.md)."""
    avail = psutil.virtual_memory().available
    return max(avail - max(avail // 10, 4 << 30), avail // 2)


def gpu_budget(config: ZerofitConfig, device: torch.device | None = None) -> int:
    """The device bytes a plan may take: ``max_gpu_memory`` (at most the GPU's size), less what others (other
    processes, this one's allocations outside the caching allocator) hold on it now."""
    free, total = torch.cuda.mem_get_info(device)
    return min(config.max_gpu_memory or total, total) - (total - free - torch.cuda.memory_reserved())


@dataclasses.dataclass(frozen=True)
class UpdatePolicy:
    """How the host updates of a step run, read from the config once at initialize."""

    deferred: bool
    """every host update waits for the global norm (clipping, fp16's overflow check, the user's loop)"""
    speculate: bool
    """[Note: speculative updates]: clipping without fp16 may update during the backward"""
    known: bool
    """[Note: updates in the backward of the user's loop]: the step's factor is known before its backward"""
    split: bool
    """[Note: moments after the forward]: deferred host updates in two passes"""
    cast_first: bool
    """[Note: the master behind its cast]: the streamed blocks get 16-bit host copies at the first update"""
    cast_early: bool = False
    """[Note: a speculated cast]: the user's loop's clipped steps cast in their backward"""


def update_policy(
    config: ZerofitConfig, dtype: torch.dtype, on_cuda: bool, groups, user_loop: bool, hooked: bool = False
) -> UpdatePolicy:
    """The engine's :class:`UpdatePolicy` for ``config`` and its parameter ``groups``; a warning when the two-pass
    kernel is wanted but could not be built."""
    # clipping and fp16's overflow check need the global norm: every host update waits for it (deferred), as
    # under the user's loop ([Note: the user's loop drives the engine])
    # the hooked mode hands a unit's gradient to the step once per micro-batch: the host sums them, and the updates
    # wait for the step's end ([Note: a unit's call as an autograd function], step/hooked.py)
    deferred = needs_norm(config) or user_loop or hooked
    # [Note: speculative updates] (update/speculation.py): clipping without fp16 may update during the backward
    speculate = (
        not user_loop  # a rollback differs by rounding: [Note: updates in the backward of the user's loop]
        and config.gradient_clipping > 0
        and config.precision != "fp16"
        and config.offload.speculative_updates
        and all(Speculation.usable(*g.optimizer.betas) for g in groups)
    )
    # [Note: updates in the backward of the user's loop]: where its step's factor is known before its backward
    known = (
        user_loop
        and config.gradient_clipping == 0
        and config.precision != "fp16"
        and config.offload.speculative_updates
    )
    # [Note: moments after the forward] (update/split_adamw.py): deferred host updates in two passes
    split = split_updates(config, on_cuda, deferred)
    # [Note: the master behind its cast]: the streamed blocks get 16-bit host copies at the first update
    cast_first = split and cast_copies(config, dtype, on_cuda, deferred)
    if split_wanted(config, on_cuda, deferred) and not split:
        log.warning(
            "zerofit: offload.split_updates: the kernel could not be built (%s); the fused kernel updates in one pass",
            split_adamw.why_unavailable(),
        )
    # [Note: a speculated cast] (update/speculation.py): the clipped user's loop casts in its backward
    cast_early = user_loop and cast_first and config.offload.speculative_updates
    return UpdatePolicy(deferred, speculate, known, split, cast_first, cast_early)


def planner_inputs(
    config: ZerofitConfig, adapter, *, on_cuda: bool, device_budget: int | None, host_budget: int | None
) -> dict:
    """make_plan's keyword arguments for a first plan of ``adapter``'s model under ``config``, within the
    budgets: the one function the engine's first plan and ``zerofit estimate``'s plan are made from."""
    dtype = DTYPES[config.precision]
    return dict(
        device_budget=device_budget,
        host_budget=host_budget,
        chunkable_loss=adapter.chunkable_loss,
        **placement_args(config, adapter.num_blocks),
        **plan_args(config, dtype, on_cuda, needs_norm(config) or adapter.hooked),
    )


def nodes_plan(config: ZerofitConfig, nodes: int, plan_for) -> tuple[str, Plan]:
    """[Note: the nodes' layout]
    On several nodes the planner chooses between the two layouts (docs/ranks.md): ``hybrid`` ([Note: nodes hold
    the state whole], ranks.py) where the whole host state fits each node's host budget, else ``full`` ([Note:
    nodes hold a slice of the state], node_slices.py: each node 1/N of it). ``nodes_layout`` names one (FSDP's
    HYBRID_SHARD and _HYBRID_SHARD_ZERO2 name hybrid, FULL_SHARD and SHARD_GRAD_OP across nodes and DeepSpeed's
    ZeRO stages 1-3 name full; ``zero_hpz_partition_size``, hybrid). Hybrid first, where both fit: it never
    sends weights across the nodes (only the gradients, each node's shards all-reduced), whose bytes equal the
    full layout's for one gather of the weights per use, and every node keeps a whole checkpointable state;
    the full layout's CPU updates and uploads are 1/N of the hybrid's per node, which ``zerofit estimate --nnodes``
    weighs against the bandwidth between the nodes. ``plan_for(share)``: the plan with ``host_share`` ``share``.
    Returns the layout and its plan; one node: ``hybrid`` (the two are the same there)."""
    want = config.nodes_layout
    if nodes <= 1 or want == "hybrid":
        return "hybrid", plan_for(1.0)
    if want == "full":
        return "full", plan_for(1.0 / nodes)
    try:
        return "hybrid", plan_for(1.0)
    except PlanError as whole:
        try:
            plan = plan_for(1.0 / nodes)
        except PlanError:
            raise whole from None
        log.info(
            "zerofit: the whole state does not fit one node's host memory (%s): the full layout, each of the "
            "%d nodes holding 1/%d of it",
            whole,
            nodes,
            nodes,
        )
        return "full", plan


def check_ranks(config: ZerofitConfig, ranks) -> None:
    """What several ranks cannot do yet is refused before anything is allocated."""
    if config.world_size != ranks.world:
        raise ValueError(
            f"the config's world_size is {config.world_size} but {ranks.world} ranks run: build the "
            "config with zerofit.initialize (it reads WORLD_SIZE) or pass world_size="
            f"{ranks.world} to load_config"
        )
    off = config.offload
    if "nvme" in (off.param_device, off.optimizer_device):
        raise ValueError(
            "the NVMe tier runs on one rank for now: with several ranks use offload device 'cpu' "
            "(the host's ranks share one copy of the state in host memory)"
        )


def world_size() -> int:
    """The number of ranks of the process group (made, or described by torchrun's environment, or by srun's:
    [Note: srun is a launcher too], slurm.py)."""
    import torch.distributed as dist

    from zerofit.engine.distributed import slurm

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    slurm.adopt()
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---------------------------------------------------------------------------------------------- the part


class Planning:
    """The engine's plan (a part). ``plan``: the placement every buffer was allocated for; ``batch_plan``: its
    prediction for the batch actually trained (checked before the first step of each new shape, PlanError before
    anything of that step is allocated); ``host16``: whether the plan counts 16-bit host copies of the streamed
    blocks; ``chunk_loss_ok``: whether the model's head and loss run over token chunks (probed at start-up)."""

    def __init__(
        self,
        config: ZerofitConfig,
        adapter: Adapter,
        shape: ModelShape,
        *,
        on_cuda: bool,
        device: torch.device,
        ranks: Ranks,
        seq_len: int | None,
        window_room: int = 1,
    ) -> None:
        self.config, self.shape, self.on_cuda = config, shape, on_cuda
        self.plan_batch = plan_batch(config, adapter.model, seq_len)
        # [Note: a device budget on the CPU] (search.py): max_gpu_memory bounds the CPU's "device" as a GPU's
        dev_budget = gpu_budget(config, device) if on_cuda else config.max_gpu_memory
        host_budget = config.max_host_memory or default_host_budget()
        if ranks.many:  # every rank must make the same plan: the collectives follow the units' homes
            budgets = ranks.objects((dev_budget, host_budget))
            dev_budget = None if dev_budget is None else min(b[0] for b in budgets)
            host_budget = budgets[0][1]
        inputs = planner_inputs(config, adapter, on_cuda=on_cuda, device_budget=dev_budget, host_budget=host_budget)
        # [Note: the nodes' layout]: hybrid or full on several nodes (the engine hands it to its ranks)
        self.layout, self.plan = nodes_plan(
            config, ranks.nodes, lambda share: make_plan(shape, self.plan_batch, **(inputs | dict(host_share=share)))
        )
        if window_room > 1 and self.plan.weight_slots:
            self._make_room(window_room, inputs)
        self.batch_plan: Plan | None = None
        self.checked_shape: tuple | None = None
        self.host16 = False
        self.chunk_loss_ok = False
        self.held = 1  # the user's loop: micro-batches its window holds (learnt: Planning.hold_for)

    def _make_room(self, n: int, inputs: dict) -> None:
        """[Note: room for a learnt window]
        The user's loop with the default window learns the loop's G at its first step and then holds that many
        micro-batches' block checkpoints until their blocks' backward ([Note: the window learns the loop's G],
        userloop), within the placement made here. A plan for one micro-batch fills the GPU with resident blocks
        and leaves no room for them: a 3B model's loop of 4 micro-batches at a 24 GiB cap kept 3 resident blocks
        and ran one micro-batch's backward at a time, several times slower per step than with a window of 4
        planned (docs/benchmarks.md, the user's own loop).
        So where blocks stream anyway, the plan is made for ``n`` micro-batches' checkpoints (LEARN_WINDOW): a
        resident block or two fewer, each costing its upload per pass, where the window saves whole passes. Only
        where that plan needs nothing slower than the one-micro-batch plan (the same loss chunks, checkpoints on
        the device as there, every block's kept); else the one-micro-batch plan stands. A loop of one micro-batch
        per step pays those blocks' uploads."""
        b, p = self.plan_batch, self.plan
        room = BatchShape(b.micro_batch, b.seq_len, max(n, b.grad_accum))
        try:
            plan = make_plan(self.shape, room, **(inputs | dict(host_share=p.host_share)))
        except PlanError:
            return
        slower = ("loss_chunks", "offload_checkpoints", "checkpoint_every", "stage_numel", "sequence_tile")
        if any(getattr(plan, k) != getattr(p, k) for k in slower):
            return
        self.plan, self.plan_batch = plan, room

    @property
    def current(self) -> Plan:
        """The plan the step in progress follows: the one for the batch trained, once there is one."""
        return self.batch_plan if self.batch_plan is not None else self.plan

    def replan(self, batch: BatchShape, **changes) -> Plan:
        """A plan for ``batch`` with the current placement kept (resident blocks, shell optimizer, staging);
        the disk's speed, measured on the swap file once, stays with it."""
        args = plan_args(self.config, DTYPES[self.config.precision], self.on_cuda, needs_norm(self.config)) | dict(
            device_budget=self.plan.device_budget,
            host_budget=self.plan.host_budget,
            **placement_kept(self.plan),
            host16=self.host16,
        )
        plan = make_plan(self.shape, batch, **(args | changes))
        return dataclasses.replace(plan, disk_speed=self.plan.disk_speed)

    def adopt_host16(self, **changes) -> None:
        """The plan with 16-bit host copies of the streamed blocks ([Note: 16-bit copies for extra forwards],
        copies16.py), adopted; PlanError (the plan unchanged) where they do not fit."""
        self.plan = self.replan(self.plan_batch, host16=True, **changes)
        self.host16 = True

    def ensure(self, micro_batches: list[dict]) -> None:
        """Check the plan against the real batch shape before the first step allocates activations."""
        ids = micro_batches[0].get("input_ids")
        if ids is None or self.checked_shape == tuple(ids.shape):
            return
        batch = BatchShape(
            ids.shape[0], ids.shape[-1], max(len(micro_batches), self.config.gradient_accumulation_steps, self.held)
        )
        try:
            check = self.replan(batch)  # PlanError before anything of this step is allocated
        except PlanError as e:
            if (batch.micro_batch, batch.seq_len) == (self.plan_batch.micro_batch, self.plan_batch.seq_len):
                raise
            p = self.plan_batch
            raise PlanError(
                f"this micro-batch ({batch.micro_batch} x {batch.seq_len} tokens) does not fit the placement made at "
                f"start-up for micro-batches of {p.micro_batch} x {p.seq_len} tokens (its resident blocks and "
                f"staging are kept once made); give the batch at start-up (micro_batch_size: {batch.micro_batch}, "
                f"seq_len: {batch.seq_len} in the zerofit config; zerofit.fsdp's wrappers take it as "
                f"zerofit_config=) and the placement is made for it. The replan for the kept placement: {e}"
            ) from None
        self.checked_shape = tuple(ids.shape)
        self.plan_batch = batch
        self.batch_plan = check

    def hold_for(self, G: int) -> None:
        """The user's loop's window will hold ``G`` micro-batches (their checkpoints until the step's blocks
        backward): the plan for the batch checked so far, with them; PlanError (nothing changed) if they do not
        fit the kept placement."""
        b = self.plan_batch
        batch = BatchShape(b.micro_batch, b.seq_len, max(G, b.grad_accum))
        check = self.replan(batch)
        self.plan_batch, self.batch_plan, self.held = batch, check, G

    def checkpoint_args(self, streaming: bool) -> dict:
        """How a training forward keeps its block checkpoints, as the plan for the batch says ([Note: offloaded
        checkpoints], activations.py; [Note: checkpoints every k blocks], schedule.py): train_batch, and the
        DeepSpeed-shaped loop's window, whose blocks' backward waits for the boundary with every micro-batch's
        checkpoints kept until then."""
        plan = self.current
        return dict(
            offload=plan.offload_checkpoints and streaming,
            every=plan.checkpoint_every if streaming else 1,
            ahead=plan.checkpoint_ahead,
        )

    def loss_chunks(self, streaming: bool) -> int:
        """The token chunks the step in progress computes the head and loss over ([Note: a smaller GPU floor])."""
        return self.current.loss_chunks if streaming and self.chunk_loss_ok else 1

    def probed_chunked_loss(self, ok: bool) -> None:
        """Whether the model's head and loss ran on a chunk of the final hidden state (Schedule.chunked_loss_works);
        if not, the plan is made again without loss chunks, before step 0 (refused if the device cannot hold the
        whole logits)."""
        self.chunk_loss_ok = ok
        if not ok:
            self._without_loss_chunks()

    def _without_loss_chunks(self) -> None:
        p = self.plan
        self.plan = self.replan(
            self.plan_batch, floor=(False, True, bool(p.stage_numel), p.checkpoint_every) + kept_tile(p)
        )
        log.info("zerofit: re-planned without loss chunks:\n%s", self.plan.describe())

    def measured_disk(self, write: float, read: float) -> None:
        """The disk tier's speed, measured on its swap file, is part of the plan (its description shows it)."""
        self.plan = dataclasses.replace(self.plan, disk_speed=(write, read))

    def disk_speed(self, tier: DiskTier | None) -> dict:
        """The disk tier's write and read speed measured on its swap file at initialize ({} without a tier)."""
        if tier is None:
            return {}
        assert self.plan.disk_speed is not None  # measured on its swap file when the tier was opened
        w, r = self.plan.disk_speed
        return {"write_gb_per_s": w, "read_gb_per_s": r, "direct_io": tier.file.direct}

    def open_tier(self, deferred: bool) -> DiskTier | None:
        """The disk tier the plan asks for: its file reserved under ``offload.nvme_path`` and its speed measured
        (preflight: a path that cannot hold it fails here, before anything else is allocated)."""
        plan = self.plan
        if not plan.disk_blocks and not plan.disk_frozen:
            return None
        # [Note: frozen parameters] (store.py): the tier holds the trained state of the last blocks (of a LoRA model,
        # their adapters'), and the frozen 16-bit weights of the plan's disk_frozen blocks ([Note: a frozen base on
        # the disk], disk.py): the rest of the frozen weights stays in host memory, which the planner counts
        off = self.config.offload
        grad = ("grad",) if deferred else ()  # [Note: gradients on the disk], step/optimizer_step.py
        cb = torch.empty((), dtype=DTYPES[self.config.precision]).element_size()
        frozen: list[tuple[int, int, tuple[str, ...]]] = [
            (frozen_key(i), -(-self.shape.frozen_host_bytes(cb, [i + 1]) // 4), ("w16",)) for i in plan.disk_frozen
        ]
        regions, nbytes = disk_layout(
            [(i, self.shape.block_numels[i], DISK_FIELDS[m] + grad) for i, m in plan.disk_blocks] + frozen
        )
        assert off.nvme_path is not None  # a device "nvme" needs it (config/schema.py); only then is disk planned
        file = SwapFile(off.nvme_path, nbytes, threads=off.nvme_queue_depth, block_bytes=off.nvme_block_size)
        try:
            w, r = file.measure()
            mb = max(list(self.shape.block_numels) + [n for _, n, _ in frozen])
            tier = DiskTier(file, regions, tier_chunk(mb), tier_buffers(mb, TIER_BUFFERS))
        except BaseException:
            file.close()
            raise
        self.measured_disk(w, r)
        log.info(
            "zerofit: NVMe tier: %s, %s reserved%s; measured there: write %.2f GB/s, read %.2f GB/s",
            file.path,
            fmt_bytes(file.nbytes),
            "" if file.direct else " (O_DIRECT refused by this file system: buffered I/O)",
            w,
            r,
        )
        if not file.direct:
            log.warning(
                "zerofit: %s does not accept O_DIRECT: the disk tier uses buffered I/O (the page cache "
                "takes host memory and the speed differs)",
                file.path,
            )
        if file.reused:
            log.info("zerofit: reused the swap file a previous run left in %s", file.folder)
        return tier

    def log_placement(self, num_blocks: int, on_cuda: bool, device) -> None:
        """Say where the optimizer state is under the plan, and where that is not what the config asked for."""
        off = self.config.offload
        log.info(
            "zerofit %s", self.plan.optimizer_homes(num_blocks, "the GPU" if on_cuda else f"the device ({device})")
        )
        for warning in placement_warnings(
            self.plan, num_blocks, optimizer_device=off.optimizer_device, param_device=off.param_device, on_cuda=on_cuda
        ):
            log.warning("zerofit: %s", warning)
