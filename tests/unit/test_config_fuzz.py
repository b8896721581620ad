"""Property-based fuzzing of the configuration (RELIABILITY.md: "bad configuration is refused early").

Generated valid configs (DeepSpeed and zerofit vocabularies) load and round-trip
unchanged; one mutation (an unknown key at any depth, a wrong type, a negative
size, an inconsistent batch triple, NVMe without a usable path) always raises
ConfigError naming the mutated field.

    .venv/bin/python -m pytest tests/unit/test_config_fuzz.py -q
"""

from __future__ import annotations

import copy
import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zerofit.config import ConfigError, ZerofitConfig, load_config
from zerofit.config.deepspeed_keys import (
    ADAM_PARAMS,
    DEEPSPEED_KEYS,
    SCHEDULER_PARAMS,
    Anything,
    Betas,
    Bool,
    Choice,
    Float,
    Int,
    Key,
    Section,
    Text,
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NVME_DIR = tempfile.mkdtemp(prefix="zerofit-nvme-")  # a usable folder for valid NVMe configs
A_FILE = Path(NVME_DIR) / "a_file"
A_FILE.write_text("not a folder")

# ---------------------------------------------------------------------------
# Values of each kind
# ---------------------------------------------------------------------------


@functools.cache
def valid_value(kind) -> st.SearchStrategy:
    if isinstance(kind, Int):
        hi = kind.hi if kind.hi is not None else kind.lo + 10**9
        s = st.integers(kind.lo, hi) | st.integers(max(kind.lo, 0), min(hi, 10**6)).map(float)
        return s | st.none() if kind.nullable else s
    if isinstance(kind, Float):
        hi = kind.hi if kind.hi is not None else 1e6
        return st.floats(kind.lo, hi, exclude_min=kind.lo_open, exclude_max=kind.hi_open, allow_nan=False)
    if isinstance(kind, Bool):
        return st.booleans() | st.none() if kind.nullable else st.booleans()
    if isinstance(kind, Choice):
        return st.sampled_from(kind.values)
    if isinstance(kind, Text):
        return st.text(max_size=8) | st.none() if kind.nullable else st.text(max_size=8)
    if isinstance(kind, Betas):
        return st.lists(st.floats(0, 0.999), min_size=2, max_size=2)
    assert isinstance(kind, Anything)
    return st.just({})


_NOT_STRINGS = st.sampled_from([[1], {"a": 1}, [], {}])


@functools.cache
def invalid_value(kind) -> st.SearchStrategy:
    """A value of the wrong type (or outside the allowed set) for ``kind``; never "auto"."""
    if isinstance(kind, Int):
        return st.sampled_from(["7", "x", True, 1.5, [1], {}] + ([] if kind.nullable else [None]))
    if isinstance(kind, Float):
        return st.sampled_from(["1.0", "x", True, [0.1], {}, None, float("nan"), float("inf")])
    if isinstance(kind, Bool):
        return st.sampled_from(["true", "yes", 1, 0, [True], {}] + ([] if kind.nullable else [None]))
    if isinstance(kind, Choice):
        return st.sampled_from(["no-such-choice", 12345, [1], {}, 2.5]).filter(lambda v: v not in kind.values)
    if isinstance(kind, Text):
        return st.sampled_from([5, 1.5, True, [1], {}] + ([] if kind.nullable else [None]))
    if isinstance(kind, Betas):
        return st.sampled_from([[0.9], [0.9, 1.5], "0.9,0.99", 0.9, [0.9, "x"], None, [0.9, 0.99, 0.999]])
    raise AssertionError(kind)


def negative_value(kind) -> st.SearchStrategy:
    if isinstance(kind, Int):
        return st.integers(-(10**9), kind.lo - 1) | st.just(-5e8).filter(lambda v: v < kind.lo)
    return st.floats(-1e9, -1e-9)


# ---------------------------------------------------------------------------
# Valid DeepSpeed configs
# ---------------------------------------------------------------------------

# Leaves set explicitly by the generator (they interact), not drawn from the table.
_ZERO_EXPLICIT = {
    "stage",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
}
_RANDOM_SECTIONS = (
    "aio",
    "activation_checkpointing",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "flops_profiler",
    "data_types",
)


@functools.cache
def _leaf_names(spec_id: int, skip: frozenset, max_keys: int) -> st.SearchStrategy:
    spec = _SPECS[spec_id]
    names = sorted(n for n, item in spec.items() if isinstance(item, Key) and n not in skip)
    return st.lists(st.sampled_from(names), unique=True, max_size=max_keys)


@functools.cache
def _auto_or(kind) -> st.SearchStrategy:
    return st.just("auto") | valid_value(kind)


_SPECS: dict[int, dict] = {}


def _random_leaves(draw, spec: dict, skip=frozenset(), max_keys=6) -> dict:
    """A random subset of ``spec``'s leaf keys with valid values ("auto" where allowed)."""
    _SPECS[id(spec)] = spec
    out = {}
    for name in draw(_leaf_names(id(spec), frozenset(skip), max_keys)):
        item = spec[name]
        out[name] = draw(_auto_or(item.kind) if item.auto else valid_value(item.kind))
    return out


_TOP_KEYS = {n: i for n, i in DEEPSPEED_KEYS.items() if isinstance(i, Key)}


@st.composite
def deepspeed_configs(draw) -> tuple[dict, int]:
    world = draw(st.integers(1, 4))
    micro, accum = draw(st.integers(1, 16)), draw(st.integers(1, 8))
    triple = {
        "train_batch_size": micro * accum * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
    }
    cfg: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(sorted(triple)), unique=True)):
        cfg[key] = draw(st.sampled_from([triple[key], "auto"]))

    # precision: never both enabled
    fp16, bf16 = draw(
        st.sampled_from(
            [
                (None, None),
                (True, None),
                (None, True),
                (False, True),
                (True, False),
                ("auto", None),
                ("auto", "auto"),
                (False, False),
            ]
        )
    )
    if fp16 is not None:
        cfg["fp16"] = {"enabled": fp16, **_random_leaves(draw, DEEPSPEED_KEYS["fp16"].keys, skip={"enabled"})}
    if bf16 is not None:
        cfg[draw(st.sampled_from(["bf16", "bfloat16"]))] = {"enabled": bf16}

    if draw(st.booleans()):
        kind = draw(st.sampled_from(["AdamW", "Adam", "adamw"]))
        params = _random_leaves(draw, ADAM_PARAMS, skip={"adam_w_mode"})
        if kind == "Adam" and draw(st.booleans()):
            params.update(adam_w_mode=False, weight_decay=0.0)
        cfg["optimizer"] = {"type": kind, "params": params}

    if draw(st.booleans()):
        kind = draw(st.sampled_from(sorted(SCHEDULER_PARAMS)))
        required = {
            "WarmupDecayLR": ["total_num_steps"],
            "WarmupCosineLR": ["total_num_steps"],
            "OneCycle": ["cycle_min_lr", "cycle_max_lr"],
        }.get(kind, [])
        params = _random_leaves(draw, SCHEDULER_PARAMS[kind], skip=set(required))
        for key in required:
            params[key] = draw(
                st.integers(1, 10**6) | st.just("auto")
                if key == "total_num_steps"
                else valid_value(SCHEDULER_PARAMS[kind][key].kind)
            )
        cfg["scheduler"] = {"type": kind, "params": params}

    stage = draw(st.integers(0, 3))
    zero: dict[str, Any] = {
        "stage": stage,
        **_random_leaves(draw, DEEPSPEED_KEYS["zero_optimization"].keys, skip=_ZERO_EXPLICIT, max_keys=10),
    }
    nvme_path = draw(st.sampled_from([NVME_DIR, str(Path(NVME_DIR) / "sub" / "dir")]))
    if stage >= 1 and draw(st.booleans()):
        device = draw(st.sampled_from(["none", "cpu", "nvme"]))
        zero["offload_optimizer"] = {
            "device": device,
            "pin_memory": draw(st.booleans()),
            **({"nvme_path": nvme_path} if device == "nvme" else {}),
        }
    if stage == 3 and draw(st.booleans()):
        device = draw(st.sampled_from(["none", "cpu", "nvme"]))
        zero["offload_param"] = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
    cfg["zero_optimization"] = zero  # always present: makes the dict DeepSpeed-flavoured

    for name in draw(st.lists(st.sampled_from(_RANDOM_SECTIONS), unique=True, max_size=3)):
        cfg[name] = _random_leaves(draw, DEEPSPEED_KEYS[name].keys)
    cfg.update(_random_leaves(draw, _TOP_KEYS, skip=set(triple), max_keys=4))
    return cfg, world


def _tables_at(cfg: dict) -> list[tuple[list[str], dict, dict]]:
    """Every checked object in ``cfg``: (path, the object, its key table)."""
    out = []

    def visit(path, node, spec):
        out.append((path, node, spec))
        for key, value in node.items():
            name = key if key in spec else next((n for n, i in spec.items() if key in i.aliases), None)
            item = spec.get(name)
            if isinstance(item, Section) and item.keys is not None and isinstance(value, dict):
                visit(path + [key], value, item.keys)
        if path == ["optimizer"] and isinstance(node.get("params"), dict):
            out.append((path + ["params"], node["params"], ADAM_PARAMS))
        if path == ["scheduler"] and isinstance(node.get("params"), dict):
            out.append((path + ["params"], node["params"], SCHEDULER_PARAMS[node["type"]]))

    visit([], cfg, DEEPSPEED_KEYS)
    return out


def _leaves_at(cfg: dict) -> list[tuple[list[str], dict, str, Key]]:
    """Every leaf present in ``cfg``: (path of its object, the object, key, its spec)."""
    out = []
    for path, node, spec in _tables_at(cfg):
        alias = {a: n for n, i in spec.items() for a in i.aliases}
        for key in node:
            item = spec.get(key) or spec.get(alias.get(key))
            if isinstance(item, Key):
                out.append((path, node, key, item))
    return out


def _raises_naming(field: str, source, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kw)
    assert info.value.field == field, str(info.value)
    text = str(info.value)
    assert field in text and "expected" in text and "found" in text and "pydantic" not in text
    return info.value


# ---------------------------------------------------------------------------
# DeepSpeed vocabulary
# ---------------------------------------------------------------------------


@FUZZ
@given(deepspeed_configs())
def test_valid_deepspeed_configs_load_and_round_trip(cfg_world):
    cfg, world = cfg_world
    loaded = load_config(cfg, world_size=world)
    config = loaded.config
    assert loaded.flavour == "deepspeed" and config.world_size == world
    assert config.train_batch_size == config.micro_batch_size * config.gradient_accumulation_steps * world
    assert load_config(config.model_dump()).config == config
    assert load_config(json.loads(json.dumps(config.model_dump(mode="json")))).config == config
    assert load_config(cfg, world_size=world) == loaded  # resolved the same way every time
    assert {r.status for r in loaded.report} <= {"honoured", "mapped", "not-applicable"}


@FUZZ
@given(deepspeed_configs(), st.data())
def test_unknown_key_at_any_depth(cfg_world, data):
    cfg, world = cfg_world
    cfg = copy.deepcopy(cfg)
    path, node, spec = data.draw(st.sampled_from(_tables_at(cfg)))
    key = "zz_" + data.draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12))
    node[key] = data.draw(st.integers() | st.text(max_size=3) | st.just({}))
    _raises_naming(".".join(path + [key]), cfg, world_size=world)


@FUZZ
@given(deepspeed_configs(), st.data())
def test_wrong_type_names_the_field(cfg_world, data):
    cfg, world = cfg_world
    cfg = copy.deepcopy(cfg)
    typed = [(p, n, k, i) for p, n, k, i in _leaves_at(cfg) if not isinstance(i.kind, Anything)]
    path, node, key, item = data.draw(st.sampled_from(typed))
    node[key] = data.draw(invalid_value(item.kind))
    _raises_naming(".".join(path + [key]), cfg, world_size=world)


@FUZZ
@given(deepspeed_configs(), st.data())
def test_negative_size_names_the_field(cfg_world, data):
    cfg, world = cfg_world
    cfg = copy.deepcopy(cfg)
    numeric = [(p, n, k, i) for p, n, k, i in _leaves_at(cfg) if isinstance(i.kind, (Int, Float))]
    assume(numeric)
    path, node, key, item = data.draw(st.sampled_from(numeric))
    node[key] = data.draw(negative_value(item.kind))
    _raises_naming(".".join(path + [key]), cfg, world_size=world)


@FUZZ
@given(world=st.integers(1, 8), micro=st.integers(1, 64), accum=st.integers(1, 64), train=st.integers(1, 4096))
def test_inconsistent_batch_triple_deepspeed(world, micro, accum, train):
    assume(train != micro * accum * world)
    cfg = {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum}
    err = _raises_naming("train_batch_size", cfg, world_size=world)
    assert (
        f"train_batch_size ({train}) != train_micro_batch_size_per_gpu ({micro}) * "
        f"gradient_accumulation_steps ({accum}) * world_size ({world}) = {micro * accum * world}"
    ) in str(err)


@FUZZ
@given(world=st.integers(1, 8), other=st.integers(1, 64), train=st.integers(1, 4096), which=st.booleans())
def test_fractional_batch_triple_deepspeed(world, other, train, which):
    assume(train % (other * world) != 0)
    given_key, derived = (
        ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        if which
        else ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu")
    )
    cfg = {"train_batch_size": train, given_key: other, "zero_optimization": {}}
    err = _raises_naming(derived, cfg, world_size=world)
    assert f"train_batch_size ({train}) / ({given_key} ({other}) * world_size ({world}))" in str(err)


_UNUSABLE = [None, "", str(A_FILE), str(A_FILE / "below")]


@FUZZ
@given(deepspeed_configs(), st.data())
def test_nvme_without_usable_path(cfg_world, data):
    cfg, world = cfg_world
    cfg = copy.deepcopy(cfg)
    part = data.draw(st.sampled_from(["offload_param", "offload_optimizer"]))
    cfg["zero_optimization"]["stage"] = 3
    cfg["zero_optimization"].pop("offload_param" if part == "offload_optimizer" else "offload_optimizer", None)
    section = {"device": "nvme"}
    path = data.draw(st.sampled_from(_UNUSABLE))
    if path is not None or data.draw(st.booleans()):
        section["nvme_path"] = path
    cfg["zero_optimization"][part] = section
    _raises_naming(f"zero_optimization.{part}.nvme_path", cfg, world_size=world)


# ---------------------------------------------------------------------------
# zerofit vocabulary
# ---------------------------------------------------------------------------

_POS = st.integers(1, 10**6)
_ZF_SECTIONS = {
    "fp16": {
        "loss_scale": st.floats(0, 1e6),
        "initial_scale_power": st.integers(0, 64),
        "loss_scale_window": _POS,
        "hysteresis": st.integers(1, 8),
        "consecutive_hysteresis": st.booleans(),
        "min_loss_scale": st.floats(1e-6, 1e6),
    },
    "optimizer": {
        "lr": st.floats(1e-9, 10, exclude_min=True),
        "betas": st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)),
        "eps": st.floats(1e-12, 1e-3),
        "weight_decay": st.floats(0, 1),
    },
    "scheduler": {
        "type": st.sampled_from(["constant", "linear", "cosine", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]),
        "warmup_steps": st.integers(0, 10**5),
        "total_steps": st.none() | _POS,
        "warmup_min_lr": st.floats(0, 1),
        "warmup_max_lr": st.none() | st.floats(1e-9, 1),
        "warmup_type": st.sampled_from(["log", "linear"]),
        "min_lr_ratio": st.floats(0, 1),
        "warmup_min_ratio": st.floats(0, 1),
    },
    "offload": {
        "param_device": st.sampled_from(["none", "cpu"]),
        "optimizer_device": st.sampled_from(["none", "cpu"]),
        "pin_memory": st.booleans(),
        "prefetch_depth": st.none() | st.integers(1, 64),
        "resident_blocks": st.none() | st.integers(0, 1000),
    },
}
_ZF_TOP = {
    "precision": st.sampled_from(["fp32", "bf16", "fp16"]),
    "gradient_clipping": st.floats(0, 100),
    "activation_checkpointing": st.booleans(),
    "max_gpu_memory": st.none() | st.integers(0, 2**40) | st.sampled_from(["24GiB", "1.5GB", "512MiB"]),
    "max_host_memory": st.none() | st.integers(0, 2**42),
    "seed": st.integers(0, 2**31),
    "steps_per_print": _POS,
    "wall_clock_breakdown": st.booleans(),
}


@st.composite
def zerofit_configs(draw) -> dict:
    world = draw(st.integers(1, 4))
    micro, accum = draw(st.integers(1, 16)), draw(st.integers(1, 8))
    triple = {
        "train_batch_size": micro * accum * world,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": accum,
    }
    cfg: dict[str, Any] = {"world_size": world} if draw(st.booleans()) or world > 1 else {}
    for key in draw(st.lists(st.sampled_from(sorted(triple)), unique=True)):
        cfg[key] = triple[key]
    for key in draw(st.lists(st.sampled_from(sorted(_ZF_TOP)), unique=True)):
        cfg[key] = draw(_ZF_TOP[key])
    for section in draw(st.lists(st.sampled_from(sorted(_ZF_SECTIONS)), unique=True)):
        fields = _ZF_SECTIONS[section]
        keys = draw(st.lists(st.sampled_from(sorted(fields)), unique=True))
        cfg[section] = {k: draw(fields[k]) for k in keys}
    if draw(st.booleans()):
        offload = cfg.setdefault("offload", {})
        offload[draw(st.sampled_from(["param_device", "optimizer_device"]))] = "nvme"
        offload["nvme_path"] = NVME_DIR
    return cfg


# Wrong values for zerofit's fields: the field's dotted path -> values of the wrong type or out of range.
_ZF_WRONG = {
    "train_batch_size": ["8", 8.0, True, [8]],
    "micro_batch_size": ["1", 1.0, False],
    "gradient_accumulation_steps": ["2", 2.5],
    "world_size": ["1", 1.0, None],
    "precision": ["fp8", "BF16", 16, None],
    "gradient_clipping": ["1", True, None, float("nan")],
    "activation_checkpointing": ["yes", 1, None],
    "max_gpu_memory": ["lots", True, [1], "24 parsecs"],
    "seed": ["0", 0.5, None],
    "steps_per_print": ["10", 10.0],
    "wall_clock_breakdown": ["false", 0],
    "fp16": [1, "x", [1]],
    "optimizer": [1, "adamw"],
    "offload": [[], "cpu"],
    "fp16.loss_scale": ["0", True],
    "fp16.initial_scale_power": [16.0, "16", 65],
    "fp16.hysteresis": ["2", 2.0],
    "fp16.consecutive_hysteresis": ["no", 1],
    "fp16.min_loss_scale": ["1", None],
    "optimizer.lr": ["1e-3", None, True],
    "optimizer.betas": [[0.9], "0.9", [0.9, 1.0], [0.9, "x"]],
    "optimizer.eps": ["1e-8"],
    "optimizer.type": ["sgd", 1, None],
    "optimizer.weight_decay": ["0.1", None],
    "scheduler.type": ["OneCycleLR", 1],
    "scheduler.warmup_steps": ["10", 1.5],
    "scheduler.total_steps": ["100", 0],
    "scheduler.warmup_type": ["cosine"],
    "scheduler.min_lr_ratio": [1.5, "0"],
    "offload.param_device": ["gpu", None, 1],
    "offload.pin_memory": ["true"],
    "offload.prefetch_depth": [65, "2"],
    "offload.resident_blocks": ["1", 1.5],
}
_ZF_NEGATIVE = [
    "train_batch_size",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "gradient_clipping",
    "max_gpu_memory",
    "max_host_memory",
    "seed",
    "steps_per_print",
    "fp16.loss_scale",
    "fp16.initial_scale_power",
    "fp16.loss_scale_window",
    "fp16.hysteresis",
    "fp16.min_loss_scale",
    "optimizer.lr",
    "optimizer.eps",
    "optimizer.weight_decay",
    "scheduler.warmup_steps",
    "scheduler.total_steps",
    "scheduler.warmup_min_lr",
    "scheduler.warmup_max_lr",
    "scheduler.min_lr_ratio",
    "scheduler.warmup_min_ratio",
    "offload.prefetch_depth",
    "offload.resident_blocks",
]


def _put(cfg: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


@FUZZ
@given(zerofit_configs())
def test_valid_zerofit_configs_load_and_round_trip(cfg):
    loaded = load_config(cfg)
    config = loaded.config
    assert loaded.flavour == "zerofit"
    assert load_config(config.model_dump()).config == config
    assert load_config(json.loads(json.dumps(config.model_dump(mode="json")))).config == config
    assert ZerofitConfig(**config.model_dump()) == config


@FUZZ
@given(zerofit_configs(), st.data())
def test_zerofit_unknown_key_at_any_depth(cfg, data):
    cfg = copy.deepcopy(cfg)
    where = data.draw(st.sampled_from([None, *sorted(_ZF_SECTIONS)]))
    key = "zz_" + data.draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12))
    dotted = key if where is None else f"{where}.{key}"
    _put(cfg, dotted, data.draw(st.integers() | st.text(max_size=3)))
    _raises_naming(dotted, cfg)


@FUZZ
@given(zerofit_configs(), st.data())
def test_zerofit_wrong_type_names_the_field(cfg, data):
    cfg = copy.deepcopy(cfg)
    dotted = data.draw(st.sampled_from(sorted(_ZF_WRONG)))
    _put(cfg, dotted, data.draw(st.sampled_from(_ZF_WRONG[dotted])))
    _raises_naming(dotted, cfg)


@FUZZ
@given(zerofit_configs(), st.data())
def test_zerofit_negative_size_names_the_field(cfg, data):
    cfg = copy.deepcopy(cfg)
    dotted = data.draw(st.sampled_from(_ZF_NEGATIVE))
    _put(cfg, dotted, data.draw(st.integers(-(10**9), -1) | st.floats(-1e9, -1e-9)))
    _raises_naming(dotted, cfg)


@FUZZ
@given(world=st.integers(1, 8), micro=st.integers(1, 64), accum=st.integers(1, 64), train=st.integers(1, 4096))
def test_inconsistent_batch_triple_zerofit(world, micro, accum, train):
    assume(train != micro * accum * world)
    cfg = {
        "train_batch_size": train,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": accum,
        "world_size": world,
    }
    err = _raises_naming("train_batch_size", cfg)
    assert (
        f"train_batch_size ({train}) != micro_batch_size ({micro}) * gradient_accumulation_steps ({accum}) "
        f"* world_size ({world}) = {micro * accum * world}"
    ) in str(err)


@FUZZ
@given(zerofit_configs(), st.data())
def test_zerofit_nvme_without_usable_path(cfg, data):
    cfg = copy.deepcopy(cfg)
    offload = cfg.setdefault("offload", {})
    offload[data.draw(st.sampled_from(["param_device", "optimizer_device"]))] = "nvme"
    path = data.draw(st.sampled_from(_UNUSABLE))
    offload.pop("nvme_path", None)
    if path is not None or data.draw(st.booleans()):
        offload["nvme_path"] = path
    _raises_naming("offload.nvme_path", cfg)
