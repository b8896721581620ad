"""Read DeepSpeed JSON configs into :class:`~zerofit.config.schema.ZerofitConfig`.

Users arrive with DeepSpeed configs copied from tutorials and Hugging Face
recipes; zerofit reads them as they are. Every DeepSpeed key is one of:

* **honoured**: same meaning, copied to the zerofit field named in the note;
* **mapped**: zerofit has its own mechanism and translates the value (for
  example ``stage3_prefetch_bucket_size``, in elements, becomes a prefetch depth
  in blocks chosen by zerofit's planner);
* **not-applicable**: zerofit decides this itself (bucket sizes, communication
  overlap, ...); the value is still type-checked.

:func:`translate` returns a :class:`KeyReport` for every key present; the engine
prints the mapped and not-applicable ones once at start-up. An unknown key at
any depth is a :class:`ConfigError` naming its dotted path and the closest known
key. Sections of DeepSpeed features that zerofit does not implement and that
would change the training math if ignored (``elasticity``, ``curriculum_learning``,
``data_efficiency``, ``progressive_layer_drop`` when enabled; ``sparse_attention``;
``amp`` when enabled) are refused rather than dropped.

Defaults. A key *absent* from a DeepSpeed config takes DeepSpeed's default, as
DeepSpeed would (``weight_decay`` 0, ``offload_*.device`` ``none``, fp32 when
neither ``fp16`` nor ``bf16`` is enabled, ``WarmupDecayLR``'s ``warmup_max_lr``
0.001, ...). Two exceptions, both with no effect on the math: ``pin_memory``
keeps zerofit's default (on) unless the config sets it, and settings DeepSpeed
has no default for (no ``optimizer`` section) take zerofit's.

``"auto"`` (accepted where Hugging Face recipes put it) resolves the same way
every time, to what zerofit would choose on its own:

==============================================  =================================================
key                                             ``"auto"`` becomes
==============================================  =================================================
``train_batch_size``,                           derived from the other two and ``world_size``;
``train_micro_batch_size_per_gpu``,             with fewer than two given: micro batch 1,
``gradient_accumulation_steps``                 accumulation 1 (see :func:`~zerofit.config.schema.resolve_batch`)
``gradient_clipping``                           0.0 (off; zerofit's default)
``optimizer.params.{lr,betas,eps,weight_decay}``  zerofit's defaults: 1e-3, (0.9, 0.999), 1e-8, 0.01
``scheduler.params.warmup_min_lr``              0.0
``scheduler.params.warmup_max_lr``              the optimizer's lr
``scheduler.params.warmup_num_steps``           0 (DeepSpeed's formulas then warm up over 2 steps)
``scheduler.params.total_num_steps``            unset: the engine supplies the run length
``fp16.enabled``, ``bf16.enabled``              bf16 unless the other is explicitly ``true``
bucket sizes, thresholds (not-applicable)       zerofit's planner decides
==============================================  =================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Union

from zerofit.config.schema import (
    ConfigError,
    OptimizerConfig,
    Problem,
    ZerofitConfig,
    _close,
    check_nvme_path,
    resolve_batch,
    show,
)

__all__ = [
    "KeyReport", "Status", "Key", "Section", "Translation",
    "translate", "from_deepspeed", "is_deepspeed_config", "rename_fields",
    "DEEPSPEED_KEYS", "ADAM_PARAMS", "SCHEDULER_PARAMS",
]

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


class _Bad(Exception):
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
            raise _Bad
        v = int(v)
        if v < self.lo or (self.hi is not None and v > self.hi):
            raise _Bad
        return v


@dataclass(frozen=True)
class Float:
    lo: float = 0.0
    hi: float | None = None
    lo_open: bool = False

    @property
    def expected(self) -> str:
        lo = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        return f"a number {lo}" + (f" and <= {self.hi:g}" if self.hi is not None else "")

    def check(self, v: Any) -> Any:
        if not _is_number(v):
            raise _Bad
        if v < self.lo or (self.lo_open and v == self.lo) or (self.hi is not None and v > self.hi):
            raise _Bad
        return float(v)


@dataclass(frozen=True)
class Bool:
    nullable: bool = False
    expected = "true or false"

    def check(self, v: Any) -> Any:
        if isinstance(v, bool) or (v is None and self.nullable):
            return v
        raise _Bad


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
        raise _Bad


@dataclass(frozen=True)
class Text:
    nullable: bool = False

    @property
    def expected(self) -> str:
        return "a string" + (" or null" if self.nullable else "")

    def check(self, v: Any) -> Any:
        if isinstance(v, str) or (v is None and self.nullable):
            return v
        raise _Bad


@dataclass(frozen=True)
class Betas:
    expected = "a list of two numbers, each in [0, 1)"

    def check(self, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(b) and 0 <= b < 1 for b in v):
            return (float(v[0]), float(v[1]))
        raise _Bad


@dataclass(frozen=True)
class Anything:
    expected = "any JSON value"

    def check(self, v: Any) -> Any:
        return v


_Kind = Union[Int, Float, Bool, Choice, Text, Betas, Anything]


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


@dataclass(frozen=True)
class Section:
    """A DeepSpeed object. ``keys=None``: its contents are not checked (a feature zerofit does not use)."""

    keys: Mapping[str, "Key | Section"] | None
    status: Status = NA
    note: str = ""
    aliases: tuple[str, ...] = ()
    nullable: bool = False


_BUCKETS = "zerofit sizes its transfers per block; no communication buckets"
_PLANNER = "zerofit's planner decides from the model's block sizes and the memory budgets"
_COMM = "zerofit decides its own communication schedule"
_MONITOR = "zerofit logs to its own timeline; metric sinks are configured outside the training config"


def _na(kind: _Kind, note: str, **kw: Any) -> Key:
    return Key(kind, NA, note, **kw)


_OFFLOAD_OPTIMIZER = Section({
    "device": Key(Choice(("none", "cpu", "nvme")), HONOURED, "-> offload.optimizer_device"),
    "nvme_path": Key(Text(nullable=True), HONOURED, "-> offload.nvme_path"),
    "pin_memory": Key(Bool(), HONOURED, "-> offload.pin_memory (one setting for all host buffers)"),
    "buffer_count": _na(Int(0), "zerofit sizes its own staging buffers"),
    "pipeline_read": _na(Bool(), "zerofit always overlaps NVMe reads with compute"),
    "pipeline_write": _na(Bool(), "zerofit always overlaps NVMe writes with compute"),
    "pipeline": _na(Bool(), "zerofit always overlaps NVMe I/O with compute"),
    "fast_init": _na(Bool(), "zerofit initialises its NVMe files itself"),
    "ratio": _na(Float(0, 1), "the planner decides which optimizer state stays on the GPU"),
    "super_offload": _na(Bool(), "zerofit's CPU optimizer is its own"),
    "convert_grad_on_cpu": _na(Bool(), "zerofit decides where gradients are converted"),
    "cpuadam_cores_perc": _na(Float(0, 1), "zerofit sizes its CPU optimizer worker itself"),
}, nullable=True)

_OFFLOAD_PARAM = Section({
    "device": Key(Choice(("none", "cpu", "nvme")), HONOURED, "-> offload.param_device"),
    "nvme_path": Key(Text(nullable=True), HONOURED, "-> offload.nvme_path"),
    "pin_memory": Key(Bool(), HONOURED, "-> offload.pin_memory (one setting for all host buffers)"),
    "buffer_count": _na(Int(0), "zerofit sizes its own staging buffers"),
    "buffer_size": _na(Int(0), "zerofit sizes its own staging buffers", auto=True),
    "max_in_cpu": _na(Int(0), "bounded by max_host_memory instead"),
}, nullable=True)

_ZERO = Section({
    "stage": Key(Choice((0, 1, 2, 3)), MAPPED,
                 "zerofit streams whole blocks; where weights and optimizer state live follows offload_param "
                 "and offload_optimizer"),
    "offload_optimizer": _OFFLOAD_OPTIMIZER,
    "offload_param": _OFFLOAD_PARAM,
    "cpu_offload": Key(Bool(nullable=True), MAPPED, "deprecated; true -> offload_optimizer.device cpu"),
    "cpu_offload_param": Key(Bool(nullable=True), MAPPED, "deprecated; true -> offload_param.device cpu"),
    "cpu_offload_use_pin_memory": Key(Bool(nullable=True), MAPPED, "deprecated; -> offload.pin_memory"),
    "stage3_prefetch_bucket_size": Key(Int(0), MAPPED, "elements fetched ahead -> offload.prefetch_depth (blocks), "
                                       + _PLANNER, auto=True, aliases=("prefetch_bucket_size",)),
    "stage3_max_live_parameters": Key(Int(0), MAPPED, "resident parameters -> bounded by max_gpu_memory; "
                                      + _PLANNER, auto=True, aliases=("max_live_parameters",)),
    "stage3_param_persistence_threshold": _na(Int(0), _PLANNER, auto=True,
                                              aliases=("param_persistence_threshold",)),
    "stage3_model_persistence_threshold": _na(Int(0), _PLANNER, auto=True,
                                              aliases=("model_persistence_threshold",)),
    "stage3_max_reuse_distance": _na(Int(0), _PLANNER, auto=True, aliases=("max_reuse_distance",)),
    "stage3_gather_16bit_weights_on_model_save": _na(
        Bool(), "zerofit's checkpoints always hold whole tensors", auto=True,
        aliases=("gather_16bit_weights_on_model_save",)),
    "stage3_gather_fp16_weights_on_model_save": _na(Bool(), "deprecated; zerofit's checkpoints hold whole tensors"),
    "stage3_module_granularity_threshold": _na(Int(0), "zerofit fetches whole blocks",
                                               aliases=("module_granularity_threshold",)),
    "stage3_use_all_reduce_for_fetch_params": _na(Bool(), _COMM, aliases=("use_all_reduce_for_fetch_params",)),
    "stage3_allgather_sequential": _na(Bool(), _COMM, aliases=("allgather_sequential",)),
    "stage3_partition_stream_chunk_size": _na(Int(0), _BUCKETS, aliases=("partition_stream_chunk_size",)),
    "sub_group_size": _na(Int(0), "zerofit's optimizer steps one block at a time", auto=True),
    "contiguous_gradients": _na(Bool(), "zerofit keeps each block's gradients in one flat buffer"),
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
    "zero_hpz_partition_size": _na(Int(0), "zerofit does not use hierarchical partitioning"),
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
})

_FP16 = Section({
    "enabled": Key(Bool(), HONOURED, "true -> precision fp16", auto=True),
    "loss_scale": Key(Float(0), HONOURED, "-> fp16.loss_scale (0 = dynamic)"),
    "initial_scale_power": Key(Int(0, 64), HONOURED, "-> fp16.initial_scale_power"),
    "loss_scale_window": Key(Int(1), HONOURED, "-> fp16.loss_scale_window"),
    "hysteresis": Key(Int(1), HONOURED, "-> fp16.hysteresis"),
    "consecutive_hysteresis": Key(Bool(), HONOURED, "-> fp16.consecutive_hysteresis"),
    "min_loss_scale": Key(Float(0, lo_open=True), HONOURED, "-> fp16.min_loss_scale"),
    "auto_cast": _na(Bool(), "zerofit runs the model's forward in the compute dtype itself"),
    "fused_mode": _na(Bool(), "zerofit has one fp16 optimizer path"),
    "fp16_master_weights_and_grads": _na(Bool(), "zerofit always keeps fp32 master weights"),
})

_BF16 = Section({
    "enabled": Key(Bool(), HONOURED, "true -> precision bf16", auto=True),
    "immediate_grad_update": _na(Bool(), "zerofit decides when gradients are applied"),
    "check_grad_overflow": _na(Bool(), "bf16 needs no overflow check in zerofit"),
    "bf16_master_weights_and_grads": _na(Bool(), "zerofit always keeps fp32 master weights"),
    "bf16_optimizer_states": _na(Bool(), "zerofit always keeps fp32 optimizer state"),
}, aliases=("bfloat16",))

_ACT_NOTE = "zerofit checkpoints every block itself (activation_checkpointing=true)"
_ACT = Section({
    "partition_activations": _na(Bool(), _ACT_NOTE),
    "cpu_checkpointing": _na(Bool(), _ACT_NOTE),
    "contiguous_memory_optimization": _na(Bool(), _ACT_NOTE),
    "number_checkpoints": _na(Int(0, nullable=True), _ACT_NOTE),
    "synchronize_checkpoint_boundary": _na(Bool(), _ACT_NOTE),
    "profile": _na(Bool(), _ACT_NOTE),
})

_AIO_NOTE = "zerofit's NVMe tier chooses its own I/O sizes and threads"
_AIO = Section({
    "block_size": _na(Int(1), _AIO_NOTE),
    "queue_depth": _na(Int(1), _AIO_NOTE),
    "thread_count": _na(Int(1), _AIO_NOTE),
    "intra_op_parallelism": _na(Int(1), _AIO_NOTE),
    "single_submit": _na(Bool(), _AIO_NOTE),
    "overlap_events": _na(Bool(), _AIO_NOTE),
    "use_gds": _na(Bool(), _AIO_NOTE),
})


def _monitor(*keys: str) -> Section:
    return Section({"enabled": _na(Bool(), _MONITOR), **{k: _na(Text(nullable=True), _MONITOR) for k in keys}})


_FLOPS_NOTE = "zerofit's timeline (wall_clock_breakdown) reports compute and transfers"

DEEPSPEED_KEYS: dict[str, Key | Section] = {
    # batch, clipping, logging
    "train_batch_size": Key(Int(1), HONOURED, "-> train_batch_size", auto=True),
    "train_micro_batch_size_per_gpu": Key(Int(1), HONOURED, "-> micro_batch_size", auto=True),
    "gradient_accumulation_steps": Key(Int(1), HONOURED, "-> gradient_accumulation_steps", auto=True),
    "gradient_clipping": Key(Float(0), HONOURED, "-> gradient_clipping", auto=True),
    "steps_per_print": Key(Int(1, nullable=True), HONOURED, "-> steps_per_print"),
    "wall_clock_breakdown": Key(Bool(), HONOURED, "-> wall_clock_breakdown"),
    # optimizer and schedule; their params are checked per type (ADAM_PARAMS, SCHEDULER_PARAMS)
    "optimizer": Section({
        "type": Key(Text(), HONOURED, "Adam/AdamW -> zerofit's AdamW"),
        "params": Section(None, HONOURED),
        "legacy_fusion": _na(Bool(), "zerofit has one AdamW implementation"),
    }),
    "scheduler": Section({
        "type": Key(Text(), HONOURED, "-> scheduler.type, with DeepSpeed's formulas"),
        "params": Section(None, HONOURED),
    }),
    # precision
    "fp16": _FP16,
    "bf16": _BF16,
    "amp": Section(None, NA, "apex AMP is not used; zerofit's precision comes from fp16/bf16"),
    "torch_autocast": Section(None, NA, "zerofit's compute dtype comes from fp16/bf16"),
    "data_types": Section({
        "grad_accum_dtype": _na(Choice(("fp32", "fp16", "bf16", None)), "zerofit accumulates gradients in fp32"),
        "param_dtype": _na(Choice(("fp32", "fp16", "bf16", None)), "zerofit's compute dtype comes from fp16/bf16"),
        "buffer_dtype": _na(Choice(("fp32", "fp16", "bf16", None)), "zerofit leaves buffers as loaded"),
    }),
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
    "flops_profiler": Section({
        "enabled": _na(Bool(), _FLOPS_NOTE),
        "recompute_fwd_factor": _na(Float(0), _FLOPS_NOTE),
        "profile_step": _na(Int(0), _FLOPS_NOTE),
        "module_depth": _na(Int(-1), _FLOPS_NOTE),
        "top_modules": _na(Int(0), _FLOPS_NOTE),
        "detailed": _na(Bool(), _FLOPS_NOTE),
        "output_file": _na(Text(nullable=True), _FLOPS_NOTE),
    }),
    "timers": Section(None, NA, _FLOPS_NOTE),
    "memory_breakdown": _na(Bool(), "zerofit's planner prints its memory prediction at start-up"),
    "dump_state": _na(Bool(), "zerofit prints its resolved config at start-up"),
    "log_level": _na(Text(), "zerofit logs through Python's logging"),
    # checkpointing
    "checkpoint": Section(None, NA, "zerofit's checkpoints are written and verified by its own checkpointer"),
    "nebula": Section(None, NA, "zerofit's checkpoints are written by its own checkpointer"),
    "datastates": Section(None, NA, "zerofit's checkpoints are written by its own checkpointer"),
    # data loading
    "dataloader_drop_last": _na(Bool(), "zerofit does not build the data loader"),
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
    # refused when enabled: ignoring them would change the math (see _REFUSED_WHEN_ENABLED)
    "elasticity": Section(None, NA, "elastic batch sizes are not used (the section is disabled)"),
    "curriculum_learning": Section(None, NA, "curriculum learning is not used (the section is disabled)"),
    "data_efficiency": Section(None, NA, "data efficiency is not used (the section is disabled)"),
    "progressive_layer_drop": Section(None, NA, "progressive layer drop is not used (the section is disabled)"),
    "sparse_attention": Section(None, NA, "refused: zerofit does not replace attention"),
}

_REFUSED_WHEN_ENABLED = ("elasticity", "curriculum_learning", "data_efficiency", "progressive_layer_drop", "amp")

ADAM_PARAMS: dict[str, Key | Section] = {
    "lr": Key(Float(0, lo_open=True), HONOURED, "-> optimizer.lr", auto=True),
    "betas": Key(Betas(), HONOURED, "-> optimizer.betas", auto=True),
    "eps": Key(Float(0, lo_open=True), HONOURED, "-> optimizer.eps", auto=True),
    "weight_decay": Key(Float(0), HONOURED, "-> optimizer.weight_decay (decoupled, as AdamW)", auto=True),
    "adam_w_mode": Key(Bool(), MAPPED, "true (DeepSpeed's default) = AdamW"),
    "torch_adam": _na(Bool(), "zerofit's AdamW is its own; same math as torch.optim.AdamW"),
    "bias_correction": Key(Choice((True,)), HONOURED, "zerofit's AdamW is always bias-corrected",
                           hint="zerofit's AdamW is always bias-corrected; remove the key"),
    "amsgrad": Key(Choice((False,)), HONOURED, "zerofit's AdamW has no amsgrad variant",
                   hint="zerofit's AdamW has no amsgrad variant; remove the key"),
    "max_grad_norm": Key(Choice((0, 0.0)), NA, "DeepSpeed ignores it; use gradient_clipping",
                         hint="DeepSpeed ignores max_grad_norm as an optimizer parameter; set gradient_clipping"),
}

_WARMUP_COMMON: dict[str, Key | Section] = {
    "warmup_num_steps": Key(Int(0), HONOURED, "-> scheduler.warmup_steps", auto=True),
    "warmup_type": Key(Choice(("log", "linear")), HONOURED, "-> scheduler.warmup_type"),
    "last_batch_iteration": Key(Choice((-1,)), NA, "zerofit resumes the schedule from its checkpoint",
                                hint="zerofit resumes the schedule from its checkpoint; remove the key"),
}
_WARMUP_LR: dict[str, Key | Section] = {
    **_WARMUP_COMMON,
    "warmup_min_lr": Key(Float(0), HONOURED, "-> scheduler.warmup_min_lr", auto=True),
    "warmup_max_lr": Key(Float(0, lo_open=True), HONOURED, "-> scheduler.warmup_max_lr", auto=True),
}
_TOTAL = Key(Int(1), HONOURED, "-> scheduler.total_steps", auto=True)
SCHEDULER_PARAMS: dict[str, dict[str, Key | Section]] = {
    "WarmupLR": _WARMUP_LR,
    "WarmupDecayLR": {**_WARMUP_LR, "total_num_steps": _TOTAL},
    "WarmupCosineLR": {
        **_WARMUP_COMMON,
        "total_num_steps": _TOTAL,
        "warmup_min_ratio": Key(Float(0, 1), HONOURED, "-> scheduler.warmup_min_ratio"),
        "cos_min_ratio": Key(Float(0, 1), HONOURED, "-> scheduler.min_lr_ratio"),
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


_KNOWN_PATHS = sorted(set(
    _all_paths(DEEPSPEED_KEYS)
    + _all_paths(ADAM_PARAMS, "optimizer.params.")
    + [p for table in SCHEDULER_PARAMS.values() for p in _all_paths(table, "scheduler.params.")]
))


# ----------------------------------------------------------------------------
# Walking a config against the table
# ----------------------------------------------------------------------------

AUTO = "auto"


class _Values:
    """Checked values by canonical dotted path, plus the spelling the user wrote for each."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.written: dict[str, str] = {}     # canonical path -> path as written (aliases kept)
        self.spec: dict[str, Key | Section] = {}

    def __contains__(self, path: str) -> bool:
        return path in self.values

    def get(self, path: str, default: Any = None) -> Any:
        """The value, ``AUTO`` for ``"auto"``, or ``default`` when absent (or null)."""
        v = self.values.get(path)
        return default if v is None else v

    def name(self, path: str) -> str:
        """How to name ``path`` in a message: as the user wrote it if present."""
        if path in self.written:
            return self.written[path]
        parent, _, leaf = path.rpartition(".")
        return f"{self.name(parent)}.{leaf}" if parent else path


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _unknown_key(key: str, written_parent: str, spec: Mapping[str, Key | Section]) -> ConfigError:
    here = _join(written_parent, key)
    names = list(spec) + [a for item in spec.values() for a in item.aliases]
    guess = _close(key, names)
    if guess is not None:
        hint = f"did you mean {_join(written_parent, guess)!r}?"
    else:
        # A known key in the wrong place, or a close one anywhere.
        leaves = {p.rpartition(".")[2]: p for p in _KNOWN_PATHS}
        far = _close(key, list(leaves))
        if far:
            hint = f"did you mean {leaves[far]!r}?"
        elif len(spec) <= 16:
            hint = f"known keys here: {', '.join(spec)}"
        else:
            hint = "see DeepSpeed's configuration reference for the keys of this section"
    if not written_parent and key in ZerofitConfig.model_fields:
        hint = (f"{key!r} is a zerofit field: this dict mixes DeepSpeed and zerofit keys; "
                "pass zerofit fields as overrides instead")
    return ConfigError(here, "a key DeepSpeed defines", f"unknown key {key!r}", hint)


def _walk(spec: Mapping[str, Key | Section], data: Any, canon: str, written: str, out: _Values) -> None:
    """Check ``data`` (the object at ``written``) against ``spec``; record every value in ``out``."""
    if not isinstance(data, Mapping):
        raise ConfigError(written or "<config>", "an object {...}", show(data))
    alias_of = {a: name for name, item in spec.items() for a in item.aliases}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(_join(written, str(key)), "a string key", show(key))
        name = key if key in spec else alias_of.get(key)
        if name is None:
            raise _unknown_key(key, written, spec)
        here, path = _join(written, key), _join(canon, name)
        if path in out.written:
            raise ConfigError(here, "one spelling of this key", f"both {out.written[path]!r} and {here!r}",
                              "remove one of them")
        item = spec[name]
        out.written[path], out.spec[path] = here, item
        if isinstance(item, Section):
            if value is None and item.nullable:
                out.values[path] = None
            elif item.keys is None:
                if not isinstance(value, Mapping):
                    raise ConfigError(here, "an object {...}", show(value))
                out.values[path] = value
            else:
                out.values[path] = value
                _walk(item.keys, value, path, here, out)
        elif item.auto and value == AUTO:
            out.values[path] = AUTO
        else:
            try:
                out.values[path] = item.kind.check(value)
            except _Bad:
                expected = item.kind.expected + (' or "auto"' if item.auto else "")
                raise ConfigError(here, expected, show(value), item.hint) from None


# ----------------------------------------------------------------------------
# Translation
# ----------------------------------------------------------------------------


_TOP_LEVEL_NAMES = set(DEEPSPEED_KEYS) | {a for item in DEEPSPEED_KEYS.values() for a in item.aliases}
_DEEPSPEED_ONLY_FP16_KEYS = {"enabled", "auto_cast", "fused_mode", "fp16_master_weights_and_grads"}


def is_deepspeed_config(d: Mapping[str, Any]) -> bool:
    """True if ``d`` is written in DeepSpeed's vocabulary rather than zerofit's.

    1. a key only DeepSpeed has (``zero_optimization``, ``train_micro_batch_size_per_gpu``,
       ``bf16``, ...): DeepSpeed (zerofit-only keys in it are then reported as unknown);
    2. else a key only zerofit has (``micro_batch_size``, ``precision``, ``offload``, ...): zerofit;
    3. else the shape of the shared keys: DeepSpeed's ``optimizer``/``scheduler``
       have ``params`` (or the optimizer type is spelled ``Adam``/``AdamW``), its
       ``fp16`` has ``enabled``, its ``activation_checkpointing`` is an object;
    4. else zerofit (the shared keys then mean the same in both, except that
       zerofit's default precision is bf16 and DeepSpeed's fp32).
    """
    zerofit_fields = set(ZerofitConfig.model_fields)
    if any(key in _TOP_LEVEL_NAMES and key not in zerofit_fields for key in d):
        return True
    if any(key in zerofit_fields and key not in _TOP_LEVEL_NAMES for key in d):
        return False
    for key, value in d.items():
        if key in ("optimizer", "scheduler") and isinstance(value, Mapping) and "params" in value:
            return True
        if key == "optimizer" and isinstance(value, Mapping) and value.get("type") in ("Adam", "AdamW", "adam"):
            return True
        if key == "fp16" and isinstance(value, Mapping) and set(value) & _DEEPSPEED_ONLY_FP16_KEYS:
            return True
        if key == "activation_checkpointing" and isinstance(value, Mapping):
            return True
    return False


@dataclass(frozen=True)
class Translation:
    """A DeepSpeed config in zerofit's vocabulary, not yet validated as a whole."""

    fields: dict[str, Any]
    """keyword arguments for :class:`ZerofitConfig` (nested dicts)"""
    report: tuple[KeyReport, ...]
    """what happened to every DeepSpeed key present"""
    origin: dict[str, str]
    """zerofit dotted field -> the DeepSpeed key it came from (to name it in later errors)"""

    def validate(self) -> ZerofitConfig:
        """Build the :class:`ZerofitConfig`; errors name the DeepSpeed key the field came from."""
        try:
            return ZerofitConfig.model_validate(self.fields)
        except ConfigError as exc:
            raise rename_fields(exc, self.origin) from None


def rename_fields(exc: ConfigError, origin: Mapping[str, str]) -> ConfigError:
    """``exc`` with zerofit field names replaced by the config keys they came from."""
    return ConfigError.from_problems([
        Problem(origin.get(p.field, p.field), p.expected, p.found, p.hint) for p in exc.problems
    ])


def translate(ds: Mapping[str, Any], *, world_size: int = 1) -> Translation:
    """Check a DeepSpeed config and translate it into zerofit's fields (see the module docstring)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", "an integer >= 1", show(world_size))
    v = _Values()
    _walk(DEEPSPEED_KEYS, ds, "", "", v)
    notes: dict[str, str] = {}
    origin: dict[str, str] = {}
    fields: dict[str, Any] = {"world_size": world_size}
    extra: list[KeyReport] = []

    _refuse_unsupported(v)
    _batch(v, world_size, fields, notes, origin)
    fields["precision"] = _precision(v, notes)
    fields["fp16"] = _loss_scale(v, origin)
    fields["optimizer"] = _optimizer(v, notes, origin, extra)
    if "scheduler" in v:
        fields["scheduler"] = _scheduler(v, fields["optimizer"], notes, origin)
    fields["offload"] = _offload(v, notes, origin)

    clip = v.get("gradient_clipping", 0.0)
    if clip is AUTO:
        clip = 0.0
        notes["gradient_clipping"] = "auto -> 0.0 (off, zerofit's default)"
    fields["gradient_clipping"] = clip
    origin["gradient_clipping"] = v.name("gradient_clipping")
    if v.get("steps_per_print") is not None:
        fields["steps_per_print"] = v.get("steps_per_print")
    if "wall_clock_breakdown" in v:
        fields["wall_clock_breakdown"] = v.get("wall_clock_breakdown")
    for path in ("zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters"):
        if v.get(path) is AUTO:
            notes[path] = "auto: " + _PLANNER

    # Report in the config's own order (optimizer/scheduler params are checked after the main walk).
    order = {key: i for i, key in enumerate(ds)}
    report = sorted(_report(v, notes), key=lambda r: order.get(r.key.split(".")[0], len(order)))
    return Translation(fields=fields, report=tuple(report + extra), origin=origin)


def from_deepspeed(ds: Mapping[str, Any], *, world_size: int = 1) -> tuple[ZerofitConfig, tuple[KeyReport, ...]]:
    """Read a DeepSpeed config (a dict) into a validated :class:`ZerofitConfig` and its key report."""
    t = translate(ds, world_size=world_size)
    return t.validate(), t.report


def _report(v: _Values, notes: Mapping[str, str]) -> list[KeyReport]:
    out = []
    for path, written in v.written.items():
        item = v.spec[path]
        if isinstance(item, Section) and any(p.startswith(path + ".") for p in v.written):
            continue  # its keys are reported one by one
        out.append(KeyReport(written, item.status, notes.get(path, item.note)))
    return out


def _refuse_unsupported(v: _Values) -> None:
    for name in _REFUSED_WHEN_ENABLED:
        section = v.get(name)
        if isinstance(section, Mapping) and section.get("enabled") not in (None, False, AUTO):
            raise ConfigError(f"{v.name(name)}.enabled", f"false (zerofit does not implement DeepSpeed's {name})",
                              show(section.get("enabled")), f"remove the {name!r} section or disable it")
    if "sparse_attention" in v:
        raise ConfigError(v.name("sparse_attention"), "no sparse_attention section (zerofit keeps the model's "
                          "own attention)", show(v.get("sparse_attention")), "remove the section")


def _batch(v: _Values, world_size: int, fields: dict, notes: dict, origin: dict) -> None:
    ds_names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "world_size")
    given = [None if v.get(k) is AUTO else v.get(k) for k in ds_names[:3]]
    resolved = resolve_batch(*given, world_size, [v.name(k) for k in ds_names[:3]] + ["world_size"])
    for ds_name, zf_name, value in zip(ds_names, ("train_batch_size", "micro_batch_size",
                                                  "gradient_accumulation_steps"), resolved):
        fields[zf_name] = value
        origin[zf_name] = v.name(ds_name)
        if v.get(ds_name) is AUTO:
            notes[ds_name] = f"auto -> {value} (derived from the others and world_size={world_size}; " \
                             "micro batch and accumulation default to 1)"


def _precision(v: _Values, notes: dict) -> str:
    fp16, bf16 = v.get("fp16.enabled", False), v.get("bf16.enabled", False)
    if fp16 is True and bf16 is True:
        raise ConfigError(v.name("bf16.enabled"), f"at most one of {v.name('fp16.enabled')} and "
                          f"{v.name('bf16.enabled')} true", "both true",
                          "choose fp16 (with loss scaling) or bf16")
    if fp16 is True:
        precision = "fp16"
    elif bf16 is True:
        precision = "bf16"
    elif AUTO in (fp16, bf16):
        precision = "bf16"
    else:
        precision = "fp32"  # DeepSpeed's default when neither is enabled
    for path in ("fp16.enabled", "bf16.enabled"):
        if v.get(path) is AUTO:
            notes[path] = f"auto -> precision {precision} (bf16 unless the other section is enabled)"
    return precision


def _loss_scale(v: _Values, origin: dict) -> dict:
    out = {}
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "consecutive_hysteresis", "min_loss_scale"):
        if f"fp16.{key}" in v:
            out[key] = v.get(f"fp16.{key}")
        origin[f"fp16.{key}"] = v.name(f"fp16.{key}")
    return out


_ZF_OPT = OptimizerConfig()


def _optimizer(v: _Values, notes: dict, origin: dict, extra: list) -> dict:
    if "optimizer" not in v:
        extra.append(KeyReport("optimizer", MAPPED, f"not given: zerofit's AdamW with lr={_ZF_OPT.lr}, "
                               f"betas={_ZF_OPT.betas}, eps={_ZF_OPT.eps}, weight_decay={_ZF_OPT.weight_decay}"))
        return {}
    kind = v.get("optimizer.type")
    if kind is None:
        raise ConfigError(v.name("optimizer") + ".type", "'AdamW' or 'Adam'", "nothing")
    if kind.lower() not in ("adam", "adamw"):
        raise ConfigError(v.name("optimizer.type"), "'AdamW' or 'Adam' (zerofit implements AdamW only)", show(kind),
                          "zerofit's AdamW has the math of torch.optim.AdamW")
    _walk(ADAM_PARAMS, v.get("optimizer.params", {}), "optimizer.params", v.name("optimizer") + ".params", v)

    out = {}
    # DeepSpeed's Adam/AdamW defaults for absent keys; zerofit's defaults for "auto".
    for key, ds_default in (("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0.0)):
        path = f"optimizer.params.{key}"
        value = v.get(path, ds_default)
        if value is AUTO:
            value = getattr(_ZF_OPT, key)
            notes[path] = f"auto -> {value} (zerofit's default)"
        out[key] = value
        origin[f"optimizer.{key}"] = v.name(path)
    if kind.lower() == "adam":
        adam_w = v.get("optimizer.params.adam_w_mode", True)
        if not adam_w and out["weight_decay"] > 0:
            raise ConfigError(v.name("optimizer.params.adam_w_mode"), "true (decoupled weight decay, AdamW)",
                              "false with weight_decay > 0 (L2-regularised Adam)",
                              "zerofit implements AdamW only; set weight_decay 0 or adam_w_mode true")
        notes["optimizer.type"] = "Adam with adam_w_mode=true (DeepSpeed's default) is AdamW -> zerofit's AdamW"
    return out


def _scheduler(v: _Values, optimizer: dict, notes: dict, origin: dict) -> dict:
    kind = v.get("scheduler.type")
    if kind not in SCHEDULER_PARAMS:
        raise ConfigError(v.name("scheduler") + ".type", "one of " + ", ".join(map(repr, SCHEDULER_PARAMS)),
                          "nothing" if kind is None else show(kind),
                          "zerofit implements DeepSpeed's warm-up schedules, and constant/linear/cosine "
                          "in its own config")
    _walk(SCHEDULER_PARAMS[kind], v.get("scheduler.params", {}), "scheduler.params",
          v.name("scheduler") + ".params", v)

    def param(key: str, default: Any, auto_value: Any, auto_note: str) -> Any:
        path = f"scheduler.params.{key}"
        value = v.get(path, default)
        if value is AUTO:
            notes[path] = f"auto -> {auto_note}"
            return auto_value
        return value

    out: dict[str, Any] = {
        "type": kind,
        "warmup_steps": param("warmup_num_steps", 1000, 0, "0 (no warm-up beyond DeepSpeed's minimum of 2)"),
        "warmup_type": v.get("scheduler.params.warmup_type", "log"),
    }
    if kind in ("WarmupLR", "WarmupDecayLR"):
        out["warmup_min_lr"] = param("warmup_min_lr", 0.0, 0.0, "0.0")
        # DeepSpeed: WarmupLR's warmup_max_lr defaults to the optimizer's lr, WarmupDecayLR's to 0.001.
        out["warmup_max_lr"] = param("warmup_max_lr", None if kind == "WarmupLR" else 0.001, None,
                                     "the optimizer's lr")
        if kind == "WarmupDecayLR" and "scheduler.params.warmup_max_lr" not in v:
            notes["scheduler.type"] = "WarmupDecayLR without warmup_max_lr: DeepSpeed's default peak 0.001 " \
                                      f"(not the optimizer's lr {optimizer.get('lr', _ZF_OPT.lr)})"
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        if "scheduler.params.total_num_steps" not in v:
            raise ConfigError(v.name("scheduler") + ".params.total_num_steps",
                              f"the run's length in optimizer steps ({kind} needs it)", "nothing",
                              'give a number, or "auto" to have the engine supply it')
        out["total_steps"] = param("total_num_steps", None, None, "the run length, supplied by the engine")
    if kind == "WarmupCosineLR":
        out["warmup_min_ratio"] = v.get("scheduler.params.warmup_min_ratio", 0.0)
        out["min_lr_ratio"] = v.get("scheduler.params.cos_min_ratio", 0.0001)  # DeepSpeed's default
    for zf, ds in (("warmup_steps", "warmup_num_steps"), ("warmup_type", "warmup_type"),
                   ("warmup_min_lr", "warmup_min_lr"), ("warmup_max_lr", "warmup_max_lr"),
                   ("total_steps", "total_num_steps"), ("warmup_min_ratio", "warmup_min_ratio"),
                   ("min_lr_ratio", "cos_min_ratio")):
        origin[f"scheduler.{zf}"] = v.name(f"scheduler.params.{ds}")
    origin["scheduler.type"] = v.name("scheduler.type")
    return out


def _offload(v: _Values, notes: dict, origin: dict) -> dict:
    z = "zero_optimization"
    stage = v.get(f"{z}.stage", 0)
    devices = {}
    for part, legacy in (("offload_optimizer", "cpu_offload"), ("offload_param", "cpu_offload_param")):
        if v.get(f"{z}.{part}") is not None:
            devices[part] = v.get(f"{z}.{part}.device", "none")  # DeepSpeed's default device
        else:
            devices[part] = "cpu" if v.get(f"{z}.{legacy}") is True else "none"
    if devices["offload_param"] != "none" and stage != 3:
        raise ConfigError(v.name(f"{z}.offload_param.device"), f"'none' unless {z}.stage is 3",
                          f"{devices['offload_param']!r} with stage {stage}",
                          "DeepSpeed offloads parameters only in stage 3; set stage 3 or remove offload_param")
    if devices["offload_optimizer"] != "none" and stage == 0:
        raise ConfigError(v.name(f"{z}.offload_optimizer.device"), f"'none' unless {z}.stage is 1, 2 or 3",
                          f"{devices['offload_optimizer']!r} with stage 0",
                          "DeepSpeed offloads the optimizer only with ZeRO; set a stage or remove offload_optimizer")

    nvme: dict[str, str] = {}
    for part in ("offload_optimizer", "offload_param"):
        path = f"{z}.{part}.nvme_path"
        if devices[part] == "nvme":
            check = check_nvme_path(v.get(path), field=v.name(path))
            nvme[part] = v.get(path)
            notes[path] = f"-> offload.nvme_path; {check.describe()}"
        elif v.get(path) is not None:
            notes[path] = "unused: the device is not nvme"
    if len(set(nvme.values())) > 1:
        raise ConfigError(v.name(f"{z}.offload_param.nvme_path"),
                          f"the same folder as {v.name(f'{z}.offload_optimizer.nvme_path')}",
                          show(nvme["offload_param"]), "zerofit keeps its NVMe tier in one folder")

    out: dict[str, Any] = {"param_device": devices["offload_param"], "optimizer_device": devices["offload_optimizer"],
                           "nvme_path": next(iter(nvme.values()), None)}
    pins = {p: v.get(p) for p in (f"{z}.offload_optimizer.pin_memory", f"{z}.offload_param.pin_memory",
                                  f"{z}.cpu_offload_use_pin_memory") if v.get(p) is not None}
    if pins:
        out["pin_memory"] = any(pins.values())
        if len(set(pins.values())) > 1:
            for p in pins:
                notes[p] = f"-> offload.pin_memory={out['pin_memory']} (zerofit has one setting; any true wins)"
    origin.update({
        "offload.param_device": v.name(f"{z}.offload_param.device"),
        "offload.optimizer_device": v.name(f"{z}.offload_optimizer.device"),
        "offload.nvme_path": v.name(f"{z}.{next(iter(nvme), 'offload_param')}.nvme_path"),
        "offload.pin_memory": v.name(next(iter(pins), f"{z}.offload_param.pin_memory")),
    })
    if f"{z}.stage" in v:
        notes[f"{z}.stage"] = (f"stage {stage}: zerofit streams whole blocks; weights on "
                               f"{_where(devices['offload_param'])}, optimizer state on "
                               f"{_where(devices['offload_optimizer'])}")
    return out


def _where(device: str) -> str:
    return {"none": "the GPU", "cpu": "the CPU", "nvme": "NVMe"}[device]
