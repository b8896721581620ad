"""Configuration: fixtures, DeepSpeed keys, "auto", the batch triple, NVMe, overrides, errors.

.venv/bin/python -m pytest tests/unit/test_config.py -q
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from zerofit.config import (
    ConfigError,
    KeyReport,
    LoadedConfig,
    ZerofitConfig,
    format_report,
    load_config,
    parse_bytes,
    render_config,
)
from zerofit.config.deepspeed import (
    ADAM_PARAMS,
    DEEPSPEED_KEYS,
    SCHEDULER_PARAMS,
    Section,
    is_deepspeed_config,
)

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared fixtures not present")

# The Hugging Face Trainer's ZeRO-3 recipe, "auto" everywhere it puts it.
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _error(source, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kw)
    return info.value


def _statuses(loaded: LoadedConfig) -> dict[str, str]:
    return {r.key: r.status for r in loaded.report}


# ---------------------------------------------------------------------------
# The shared fixtures
# ---------------------------------------------------------------------------


@needs_fixtures
def test_fixture_single_gpu_tuned():
    loaded = load_config(FIXTURES / "single_gpu_tuned.json")
    c = loaded.config
    assert loaded.flavour == "deepspeed" and loaded.source.endswith("single_gpu_tuned.json")
    # only micro batch and accumulation given: train_batch_size derived
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps, c.world_size) == (8, 1, 8, 1)
    assert c.precision == "fp16" and c.gradient_clipping == 1.0
    assert (
        c.fp16.initial_scale_power,
        c.fp16.min_loss_scale,
        c.fp16.hysteresis,
        c.fp16.loss_scale_window,
        c.fp16.loss_scale,
    ) == (16, 1.0, 2, 100, 0.0)
    assert (c.optimizer.lr, c.optimizer.weight_decay, c.optimizer.betas, c.optimizer.eps) == (
        5e-5,
        0.01,
        (0.9, 0.999),
        1e-8,
    )
    assert (c.offload.param_device, c.offload.optimizer_device, c.offload.pin_memory) == ("cpu", "cpu", True)
    assert c.offload.prefetch_depth is None  # the planner decides from stage3_prefetch_bucket_size's budget
    assert c.scheduler.type == "constant"
    s = _statuses(loaded)
    assert s["zero_optimization.stage3_prefetch_bucket_size"] == "mapped"
    assert s["zero_optimization.contiguous_gradients"] == "not-applicable"
    assert s["zero_optimization.reduce_bucket_size"] == "not-applicable"
    assert s["zero_optimization.offload_optimizer.buffer_count"] == "not-applicable"
    assert s["zero_optimization.offload_param.device"] == "mapped"  # the planner keeps on the GPU what fits
    assert s["train_micro_batch_size_per_gpu"] == "honoured"
    assert all(r.status != "honoured" for r in loaded.notices)
    assert len(loaded.report) == 23  # every key present, once


@needs_fixtures
def test_fixture_two_gpu_zero3():
    one = load_config(FIXTURES / "two_gpu_zero3.json").config
    assert (one.train_batch_size, one.micro_batch_size, one.gradient_accumulation_steps) == (8, 8, 1)
    loaded = load_config(FIXTURES / "two_gpu_zero3.json", world_size=2)
    c = loaded.config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps, c.world_size) == (16, 8, 1, 2)
    assert c.precision == "fp16" and c.fp16 == ZerofitConfig().fp16  # DeepSpeed's fp16 defaults
    # no offload_param: DeepSpeed keeps the parameters on the GPU (partitioned across ranks)
    assert (c.offload.param_device, c.offload.optimizer_device) == ("none", "cpu")
    assert c.optimizer == ZerofitConfig().optimizer  # no optimizer section: zerofit's AdamW defaults
    s = _statuses(loaded)
    assert s["optimizer"] == "mapped"
    assert s["zero_optimization.allgather_partitions"] == s["zero_optimization.reduce_scatter"] == "not-applicable"


@needs_fixtures
def test_fixture_zero3_cpu_offload():
    c = load_config(FIXTURES / "zero3_cpu_offload.json").config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (32, 8, 4)
    assert (c.optimizer.lr, c.optimizer.weight_decay) == (6e-5, 0.01)
    assert c.precision == "fp16" and c.fp16.loss_scale_window == 100
    assert (c.offload.param_device, c.offload.optimizer_device) == ("none", "cpu")
    assert load_config(FIXTURES / "zero3_cpu_offload.json", world_size=2).config.micro_batch_size == 4
    err = _error(FIXTURES / "zero3_cpu_offload.json", world_size=3)
    assert err.field == "train_micro_batch_size_per_gpu"
    assert "train_batch_size (32) / (gradient_accumulation_steps (4) * world_size (3))" in str(err)


@needs_fixtures
@pytest.mark.parametrize("name", ["single_gpu_tuned.json", "two_gpu_zero3.json", "zero3_cpu_offload.json"])
def test_fixtures_round_trip(name):
    c = load_config(FIXTURES / name).config
    assert load_config(c.model_dump()).config == c
    assert load_config(json.loads(json.dumps(c.model_dump(mode="json")))).config == c


# ---------------------------------------------------------------------------
# The key table covers DeepSpeed's documented keys
# ---------------------------------------------------------------------------

CONFIG_MD_KEYS = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer.type",
    "optimizer.params",
    "scheduler.type",
    "scheduler.params",
    "fp16.enabled",
    "fp16.loss_scale",
    "fp16.initial_scale_power",
    "fp16.loss_scale_window",
    "fp16.hysteresis",
    "fp16.min_loss_scale",
    "bf16.enabled",
    "zero_optimization.stage",
    *(
        f"zero_optimization.offload_optimizer.{k}"
        for k in ("device", "nvme_path", "pin_memory", "buffer_count", "fast_init", "ratio")
    ),
    *(
        f"zero_optimization.offload_param.{k}"
        for k in ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu")
    ),
    *(
        f"zero_optimization.{k}"
        for k in (
            "overlap_comm",
            "contiguous_gradients",
            "allgather_partitions",
            "allgather_bucket_size",
            "reduce_scatter",
            "reduce_bucket_size",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "sub_group_size",
            "stage3_gather_16bit_weights_on_model_save",
        )
    ),
    *(f"aio.{k}" for k in ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events")),
    "activation_checkpointing.partition_activations",
    "activation_checkpointing.cpu_checkpointing",
    "steps_per_print",
    "wall_clock_breakdown",
    "tensorboard",
    "wandb",
    "csv_monitor",
]


def _lookup(path: str):
    node: dict = DEEPSPEED_KEYS
    item = None
    for part in path.split("."):
        item = node[part]
        node = item.keys if isinstance(item, Section) and item.keys is not None else {}
    return item


@pytest.mark.parametrize("path", CONFIG_MD_KEYS)
def test_every_config_md_key_is_known(path):
    item = _lookup(path)
    assert item.status in ("honoured", "mapped", "not-applicable")


def _leaves(spec, prefix=""):
    for name, item in spec.items():
        yield prefix + name, item
        if isinstance(item, Section) and item.keys is not None:
            yield from _leaves(item.keys, prefix + name + ".")


def test_every_key_that_is_not_honoured_says_why():
    tables = [DEEPSPEED_KEYS, ADAM_PARAMS, *SCHEDULER_PARAMS.values()]
    for table in tables:
        for path, item in _leaves(table):
            if item.status != "honoured" and not (isinstance(item, Section) and item.keys is not None):
                assert item.note, path


# ---------------------------------------------------------------------------
# "auto"
# ---------------------------------------------------------------------------


def test_hugging_face_recipe_auto_resolution():
    loaded = load_config(HF_ZERO3, world_size=4)
    c = loaded.config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (4, 1, 1)
    assert c.precision == "bf16"  # fp16.enabled "auto" and no explicit choice: zerofit's bf16
    assert c.gradient_clipping == 1.0  # "auto": DeepSpeed's default (and transformers' max_grad_norm)
    assert c.optimizer == ZerofitConfig().optimizer
    assert (
        c.scheduler.type,
        c.scheduler.warmup_min_lr,
        c.scheduler.warmup_max_lr,
        c.scheduler.warmup_steps,
        c.scheduler.total_steps,
    ) == ("WarmupDecayLR", 0.0, None, 0, None)
    assert c.steps_per_print == 2000
    notes = {r.key: r.note for r in loaded.report}
    assert notes["train_batch_size"].startswith("auto -> 4")
    assert notes["optimizer.params.lr"] == "auto -> 0.001 (zerofit's default)"
    assert notes["fp16.enabled"].startswith("auto -> precision bf16")
    assert notes["zero_optimization.stage3_prefetch_bucket_size"].startswith("auto")
    assert _statuses(loaded)["zero_optimization.reduce_bucket_size"] == "not-applicable"
    # the same every time
    assert load_config(HF_ZERO3, world_size=4) == loaded


def test_auto_batch_sizes_derive_from_the_others():
    c = load_config(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4},
        world_size=2,
    ).config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (64, 8, 4)
    c = load_config(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}
    ).config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (2, 2, 1)


def test_auto_precision():
    assert load_config({"bf16": {"enabled": "auto"}, "fp16": {"enabled": True}}).config.precision == "fp16"
    assert load_config({"bf16": {"enabled": "auto"}}).config.precision == "bf16"
    assert load_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": False}}).config.precision == "bf16"


def test_auto_is_refused_where_huggingface_never_puts_it():
    err = _error({"zero_optimization": {"stage": "auto"}})
    assert err.field == "zero_optimization.stage"


# ---------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------


def test_fp16_and_bf16_together_is_an_error():
    err = _error({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert err.field == "bf16.enabled" and "fp16.enabled" in str(err)


def test_neither_precision_is_fp32_as_in_deepspeed():
    assert load_config({"train_micro_batch_size_per_gpu": 2}).config.precision == "fp32"
    assert load_config({"fp16": {"enabled": False}, "bf16": {"enabled": False}}).config.precision == "fp32"


def test_bfloat16_alias():
    loaded = load_config({"bfloat16": {"enabled": True}})
    assert loaded.config.precision == "bf16"
    assert _statuses(loaded)["bfloat16.enabled"] == "honoured"
    err = _error({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})
    assert err.field == "bf16" and "bfloat16" in str(err)


# ---------------------------------------------------------------------------
# Unknown keys, wrong types, negative sizes
# ---------------------------------------------------------------------------


def test_unknown_key_names_path_and_suggests():
    err = _error({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}})
    assert err.field == "zero_optimization.offload_param.pin_memroy"
    assert "did you mean 'zero_optimization.offload_param.pin_memory'?" in str(err)


def test_a_misspelled_deepspeed_section_is_suggested_though_the_dict_reads_as_zerofits():
    """With its one DeepSpeed section misspelled, the rest of the dict (train_batch_size) is read as zerofit's:
    the hint still names DeepSpeed's key."""
    err = _error({"train_batch_size": 8, "zero_optimisation": {"stage": 3}})
    assert err.field == "zero_optimisation"
    assert "did you mean DeepSpeed's 'zero_optimization'?" in str(err)


def test_known_key_in_the_wrong_place_is_pointed_home():
    err = _error({"train_micro_batch_size_per_gpu": 1, "stage3_prefetch_bucket_size": 5e8})
    assert err.field == "stage3_prefetch_bucket_size"
    assert "zero_optimization.stage3_prefetch_bucket_size" in str(err)


def test_zerofit_field_inside_a_deepspeed_config():
    err = _error({"zero_optimization": {"stage": 3}, "max_gpu_memory": "24GiB"})
    assert err.field == "max_gpu_memory" and "override" in str(err)


def test_unknown_optimizer_and_scheduler_params():
    err = _error({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decy": 0.1}}})
    assert err.field == "optimizer.params.weight_decy" and "optimizer.params.weight_decay" in str(err)
    # WarmupCosineLR takes its peak from the optimizer: warmup_max_lr is not one of its params
    err = _error({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_max_lr": 1}}})
    assert err.field == "scheduler.params.warmup_max_lr"


@pytest.mark.parametrize(
    "config, field",
    [
        ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage"),
        ({"fp16": {"enabled": "true"}}, "fp16.enabled"),
        ({"train_batch_size": 8.5}, "train_batch_size"),
        ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping"),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device"),
        ({"zero_optimization": []}, "zero_optimization"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
        ({"aio": {"thread_count": 0}}, "aio.thread_count"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, "scheduler.params.warmup_type"),
        ({"fp16": {"enabled": True, "initial_scale_power": 99}}, "fp16.initial_scale_power"),
    ],
)
def test_wrong_types_name_the_field(config, field):
    err = _error(config)
    assert err.field == field and "expected" in str(err) and "found" in str(err)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"stage3_prefetch_bucket_size": -5e8}}, "zero_optimization.stage3_prefetch_bucket_size"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": -1}}},
            "zero_optimization.offload_param.buffer_size",
        ),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
        ({"gradient_accumulation_steps": -2, "zero_optimization": {}}, "gradient_accumulation_steps"),
        ({"gradient_clipping": -1.0, "zero_optimization": {}}, "gradient_clipping"),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale"),
    ],
)
def test_negative_sizes_name_the_field(config, field):
    assert _error(config).field == field


def test_error_messages_are_plain():
    for config in (
        {"train_batch_size": "x", "zero_optimization": {}},
        {"micro_batch_size": "x"},
        {"offload": {"prefetch_depth": 0}},
    ):
        text = str(_error(config))
        assert "pydantic" not in text and "errors.pydantic.dev" not in text


# ---------------------------------------------------------------------------
# The batch triple
# ---------------------------------------------------------------------------


def test_inconsistent_triple_shows_the_arithmetic_zerofit_names():
    err = _error({"train_batch_size": 32, "micro_batch_size": 4, "gradient_accumulation_steps": 4})
    assert err.field == "train_batch_size"
    assert (
        "train_batch_size (32) != micro_batch_size (4) * gradient_accumulation_steps (4) * world_size (1) = 16"
        in str(err)
    )


def test_inconsistent_triple_shows_the_arithmetic_deepspeed_names():
    err = _error({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4})
    assert (
        "train_batch_size (30) != train_micro_batch_size_per_gpu (4) * gradient_accumulation_steps (4) "
        "* world_size (1) = 16"
    ) in str(err)


def test_fractional_triple():
    err = _error({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    assert err.field == "gradient_accumulation_steps"
    assert "train_batch_size (30) / (train_micro_batch_size_per_gpu (4) * world_size (1)) = 7.5" in str(err)


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"train_batch_size": 24, "micro_batch_size": 3}, (24, 3, 4)),
        ({"train_batch_size": 24, "gradient_accumulation_steps": 2}, (24, 6, 2)),
        ({"micro_batch_size": 3, "gradient_accumulation_steps": 2}, (12, 3, 2)),
        ({"train_batch_size": 24}, (24, 12, 1)),
        ({"micro_batch_size": 5}, (10, 5, 1)),
        ({"gradient_accumulation_steps": 3}, (6, 1, 3)),
        ({}, (2, 1, 1)),
    ],
)
def test_any_two_determine_the_third(given, expected):
    c = ZerofitConfig(world_size=2, **given)
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == expected


# ---------------------------------------------------------------------------
# NVMe
# ---------------------------------------------------------------------------


def _nvme(path, part="offload_param"):
    section = {"device": "nvme"} if path is None else {"device": "nvme", "nvme_path": path}
    return {"zero_optimization": {"stage": 3, part: section}}


def test_nvme_with_usable_path(tmp_path):
    loaded = load_config(_nvme(str(tmp_path)))
    assert (loaded.config.offload.param_device, loaded.config.offload.nvme_path) == ("nvme", str(tmp_path))
    note = {r.key: r.note for r in loaded.report}["zero_optimization.offload_param.nvme_path"]
    assert "writable" in note and "GiB free" in note
    creatable = tmp_path / "not" / "yet"
    assert load_config(_nvme(str(creatable), "offload_optimizer")).config.offload.optimizer_device == "nvme"
    assert not creatable.exists()  # checking creates nothing


def test_nvme_without_usable_path(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for path in (None, "", str(a_file), str(a_file / "below")):
        err = _error(_nvme(path))
        assert err.field == "zero_optimization.offload_param.nvme_path", path
    err = _error(_nvme(None, "offload_optimizer"))
    assert err.field == "zero_optimization.offload_optimizer.nvme_path"
    err = _error({"offload": {"optimizer_device": "nvme", "nvme_path": str(a_file)}})
    assert err.field == "offload.nvme_path"


def test_offload_report_says_what_the_plan_does(tmp_path):
    """The offload keys are reported by what zerofit does with them, not as DeepSpeed's meaning: the disk tier
    holds only what host memory cannot, and optimizer state follows its block's weights onto the GPU."""

    def report(zero):
        loaded = load_config({"zero_optimization": zero})
        return {r.key.removeprefix("zero_optimization."): (r.status, r.note) for r in loaded.report}

    r = report({"stage": 2, "offload_optimizer": {"device": "cpu"}})
    status, note = r["offload_optimizer.device"]
    assert status == "mapped" and "optimizer state stays on the GPU" in note, note
    assert "every block stays on the GPU" in r["stage"][1]

    r = report(
        {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        }
    )
    for key in ("offload_optimizer.device", "offload_param.device", "offload_optimizer.nvme_path"):
        status, note = r[key]
        assert status == "mapped" and ("disk tier" in note or "swap file" in note), (key, note)
    assert "on the disk tier under nvme_path" in r["stage"][1] and "host memory first" in r["stage"][1]
    r = report(
        {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_param": {"device": "cpu"},
        }
    )
    loaded = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                "offload_param": {"device": "cpu"},
            },
            "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 2},
        }
    )
    assert loaded.config.offload.nvme_block_size == 1 << 20 and loaded.config.offload.nvme_queue_depth == 16
    aio = {r.key: r.status for r in loaded.report if r.key.startswith("aio.")}
    assert aio["aio.block_size"] == aio["aio.queue_depth"] == aio["aio.thread_count"] == "mapped", aio

    r = report({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})
    assert "host memory for the blocks the planner streams" in r["offload_optimizer.device"][1]
    assert "keeps on the GPU those that fit" in r["offload_param.device"][1]
    assert all(status != "honoured" for key, (status, _) in r.items() if key.endswith(".device"))


def test_nvme_paths_must_agree(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "a")},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "b")},
        }
    }
    assert _error(config).field == "zero_optimization.offload_param.nvme_path"


# ---------------------------------------------------------------------------
# Optimizer, scheduler, offload and refused features
# ---------------------------------------------------------------------------


def test_optimizer_mapping():
    c = load_config({"optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95]}}}).config
    assert (c.optimizer.lr, c.optimizer.betas, c.optimizer.weight_decay) == (3e-4, (0.8, 0.95), 0.0)
    err = _error({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}})
    assert err.field == "optimizer.params.adam_w_mode"
    assert load_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).config.optimizer.lr == 1e-3
    assert _error({"optimizer": {"type": "Lamb", "params": {}}}).field == "optimizer.type"
    assert (
        _error({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}).field
        == "optimizer.params.max_grad_norm"
    )
    assert _error({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}).field == "optimizer.params.amsgrad"


def test_scheduler_mapping():
    c = load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}).config.scheduler
    assert (c.type, c.warmup_steps, c.warmup_min_lr, c.warmup_max_lr, c.warmup_type) == (
        "WarmupLR",
        100,
        0.0,
        None,
        "log",
    )
    c = load_config({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}}).config.scheduler
    assert (c.warmup_steps, c.warmup_max_lr, c.total_steps) == (1000, 0.001, 500)  # DeepSpeed's defaults
    c = load_config(
        {
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": 500,
                    "warmup_num_steps": 10,
                    "warmup_min_ratio": 0.1,
                    "cos_min_ratio": 0.02,
                    "warmup_type": "linear",
                },
            }
        }
    ).config.scheduler
    assert (c.type, c.total_steps, c.warmup_steps, c.warmup_min_ratio, c.min_lr_ratio, c.warmup_type) == (
        "WarmupCosineLR",
        500,
        10,
        0.1,
        0.02,
        "linear",
    )
    assert (
        load_config(
            {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5}}}
        ).config.scheduler.min_lr_ratio
        == 0.0001
    )
    err = _error({"scheduler": {"type": "WarmupDecayLR", "params": {}}})
    assert err.field == "scheduler.params.total_num_steps"
    assert _error({"scheduler": {"type": "CyclicLR", "params": {}}}).field == "scheduler.type"
    assert _error({"scheduler": {"type": "OneCycle", "params": {}}}).field == "scheduler.params.cycle_min_lr"
    assert (
        _error({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}}).field
        == "scheduler.params.last_batch_iteration"
    )


def test_offload_rules():
    err = _error({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert err.field == "zero_optimization.offload_param.device"
    err = _error({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert err.field == "zero_optimization.offload_optimizer.device"
    c = load_config({"zero_optimization": {"stage": 2, "cpu_offload": True}}).config
    assert (c.offload.param_device, c.offload.optimizer_device) == ("none", "cpu")
    c = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu", "pin_memory": False},
                "offload_optimizer": None,
            }
        }
    ).config
    assert (c.offload.param_device, c.offload.optimizer_device, c.offload.pin_memory) == ("cpu", "none", False)
    c = load_config({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1e7}})  # pydantic field name
    assert _statuses(c)["zero_optimization.prefetch_bucket_size"] == "mapped"
    err = _error({"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}})
    assert err.field == "zero_optimization.prefetch_bucket_size"


@pytest.mark.parametrize(
    "config, field",
    [
        ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity.enabled"),
        ({"progressive_layer_drop": {"enabled": True}}, "progressive_layer_drop.enabled"),
        ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp.enabled"),
        ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ],
)
def test_features_that_would_change_the_math_are_refused(config, field):
    assert _error(config).field == field


def test_disabled_features_and_sinks_are_reported():
    loaded = load_config(
        {
            "elasticity": {"enabled": False},
            "tensorboard": {"enabled": True, "output_path": "tb"},
            "flops_profiler": {"enabled": True, "profile_step": 1},
            "activation_checkpointing": {"partition_activations": True},
        }
    )
    assert {k: s for k, s in _statuses(loaded).items() if k not in ("optimizer", "gradient_clipping")} == {
        "elasticity": "not-applicable",
        "tensorboard.enabled": "not-applicable",
        "tensorboard.output_path": "not-applicable",
        "flops_profiler.enabled": "not-applicable",
        "flops_profiler.profile_step": "not-applicable",
        "activation_checkpointing.partition_activations": "not-applicable",
    }
    assert loaded.config.activation_checkpointing is True


# ---------------------------------------------------------------------------
# load_config: sources, overrides, rendering
# ---------------------------------------------------------------------------


def test_sources(tmp_path):
    assert load_config().config == ZerofitConfig() and load_config().source == "<defaults>"
    c = ZerofitConfig(seed=3)
    assert load_config(c).config is c
    loaded = load_config({"seed": 3, "offload": {"prefetch_depth": 2}})
    assert loaded.flavour == "zerofit" and loaded.report == () and loaded.config.offload.prefetch_depth == 2
    assert load_config(loaded) is loaded
    path = tmp_path / "zf.json"
    path.write_text(json.dumps({"micro_batch_size": 2, "precision": "fp32"}))
    assert load_config(str(path)).config.precision == "fp32" and load_config(path).source == str(path)


def test_bad_sources(tmp_path):
    assert _error(tmp_path / "missing.json").field.endswith("missing.json")
    (tmp_path / "c.yaml").write_text("a: 1")
    assert "a .json file" in str(_error(tmp_path / "c.yaml"))
    (tmp_path / "bad.json").write_text('{"train_batch_size": 8,}')
    assert "line 1" in str(_error(tmp_path / "bad.json"))
    (tmp_path / "dup.json").write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    assert _error(tmp_path / "dup.json").field == "stage"
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "JSON object" in str(_error(tmp_path / "list.json"))
    assert _error(42).field == "<config>"


def test_overrides():
    base = {"train_batch_size": 32, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}}
    c = load_config(base, **{"offload.prefetch_depth": 3}, seed=7, max_gpu_memory="24GiB").config
    assert (c.offload.prefetch_depth, c.seed, c.max_gpu_memory) == (3, 7, 24 * 2**30)
    c = load_config(base, offload={"nvme_path": None, "prefetch_depth": 4}).config
    assert c.offload.prefetch_depth == 4 and c.offload.param_device == "none"  # merged, not replaced
    # batch triple: train_batch_size is kept, the other field is derived again
    c = load_config(base, micro_batch_size=2).config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (32, 2, 16)
    c = load_config(base, gradient_accumulation_steps=2).config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (32, 16, 2)
    c = load_config(base, micro_batch_size=2, gradient_accumulation_steps=2).config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (4, 2, 2)
    c = load_config({"micro_batch_size": 4, "gradient_accumulation_steps": 8}, world_size=2).config
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps, c.world_size) == (64, 4, 8, 2)
    assert _error(base, micro_batch_size=3).field == "gradient_accumulation_steps"
    err = _error(base, **{"offload.prefech_depth": 2})
    assert err.field == "offload.prefech_depth" and "offload.prefetch_depth" in str(err)
    assert _error(base, **{"seed.value": 1}).field == "seed"
    assert _error(base, **{"offload.prefetch_depth": 0}).field == "offload.prefetch_depth"


def test_render_config_and_report():
    loaded = load_config(HF_ZERO3)
    text = render_config(loaded)
    first, rest = text.split("\n", 1)
    assert first == (
        "zerofit configuration (from deepspeed config <dict>; a key it leaves out takes the defaults "
        "of DeepSpeed 0.19.8)"
    )
    body = rest[: rest.index("\nDeepSpeed keys")]
    assert ZerofitConfig.model_validate(json.loads(body)) == loaded.config
    assert "zero_optimization.overlap_comm" in text and "not-applicable" in text
    short = format_report(loaded.notices)
    assert "honoured" not in short and "zero_optimization.reduce_bucket_size" in short
    assert str(KeyReport("a.b", "mapped", "why")) == "a.b [mapped]: why"
    assert "DeepSpeed keys" not in render_config(load_config())


# ---------------------------------------------------------------------------
# Odds and ends
# ---------------------------------------------------------------------------


def test_zerofit_config_raises_config_error_directly():
    with pytest.raises(ConfigError) as info:
        ZerofitConfig(precision="fp8")
    assert info.value.field == "precision" and "'fp32', 'bf16' or 'fp16'" in str(info.value)
    with pytest.raises(ConfigError):
        ZerofitConfig.model_validate({"micro_batch_size": 0})
    assert isinstance(info.value, ValueError)


def test_config_error_survives_pickling():
    err = _error({"train_batch_size": 30, "micro_batch_size": 4})
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is ConfigError and again.field == err.field and str(again) == str(err)


def test_several_problems_are_listed():
    err = _error({"seed": -1, "precision": "fp8"})
    assert len(err.problems) == 2 and "2 configuration problems" in str(err)


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(1024) == 1024 and parse_bytes(None) is None
    for bad in ("lots", -1, True, float("inf"), [1]):
        with pytest.raises(ConfigError):
            parse_bytes(bad, "max_host_memory")


def test_flavour_detection():
    assert is_deepspeed_config({"zero_optimization": {}})
    assert is_deepspeed_config({"optimizer": {"type": "AdamW", "params": {}}})
    assert is_deepspeed_config({"optimizer": {"type": "AdamW"}})
    assert is_deepspeed_config({"fp16": {"enabled": True}})
    assert is_deepspeed_config({"activation_checkpointing": {}})
    assert not is_deepspeed_config({"train_batch_size": 8, "fp16": {"hysteresis": 3}})
    assert not is_deepspeed_config(ZerofitConfig().model_dump())


@pytest.mark.parametrize("stage,word", [(3, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (1, "NO_SHARD"), (0, "NO_SHARD")])
def test_zero_stage_maps_to_fsdp_sharding_words(stage, word):
    """DeepSpeed's stage is read as FSDP's word for it (docs/ranks.md); zerofit's own config takes the words."""
    from zerofit.config import load_config

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage}}
    loaded = load_config(ds, world_size=2)
    assert loaded.config.sharding == word
    assert loaded.config.world_size == 2 and loaded.config.train_batch_size == 4
    assert load_config({"sharding": word}).config.sharding == word
    with pytest.raises(ConfigError, match="sharding"):
        load_config({"sharding": "HYBRID"})


def test_a_deepspeed_config_is_read_once(tmp_path, monkeypatch):
    """The batch triple is resolved once and the NVMe folder checked once for a DeepSpeed config (in the
    translation, under DeepSpeed's names): the ZerofitConfig it builds does not read them again."""
    import zerofit.config.deepspeed as ds_mod
    import zerofit.config.deepspeed_sections as sections_mod
    import zerofit.config.schema as schema_mod

    calls = {"batch": 0, "nvme": 0}
    real_batch, real_nvme = schema_mod.resolve_batch, schema_mod.check_nvme_path

    def batch(*a, **k):
        calls["batch"] += 1
        return real_batch(*a, **k)

    def nvme(*a, **k):
        calls["nvme"] += 1
        return real_nvme(*a, **k)

    for mod in (schema_mod, ds_mod):
        monkeypatch.setattr(mod, "resolve_batch", batch)
    for mod in (schema_mod, sections_mod):
        monkeypatch.setattr(mod, "check_nvme_path", nvme)
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        }
    ).config
    assert (cfg.train_batch_size, cfg.offload.nvme_path) == (8, str(tmp_path))
    assert calls == {"batch": 1, "nvme": 1}


def test_a_config_with_overrides_is_read_once(tmp_path, monkeypatch):
    """One resolution of the batch triple and one check of the NVMe folder per load_config, overrides or not;
    an override of the batch or of the offload section has them done again, on the overridden fields."""
    from zerofit.config import load_config, schema

    calls = {"batch": 0, "nvme": 0}
    resolve, check = schema.resolve_batch, schema.check_nvme_path

    def counted_resolve(*a, **kw):
        calls["batch"] += 1
        return resolve(*a, **kw)

    def counted_check(*a, **kw):
        calls["nvme"] += 1
        return check(*a, **kw)

    monkeypatch.setattr(schema, "resolve_batch", counted_resolve)
    monkeypatch.setattr(schema, "check_nvme_path", counted_check)
    src = {
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "offload": {"optimizer_device": "nvme", "nvme_path": str(tmp_path)},
    }
    cfg = load_config(src, seed=3, max_gpu_memory="8GiB").config
    assert calls == {"batch": 1, "nvme": 1} and cfg.train_batch_size == 8 and cfg.seed == 3
    calls.update(batch=0, nvme=0)
    cfg = load_config(src, micro_batch_size=1).config  # the triple derived again from the override
    assert calls == {"batch": 2, "nvme": 1} and (cfg.micro_batch_size, cfg.gradient_accumulation_steps) == (1, 8)
    calls.update(batch=0, nvme=0)
    load_config(src, **{"offload.prefetch_depth": 2})  # the offload section again: its folder checked again
    assert calls == {"batch": 1, "nvme": 2}


@pytest.mark.parametrize(
    "zero,layout,said",
    [
        ({"stage": 3}, "full", "on several nodes -> nodes_layout full"),
        ({"stage": 2}, "full", "on several nodes -> nodes_layout full"),
        ({"stage": 0}, "hybrid", "on several nodes -> nodes_layout hybrid"),
        ({"stage": 3, "zero_hpz_partition_size": 8}, "hybrid", "8 -> nodes_layout hybrid"),
        ({}, "auto", None),
    ],
)
def test_deepspeeds_words_name_the_layout_across_nodes(zero, layout, said):
    """[Note: the nodes' layout]: ZeRO stages 1-3 shard over every rank of every node (the full layout), hpZ's
    zero_hpz_partition_size gathers inside each node (the hybrid one), stage 0 replicates (hybrid); the key report
    says so; without a zero section, the planner's choice. zerofit's own config takes the words."""
    from zerofit.config import load_config

    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}
    if zero:
        ds["zero_optimization"] = zero
    loaded = load_config(ds, world_size=2)
    assert loaded.config.nodes_layout == layout
    notes = " ".join(r.note for r in loaded.report)
    assert said is None or said in notes, notes
    assert load_config({"nodes_layout": "full"}).config.nodes_layout == "full"
    with pytest.raises(ConfigError, match="nodes_layout"):
        load_config({"nodes_layout": "sharded"})


@pytest.mark.parametrize(
    "strategy,layout",
    [
        ("HYBRID_SHARD", "hybrid"),
        ("_HYBRID_SHARD_ZERO2", "hybrid"),
        ("FULL_SHARD", "full"),
        ("SHARD_GRAD_OP", "full"),
        (None, "auto"),
    ],
)
def test_fsdps_sharding_strategy_names_the_layout_across_nodes(strategy, layout):
    """FSDP's words: HYBRID_SHARD and _HYBRID_SHARD_ZERO2 the hybrid layout, FULL_SHARD and SHARD_GRAD_OP (which
    shard over every rank of every node) the full one, none the planner's choice; the one-node sharding as before."""
    from torch.distributed.fsdp import ShardingStrategy

    import zerofit.fsdp as zf
    from tests.support import tiny_models as tm

    wrapped = zf.FullyShardedDataParallel(
        tm.llama(),
        sharding_strategy=strategy and ShardingStrategy[strategy],
        zerofit_config={"device": "cpu", "precision": "fp32"},
    )
    cfg = wrapped.zerofit_engine.config
    assert cfg.nodes_layout == layout
    assert cfg.sharding == {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}.get(
        strategy, strategy or "auto"
    )
    wrapped.zerofit_engine.close()
