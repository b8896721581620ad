"""A DeepSpeed config means what it means in DeepSpeed 0.19.8: every key zerofit honours or maps takes
DeepSpeed's default when absent, read here from DeepSpeed's own source (its constants, pydantic config models
and class signatures), so that a DeepSpeed bump that moves a default fails here; and DeepSpeed's own
``DeepSpeedConfig`` resolves a config to the same values zerofit does. Then the default that changes the math
most, ``gradient_clipping`` 1.0, in a training run.

Needs real DeepSpeed (0.19.8) installed; it imports on the CPU with ``DS_ACCELERATOR=cpu``.
"""

from __future__ import annotations

import copy
import inspect
import json
import os

import pytest
import torch

# DeepSpeed picks its accelerator at import: these come first, DeepSpeed's imports after them (E402)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")
deepspeed = pytest.importorskip("deepspeed")

from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: E402
from deepspeed.runtime import constants as C  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402
from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT, DeepSpeedConfig  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.swap_tensor import constants as AIO  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from deepspeed.runtime.zero.offload_config import (  # noqa: E402
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)

import zerofit.deepspeed as zdeepspeed  # noqa: E402
from tests.support import tiny_models as tm  # noqa: E402
from zerofit.config import load_config, render_config  # noqa: E402
from zerofit.config.deepspeed_keys import (  # noqa: E402
    ADAM_PARAMS,
    DEEPSPEED_KEYS,
    DEEPSPEED_VERSION,
    NO_DEFAULT,
    SCHEDULER_PARAMS,
    TORCH_ADAMW_WEIGHT_DECAY,
    Key,
    Section,
    default,
)
from zerofit.engine.model.adapter import loss_of  # noqa: E402


def test_the_installed_deepspeed_is_the_one_whose_defaults_zerofit_takes():
    assert deepspeed.__version__ == DEEPSPEED_VERSION, (
        f"DeepSpeed {deepspeed.__version__} is installed, zerofit's table has {DEEPSPEED_VERSION}'s defaults: "
        "check every default against the new release, then bump DEEPSPEED_VERSION"
    )


def _field_default(model, name: str):
    field = model.model_fields[name]
    return field.get_default(call_default_factory=True)


def _pydantic(model, name: str):
    """DeepSpeed's pydantic default, by field name or alias (``stage3_prefetch_bucket_size``)."""
    for field_name, field in model.model_fields.items():
        if name in (field_name, field.alias):
            return _field_default(model, field_name)
    raise KeyError(f"{model.__name__} has no field {name}")


def _signature(fn, name: str):
    p = inspect.signature(fn).parameters[name]
    return NO_DEFAULT if p.default is p.empty else p.default


# Every key zerofit honours or maps with a default -> DeepSpeed 0.19.8's own default, from its source.
_DEEPSPEED = {
    "train_batch_size": C.TRAIN_BATCH_SIZE_DEFAULT,
    "train_micro_batch_size_per_gpu": C.TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT,
    "gradient_accumulation_steps": C.GRADIENT_ACCUMULATION_STEPS_DEFAULT,
    "gradient_clipping": C.GRADIENT_CLIPPING_DEFAULT,
    "steps_per_print": C.STEPS_PER_PRINT_DEFAULT,
    "wall_clock_breakdown": C.WALL_CLOCK_BREAKDOWN_DEFAULT,
    "managed_gradient_accumulation": C.MANAGED_GRADIENT_ACCUMULATION_DEFAULT,
    "dataloader_drop_last": C.DATALOADER_DROP_LAST_DEFAULT,
    "checkpoint.tag_validation": C.CHECKPOINT_TAG_VALIDATION_DEFAULT,
    "bf16.enabled": _field_default(DeepSpeedBF16Config, "enabled"),
    **{
        f"fp16.{k}": _field_default(DeepSpeedFP16Config, k)
        for k in (
            "enabled",
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
        )
    },
    "zero_optimization.stage": _field_default(DeepSpeedZeroConfig, "stage"),
    "zero_optimization.zero_hpz_partition_size": _field_default(DeepSpeedZeroConfig, "zero_hpz_partition_size"),
    **{
        f"zero_optimization.offload_optimizer.{k}": _field_default(DeepSpeedZeroOffloadOptimizerConfig, k)
        for k in ("device", "nvme_path", "pin_memory")
    },
    **{
        f"zero_optimization.offload_param.{k}": _field_default(DeepSpeedZeroOffloadParamConfig, k)
        for k in ("device", "nvme_path", "pin_memory")
    },
    "aio.block_size": AIO.AIO_BLOCK_SIZE_DEFAULT,
    "aio.queue_depth": AIO.AIO_QUEUE_DEPTH_DEFAULT,
    "aio.intra_op_parallelism": AIO.AIO_INTRA_OP_PARALLELISM_DEFAULT,
}


def _keys_with_defaults(spec, prefix=""):
    for name, item in spec.items():
        if isinstance(item, Section) and item.keys is not None:
            yield from _keys_with_defaults(item.keys, f"{prefix}{name}.")
        elif isinstance(item, Key) and item.default is not NO_DEFAULT:
            yield f"{prefix}{name}", item


def _same(ours, theirs) -> bool:
    if hasattr(theirs, "value"):  # DeepSpeed's enums (stage 0, device "none")
        theirs = theirs.value
    if isinstance(ours, tuple):
        theirs = tuple(theirs)
    if isinstance(ours, str) and isinstance(theirs, str):  # tag_validation: DeepSpeed upper-cases the value
        return ours.upper() == theirs.upper()
    return ours == theirs and isinstance(ours, bool) == isinstance(theirs, bool)  # True is not 1


def test_every_top_level_default_is_deepspeeds():
    ours = dict(_keys_with_defaults(DEEPSPEED_KEYS))
    assert set(ours) == set(_DEEPSPEED), "a key zerofit maps has no DeepSpeed source here (or the reverse)"
    wrong = {k: (ours[k].default, _DEEPSPEED[k]) for k in ours if not _same(ours[k].default, _DEEPSPEED[k])}
    assert not wrong, f"zerofit's default vs DeepSpeed {DEEPSPEED_VERSION}'s: {wrong}"
    assert C.GRADIENT_CLIPPING_DEFAULT == 1.0 and default("gradient_clipping") == 1.0


def test_every_optimizer_default_is_deepspeeds_adam():
    """DeepSpeed builds its CPU Adam (offload) or FusedAdam (GPU) from the params: both with these defaults; with
    torch_adam, torch.optim.AdamW, whose weight decay is 0.01."""
    ours = dict(_keys_with_defaults(ADAM_PARAMS))
    assert set(ours) == {
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "adam_w_mode",
        "torch_adam",
        "bias_correction",
        "amsgrad",
    }
    for cls in (DeepSpeedCPUAdam, FusedAdam):
        for k in ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad"):
            assert _same(ours[k].default, _signature(cls.__init__, k)), (cls.__name__, k)
    assert ours["adam_w_mode"].default == ADAM_W_MODE_DEFAULT
    # get_optimizer_configuration: torch_adam = optimizer_parameters.pop(TORCH_ADAM_PARAM, False)
    assert "pop(TORCH_ADAM_PARAM, False)" in inspect.getsource(DeepSpeedEngine.get_optimizer_configuration)
    assert ours["torch_adam"].default is False
    assert TORCH_ADAMW_WEIGHT_DECAY == _signature(torch.optim.AdamW.__init__, "weight_decay")
    # and the absent keys resolve to them
    opt = load_config({"optimizer": {"type": "AdamW", "params": {}}}).config.optimizer
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    opt = load_config({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}).config.optimizer
    assert opt.weight_decay == 0.01
    with pytest.raises(ValueError, match=r"optimizer\.params\.max_grad_norm.*gradient_clipping"):
        load_config({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 0.0}}})


@pytest.mark.parametrize("kind", sorted(SCHEDULER_PARAMS))
def test_every_scheduler_default_is_deepspeeds(kind):
    """Each schedule's keys are its DeepSpeed class's parameters, with the same defaults (required ones too)."""
    init = getattr(lr_schedules, kind).__init__
    params = [n for n in inspect.signature(init).parameters if n not in ("self", "optimizer")]
    assert sorted(SCHEDULER_PARAMS[kind]) == sorted(params)
    for name in params:
        ours = SCHEDULER_PARAMS[kind][name].default
        assert (
            _same(ours, _signature(init, name)) if ours is not NO_DEFAULT else _signature(init, name) is NO_DEFAULT
        ), (kind, name, ours, _signature(init, name))


@pytest.mark.parametrize(
    "section, model",
    [
        ("fp16", DeepSpeedFP16Config),
        ("bf16", DeepSpeedBF16Config),
        ("zero_optimization", DeepSpeedZeroConfig),
        ("zero_optimization.offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig),
        ("zero_optimization.offload_param", DeepSpeedZeroOffloadParamConfig),
    ],
)
def test_every_key_of_the_sections_zerofit_maps_is_known(section, model):
    """A key DeepSpeed adds to these sections must be read by zerofit (or refused by name), not missed."""
    spec = DEEPSPEED_KEYS
    for part in section.split("."):
        spec = spec[part].keys
    known = set(spec) | {a for item in spec.values() for a in item.aliases}
    theirs = {f.alias or n for n, f in model.model_fields.items()}
    assert not theirs - known, f"{section}: DeepSpeed keys zerofit does not know: {sorted(theirs - known)}"


_CONFIGS = [
    {"train_micro_batch_size_per_gpu": 2},
    {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "aio": {"queue_depth": 4},
        "checkpoint": {"tag_validation": "fail"},
        "managed_gradient_accumulation": False,
    },
    {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,
        "steps_per_print": 5,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "dataloader_drop_last": True,
    },
]


@pytest.mark.parametrize("ds", _CONFIGS, ids=["bare", "fp16-zero3-offload", "bf16-zero2"])
def test_deepspeed_resolves_a_config_as_zerofit_does(ds):
    """DeepSpeed's own DeepSpeedConfig and zerofit read the same JSON to the same values."""
    theirs = DeepSpeedConfig(copy.deepcopy(ds))
    ours = load_config(ds).config
    assert (ours.train_batch_size, ours.micro_batch_size, ours.gradient_accumulation_steps) == (
        theirs.train_batch_size,
        theirs.train_micro_batch_size_per_gpu,
        theirs.gradient_accumulation_steps,
    )
    assert ours.gradient_clipping == theirs.gradient_clipping
    assert ours.steps_per_print == theirs.steps_per_print
    assert ours.wall_clock_breakdown == theirs.wall_clock_breakdown
    assert ours.managed_gradient_accumulation == theirs.managed_gradient_accumulation
    fp16, bf16 = theirs.float16_config, theirs.bfloat16_config
    assert ours.precision == ("fp16" if fp16.enabled else "bf16" if bf16.enabled else "fp32")
    assert (
        ours.fp16.loss_scale,
        ours.fp16.initial_scale_power,
        ours.fp16.loss_scale_window,
        ours.fp16.hysteresis,
        ours.fp16.consecutive_hysteresis,
        ours.fp16.min_loss_scale,
    ) == (
        fp16.loss_scale,
        fp16.initial_scale_power,
        fp16.loss_scale_window,
        fp16.hysteresis,
        fp16.consecutive_hysteresis,
        fp16.min_loss_scale,
    )
    zero = theirs.zero_config
    for part, ours_device in (
        ("offload_optimizer", ours.offload.optimizer_device),
        ("offload_param", ours.offload.param_device),
    ):
        section = getattr(zero, part)
        device = "none" if section is None else getattr(section.device, "value", section.device)
        assert ours_device == device, part
        if section is not None:
            assert ours.offload.pin_memory == section.pin_memory
    aio = theirs.aio_config
    assert ours.offload.nvme_queue_depth == aio["queue_depth"] * aio["intra_op_parallelism"]
    if "block_size" in ds.get("aio", {}):
        assert ours.offload.nvme_block_size == aio["block_size"]
    assert zdeepspeed.arguments.dataloader_drop_last(ds) == theirs.dataloader_drop_last


def test_tag_validation_takes_deepspeeds_values():
    for value in ("Ignore", "Warn", "Fail", "ignore", "WARN"):
        ds = {"train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": value}}
        DeepSpeedConfig(copy.deepcopy(ds))  # DeepSpeed takes it ...
        load_config(ds)  # ... and so does zerofit
    with pytest.raises(Exception, match="tag_validation"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": "Strict"}})
    with pytest.raises(ValueError, match=r"checkpoint\.tag_validation: expected one of 'Ignore', 'Warn', 'Fail'"):
        load_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": "Strict"}})


def test_config_show_names_the_deepspeed_version(tmp_path):
    from typer.testing import CliRunner

    from zerofit.cli import app

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    out = CliRunner().invoke(app, ["config", "show", str(path)])
    assert out.exit_code == 0, out.output
    assert "takes the defaults of DeepSpeed 0.19.8" in out.output.splitlines()[0]
    assert '"gradient_clipping": 1.0' in out.output
    assert "not given: 1.0 (DeepSpeed 0.19.8's default" in out.output
    assert "DeepSpeed" not in render_config(load_config({"micro_batch_size": 2})).splitlines()[0]


def test_a_deepspeed_config_without_gradient_clipping_clips_at_one():
    """DeepSpeed 0.19.8 clips at 1.0 when the key is absent: the losses and weights of the DeepSpeed loop are a
    plain torch loop's with clip_grad_norm_(1.0) (the tiny model's gradient norm is above 1), and not the
    unclipped loop's."""
    G, steps = 2, 5
    torch.manual_seed(0)
    model = tm.llama()
    clipped, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }
    engine, *_ = zdeepspeed.initialize(model=model, config=config, device="cpu")
    assert engine.gradient_clipping() == 1.0
    batches = [mb for mbs in tm.batches(steps, G) for mb in mbs]
    losses, norms = [], []
    for mb in batches:
        loss = loss_of(engine(**mb))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.was_step_applied():
            norms.append(engine.get_global_grad_norm())

    def plain(ref, clip):
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        out = []
        for i, mb in enumerate(batches):
            loss = loss_of(ref(**mb))
            (loss / G).backward()
            out.append(loss.item())
            if (i + 1) % G == 0:
                if clip:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                opt.step()
                opt.zero_grad()
        return out

    want, off = plain(clipped, 1.0), plain(unclipped, 0.0)
    assert min(norms) > 1.0, norms
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=1e-6)
    master = engine.master_state_dict()
    for n, p in clipped.named_parameters():  # RELIABILITY.md's fp32 tolerance (atol 1e-5): on a CPU one weight
        # of 2048 differed by 2.0e-6 (relative 1.1e-3, a small weight) at atol 1e-6
        torch.testing.assert_close(master[n], p.detach(), rtol=1.3e-6, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    assert max(abs(a - b) for a, b in zip(losses, off)) > 1e-3  # unclipped differs far beyond rounding
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_loss_scale_config_follows_deepspeeds_arithmetic(stage):
    """optimizer.loss_scale_config (DeepSpeed's FP16 optimizer's) through a run of clean and overflowing steps.
    Without ZeRO the scale halves at every overflow and stays at min_loss_scale, skipping (DeepSpeed's own
    FP16_Optimizer._update_scale on its own LossScaleConfig is the reference); with ZeRO the hysteresis absorbs
    the first overflow, as DeepSpeed's DynamicLossScaler does."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScaleProfile

    fp16 = {"enabled": True, "initial_scale_power": 3, "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 2}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "fp16": fp16,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }
    torch.manual_seed(0)
    engine, optimizer, _, _ = zdeepspeed.initialize(model=tm.PlainLM(), config=config, device="cpu")
    scale = optimizer.loss_scale_config
    assert (
        scale.use_grad_scaling,
        scale.dynamic_loss_scale,
        scale.cur_scale,
        scale.scale_window,
        scale.min_loss_scale,
    ) == (True, True, 8.0, 2, 2.0)
    theirs = LossScaleConfig(
        low_precision_dtype=torch.float16,
        dynamic_loss_scale=True,
        static_loss_scale=0,
        dynamic_loss_args=DeepSpeedFP16Config(**fp16).dynamic_loss_scale_args(),
        profile=LossScaleProfile.FUSED,
        initial_dynamic_scale=2.0**3,
    )
    ds_optimizer = SimpleNamespace(loss_scale_config=theirs, verbose=False)
    overflows = [True, False, False, False, True, True, True, True, False]
    scales = []
    for overflow, mb in zip(overflows, tm.batches(len(overflows), 1)):
        loss = loss_of(engine(**mb[0]))
        engine.backward(loss * float("inf") if overflow else loss)
        engine.step()
        assert engine.was_step_applied() == (not overflow)
        scales.append(scale.cur_scale)
        if stage == 0:
            FP16_Optimizer._update_scale(ds_optimizer, overflow)
            assert (scale.cur_scale, scale.cur_iter, scale.last_overflow_iter) == (
                theirs.cur_scale,
                theirs.cur_iter,
                theirs.last_overflow_iter,
            )
    if stage == 0:
        assert scales == [4.0, 4.0, 4.0, 8.0, 4.0, 2.0, 2.0, 2.0, 2.0]  # down at once, floored at the minimum
    else:
        assert scales[:4] == [8.0, 8.0, 8.0, 16.0] and scale.cur_hysteresis is not None
    engine.close()
