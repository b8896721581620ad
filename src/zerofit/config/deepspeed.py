"""Read DeepSpeed JSON configs into :class:`~zerofit.config.schema.ZerofitConfig`.

Users arrive with DeepSpeed configs copied from tutorials and Hugging Face
recipes; zerofit reads them as they are. Every DeepSpeed key is one of:

* **honoured**: same meaning, copied to the zerofit field named in the note;
* **mapped**: zerofit has its own mechanism and translates the value (for
  example ``stage3_prefetch_bucket_size``, in elements, becomes a prefetch depth
  in blocks chosen by zerofit's planner);
* **not-applicable**: zerofit decides this itself (bucket sizes, communication
  overlap, ...); the value is still type-checked.

The table of keys lives in :mod:`zerofit.config.deepspeed_keys`; :mod:`zerofit.config.deepspeed_walk`
walks a config against it, :mod:`zerofit.config.deepspeed_sections` translates its optimizer, scheduler and
offload sections, and this module the rest (batch, precision, loss scale, clipping, layout).
:func:`translate` returns a :class:`KeyReport` for every key present; the engine prints
the mapped and not-applicable ones once at start-up. An unknown key at any depth is a
:class:`ConfigError` naming its dotted path and the closest known key. Sections of DeepSpeed features
that zerofit does not implement and that would change the training math if ignored (``elasticity``,
``curriculum_learning``, ``data_efficiency``, ``progressive_layer_drop`` when enabled; ``sparse_attention``;
``amp`` when enabled) are refused rather than dropped.

Defaults. A key *absent* from a DeepSpeed config takes DeepSpeed's default, as
DeepSpeed 0.19.8 (:data:`~zerofit.config.deepspeed_keys.DEEPSPEED_VERSION`) reads it:
each key's ``default`` in the table, checked against DeepSpeed's own source by
``tests/unit/test_deepspeed_defaults.py`` (``gradient_clipping`` 1.0, ``weight_decay`` 0,
``offload_*.device`` ``none``, fp32 when neither ``fp16`` nor ``bf16`` is enabled,
``WarmupDecayLR``'s ``warmup_max_lr`` 0.001, ``steps_per_print`` none, ...). Exceptions, none of
which changes the math: ``aio.block_size`` keeps zerofit's 4 MiB request unless the config
sets it; settings DeepSpeed has no default for take zerofit's (no ``optimizer`` section:
DeepSpeed would have no optimizer to step; neither a batch size nor a micro batch size:
DeepSpeed stops, zerofit takes a micro batch of 1).

``"auto"`` (accepted where Hugging Face recipes put it) resolves the same way
every time, to what zerofit would choose on its own:

==============================================  =================================================
key                                             ``"auto"`` becomes
==============================================  =================================================
``train_batch_size``,                           derived from the other two and ``world_size``;
``train_micro_batch_size_per_gpu``,             with fewer than two given: micro batch 1,
``gradient_accumulation_steps``                 accumulation 1 (see :func:`~zerofit.config.schema.resolve_batch`)
``gradient_clipping``                           1.0 (DeepSpeed's default; transformers' max_grad_norm)
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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerofit.config.schema import (
    ConfigError,
    Problem,
    ZerofitConfig,
    resolve_batch,
    show,
)

__all__ = [
    "KeyReport",
    "Status",
    "Key",
    "Section",
    "Translation",
    "translate",
    "from_deepspeed",
    "is_deepspeed_config",
    "rename_fields",
    "DEEPSPEED_KEYS",
    "ADAM_PARAMS",
    "SCHEDULER_PARAMS",
    "DEEPSPEED_VERSION",
]

import zerofit.config.deepspeed_sections as sections
from zerofit.config.deepspeed_keys import (
    ADAM_PARAMS,
    AUTO,
    DEEPSPEED_KEYS,
    DEEPSPEED_VERSION,
    MAPPED,
    PLANNER_DECIDES,
    REFUSED_WHEN_ENABLED,
    SCHEDULER_PARAMS,
    Key,
    KeyReport,
    Section,
    Status,
    default,
)
from zerofit.config.deepspeed_walk import Values, walk

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
        try:  # the batch triple and the NVMe folder were read here, under DeepSpeed's names: not again
            return ZerofitConfig(_read=("batch", "nvme_path"), **self.fields)
        except ConfigError as exc:
            raise rename_fields(exc, self.origin) from None


def rename_fields(exc: ConfigError, origin: Mapping[str, str]) -> ConfigError:
    """``exc`` with zerofit field names replaced by the config keys they came from."""
    return ConfigError.from_problems(
        [Problem(origin.get(p.field, p.field), p.expected, p.found, p.hint) for p in exc.problems]
    )


def translate(ds: Mapping[str, Any], *, world_size: int = 1) -> Translation:
    """Check a DeepSpeed config and translate it into zerofit's fields (see the module docstring)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("world_size", "an integer >= 1", show(world_size))
    v = Values()
    walk(DEEPSPEED_KEYS, ds, "", "", v)
    notes: dict[str, str] = {}
    origin: dict[str, str] = {}
    fields: dict[str, Any] = {"world_size": world_size}
    extra: list[KeyReport] = []

    _refuse_unsupported(v)
    _batch(v, world_size, fields, notes, origin)
    fields["precision"] = _precision(v, notes)
    fields["fp16"] = _loss_scale(v, fields["precision"], notes, origin)
    fields["optimizer"] = sections.optimizer(v, notes, origin, extra)
    if "scheduler" in v:
        fields["scheduler"] = sections.scheduler(v, fields["optimizer"], notes, origin)
    fields["offload"] = sections.offload(v, notes, origin)
    if "zero_optimization.stage" in v:  # FSDP's word for the stage (docs/ranks.md)
        fields["sharding"] = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP"}.get(v.get("zero_optimization.stage", 0), "NO_SHARD")
        origin["sharding"] = v.name("zero_optimization.stage")
    _nodes_layout(v, fields, notes, origin)

    clip = v.get("gradient_clipping", default("gradient_clipping"))
    if clip is AUTO:
        clip = default("gradient_clipping")
        notes["gradient_clipping"] = f"auto -> {clip} (DeepSpeed's default, and transformers' max_grad_norm)"
    elif "gradient_clipping" not in v:
        extra.append(
            KeyReport(
                "gradient_clipping",
                MAPPED,
                f"not given: {clip} (DeepSpeed {DEEPSPEED_VERSION}'s default; 0 turns clipping off)",
            )
        )
    fields["gradient_clipping"] = float(clip)
    origin["gradient_clipping"] = v.name("gradient_clipping")
    for key in ("steps_per_print", "wall_clock_breakdown", "managed_gradient_accumulation"):
        fields[key] = v.get(key, default(key))
        origin[key] = v.name(key)
    for path in ("zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters"):
        if v.get(path) is AUTO:
            notes[path] = "auto: " + PLANNER_DECIDES

    # Report in the config's own order (optimizer/scheduler params are checked after the main walk).
    order = {key: i for i, key in enumerate(ds)}
    report = sorted(_report(v, notes), key=lambda r: order.get(r.key.split(".")[0], len(order)))
    return Translation(fields=fields, report=tuple(report + extra), origin=origin)


def from_deepspeed(ds: Mapping[str, Any], *, world_size: int = 1) -> tuple[ZerofitConfig, tuple[KeyReport, ...]]:
    """Read a DeepSpeed config (a dict) into a validated :class:`ZerofitConfig` and its key report."""
    t = translate(ds, world_size=world_size)
    return t.validate(), t.report


def _report(v: Values, notes: Mapping[str, str]) -> list[KeyReport]:
    out = []
    for path, written in v.written.items():
        item = v.spec[path]
        if isinstance(item, Section) and any(p.startswith(path + ".") for p in v.written):
            continue  # its keys are reported one by one
        out.append(KeyReport(written, item.status, notes.get(path, item.note)))
    return out


def _refuse_unsupported(v: Values) -> None:
    for name in REFUSED_WHEN_ENABLED:
        section = v.get(name)
        if isinstance(section, Mapping) and section.get("enabled") not in (None, False, AUTO):
            raise ConfigError(
                f"{v.name(name)}.enabled",
                f"false (zerofit does not implement DeepSpeed's {name})",
                show(section.get("enabled")),
                f"remove the {name!r} section or disable it",
            )
    if "sparse_attention" in v:
        raise ConfigError(
            v.name("sparse_attention"),
            "no sparse_attention section (zerofit keeps the model's own attention)",
            show(v.get("sparse_attention")),
            "remove the section",
        )


def _batch(v: Values, world_size: int, fields: dict, notes: dict, origin: dict) -> None:
    ds_names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "world_size")
    given = [None if v.get(k) is AUTO else v.get(k) for k in ds_names[:3]]
    resolved = resolve_batch(*given, world_size, [v.name(k) for k in ds_names[:3]] + ["world_size"])
    for ds_name, zf_name, value in zip(
        ds_names, ("train_batch_size", "micro_batch_size", "gradient_accumulation_steps"), resolved
    ):
        fields[zf_name] = value
        origin[zf_name] = v.name(ds_name)
        if v.get(ds_name) is AUTO:
            notes[ds_name] = (
                f"auto -> {value} (derived from the others and world_size={world_size}; "
                "micro batch and accumulation default to 1)"
            )


def _nodes_layout(v, fields: dict, notes: dict, origin: dict) -> None:
    """[Note: the nodes' layout] (engine/plan/engine_plan.py) in DeepSpeed's words: ZeRO stages 1-3 shard the optimizer
    state over every rank of every node (the full layout); ``zero_hpz_partition_size`` (ZeRO++'s hierarchical
    partitioning, the GPUs of a node) gathers the weights inside each node: the hybrid layout, each node holding the
    whole state (where hpZ keeps the optimizer state sharded over every rank). Stage 0 replicates: hybrid."""
    hpz_key = "zero_optimization.zero_hpz_partition_size"
    hpz = v.get(hpz_key, 1)
    if hpz not in (None, 0, 1):
        fields["nodes_layout"] = "hybrid"
        origin["nodes_layout"] = v.name(hpz_key)
        notes[hpz_key] = (
            f"{hpz} -> nodes_layout hybrid: on several nodes each node holds the whole state and "
            "gathers the weights inside itself (hpZ's secondary partition; zerofit keeps the optimizer "
            "state whole per node, where hpZ shards it); only gradients cross the nodes (docs/ranks.md)"
        )
    elif "zero_optimization.stage" in v:
        stage = v.get("zero_optimization.stage", 0)
        fields["nodes_layout"] = "full" if stage else "hybrid"
        origin["nodes_layout"] = v.name("zero_optimization.stage")
        notes["zero_optimization.stage"] = (
            notes.get("zero_optimization.stage", DEEPSPEED_KEYS["zero_optimization"].keys["stage"].note)
            + "; on several nodes -> nodes_layout "
            + (
                "full (the state sharded over every rank of every node; zero_hpz_partition_size = the GPUs per node "
                "names hybrid)"
                if stage
                else "hybrid (every node holds the whole state)"
            )
        )


def _precision(v: Values, notes: dict) -> str:
    fp16, bf16 = v.get("fp16.enabled", False), v.get("bf16.enabled", False)
    if fp16 is True and bf16 is True:
        raise ConfigError(
            v.name("bf16.enabled"),
            f"at most one of {v.name('fp16.enabled')} and {v.name('bf16.enabled')} true",
            "both true",
            "choose fp16 (with loss scaling) or bf16",
        )
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


def _loss_scale(v: Values, precision: str, notes: dict, origin: dict) -> dict:
    out = {}
    for key in (
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
    ):
        out[key] = v.get(f"fp16.{key}", default(f"fp16.{key}"))
        origin[f"fp16.{key}"] = v.name(f"fp16.{key}")
    if precision == "fp16" and v.get("zero_optimization.stage", default("zero_optimization.stage")) == 0:
        # [Note: fp16 without ZeRO] (optim/loss_scaler.py): DeepSpeed's FP16_Optimizer has no hysteresis
        out.update(hysteresis=1, consecutive_hysteresis=False, raise_at_min_scale=False)
        notes["fp16.enabled"] = (
            "true -> precision fp16; without ZeRO (stage 0) as DeepSpeed's FP16_Optimizer: the "
            "scale halves at every overflow (no hysteresis) and stays at min_loss_scale"
        )
        for key in ("hysteresis", "consecutive_hysteresis"):
            if f"fp16.{key}" in v:
                notes[f"fp16.{key}"] = "not used without ZeRO (stage 0): DeepSpeed's FP16_Optimizer has no hysteresis"
    return out
