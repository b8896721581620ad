"""Read DeepSpeed JSON configs into :class:`~zerofit.config.schema.ZerofitConfig`.

Users arrive with DeepSpeed configs copied from tutorials and Hugging Face
recipes; zerofit reads them as they are. Every DeepSpeed key is one of:

* **honoured**: same meaning, copied to the zerofit field named in the note;
* **mapped**: zerofit has its own mechanism and translates the value (for
  example ``stage3_prefetch_bucket_size``, in elements, becomes a prefetch depth
  in blocks chosen by zerofit's planner);
* **not-applicable**: zerofit decides this itself (bucket sizes, communication
  overlap, ...); the value is still type-checked.

The table of keys lives in :mod:`zerofit.config.deepspeed_keys`; this module walks a
config against it. :func:`translate` returns a :class:`KeyReport` for every key present; the engine
prints the mapped and not-applicable ones once at start-up. An unknown key at
any depth is a :class:`ConfigError` naming its dotted path and the closest known
key. Sections of DeepSpeed features that zerofit does not implement and that
would change the training math if ignored (``elasticity``, ``curriculum_learning``,
``data_efficiency``, ``progressive_layer_drop`` when enabled; ``sparse_attention``;
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
    OptimizerConfig,
    Problem,
    ZerofitConfig,
    check_nvme_path,
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

from zerofit.config.deepspeed_keys import (
    ADAM_PARAMS,
    AUTO,
    DEEPSPEED_KEYS,
    DEEPSPEED_VERSION,
    KNOWN_PATHS,
    MAPPED,
    NO_DEFAULT,
    PLANNER_DECIDES,
    REFUSED_WHEN_ENABLED,
    SCHEDULER_PARAMS,
    TORCH_ADAMW_WEIGHT_DECAY,
    BadValue,
    Key,
    KeyReport,
    Section,
    Status,
    default,
)
from zerofit.config.errors import close_match


class _Values:
    """Checked values by canonical dotted path, plus the spelling the user wrote for each."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.written: dict[str, str] = {}  # canonical path -> path as written (aliases kept)
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
    guess = close_match(key, names)
    if guess is not None:
        hint = f"did you mean {_join(written_parent, guess)!r}?"
    else:
        # A known key in the wrong place, or a close one anywhere.
        leaves = {p.rpartition(".")[2]: p for p in KNOWN_PATHS}
        far = close_match(key, list(leaves))
        if far:
            hint = f"did you mean {leaves[far]!r}?"
        elif len(spec) <= 16:
            hint = f"known keys here: {', '.join(spec)}"
        else:
            hint = "see DeepSpeed's configuration reference for the keys of this section"
    if not written_parent and key in ZerofitConfig.model_fields:
        hint = (
            f"{key!r} is a zerofit field: this dict mixes DeepSpeed and zerofit keys; "
            "pass zerofit fields as overrides instead"
        )
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
            raise ConfigError(
                here, "one spelling of this key", f"both {out.written[path]!r} and {here!r}", "remove one of them"
            )
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
            except BadValue:
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
    v = _Values()
    _walk(DEEPSPEED_KEYS, ds, "", "", v)
    notes: dict[str, str] = {}
    origin: dict[str, str] = {}
    fields: dict[str, Any] = {"world_size": world_size}
    extra: list[KeyReport] = []

    _refuse_unsupported(v)
    _batch(v, world_size, fields, notes, origin)
    fields["precision"] = _precision(v, notes)
    fields["fp16"] = _loss_scale(v, fields["precision"], notes, origin)
    fields["optimizer"] = _optimizer(v, notes, origin, extra)
    if "scheduler" in v:
        fields["scheduler"] = _scheduler(v, fields["optimizer"], notes, origin)
    fields["offload"] = _offload(v, notes, origin)
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


def _report(v: _Values, notes: Mapping[str, str]) -> list[KeyReport]:
    out = []
    for path, written in v.written.items():
        item = v.spec[path]
        if isinstance(item, Section) and any(p.startswith(path + ".") for p in v.written):
            continue  # its keys are reported one by one
        out.append(KeyReport(written, item.status, notes.get(path, item.note)))
    return out


def _refuse_unsupported(v: _Values) -> None:
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


def _batch(v: _Values, world_size: int, fields: dict, notes: dict, origin: dict) -> None:
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


def _precision(v: _Values, notes: dict) -> str:
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


def _loss_scale(v: _Values, precision: str, notes: dict, origin: dict) -> dict:
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


_ZF_OPT = OptimizerConfig()


def _optimizer(v: _Values, notes: dict, origin: dict, extra: list) -> dict:
    if "optimizer" not in v:
        extra.append(
            KeyReport(
                "optimizer",
                MAPPED,
                f"not given: zerofit's AdamW with lr={_ZF_OPT.lr}, "
                f"betas={_ZF_OPT.betas}, eps={_ZF_OPT.eps}, weight_decay={_ZF_OPT.weight_decay}",
            )
        )
        return {}
    kind = v.get("optimizer.type")
    if kind is None:
        raise ConfigError(v.name("optimizer") + ".type", "'AdamW' or 'Adam'", "nothing")
    if kind.lower() not in ("adam", "adamw"):
        raise ConfigError(
            v.name("optimizer.type"),
            "'AdamW' or 'Adam' (zerofit implements AdamW only)",
            show(kind),
            "zerofit's AdamW has the math of torch.optim.AdamW",
        )
    params = v.get("optimizer.params", {})
    if isinstance(params, Mapping) and "max_grad_norm" in params:
        raise ConfigError(
            v.name("optimizer") + ".params.max_grad_norm",
            f"no max_grad_norm (DeepSpeed {DEEPSPEED_VERSION} refuses it as an optimizer parameter)",
            show(params["max_grad_norm"]),
            "set the top-level gradient_clipping instead",
        )
    _walk(ADAM_PARAMS, params, "optimizer.params", v.name("optimizer") + ".params", v)

    adam_w = kind.lower() == "adamw" or v.get("optimizer.params.adam_w_mode", default("optimizer.params.adam_w_mode"))
    out = {}
    # DeepSpeed's Adam/AdamW defaults for absent keys (its own Adam kernels' defaults, or torch.optim.AdamW's with
    # torch_adam: weight_decay 0.01); zerofit's defaults for "auto".
    torch_adamw = adam_w and v.get("optimizer.params.torch_adam", default("optimizer.params.torch_adam"))
    for key in ("lr", "betas", "eps", "weight_decay"):
        path = f"optimizer.params.{key}"
        ds_default = TORCH_ADAMW_WEIGHT_DECAY if key == "weight_decay" and torch_adamw else default(path)
        value = v.get(path, ds_default)
        if value is AUTO:
            value = getattr(_ZF_OPT, key)
            notes[path] = f"auto -> {value} (zerofit's default)"
        out[key] = value
        origin[f"optimizer.{key}"] = v.name(path)
    if kind.lower() == "adam":
        if not adam_w and out["weight_decay"] > 0:
            raise ConfigError(
                v.name("optimizer.params.adam_w_mode"),
                "true (decoupled weight decay, AdamW)",
                "false with weight_decay > 0 (L2-regularised Adam)",
                "zerofit implements AdamW only; set weight_decay 0 or adam_w_mode true",
            )
        notes["optimizer.type"] = "Adam with adam_w_mode=true (DeepSpeed's default) is AdamW -> zerofit's AdamW"
    return out


def _scheduler(v: _Values, optimizer: dict, notes: dict, origin: dict) -> dict:
    kind = v.get("scheduler.type")
    if kind not in SCHEDULER_PARAMS:
        raise ConfigError(
            v.name("scheduler") + ".type",
            "one of " + ", ".join(map(repr, SCHEDULER_PARAMS)),
            "nothing" if kind is None else show(kind),
            "zerofit implements DeepSpeed's schedules, and constant/linear/cosine in its own "
            "config; DeepSpeed's torch.optim.lr_scheduler names are not read from a config: pass "
            "the torch scheduler as zerofit.deepspeed.initialize(lr_scheduler=...)",
        )
    _walk(SCHEDULER_PARAMS[kind], v.get("scheduler.params", {}), "scheduler.params", v.name("scheduler") + ".params", v)
    origin["scheduler.type"] = v.name("scheduler.type")
    if kind in _OWN_SECTION:
        return _cyclic_scheduler(v, kind, origin)

    def param(key: str, auto_value: Any = None, auto_note: str = "") -> Any:
        """The key's value; DeepSpeed's default when absent (the table's); ``auto_value`` for "auto"."""
        path = f"scheduler.params.{key}"
        value = v.get(path, default(path, kind))
        if value is AUTO:
            notes[path] = f"auto -> {auto_note}"
            return auto_value
        return value

    out: dict[str, Any] = {
        "type": kind,
        "warmup_steps": param("warmup_num_steps", 0, "0 (no warm-up beyond DeepSpeed's minimum of 2)"),
        "warmup_type": param("warmup_type"),
    }
    if kind in ("WarmupLR", "WarmupDecayLR"):
        out["warmup_min_lr"] = param("warmup_min_lr", 0.0, "0.0")
        # DeepSpeed: WarmupLR's warmup_max_lr defaults to the optimizer's lr (None), WarmupDecayLR's to 0.001.
        out["warmup_max_lr"] = param("warmup_max_lr", None, "the optimizer's lr")
        if kind == "WarmupDecayLR" and "scheduler.params.warmup_max_lr" not in v:
            notes["scheduler.type"] = (
                "WarmupDecayLR without warmup_max_lr: DeepSpeed's default peak 0.001 "
                f"(not the optimizer's lr {optimizer.get('lr', _ZF_OPT.lr)})"
            )
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        if "scheduler.params.total_num_steps" not in v:
            raise ConfigError(
                v.name("scheduler") + ".params.total_num_steps",
                f"the run's length in optimizer steps ({kind} needs it)",
                "nothing",
                'give a number, or "auto" to have the engine supply it',
            )
        out["total_steps"] = param("total_num_steps", None, "the run length, supplied by the engine")
    if kind == "WarmupCosineLR":
        out["warmup_min_ratio"] = param("warmup_min_ratio")
        out["min_lr_ratio"] = param("cos_min_ratio")
    for zf, ds in (
        ("warmup_steps", "warmup_num_steps"),
        ("warmup_type", "warmup_type"),
        ("warmup_min_lr", "warmup_min_lr"),
        ("warmup_max_lr", "warmup_max_lr"),
        ("total_steps", "total_num_steps"),
        ("warmup_min_ratio", "warmup_min_ratio"),
        ("min_lr_ratio", "cos_min_ratio"),
    ):
        origin[f"scheduler.{zf}"] = v.name(f"scheduler.params.{ds}")
    return out


# DeepSpeed's OneCycle and LRRangeTest: their parameters go to a section of their own (zerofit field -> DeepSpeed key)
_OWN_SECTION = {
    "OneCycle": ("one_cycle", {k: k for k in SCHEDULER_PARAMS["OneCycle"] if k != "last_batch_iteration"}),
    "LRRangeTest": (
        "lr_range_test",
        {
            "min_lr": "lr_range_test_min_lr",
            "step_size": "lr_range_test_step_size",
            "step_rate": "lr_range_test_step_rate",
            "staircase": "lr_range_test_staircase",
        },
    ),
}


def _cyclic_scheduler(v: _Values, kind: str, origin: dict) -> dict:
    section, names = _OWN_SECTION[kind]
    params = {}
    for zf, ds in names.items():
        path = f"scheduler.params.{ds}"
        value = v.get(path, default(path, kind))
        if value is NO_DEFAULT:
            raise ConfigError(
                v.name("scheduler") + f".params.{ds}",
                f"a number ({kind} needs it)",
                "nothing",
                f"DeepSpeed's {kind} requires {ds}",
            )
        params[zf] = value
        origin[f"scheduler.{section}.{zf}"] = v.name(path)
    return {"type": kind, section: params}


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
        raise ConfigError(
            v.name(f"{z}.offload_param.device"),
            f"'none' unless {z}.stage is 3",
            f"{devices['offload_param']!r} with stage {stage}",
            "DeepSpeed offloads parameters only in stage 3; set stage 3 or remove offload_param",
        )
    if devices["offload_optimizer"] != "none" and stage == 0:
        raise ConfigError(
            v.name(f"{z}.offload_optimizer.device"),
            f"'none' unless {z}.stage is 1, 2 or 3",
            f"{devices['offload_optimizer']!r} with stage 0",
            "DeepSpeed offloads the optimizer only with ZeRO; set a stage or remove offload_optimizer",
        )

    nvme: dict[str, str] = {}
    for part in ("offload_optimizer", "offload_param"):
        path = f"{z}.{part}.nvme_path"
        if devices[part] == "nvme":
            check = check_nvme_path(v.get(path), field=v.name(path))
            nvme[part] = v.get(path)
            notes[path] = (
                f"-> offload.nvme_path; {check.describe()}; the disk tier's swap file goes there, "
                "sized by the plan (only what max_host_memory cannot hold)"
            )
        elif v.get(path) is not None:
            notes[path] = "unused: the device is not nvme"
    notes.update(_device_notes(z, devices))
    if len(set(nvme.values())) > 1:
        raise ConfigError(
            v.name(f"{z}.offload_param.nvme_path"),
            f"the same folder as {v.name(f'{z}.offload_optimizer.nvme_path')}",
            show(nvme["offload_param"]),
            "zerofit keeps its NVMe tier in one folder",
        )

    out: dict[str, Any] = {
        "param_device": devices["offload_param"],
        "optimizer_device": devices["offload_optimizer"],
        "nvme_path": next(iter(nvme.values()), None),
    }
    # DeepSpeed's aio block: its request size, and its requests in flight (queue depth x threads)
    if v.get("aio.block_size") is not None:
        out["nvme_block_size"] = max(4096, -(-int(v.get("aio.block_size")) // 4096) * 4096)
        origin["offload.nvme_block_size"] = v.name("aio.block_size")
    # (DeepSpeed 0.19.8's threads per request are intra_op_parallelism; thread_count is its older name)
    threads = v.get("aio.intra_op_parallelism", v.get("aio.thread_count"))
    if v.get("aio.queue_depth") is not None or threads is not None:
        depth = int(v.get("aio.queue_depth", default("aio.queue_depth")))
        out["nvme_queue_depth"] = max(1, min(256, depth * int(threads or default("aio.intra_op_parallelism"))))
        origin["offload.nvme_queue_depth"] = v.name("aio.queue_depth")
    pins = {
        p: v.get(p)
        for p in (
            f"{z}.offload_optimizer.pin_memory",
            f"{z}.offload_param.pin_memory",
            f"{z}.cpu_offload_use_pin_memory",
        )
        if v.get(p) is not None
    }
    if pins:
        out["pin_memory"] = any(pins.values())
        if len(set(pins.values())) > 1:
            for p in pins:
                notes[p] = f"-> offload.pin_memory={out['pin_memory']} (zerofit has one setting; any true wins)"
    origin.update(
        {
            "offload.param_device": v.name(f"{z}.offload_param.device"),
            "offload.optimizer_device": v.name(f"{z}.offload_optimizer.device"),
            "offload.nvme_path": v.name(f"{z}.{next(iter(nvme), 'offload_param')}.nvme_path"),
            "offload.pin_memory": v.name(next(iter(pins), f"{z}.offload_param.pin_memory")),
        }
    )
    if f"{z}.stage" in v:
        if "none" in devices.values():
            notes[f"{z}.stage"] = (
                f"stage {stage}: every block stays on the GPU with its optimizer state (zerofit "
                "offloads whole blocks, and only when offload_param and offload_optimizer are "
                "both set)"
            )
        else:
            notes[f"{z}.stage"] = (
                f"stage {stage}: zerofit streams whole blocks; weights "
                f"{_where(devices['offload_param'])}, optimizer state "
                f"{_where(devices['offload_optimizer'])}"
            )
    return out


def _where(device: str) -> str:
    return {
        "cpu": "in host memory (the planner keeps on the GPU what fits)",
        "nvme": "in host memory first, what max_host_memory cannot hold on the disk tier under nvme_path",
    }[device]


def _device_notes(z: str, devices: Mapping[str, str]) -> dict[str, str]:
    """What each offload device key becomes for the values given, in the words of what the plan will do."""
    opt, param = devices["offload_optimizer"], devices["offload_param"]
    notes = {}
    if opt == "nvme":
        notes[f"{z}.offload_optimizer.device"] = (
            "nvme -> the disk tier: the optimizer state host memory cannot "
            "hold (max_host_memory) goes to a swap file under nvme_path, Adam "
            "moments first, then master weights, streamed around each CPU "
            "update; the rest stays in host memory (the engine logs the "
            "placement)"
        )
    elif opt == "cpu" and param == "none":
        notes[f"{z}.offload_optimizer.device"] = (
            "cpu, but without offload_param every block's weights stay on "
            "the GPU, and zerofit updates a block where its weights live: the "
            "optimizer state stays on the GPU too (the engine logs the "
            "placement and a warning); add offload_param cpu (stage 3) to "
            "move it to host memory"
        )
    elif opt == "cpu":
        notes[f"{z}.offload_optimizer.device"] = (
            "cpu -> host memory for the blocks the planner streams; blocks it "
            "keeps on the GPU (and the shell, when it fits) keep their state "
            "there (the engine logs the placement)"
        )
    if param != "none" and opt == "none":
        notes[f"{z}.offload_param.device"] = (
            f"{param}, but without offload_optimizer zerofit keeps every block on "
            "the GPU with its optimizer state (the engine logs a warning)"
        )
    elif param == "nvme":
        notes[f"{z}.offload_param.device"] = (
            "nvme -> the 16-bit weights a step reads stay in host memory (read "
            "once per forward and backward); it enables the disk tier for the "
            "optimizer state, as offload_optimizer nvme does"
        )
    elif param == "cpu":
        notes[f"{z}.offload_param.device"] = (
            "cpu -> blocks stream from host memory; the planner keeps on the GPU "
            "those that fit (offload.resident_blocks bounds them)"
        )
    return notes
