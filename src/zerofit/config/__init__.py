"""zerofit's configuration: one typed, frozen :class:`ZerofitConfig`, read from whatever the user brings.

::

    from zerofit.config import load_config, render_config
    loaded = load_config("ds_config.json", world_size=2, max_gpu_memory="24GiB")
    loaded.config.micro_batch_size          # the resolved value
    for line in loaded.notices: print(line) # DeepSpeed keys zerofit mapped or decides itself
    print(render_config(loaded))            # what `zerofit config show` prints

Every bad configuration raises :class:`ConfigError` naming the field (dotted
path), what was expected and what was found, before anything is allocated.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from zerofit.config.deepspeed import KeyReport, is_deepspeed_config, translate
from zerofit.config.schema import (
    ConfigError,
    LossScaleConfig,
    LRRangeTestConfig,
    OffloadConfig,
    OneCycleConfig,
    OptimizerConfig,
    Problem,
    SchedulerConfig,
    ZerofitConfig,
    check_nvme_path,
    parse_bytes,
    resolve_batch,
    show,
)

__all__ = [
    "read_json",
    "ConfigError",
    "Problem",
    "KeyReport",
    "LoadedConfig",
    "ZerofitConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "OneCycleConfig",
    "LRRangeTestConfig",
    "LossScaleConfig",
    "OffloadConfig",
    "load_config",
    "load_with_defaults",
    "render_config",
    "format_report",
    "check_nvme_path",
    "parse_bytes",
    "resolve_batch",
]


@dataclass(frozen=True)
class LoadedConfig:
    """A resolved configuration and what happened on the way."""

    config: ZerofitConfig
    """the resolved, validated configuration"""
    report: tuple[KeyReport, ...] = ()
    """one entry per DeepSpeed key present (empty for zerofit configs)"""
    source: str = "<defaults>"
    """where it came from: a file path, ``<dict>``, ``<ZerofitConfig>`` or ``<defaults>``"""
    flavour: Literal["zerofit", "deepspeed"] = "zerofit"
    """the vocabulary the source was written in"""

    @property
    def notices(self) -> tuple[KeyReport, ...]:
        """The mapped and not-applicable keys: what the engine prints once at start-up."""
        return tuple(r for r in self.report if r.status != "honoured")


def load_config(source: Any = None, *, world_size: int | None = None, **overrides: Any) -> LoadedConfig:
    """Read a configuration from ``source`` and apply ``overrides``.

    ``source`` is one of: ``None`` (zerofit's defaults); a :class:`ZerofitConfig`
    or :class:`LoadedConfig`; a dict in DeepSpeed's vocabulary (any DeepSpeed key,
    see :func:`zerofit.config.deepspeed.is_deepspeed_config`) or in zerofit's
    (its field names, nested dicts for sections); a ``str``/``Path`` to a ``.json``
    file of either kind.

    ``world_size``: number of data-parallel ranks. For DeepSpeed configs and
    zerofit dicts/files it completes the batch triple from the fields the source
    gives (default: 1, or the zerofit source's own ``world_size``); for an
    already resolved :class:`ZerofitConfig` it is applied like an override.

    ``overrides`` are zerofit field names, top-level (``seed=1``,
    ``max_gpu_memory="24GiB"``), dotted (``**{"offload.prefetch_depth": 2}``) or
    a dict for a section (``offload={"prefetch_depth": 2}``, merged into it).
    They are applied to the resolved config, which is validated again. When an
    override changes the batch triple, ``train_batch_size`` is kept unless
    overridden too, and the field not overridden among
    ``gradient_accumulation_steps``, ``micro_batch_size``, ``train_batch_size``
    (in that order) is derived again.
    """
    loaded = _load_source(source, world_size)
    if world_size is not None and world_size != loaded.config.world_size:
        # A resolved config (ZerofitConfig, LoadedConfig) given another world size: an override.
        overrides = {"world_size": world_size, **overrides}
    if not overrides:
        return loaded
    fields = loaded.config.model_dump()
    touched = _apply_overrides(fields, overrides)
    # read once: what the source's validation resolved and checked stands unless an override touches it
    read = []
    if not touched & _BATCH:
        read.append("batch")
    if not any(k == "offload" or k.startswith("offload.") for k in touched):
        read.append("nvme_path")
    config = ZerofitConfig(_read=tuple(read), **fields)
    return LoadedConfig(config, loaded.report, loaded.source, loaded.flavour)


def load_with_defaults(source: Any, defaults: dict, **overrides: Any) -> LoadedConfig:
    """``load_config(source, **overrides)`` for a config file; without one, ``defaults`` (a dict without
    ``train_batch_size``) with the batch fields among ``overrides`` put into it, so that the batch size
    follows micro_batch_size * gradient_accumulation_steps (load_config's rules for the batch triple)."""
    if source is not None:
        return load_config(source, **overrides)
    base = dict(defaults)
    for name in ("micro_batch_size", "gradient_accumulation_steps"):
        if name in overrides:
            base[name] = overrides.pop(name)
    return load_config(base, **overrides)


def _load_source(source: Any, world_size: int | None) -> LoadedConfig:
    if source is None:
        return LoadedConfig(ZerofitConfig())
    if isinstance(source, LoadedConfig):
        return source
    if isinstance(source, ZerofitConfig):
        return LoadedConfig(source, source="<ZerofitConfig>")
    if isinstance(source, (str, os.PathLike)):
        raw, name = read_json(Path(source)), str(source)
    elif isinstance(source, Mapping):
        raw, name = source, "<dict>"
    else:
        raise ConfigError(
            "<config>", "None, a dict, a ZerofitConfig or the path of a .json file", f"a {type(source).__name__}"
        )
    if is_deepspeed_config(raw):
        t = translate(raw, world_size=1 if world_size is None else world_size)
        return LoadedConfig(t.validate(), t.report, name, "deepspeed")
    fields = copy.deepcopy(dict(raw))
    if world_size is not None:
        fields["world_size"] = world_size  # completes the triple from what the source gave, as for DeepSpeed
    return LoadedConfig(ZerofitConfig.model_validate(fields), (), name, "zerofit")


def read_json(path: Path) -> dict[str, Any]:
    """A config file's JSON object (DeepSpeed's or zerofit's); ConfigError naming the file otherwise."""
    if path.suffix.lower() != ".json":
        raise ConfigError(
            str(path), "a .json file (a DeepSpeed or zerofit config)", f"a {path.suffix or 'file without an extension'}"
        )
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(str(path), "an existing config file", "no such file") from None
    except OSError as exc:
        raise ConfigError(str(path), "a readable config file", exc.strerror or str(exc)) from None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(
                    key,
                    "each key once per object",
                    f"{key!r} twice in {path}",
                    "JSON keeps only the last one silently; remove one",
                )
            seen[key] = value
        return seen

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), "valid JSON", f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "a JSON object {...} at the top level", f"a {type(data).__name__}")
    return data


_TRIPLE_DROP_ORDER = ("gradient_accumulation_steps", "micro_batch_size", "train_batch_size")
_BATCH = {"train_batch_size", "micro_batch_size", "gradient_accumulation_steps", "world_size"}


def _apply_overrides(fields: dict[str, Any], overrides: Mapping[str, Any]) -> set[str]:
    """Write ``overrides`` into the dumped config ``fields``, in place; the keys written."""
    touched = set()
    for key, value in overrides.items():
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(key, "a field name such as 'seed' or 'offload.prefetch_depth'", show(key))
        node = fields
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})  # an unknown section is reported by validation, with a suggestion
            if not isinstance(child, dict):
                raise ConfigError(
                    ".".join(parts[: i + 1]), f"a section, to set {key!r} inside it", f"the value {show(child)}"
                )
            node = child
        leaf = parts[-1]
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = _merged(node[leaf], value)
        else:
            node[leaf] = copy.deepcopy(value)
        touched.add(key)
    # The batch triple: keep what was overridden, derive one field again (see load_config).
    batch = touched & _BATCH
    if batch:
        for name in _TRIPLE_DROP_ORDER:
            if name not in batch:
                fields.pop(name, None)
                break
    return touched


def _merged(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merged(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def format_report(report: tuple[KeyReport, ...] | list[KeyReport], *, include_honoured: bool = False) -> str:
    """The report as aligned lines, one key per line (mapped and not-applicable only, by default)."""
    rows = [r for r in report if include_honoured or r.status != "honoured"]
    if not rows:
        return ""
    width = max(len(r.key) for r in rows)
    return "\n".join(f"  {r.key:<{width}}  {r.status:<14}  {r.note}".rstrip() for r in rows)


def render_config(loaded: LoadedConfig) -> str:
    """A readable resolved configuration: the zerofit config as JSON, then the DeepSpeed key report."""
    origin = "defaults" if loaded.source == "<defaults>" else f"{loaded.flavour} config {loaded.source}"
    if loaded.flavour == "deepspeed":
        from zerofit.config.deepspeed_keys import DEEPSPEED_VERSION

        origin += f"; a key it leaves out takes the defaults of DeepSpeed {DEEPSPEED_VERSION}"
    lines = [f"zerofit configuration (from {origin})", json.dumps(loaded.config.model_dump(mode="json"), indent=2)]
    if loaded.report:
        counts = {s: sum(r.status == s for r in loaded.report) for s in ("honoured", "mapped", "not-applicable")}
        lines.append("DeepSpeed keys (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + "):")
        lines.append(format_report(loaded.report, include_honoured=True))
    return "\n".join(lines)
