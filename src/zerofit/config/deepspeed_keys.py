"""The DeepSpeed keys zerofit knows: each key's type and what it means to zerofit.

Every key is **honoured** (same meaning, copied to the zerofit field named in
its note), **mapped** (translated onto zerofit's own mechanism) or
**not-applicable** (zerofit decides it itself; the value is still type-checked).
:mod:`zerofit.config.deepspeed` walks a user's config against these tables.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

DEEPSPEED_VERSION = "0.19.8"
"""the DeepSpeed release whose defaults a key absent from a DeepSpeed config takes (``Key.default``)"""

Status = Literal["honoured", "mapped", "not-applicable"]
HONOURED: Status = "honoured"
MAPPED: Status = "mapped"
NA: Status = "not-applicable"


@dataclass(frozen=True)
class KeyReport:
    """What zerofit did with one DeepSpeed key."""

    key: str
    """dotted path as written in the config, e.g. ``zero_optimization.overlap_comm``"""
    status: Status
    """honoured (same meaning), mapped (translated) or not-applicable (zerofit decides)"""
    note: str = ""
    """what it became, or why it does not apply"""

    def __str__(self) -> str:
        return f"{self.key} [{self.status}]" + (f": {self.note}" if self.note else "")


# ----------------------------------------------------------------------------
# Value kinds: each checks one JSON value and returns it normalised
# ----------------------------------------------------------------------------


class BadValue(Exception):
    """A value does not fit its kind (turned into ConfigError by the walker, which knows the path)."""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int | None = None
    nullable: bool = False

    @property
    def expected(self) -> str:
        rng = f">= {self.lo}" if self.hi is None else f"in [{self.lo}, {self.hi}]"
        return f"an integer {rng}" + (" or null" if self.nullable else "")

    def check(self, v: Any) -> Any:
        if v is None and self.nullable:
            return None
        # JSON writes big counts as 5e8: accept floats with no fractional part.
        if not _is_number(v) or (isinstance(v, float) and not v.is_integer()):
            raise BadValue
        v = int(v)
        if v < self.lo or (self.hi is not None and v > self.hi):
            raise BadValue
        return v


@dataclass(frozen=True)
class Float:
    lo: float = 0.0
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    @property
    def expected(self) -> str:
        lo = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        hi = "" if self.hi is None else f" and {'<' if self.hi_open else '<='} {self.hi:g}"
        return f"a number {lo}{hi}"

    def check(self, v: Any) -> Any:
        if not _is_number(v):
            raise BadValue
        if (
            v < self.lo
            or (self.lo_open and v == self.lo)
            or (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))
        ):
            raise BadValue
        return float(v)


@dataclass(frozen=True)
class Bool:
    nullable: bool = False
    expected = "true or false"

    def check(self, v: Any) -> Any:
        if isinstance(v, bool) or (v is None and self.nullable):
            return v
        raise BadValue


@dataclass(frozen=True)
class Choice:
    values: tuple[Any, ...]
    fold_case: bool = False

    @property
    def expected(self) -> str:
        return "one of " + ", ".join(repr(x) for x in self.values)

    def check(self, v: Any) -> Any:
        for x in self.values:
            if v == x and type(v) is type(x):
                return x
            if self.fold_case and isinstance(v, str) and isinstance(x, str) and v.lower() == x.lower():
                return x
        raise BadValue


@dataclass(frozen=True)
class Text:
    nullable: bool = False

    @property
    def expected(self) -> str:
        return "a string" + (" or null" if self.nullable else "")

    def check(self, v: Any) -> Any:
        if isinstance(v, str) or (v is None and self.nullable):
            return v
        raise BadValue


@dataclass(frozen=True)
class Betas:
    expected = "a list of two numbers, each in [0, 1)"

    def check(self, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(b) and 0 <= b < 1 for b in v):
            return (float(v[0]), float(v[1]))
        raise BadValue


@dataclass(frozen=True)
class Anything:
    expected = "any JSON value"

    def check(self, v: Any) -> Any:
        return v


_Kind = Int | Float | Bool | Choice | Text | Betas | Anything


class _NoDefault:
    """``Key.default`` when zerofit has no use for DeepSpeed's default (the key is not-applicable)."""

    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()


# ----------------------------------------------------------------------------
# The key table
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One DeepSpeed leaf key."""

    kind: _Kind
    status: Status
    note: str = ""
    auto: bool = False
    """``"auto"`` accepted (resolved by :func:`translate`)"""
    aliases: tuple[str, ...] = ()
    """other spellings DeepSpeed accepts (its pydantic field names vs. aliases)"""
    hint: str = ""
    """what to do when the value is refused"""
    default: Any = NO_DEFAULT
    """DeepSpeed's default (:data:`DEEPSPEED_VERSION`): what an absent key means, and what zerofit takes then.
    Set for every key zerofit honours or maps; ``tests/unit/test_deepspeed_defaults.py`` compares each one with
    DeepSpeed's own source"""


@dataclass(frozen=True)
class Section:
    """A DeepSpeed object. ``keys=None``: its contents are not checked (a feature zerofit does not use)."""

    keys: Mapping[str, Key | Section] | None
    status: Status = NA
    note: str = ""
    aliases: tuple[str, ...] = ()
    nullable: bool = False


_BUCKETS = "zerofit sizes its transfers per block; no communication buckets"
PLANNER_DECIDES = "zerofit's planner decides from the model's block sizes and the memory budgets"
_COMM = (
    "zerofit decides its own communication schedule: with several ranks each block's weights are "
    "all-gathered from the ranks' shards and its gradient reduce-scattered, once per block, on process groups "
    "of their own (docs/ranks.md)"
)
_MONITOR = "zerofit logs to its own timeline; metric sinks are configured outside the training config"


def _na(kind: _Kind, note: str, **kw: Any) -> Key:
    return Key(kind, NA, note, **kw)


_NVME = (
    "'nvme': the disk tier holds the optimizer state that max_host_memory cannot (moments first, then master weights)"
)
_OFFLOAD_OPTIMIZER = Section(
    {
        "device": Key(
            Choice(("none", "cpu", "nvme")),
            MAPPED,
            "-> offload.optimizer_device: where the planner may put optimizer state; a block's state stays "
            "where its weights are (on the GPU without offload_param, or for blocks the planner keeps "
            f"there); {_NVME}; the engine logs the placement after planning",
            default="none",
        ),
        "nvme_path": Key(
            Text(nullable=True), MAPPED, "-> offload.nvme_path: the folder of the disk tier's swap file", default=None
        ),
        "pin_memory": Key(Bool(), HONOURED, "-> offload.pin_memory (one setting for all host buffers)", default=True),
        "buffer_count": _na(Int(0), "zerofit sizes its own staging buffers"),
        "pipeline_read": _na(Bool(), "the disk tier always reads ahead of each update, overlapped with compute"),
        "pipeline_write": _na(Bool(), "the disk tier always writes behind each update, overlapped with compute"),
        "pipeline": _na(Bool(), "the disk tier always overlaps its reads and writes with compute"),
        "fast_init": _na(Bool(), "the disk tier reserves its file at once (fallocate) and writes only master weights"),
        "ratio": _na(Float(0, 1), "the planner decides which optimizer state stays on the GPU"),
        "super_offload": _na(Bool(), "zerofit's CPU optimizer is its own"),
        "convert_grad_on_cpu": _na(Bool(), "zerofit decides where gradients are converted"),
        "cpuadam_cores_perc": _na(Float(0, 1), "zerofit sizes its CPU optimizer worker itself"),
    },
    nullable=True,
)

_OFFLOAD_PARAM = Section(
    {
        "device": Key(
            Choice(("none", "cpu", "nvme")),
            MAPPED,
            "-> offload.param_device: 'none' keeps every block on the GPU; 'cpu' streams blocks from host "
            f"memory, except those the planner keeps on the GPU while they fit; {_NVME}",
            default="none",
        ),
        "nvme_path": Key(
            Text(nullable=True), MAPPED, "-> offload.nvme_path: the folder of the disk tier's swap file", default=None
        ),
        "pin_memory": Key(Bool(), HONOURED, "-> offload.pin_memory (one setting for all host buffers)", default=True),
        "buffer_count": _na(Int(0), "zerofit sizes its own staging buffers"),
        "buffer_size": _na(Int(0), "zerofit sizes its own staging buffers", auto=True),
        "max_in_cpu": _na(Int(0), "bounded by max_host_memory instead"),
    },
    nullable=True,
)

_ZERO = Section(
    {
        "stage": Key(
            Choice((0, 1, 2, 3)),
            MAPPED,
            "-> sharding (3 FULL_SHARD, 2 SHARD_GRAD_OP, 0/1 NO_SHARD). zerofit streams whole blocks; where "
            "weights and optimizer state live follows offload_param and offload_optimizer; with several ranks "
            "the offloaded state is sharded 1/N and held once per host whatever the stage, and units kept on "
            "the GPUs with their optimizer are replicated (docs/ranks.md)",
            default=0,
        ),
        "offload_optimizer": _OFFLOAD_OPTIMIZER,
        "offload_param": _OFFLOAD_PARAM,
        "cpu_offload": Key(Bool(nullable=True), MAPPED, "deprecated; true -> offload_optimizer.device cpu"),
        "cpu_offload_param": Key(Bool(nullable=True), MAPPED, "deprecated; true -> offload_param.device cpu"),
        "cpu_offload_use_pin_memory": Key(Bool(nullable=True), MAPPED, "deprecated; -> offload.pin_memory"),
        "stage3_prefetch_bucket_size": Key(
            Int(0),
            MAPPED,
            "elements fetched ahead -> offload.prefetch_depth (blocks), " + PLANNER_DECIDES,
            auto=True,
            aliases=("prefetch_bucket_size",),
        ),
        "stage3_max_live_parameters": Key(
            Int(0),
            MAPPED,
            "resident parameters -> bounded by max_gpu_memory; " + PLANNER_DECIDES,
            auto=True,
            aliases=("max_live_parameters",),
        ),
        "stage3_param_persistence_threshold": _na(
            Int(0), PLANNER_DECIDES, auto=True, aliases=("param_persistence_threshold",)
        ),
        "stage3_model_persistence_threshold": _na(
            Int(0), PLANNER_DECIDES, auto=True, aliases=("model_persistence_threshold",)
        ),
        "stage3_max_reuse_distance": _na(Int(0), PLANNER_DECIDES, auto=True, aliases=("max_reuse_distance",)),
        "stage3_gather_16bit_weights_on_model_save": _na(
            Bool(),
            "zerofit's checkpoints always hold whole tensors",
            auto=True,
            aliases=("gather_16bit_weights_on_model_save",),
        ),
        "stage3_gather_fp16_weights_on_model_save": _na(Bool(), "deprecated; zerofit's checkpoints hold whole tensors"),
        "stage3_module_granularity_threshold": _na(
            Int(0), "zerofit fetches whole blocks", aliases=("module_granularity_threshold",)
        ),
        "stage3_use_all_reduce_for_fetch_params": _na(Bool(), _COMM, aliases=("use_all_reduce_for_fetch_params",)),
        "stage3_allgather_sequential": _na(Bool(), _COMM, aliases=("allgather_sequential",)),
        "stage3_partition_stream_chunk_size": _na(Int(0), _BUCKETS, aliases=("partition_stream_chunk_size",)),
        "sub_group_size": _na(Int(0), "zerofit's optimizer steps one block at a time", auto=True),
        "contiguous_gradients": _na(Bool(), "zerofit keeps each block's gradients in one flat buffer"),
        "parameter_alignment": _na(Bool(), "zerofit keeps each block's parameters in one flat buffer"),
        "compute_grad_norm": _na(
            Bool(),
            "zerofit computes the global gradient norm where a step needs it (clipping, "
            "fp16): engine.get_global_grad_norm() is None otherwise",
        ),
        "overlap_comm": _na(Bool(nullable=True), _COMM),
        "reduce_scatter": _na(Bool(), _COMM),
        "reduce_bucket_size": _na(Int(0), _BUCKETS, auto=True),
        "allgather_partitions": _na(Bool(), _COMM),
        "allgather_bucket_size": _na(Int(0), _BUCKETS, auto=True),
        "use_multi_rank_bucket_allreduce": _na(Bool(), _COMM),
        "round_robin_gradients": _na(Bool(), _COMM),
        "load_from_fp32_weights": _na(Bool(), "zerofit always restores the fp32 master weights from its checkpoint"),
        "elastic_checkpoint": _na(Bool(), "zerofit's checkpoints are its own"),
        "ignore_unused_parameters": _na(Bool(), "parameters without gradients are skipped by zerofit's optimizer"),
        "legacy_stage1": _na(Bool(), "no ZeRO stages in zerofit"),
        "zero_hpz_partition_size": Key(
            Int(0),
            MAPPED,
            "> 1 (the GPUs of a node) -> nodes_layout hybrid: on several "
            "nodes each node holds the whole state and gathers the weights inside itself; "
            "without it ZeRO stages 1-3 -> nodes_layout full (docs/ranks.md)",
            default=1,
        ),
        "zero_quantized_weights": _na(Bool(), "zerofit moves weights at full 16-bit precision"),
        "zero_quantized_nontrainable_weights": _na(Bool(), "zerofit moves weights at full 16-bit precision"),
        "zero_quantized_gradients": _na(Bool(), "zerofit moves gradients at full precision"),
        "zeropp_loco_param": _na(Anything(), "zerofit moves gradients at full precision"),
        "mics_shard_size": _na(Int(-1), "zerofit does not use MiCS sharding"),
        "mics_hierarchical_params_gather": _na(Bool(), "zerofit does not use MiCS sharding"),
        "memory_efficient_linear": _na(Bool(), "zerofit does not replace the model's modules"),
        "pipeline_loading_checkpoint": _na(Bool(), "zerofit's checkpoints are its own"),
        "override_module_apply": _na(Bool(), "zerofit does not patch the model"),
        "log_trace_cache_warnings": _na(Bool(), "zerofit does not trace parameter order"),
        "enable_sanity_checks": _na(Bool(), "zerofit's checks are always on"),
        "save_muon_momentum_buffer_in_memory": _na(Bool(), "zerofit implements AdamW only"),
        "leaf_module": Section(None, NA, "zerofit fetches whole blocks"),
        "zenflow": Section(None, NA, "zerofit's optimizer updates are always synchronous", nullable=True),
    }
)

_FP16 = Section(
    {
        "enabled": Key(Bool(), HONOURED, "true -> precision fp16", auto=True, default=False),
        "loss_scale": Key(Float(0), HONOURED, "-> fp16.loss_scale (0 = dynamic)", default=0),
        "initial_scale_power": Key(Int(0, 64), HONOURED, "-> fp16.initial_scale_power", default=16),
        "loss_scale_window": Key(Int(1), HONOURED, "-> fp16.loss_scale_window", default=1000),
        "hysteresis": Key(Int(1), HONOURED, "-> fp16.hysteresis", default=2),
        "consecutive_hysteresis": Key(Bool(), HONOURED, "-> fp16.consecutive_hysteresis", default=False),
        "min_loss_scale": Key(Float(0, lo_open=True), HONOURED, "-> fp16.min_loss_scale", default=1),
        "auto_cast": _na(Bool(), "zerofit runs the model's forward in the compute dtype itself"),
        "fused_mode": _na(Bool(), "zerofit has one fp16 optimizer path"),
        "fp16_master_weights_and_grads": _na(Bool(), "zerofit always keeps fp32 master weights"),
    }
)

_BF16 = Section(
    {
        "enabled": Key(Bool(), HONOURED, "true -> precision bf16", auto=True, default=False),
        "immediate_grad_update": _na(Bool(), "zerofit decides when gradients are applied"),
        "check_grad_overflow": _na(
            Bool(),
            "zerofit skips no bf16 step: where it computes the gradient norm "
            "(gradient_clipping > 0) a non-finite norm stops the step with "
            "FloatingPointError, where DeepSpeed (default true) skips the step",
        ),
        "bf16_master_weights_and_grads": _na(Bool(), "zerofit always keeps fp32 master weights"),
        "bf16_optimizer_states": _na(Bool(), "zerofit always keeps fp32 optimizer state"),
    },
    aliases=("bfloat16",),
)

_ACT_NOTE = "zerofit checkpoints every block itself (activation_checkpointing=true)"
_ACT = Section(
    {
        "partition_activations": _na(Bool(), _ACT_NOTE),
        "cpu_checkpointing": _na(Bool(), _ACT_NOTE),
        "contiguous_memory_optimization": _na(Bool(), _ACT_NOTE),
        "number_checkpoints": _na(Int(0, nullable=True), _ACT_NOTE),
        "synchronize_checkpoint_boundary": _na(Bool(), _ACT_NOTE),
        "profile": _na(Bool(), _ACT_NOTE),
    }
)

_AIO_NOTE = "the disk tier does plain preadv/pwritev on O_DIRECT from a thread pool (no libaio)"
_AIO = Section(
    {
        "block_size": Key(
            Int(1),
            MAPPED,
            "-> offload.nvme_block_size, bytes per disk request (rounded up to 4 KiB); "
            "absent: zerofit's 4 MiB, not DeepSpeed's 1 MiB (sized for libaio; no effect "
            "on the math)",
            default=1048576,
        ),
        "queue_depth": Key(
            Int(1),
            MAPPED,
            "-> offload.nvme_queue_depth = queue_depth x intra_op_parallelism requests "
            "in flight (threads of the disk tier's pool)",
            default=8,
        ),
        "intra_op_parallelism": Key(
            Int(1), MAPPED, "-> offload.nvme_queue_depth = queue_depth x intra_op_parallelism", default=1
        ),
        "thread_count": Key(
            Int(1),
            MAPPED,
            "older DeepSpeed's name of intra_op_parallelism (DeepSpeed 0.19.8 ignores "
            "it): read as intra_op_parallelism when that is absent",
        ),
        "single_submit": _na(Bool(), _AIO_NOTE),
        "overlap_events": _na(Bool(), _AIO_NOTE),
        "use_gds": _na(Bool(), _AIO_NOTE),
    }
)


def _monitor(*keys: str) -> Section:
    return Section({"enabled": _na(Bool(), _MONITOR), **{k: _na(Text(nullable=True), _MONITOR) for k in keys}})


_CKPT_NOTE = "zerofit's checkpoints are written and verified by its own checkpointer"
_FLOPS_NOTE = "zerofit's timeline (wall_clock_breakdown) reports compute and transfers"

DEEPSPEED_KEYS: dict[str, Key | Section] = {
    # batch, clipping, logging
    "train_batch_size": Key(
        Int(1), HONOURED, "-> train_batch_size; absent: derived from the other two", auto=True, default=None
    ),
    "train_micro_batch_size_per_gpu": Key(
        Int(1),
        HONOURED,
        "-> micro_batch_size; absent: derived from the other "
        "two (with neither it nor train_batch_size, where DeepSpeed stops, 1)",
        auto=True,
        default=None,
    ),
    "gradient_accumulation_steps": Key(
        Int(1),
        HONOURED,
        "-> gradient_accumulation_steps; absent: derived (1 when train_batch_size or the micro batch is missing too)",
        auto=True,
        default=None,
    ),
    "gradient_clipping": Key(Float(0), HONOURED, "-> gradient_clipping (0: off)", auto=True, default=1.0),
    "steps_per_print": Key(
        Int(1, nullable=True), HONOURED, "-> steps_per_print (engine.steps_per_print())", default=None
    ),
    "wall_clock_breakdown": Key(Bool(), HONOURED, "-> wall_clock_breakdown", default=False),
    "managed_gradient_accumulation": Key(
        Bool(),
        HONOURED,
        "-> managed_gradient_accumulation: false makes every "
        "engine.step() the accumulation boundary (the caller's), as DeepSpeed does",
        default=True,
    ),
    "disable_python_gc": _na(Bool(), "zerofit leaves Python's garbage collector as it is"),
    # optimizer and schedule; their params are checked per type (ADAM_PARAMS, SCHEDULER_PARAMS)
    "optimizer": Section(
        {
            "type": Key(Text(), HONOURED, "Adam/AdamW -> zerofit's AdamW"),
            "params": Section(None, HONOURED),
            "legacy_fusion": _na(Bool(), "zerofit has one AdamW implementation"),
        }
    ),
    "scheduler": Section(
        {
            "type": Key(Text(), HONOURED, "-> scheduler.type, with DeepSpeed's formulas"),
            "params": Section(None, HONOURED),
        }
    ),
    # precision
    "fp16": _FP16,
    "bf16": _BF16,
    "amp": Section(None, NA, "apex AMP is not used; zerofit's precision comes from fp16/bf16"),
    "torch_autocast": Section(None, NA, "zerofit's compute dtype comes from fp16/bf16"),
    "data_types": Section(
        {
            "grad_accum_dtype": _na(Choice(("fp32", "fp16", "bf16", None)), "zerofit accumulates gradients in fp32"),
            "param_dtype": _na(Choice(("fp32", "fp16", "bf16", None)), "zerofit's compute dtype comes from fp16/bf16"),
            "buffer_dtype": _na(Choice(("fp32", "fp16", "bf16", None)), "zerofit leaves buffers as loaded"),
            "keep_in_fp32_modules": _na(Anything(), "zerofit leaves buffers as loaded"),
        }
    ),
    "communication_data_type": _na(Choice(("fp32", "fp16", "bf16", None)), _COMM),
    "seq_parallel_communication_data_type": _na(Choice(("fp32", "fp16", "bf16")), _COMM),
    # ZeRO and offload
    "zero_optimization": _ZERO,
    "zero_allow_untested_optimizer": _na(Bool(), "zerofit implements AdamW only"),
    "zero_force_ds_cpu_optimizer": _na(Bool(), "zerofit's CPU optimizer is its own"),
    "aio": _AIO,
    "activation_checkpointing": _ACT,
    # communication
    "prescale_gradients": _na(Bool(), _COMM),
    "gradient_predivide_factor": _na(Float(0, lo_open=True), _COMM),
    "gradient_allreduce_op": _na(Choice(("avg", "sum"), fold_case=True), "zerofit averages gradients over ranks"),
    "sparse_gradients": _na(Bool(), "zerofit reduces dense gradients"),
    "disable_allgather": _na(Bool(), _COMM),
    "comms_logger": Section(None, NA, _MONITOR),
    # monitoring and profiling
    "tensorboard": _monitor("output_path", "job_name"),
    "wandb": _monitor("group", "team", "project"),
    "csv_monitor": _monitor("output_path", "job_name"),
    "comet": Section(None, NA, _MONITOR),
    "flops_profiler": Section(
        {
            "enabled": _na(Bool(), _FLOPS_NOTE),
            "recompute_fwd_factor": _na(Float(0), _FLOPS_NOTE),
            "profile_step": _na(Int(0), _FLOPS_NOTE),
            "module_depth": _na(Int(-1), _FLOPS_NOTE),
            "top_modules": _na(Int(0), _FLOPS_NOTE),
            "detailed": _na(Bool(), _FLOPS_NOTE),
            "output_file": _na(Text(nullable=True), _FLOPS_NOTE),
        }
    ),
    "timers": Section(None, NA, _FLOPS_NOTE),
    "memory_breakdown": _na(Bool(), "zerofit's planner prints its memory prediction at start-up"),
    "dump_state": _na(Bool(), "zerofit prints its resolved config at start-up"),
    "log_level": _na(Text(), "zerofit logs through Python's logging"),
    # checkpointing
    "checkpoint": Section(
        {
            "tag_validation": Key(
                Choice(("Ignore", "Warn", "Fail"), fold_case=True),
                HONOURED,
                "DeepSpeed checks that every rank saves under the same tag; on one process a tag is "
                "always consistent, so no value changes anything (with several ranks zerofit writes "
                "rank 0's tag)",
                default="Warn",
            ),
            "load_universal": _na(Bool(), "zerofit's checkpoints load under any placement already"),
            "use_node_local_storage": _na(Bool(), _CKPT_NOTE),
            "parallel_write": Section({"pipeline_stage": _na(Bool(), _CKPT_NOTE)}),
            "checkpoint_serialization": _na(Bool(), _CKPT_NOTE),
            "writer": Section(None, NA, _CKPT_NOTE, nullable=True),
        }
    ),
    "nebula": Section(None, NA, "zerofit's checkpoints are written by its own checkpointer"),
    "datastates": Section(None, NA, "zerofit's checkpoints are written by its own checkpointer"),
    # data loading
    "dataloader_drop_last": Key(
        Bool(),
        NA,
        "the engine takes batches, not a loader; "
        "zerofit.deepspeed.initialize(training_data=...) reads it for the loader it builds",
        default=False,
    ),
    "vocabulary_size": _na(Int(1, nullable=True), "DeepSpeed only used it for a warning"),
    # parallelism zerofit decides (data parallel only)
    "sequence_parallel_size": _na(Int(1), "zerofit is data-parallel only"),
    "use_data_before_expert_parallelism": _na(Bool(), "zerofit is data-parallel only"),
    "pipeline": Section(None, NA, "zerofit is data-parallel only; pipeline settings apply to PipelineModule"),
    "tensor_parallel": Section(None, NA, "zerofit is data-parallel only"),
    "expert_parallel": Section(None, NA, "zerofit is data-parallel only"),
    "hybrid_engine": Section(None, NA, "zerofit has no inference hybrid engine"),
    "compile": Section(None, NA, "zerofit compiles what it chooses itself"),
    "graph_harvesting": _na(Bool(), "zerofit does not capture CUDA graphs"),
    "autotuning": Section(None, NA, "zerofit's planner chooses placement and prefetch instead"),
    "weight_quantization": Section(None, NA, "zerofit keeps weights in the compute dtype"),
    "compression_training": Section(None, NA, "zerofit does not compress models during training"),
    "eigenvalue": Section(None, NA, "zerofit does not compute eigenvalues"),
    # refused when enabled: ignoring them would change the math (see REFUSED_WHEN_ENABLED)
    "elasticity": Section(None, NA, "elastic batch sizes are not used (the section is disabled)"),
    "curriculum_learning": Section(None, NA, "curriculum learning is not used (the section is disabled)"),
    "data_efficiency": Section(None, NA, "data efficiency is not used (the section is disabled)"),
    "progressive_layer_drop": Section(None, NA, "progressive layer drop is not used (the section is disabled)"),
    "sparse_attention": Section(None, NA, "refused: zerofit does not replace attention"),
}

REFUSED_WHEN_ENABLED = ("elasticity", "curriculum_learning", "data_efficiency", "progressive_layer_drop", "amp")

ADAM_PARAMS: dict[str, Key | Section] = {
    "lr": Key(Float(0, lo_open=True), HONOURED, "-> optimizer.lr", auto=True, default=1e-3),
    "betas": Key(Betas(), HONOURED, "-> optimizer.betas", auto=True, default=(0.9, 0.999)),
    "eps": Key(Float(0, lo_open=True), HONOURED, "-> optimizer.eps", auto=True, default=1e-8),
    "weight_decay": Key(
        Float(0),
        HONOURED,
        "-> optimizer.weight_decay (decoupled, as AdamW); absent with "
        "torch_adam true and AdamW's math: torch.optim.AdamW's 0.01",
        auto=True,
        default=0.0,
    ),
    "adam_w_mode": Key(Bool(), MAPPED, "true = AdamW (type AdamW is AdamW whatever it says)", default=True),
    "torch_adam": Key(
        Bool(),
        NA,
        "DeepSpeed's choice of torch.optim.AdamW over its own kernels: zerofit's AdamW is "
        "torch.optim.AdamW's math either way (only the absent weight_decay follows it)",
        default=False,
    ),
    "fp32_optimizer_states": Key(
        Choice((True,)),
        NA,
        "zerofit always keeps fp32 optimizer state",
        hint="zerofit keeps the Adam moments in fp32; remove the key",
    ),
    "foreach": _na(Bool(nullable=True), "zerofit's AdamW is its own kernel"),
    "bias_correction": Key(
        Choice((True,)),
        HONOURED,
        "zerofit's AdamW is always bias-corrected",
        hint="zerofit's AdamW is always bias-corrected; remove the key",
        default=True,
    ),
    "amsgrad": Key(
        Choice((False,)),
        HONOURED,
        "zerofit's AdamW has no amsgrad variant",
        hint="zerofit's AdamW has no amsgrad variant; remove the key",
        default=False,
    ),
}
"""``max_grad_norm`` is not in the table: DeepSpeed 0.19.8 raises for it, and so does zerofit, before the walk."""

TORCH_ADAMW_WEIGHT_DECAY = 0.01
"""``torch.optim.AdamW``'s default weight decay: DeepSpeed's with ``torch_adam`` true and AdamW's math"""

_LAST_ITERATION = Key(
    Choice((-1,)),
    NA,
    "zerofit resumes the schedule from its checkpoint",
    hint="zerofit resumes the schedule from its checkpoint; remove the key",
    default=-1,
)
_WARMUP_COMMON: dict[str, Key | Section] = {
    "warmup_num_steps": Key(Int(0), HONOURED, "-> scheduler.warmup_steps", auto=True, default=1000),
    "warmup_type": Key(Choice(("log", "linear")), HONOURED, "-> scheduler.warmup_type", default="log"),
    "last_batch_iteration": _LAST_ITERATION,
}
_WARMUP_LR: dict[str, Key | Section] = {
    **_WARMUP_COMMON,
    "warmup_min_lr": Key(Float(0), HONOURED, "-> scheduler.warmup_min_lr", auto=True, default=0.0),
    "warmup_max_lr": Key(
        Float(0, lo_open=True),
        HONOURED,
        "-> scheduler.warmup_max_lr; absent: the optimizer's lr",
        auto=True,
        default=None,
    ),
}
_TOTAL = Key(Int(1), HONOURED, "-> scheduler.total_steps (DeepSpeed requires it)", auto=True)
_MOM = Float(0, 1, hi_open=True)  # Adam's beta1: the schema's [0, 1)
SCHEDULER_PARAMS: dict[str, dict[str, Key | Section]] = {
    "WarmupLR": _WARMUP_LR,
    "WarmupDecayLR": {
        **_WARMUP_LR,
        "total_num_steps": _TOTAL,
        "warmup_max_lr": Key(Float(0, lo_open=True), HONOURED, "-> scheduler.warmup_max_lr", auto=True, default=0.001),
    },
    "WarmupCosineLR": {
        **_WARMUP_COMMON,
        "total_num_steps": _TOTAL,
        "warmup_min_ratio": Key(Float(0, 1), HONOURED, "-> scheduler.warmup_min_ratio", default=0.0),
        "cos_min_ratio": Key(Float(0, 1), HONOURED, "-> scheduler.min_lr_ratio", default=0.0001),
    },
    # [Note: OneCycle and LRRangeTest] (zerofit/optim/schedules.py)
    "OneCycle": {
        "cycle_min_lr": Key(Float(0), HONOURED, "-> scheduler.one_cycle.cycle_min_lr (DeepSpeed requires it)"),
        "cycle_max_lr": Key(Float(0), HONOURED, "-> scheduler.one_cycle.cycle_max_lr (DeepSpeed requires it)"),
        "decay_lr_rate": Key(Float(0), HONOURED, "-> scheduler.one_cycle.decay_lr_rate", default=0.0),
        "cycle_first_step_size": Key(
            Float(0, lo_open=True), HONOURED, "-> scheduler.one_cycle.cycle_first_step_size", default=2000
        ),
        "cycle_second_step_size": Key(
            Float(0),
            HONOURED,
            "-> scheduler.one_cycle.cycle_second_step_size; absent: cycle_first_step_size",
            default=None,
        ),
        "cycle_first_stair_count": Key(Int(0), HONOURED, "-> scheduler.one_cycle.cycle_first_stair_count", default=0),
        "cycle_second_stair_count": Key(
            Int(0, nullable=True),
            HONOURED,
            "-> scheduler.one_cycle.cycle_second_stair_count; absent: cycle_first_stair_count",
            default=None,
        ),
        "decay_step_size": Key(Float(0), HONOURED, "-> scheduler.one_cycle.decay_step_size (0: no decay)", default=0),
        "cycle_momentum": Key(
            Bool(),
            HONOURED,
            "-> scheduler.one_cycle.cycle_momentum: Adam's beta1 cycles inversely "
            "to the lr and beta2 is 0.99, as DeepSpeed sets the optimizer's betas",
            default=True,
        ),
        "cycle_min_mom": Key(_MOM, HONOURED, "-> scheduler.one_cycle.cycle_min_mom", default=0.8),
        "cycle_max_mom": Key(_MOM, HONOURED, "-> scheduler.one_cycle.cycle_max_mom", default=0.9),
        "decay_mom_rate": Key(Float(0), HONOURED, "-> scheduler.one_cycle.decay_mom_rate", default=0.0),
        "last_batch_iteration": _LAST_ITERATION,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": Key(Float(0), HONOURED, "-> scheduler.lr_range_test.min_lr", default=1e-3),
        "lr_range_test_step_size": Key(Int(1), HONOURED, "-> scheduler.lr_range_test.step_size", default=2000),
        "lr_range_test_step_rate": Key(Float(0), HONOURED, "-> scheduler.lr_range_test.step_rate", default=1.0),
        "lr_range_test_staircase": Key(Bool(), HONOURED, "-> scheduler.lr_range_test.staircase", default=False),
        "last_batch_iteration": _LAST_ITERATION,
    },
}


def _all_paths(spec: Mapping[str, Key | Section], prefix: str = "") -> list[str]:
    out = []
    for name, item in spec.items():
        path = f"{prefix}{name}"
        out.append(path)
        if isinstance(item, Section) and item.keys is not None:
            out += _all_paths(item.keys, path + ".")
    return out


KNOWN_PATHS = sorted(
    set(
        _all_paths(DEEPSPEED_KEYS)
        + _all_paths(ADAM_PARAMS, "optimizer.params.")
        + [p for table in SCHEDULER_PARAMS.values() for p in _all_paths(table, "scheduler.params.")]
    )
)


# ----------------------------------------------------------------------------
# Walking a config against the table
# ----------------------------------------------------------------------------

AUTO = "auto"


def key_table() -> list[tuple[str, str, str]]:
    """Every DeepSpeed key zerofit knows, as (dotted path, status, note), in the table's order.

    Sections whose contents zerofit does not check are listed once, by their own path."""
    rows: list[tuple[str, str, str]] = []

    def walk(spec: Mapping[str, Key | Section], prefix: str) -> None:
        for name, item in spec.items():
            path = f"{prefix}{name}"
            if isinstance(item, Section) and item.keys is not None:
                walk(item.keys, path + ".")
            else:
                note = item.note + (' ("auto" accepted)' if isinstance(item, Key) and item.auto else "")
                if isinstance(item, Key) and item.default is not NO_DEFAULT:
                    note += f"; DeepSpeed {DEEPSPEED_VERSION}'s default: {_shown(item.default)}"
                rows.append((path, item.status, note))

    walk(DEEPSPEED_KEYS, "")
    walk(ADAM_PARAMS, "optimizer.params.")
    for sched, table in SCHEDULER_PARAMS.items():
        walk(table, f"scheduler.params.[{sched}].")
    return rows


def _shown(value: Any) -> str:
    """A default as the JSON a user would write: ``[0.9, 0.999]``, ``true``, ``null``, ``"Warn"``, ``0.001``."""
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def default(path: str, scheduler: str | None = None) -> Any:
    """DeepSpeed's default (:data:`DEEPSPEED_VERSION`) for the key at the canonical dotted ``path``
    (``optimizer.params.lr``; ``scheduler.params.<key>`` of ``scheduler``'s type): what an absent key means.
    :data:`NO_DEFAULT` for keys zerofit does not use."""
    parts = path.split(".")
    if parts[:2] == ["optimizer", "params"]:
        spec, parts = ADAM_PARAMS, parts[2:]
    elif parts[:2] == ["scheduler", "params"]:
        spec, parts = SCHEDULER_PARAMS[scheduler], parts[2:]
    else:
        spec = DEEPSPEED_KEYS
    item: Key | Section | None = None
    for part in parts:
        item = spec[part]
        if isinstance(item, Section):
            spec = item.keys or {}
    if not isinstance(item, Key):
        raise KeyError(f"{path} is not a DeepSpeed key zerofit knows")
    return item.default
