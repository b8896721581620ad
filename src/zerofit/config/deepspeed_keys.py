"""The DeepSpeed keys zerofit knows: each key's type and what it means to zerofit.

Every key is **honoured** (same meaning, copied to the zerofit field named in
its note), **mapped** (translated onto zerofit's own mechanism) or
**not-applicable** (zerofit decides it itself; the value is still type-checked).
:mod:`zerofit.config.deepspeed` walks a user's config against these tables. This module holds the top-level
table and the lookups over every table; the records and value kinds are in
:mod:`zerofit.config.deepspeed_kinds`, the optimizer's and the schedulers' ``params`` in
:mod:`zerofit.config.deepspeed_params` (all re-exported here).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from zerofit.config.deepspeed_kinds import (  # noqa: F401 (re-exported)
    HONOURED,
    MAPPED,
    NA,
    NO_DEFAULT,
    Anything,
    BadValue,
    Betas,
    Bool,
    Choice,
    Float,
    Int,
    Key,
    KeyReport,
    Section,
    Status,
    Text,
    na,
)
from zerofit.config.deepspeed_params import (  # noqa: F401 (re-exported)
    ADAM_PARAMS,
    SCHEDULER_PARAMS,
    TORCH_ADAMW_WEIGHT_DECAY,
)

DEEPSPEED_VERSION = "0.19.8"
"""the DeepSpeed release whose defaults a key absent from a DeepSpeed config takes (``Key.default``)"""

# ----------------------------------------------------------------------------
# The key table
# ----------------------------------------------------------------------------

_BUCKETS = "zerofit sizes its transfers per block; no communication buckets"
PLANNER_DECIDES = "zerofit's planner decides from the model's block sizes and the memory budgets"
_COMM = (
    "zerofit decides its own communication schedule: with several ranks each block's weights are "
    "all-gathered from the ranks' shards and its gradient reduce-scattered, once per block, on process groups "
    "of their own (docs/ranks.md)"
)
_MONITOR = "zerofit logs to its own timeline; metric sinks are configured outside the training config"


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
        "buffer_count": na(Int(0), "zerofit sizes its own staging buffers"),
        "pipeline_read": na(Bool(), "the disk tier always reads ahead of each update, overlapped with compute"),
        "pipeline_write": na(Bool(), "the disk tier always writes behind each update, overlapped with compute"),
        "pipeline": na(Bool(), "the disk tier always overlaps its reads and writes with compute"),
        "fast_init": na(Bool(), "the disk tier reserves its file at once (fallocate) and writes only master weights"),
        "ratio": na(Float(0, 1), "the planner decides which optimizer state stays on the GPU"),
        "super_offload": na(Bool(), "zerofit's CPU optimizer is its own"),
        "convert_grad_on_cpu": na(Bool(), "zerofit decides where gradients are converted"),
        "cpuadam_cores_perc": na(Float(0, 1), "zerofit sizes its CPU optimizer worker itself"),
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
        "buffer_count": na(Int(0), "zerofit sizes its own staging buffers"),
        "buffer_size": na(Int(0), "zerofit sizes its own staging buffers", auto=True),
        "max_in_cpu": na(Int(0), "bounded by max_host_memory instead"),
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
        "stage3_param_persistence_threshold": na(
            Int(0), PLANNER_DECIDES, auto=True, aliases=("param_persistence_threshold",)
        ),
        "stage3_model_persistence_threshold": na(
            Int(0), PLANNER_DECIDES, auto=True, aliases=("model_persistence_threshold",)
        ),
        "stage3_max_reuse_distance": na(Int(0), PLANNER_DECIDES, auto=True, aliases=("max_reuse_distance",)),
        "stage3_gather_16bit_weights_on_model_save": na(
            Bool(),
            "zerofit's checkpoints always hold whole tensors",
            auto=True,
            aliases=("gather_16bit_weights_on_model_save",),
        ),
        "stage3_gather_fp16_weights_on_model_save": na(Bool(), "deprecated; zerofit's checkpoints hold whole tensors"),
        "stage3_module_granularity_threshold": na(
            Int(0), "zerofit fetches whole blocks", aliases=("module_granularity_threshold",)
        ),
        "stage3_use_all_reduce_for_fetch_params": na(Bool(), _COMM, aliases=("use_all_reduce_for_fetch_params",)),
        "stage3_allgather_sequential": na(Bool(), _COMM, aliases=("allgather_sequential",)),
        "stage3_partition_stream_chunk_size": na(Int(0), _BUCKETS, aliases=("partition_stream_chunk_size",)),
        "sub_group_size": na(Int(0), "zerofit's optimizer steps one block at a time", auto=True),
        "contiguous_gradients": na(Bool(), "zerofit keeps each block's gradients in one flat buffer"),
        "parameter_alignment": na(Bool(), "zerofit keeps each block's parameters in one flat buffer"),
        "compute_grad_norm": na(
            Bool(),
            "zerofit computes the global gradient norm where a step needs it (clipping, "
            "fp16): engine.get_global_grad_norm() is None otherwise",
        ),
        "overlap_comm": na(Bool(nullable=True), _COMM),
        "reduce_scatter": na(Bool(), _COMM),
        "reduce_bucket_size": na(Int(0), _BUCKETS, auto=True),
        "allgather_partitions": na(Bool(), _COMM),
        "allgather_bucket_size": na(Int(0), _BUCKETS, auto=True),
        "use_multi_rank_bucket_allreduce": na(Bool(), _COMM),
        "round_robin_gradients": na(Bool(), _COMM),
        "load_from_fp32_weights": na(Bool(), "zerofit always restores the fp32 master weights from its checkpoint"),
        "elastic_checkpoint": na(Bool(), "zerofit's checkpoints are its own"),
        "ignore_unused_parameters": na(Bool(), "parameters without gradients are skipped by zerofit's optimizer"),
        "legacy_stage1": na(Bool(), "no ZeRO stages in zerofit"),
        "zero_hpz_partition_size": Key(
            Int(0),
            MAPPED,
            "> 1 (the GPUs of a node) -> nodes_layout hybrid: on several "
            "nodes each node holds the whole state and gathers the weights inside itself; "
            "without it ZeRO stages 1-3 -> nodes_layout full (docs/ranks.md)",
            default=1,
        ),
        "zero_quantized_weights": na(Bool(), "zerofit moves weights at full 16-bit precision"),
        "zero_quantized_nontrainable_weights": na(Bool(), "zerofit moves weights at full 16-bit precision"),
        "zero_quantized_gradients": na(Bool(), "zerofit moves gradients at full precision"),
        "zeropp_loco_param": na(Anything(), "zerofit moves gradients at full precision"),
        "mics_shard_size": na(Int(-1), "zerofit does not use MiCS sharding"),
        "mics_hierarchical_params_gather": na(Bool(), "zerofit does not use MiCS sharding"),
        "memory_efficient_linear": na(Bool(), "zerofit does not replace the model's modules"),
        "pipeline_loading_checkpoint": na(Bool(), "zerofit's checkpoints are its own"),
        "override_module_apply": na(Bool(), "zerofit does not patch the model"),
        "log_trace_cache_warnings": na(Bool(), "zerofit does not trace parameter order"),
        "enable_sanity_checks": na(Bool(), "zerofit's checks are always on"),
        "save_muon_momentum_buffer_in_memory": na(Bool(), "zerofit implements AdamW only"),
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
        "auto_cast": na(Bool(), "zerofit runs the model's forward in the compute dtype itself"),
        "fused_mode": na(Bool(), "zerofit has one fp16 optimizer path"),
        "fp16_master_weights_and_grads": na(Bool(), "zerofit always keeps fp32 master weights"),
    }
)

_BF16 = Section(
    {
        "enabled": Key(Bool(), HONOURED, "true -> precision bf16", auto=True, default=False),
        "immediate_grad_update": na(Bool(), "zerofit decides when gradients are applied"),
        "check_grad_overflow": na(
            Bool(),
            "zerofit skips no bf16 step: where it computes the gradient norm "
            "(gradient_clipping > 0) a non-finite norm stops the step with "
            "FloatingPointError, where DeepSpeed (default true) skips the step",
        ),
        "bf16_master_weights_and_grads": na(Bool(), "zerofit always keeps fp32 master weights"),
        "bf16_optimizer_states": na(Bool(), "zerofit always keeps fp32 optimizer state"),
    },
    aliases=("bfloat16",),
)

_ACT_NOTE = "zerofit checkpoints every block itself (activation_checkpointing=true)"
_ACT = Section(
    {
        "partition_activations": na(Bool(), _ACT_NOTE),
        "cpu_checkpointing": na(Bool(), _ACT_NOTE),
        "contiguous_memory_optimization": na(Bool(), _ACT_NOTE),
        "number_checkpoints": na(Int(0, nullable=True), _ACT_NOTE),
        "synchronize_checkpoint_boundary": na(Bool(), _ACT_NOTE),
        "profile": na(Bool(), _ACT_NOTE),
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
        "single_submit": na(Bool(), _AIO_NOTE),
        "overlap_events": na(Bool(), _AIO_NOTE),
        "use_gds": na(Bool(), _AIO_NOTE),
    }
)


def _monitor(*keys: str) -> Section:
    return Section({"enabled": na(Bool(), _MONITOR), **{k: na(Text(nullable=True), _MONITOR) for k in keys}})


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
    "disable_python_gc": na(Bool(), "zerofit leaves Python's garbage collector as it is"),
    # optimizer and schedule; their params are checked per type (ADAM_PARAMS, SCHEDULER_PARAMS)
    "optimizer": Section(
        {
            "type": Key(Text(), HONOURED, "Adam/AdamW -> zerofit's AdamW"),
            "params": Section(None, HONOURED),
            "legacy_fusion": na(Bool(), "zerofit has one AdamW implementation"),
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
            "grad_accum_dtype": na(Choice(("fp32", "fp16", "bf16", None)), "zerofit accumulates gradients in fp32"),
            "param_dtype": na(Choice(("fp32", "fp16", "bf16", None)), "zerofit's compute dtype comes from fp16/bf16"),
            "buffer_dtype": na(Choice(("fp32", "fp16", "bf16", None)), "zerofit leaves buffers as loaded"),
            "keep_in_fp32_modules": na(Anything(), "zerofit leaves buffers as loaded"),
        }
    ),
    "communication_data_type": na(Choice(("fp32", "fp16", "bf16", None)), _COMM),
    "seq_parallel_communication_data_type": na(Choice(("fp32", "fp16", "bf16")), _COMM),
    # ZeRO and offload
    "zero_optimization": _ZERO,
    "zero_allow_untested_optimizer": na(Bool(), "zerofit implements AdamW only"),
    "zero_force_ds_cpu_optimizer": na(Bool(), "zerofit's CPU optimizer is its own"),
    "aio": _AIO,
    "activation_checkpointing": _ACT,
    # communication
    "prescale_gradients": na(Bool(), _COMM),
    "gradient_predivide_factor": na(Float(0, lo_open=True), _COMM),
    "gradient_allreduce_op": na(Choice(("avg", "sum"), fold_case=True), "zerofit averages gradients over ranks"),
    "sparse_gradients": na(Bool(), "zerofit reduces dense gradients"),
    "disable_allgather": na(Bool(), _COMM),
    "comms_logger": Section(None, NA, _MONITOR),
    # monitoring and profiling
    "tensorboard": _monitor("output_path", "job_name"),
    "wandb": _monitor("group", "team", "project"),
    "csv_monitor": _monitor("output_path", "job_name"),
    "comet": Section(None, NA, _MONITOR),
    "flops_profiler": Section(
        {
            "enabled": na(Bool(), _FLOPS_NOTE),
            "recompute_fwd_factor": na(Float(0), _FLOPS_NOTE),
            "profile_step": na(Int(0), _FLOPS_NOTE),
            "module_depth": na(Int(-1), _FLOPS_NOTE),
            "top_modules": na(Int(0), _FLOPS_NOTE),
            "detailed": na(Bool(), _FLOPS_NOTE),
            "output_file": na(Text(nullable=True), _FLOPS_NOTE),
        }
    ),
    "timers": Section(None, NA, _FLOPS_NOTE),
    "memory_breakdown": na(Bool(), "zerofit's planner prints its memory prediction at start-up"),
    "dump_state": na(Bool(), "zerofit prints its resolved config at start-up"),
    "log_level": na(Text(), "zerofit logs through Python's logging"),
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
            "load_universal": na(Bool(), "zerofit's checkpoints load under any placement already"),
            "use_node_local_storage": na(Bool(), _CKPT_NOTE),
            "parallel_write": Section({"pipeline_stage": na(Bool(), _CKPT_NOTE)}),
            "checkpoint_serialization": na(Bool(), _CKPT_NOTE),
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
    "vocabulary_size": na(Int(1, nullable=True), "DeepSpeed only used it for a warning"),
    # parallelism zerofit decides (data parallel only)
    "sequence_parallel_size": na(Int(1), "zerofit is data-parallel only"),
    "use_data_before_expert_parallelism": na(Bool(), "zerofit is data-parallel only"),
    "pipeline": Section(None, NA, "zerofit is data-parallel only; pipeline settings apply to PipelineModule"),
    "tensor_parallel": Section(None, NA, "zerofit is data-parallel only"),
    "expert_parallel": Section(None, NA, "zerofit is data-parallel only"),
    "hybrid_engine": Section(None, NA, "zerofit has no inference hybrid engine"),
    "compile": Section(None, NA, "zerofit compiles what it chooses itself"),
    "graph_harvesting": na(Bool(), "zerofit does not capture CUDA graphs"),
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
