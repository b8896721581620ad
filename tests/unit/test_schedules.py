"""Learning-rate schedules: hand-computed values, DeepSpeed's own code restated, and LambdaLR.

.venv/bin/python -m pytest tests/unit/test_schedules.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofit.config import ConfigError, SchedulerConfig, load_config
from zerofit.optim.schedules import lr_at, make_lambda

# ---------------------------------------------------------------------------
# DeepSpeed's schedulers, restated from deepspeed/runtime/lr_schedules.py
# (deepspeedai/DeepSpeed @ 22779f2c6e335b494c90c05917206d3b14510d2d): same
# arithmetic, same state, logging and multi-group handling removed.
# ---------------------------------------------------------------------------


def _update_lr(param_groups, lrs):
    for group, lr in zip(param_groups, lrs):
        group["lr"] = lr


class RefWarmupLR:
    def __init__(
        self,
        optimizer,
        warmup_min_lr=0.0,
        warmup_max_lr=None,
        warmup_num_steps=1000,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = [warmup_min_lr]
        self.max_lrs = [warmup_max_lr]
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            _update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [min_lr + (delta_lr * gamma) for min_lr, delta_lr in zip(self.min_lrs, self.delta_lrs)]

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        _update_lr(self.optimizer.param_groups, self.get_lr())

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                return self.last_batch_iteration / self.warmup_num_steps
        return 1.0


class RefWarmupDecayLR(RefWarmupLR):
    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps=1000,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                return self.last_batch_iteration / self.warmup_num_steps
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class RefWarmupCosineLR:
    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_ratio=0.0,
        warmup_num_steps=1000,
        cos_min_ratio=0.0001,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [group["lr"] for group in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            _update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self):
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                ratio = self.last_batch_iteration / self.warmup_num_steps
            ratio_delta = 1.0 - self.warmup_min_ratio
            ratio = self.warmup_min_ratio + ratio * ratio_delta
            return ratio
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio_delta = 1.0 - self.cos_min_ratio
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        ratio = max(0.0, self.cos_min_ratio + ratio_delta * ratio)
        return ratio

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        _update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        lr_ratio = self.get_lr_ratio()
        return [org_lr * lr_ratio for org_lr in self.org_lrs]


_REFS = {"WarmupLR": RefWarmupLR, "WarmupDecayLR": RefWarmupDecayLR, "WarmupCosineLR": RefWarmupCosineLR}


def _deepspeed_lrs(ds_scheduler: dict, optimizer_lr: float, steps: int) -> list[float]:
    """The lr of each applied optimizer step when DeepSpeed's engine drives the scheduler.

    DeepSpeed builds the scheduler (its __init__ writes the first lr) and calls
    scheduler.step() after every applied optimizer step (engine._take_model_step).
    """
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optimizer_lr)
    sched = _REFS[ds_scheduler["type"]](opt, **ds_scheduler.get("params", {}))
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])  # the lr this optimizer step uses
        sched.step()
    return lrs


def _ours(ds_scheduler: dict, optimizer_lr: float, steps: int) -> list[float]:
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": optimizer_lr}}, "scheduler": ds_scheduler}
    cfg = load_config(ds).config
    return [lr_at(k, cfg.optimizer.lr, cfg.scheduler) for k in range(steps)]


# ---------------------------------------------------------------------------
# DeepSpeed's schedules
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ds_scheduler",
    [
        {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}},
        {"type": "WarmupLR", "params": {"warmup_num_steps": 7, "warmup_type": "linear"}},
        {"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
        {"type": "WarmupLR", "params": {"warmup_num_steps": 1, "warmup_min_lr": 0.5, "warmup_max_lr": 0.25}},
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 10}},
        {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": 40,
                "warmup_min_lr": 1e-4,
                "warmup_max_lr": 2e-3,
                "warmup_num_steps": 5,
                "warmup_type": "linear",
            },
        },
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 3, "warmup_num_steps": 8}},  # total < warm-up
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 60, "warmup_num_steps": 12}},
        {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": 30,
                "warmup_num_steps": 4,
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.05,
                "warmup_type": "linear",
            },
        },
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 2, "warmup_num_steps": 5}},
    ],
    ids=lambda d: f"{d['type']}-{'-'.join(f'{k}={v}' for k, v in d['params'].items())}",
)
def test_deepspeed_schedules_equal_deepspeed_code(ds_scheduler):
    steps = 80
    assert _ours(ds_scheduler, 3e-4, steps) == _deepspeed_lrs(ds_scheduler, 3e-4, steps)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(sorted(_REFS)),
    warmup=st.integers(0, 30),
    total=st.integers(1, 80),
    warmup_type=st.sampled_from(["log", "linear"]),
    lr=st.floats(1e-6, 1.0),
    min_lr=st.floats(0.0, 1e-3),
    ratios=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
)
def test_deepspeed_schedules_equal_deepspeed_code_generated(kind, warmup, total, warmup_type, lr, min_lr, ratios):
    params = {"warmup_num_steps": warmup, "warmup_type": warmup_type}
    if kind in ("WarmupLR", "WarmupDecayLR"):
        params.update(warmup_min_lr=min_lr, warmup_max_lr=lr * 2)
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        params["total_num_steps"] = total
    if kind == "WarmupCosineLR":
        params.update(warmup_min_ratio=ratios[0], cos_min_ratio=ratios[1])
    ds_scheduler = {"type": kind, "params": params}
    assert _ours(ds_scheduler, lr, total + 10) == _deepspeed_lrs(ds_scheduler, lr, total + 10)


def test_warmup_lr_hand_computed():
    # W = 10, log warm-up: step s uses last_batch_iteration s-1, gamma = log(s) / log(10).
    sched = SchedulerConfig(type="WarmupLR", warmup_steps=10, warmup_min_lr=0.0, warmup_max_lr=1.0)
    assert lr_at(0, 0.5, sched) == 0.0  # before the schedule starts: warmup_min_lr
    assert lr_at(1, 0.5, sched) == 0.0  # log(1) = 0
    assert lr_at(2, 0.5, sched) == pytest.approx(math.log(2) / math.log(10))
    assert lr_at(10, 0.5, sched) == pytest.approx(math.log(10) / math.log(10))
    assert lr_at(11, 0.5, sched) == 1.0  # warm-up over: warmup_max_lr, forever
    assert lr_at(1000, 0.5, sched) == 1.0
    linear = SchedulerConfig(type="WarmupLR", warmup_steps=4, warmup_type="linear")
    assert [lr_at(s, 2.0, linear) for s in range(7)] == [0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.0]


def test_warmup_decay_lr_hand_computed():
    sched = SchedulerConfig(
        type="WarmupDecayLR", warmup_steps=4, warmup_type="linear", total_steps=12, warmup_max_lr=0.8
    )
    # warm-up to 0.8 over 4 steps (offset by one), then linear to 0 at last_batch_iteration 12 (step 13).
    expected = [0.0, 0.0, 0.2, 0.4, 0.6, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0, 0.0]
    assert [lr_at(s, 1.0, sched) for s in range(15)] == pytest.approx(expected)


def test_warmup_cosine_lr_hand_computed():
    sched = SchedulerConfig(
        type="WarmupCosineLR",
        warmup_steps=2,
        warmup_type="linear",
        total_steps=6,
        warmup_min_ratio=0.0,
        min_lr_ratio=0.0,
    )
    # ratios at last_batch_iteration -1, 0, 1 (warm-up 0, 0/2, 1/2), then cos progress (it-1)/4 for it >= 2.
    expected = [0.0, 0.0, 0.5, 1 + math.cos(math.pi / 4), 1.0, 1 + math.cos(3 * math.pi / 4), 0.0, 0.0]
    expected = [e if i < 3 else e / 2 for i, e in enumerate(expected)]
    assert [lr_at(s, 1.0, sched) for s in range(8)] == pytest.approx(expected)


# ---------------------------------------------------------------------------
# zerofit's schedules
# ---------------------------------------------------------------------------


def test_constant_hand_computed():
    assert [lr_at(s, 0.1, SchedulerConfig()) for s in (0, 1, 100)] == [0.1, 0.1, 0.1]
    warm = SchedulerConfig(type="constant", warmup_steps=3)
    assert [lr_at(s, 1.0, warm) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_linear_hand_computed():
    sched = SchedulerConfig(type="linear", warmup_steps=1, total_steps=5, min_lr_ratio=0.2)
    # warm-up 1/2, then p = (s-1)/4: 1 - 0.8 p.
    expected = [0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    assert [lr_at(s, 1.0, sched) for s in range(7)] == pytest.approx(expected)


def test_cosine_hand_computed():
    sched = SchedulerConfig(type="cosine", warmup_steps=0, total_steps=4, min_lr_ratio=0.1)
    expected = [
        1.0,
        0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2,
        0.55,
        0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2,
        0.1,
        0.1,
    ]
    assert [lr_at(s, 1.0, sched) for s in range(6)] == pytest.approx(expected)


def test_decaying_schedules_need_total_steps():
    for kind in ("linear", "cosine", "WarmupDecayLR", "WarmupCosineLR"):
        with pytest.raises(ConfigError, match="scheduler.total_steps"):
            lr_at(50, 1.0, SchedulerConfig(type=kind, warmup_steps=2))


def test_step_must_be_a_count():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            lr_at(bad, 1.0, SchedulerConfig())


# ---------------------------------------------------------------------------
# LambdaLR
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sched",
    [
        SchedulerConfig(),
        SchedulerConfig(type="constant", warmup_steps=5),
        SchedulerConfig(type="linear", warmup_steps=3, total_steps=20, min_lr_ratio=0.1),
        SchedulerConfig(type="cosine", warmup_steps=4, total_steps=25),
        SchedulerConfig(type="WarmupLR", warmup_steps=6, warmup_min_lr=1e-5),
        SchedulerConfig(type="WarmupDecayLR", warmup_steps=6, total_steps=20, warmup_max_lr=3e-3),
        SchedulerConfig(type="WarmupCosineLR", warmup_steps=6, total_steps=20, warmup_min_ratio=0.1, min_lr_ratio=0.01),
    ],
    ids=lambda s: s.type,
)
def test_lambda_lr_gives_the_same_lr_every_step(sched):
    lr = 2e-3
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(opt, make_lambda(lr, sched))
    for step in range(30):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, lr, sched), rel=1e-12, abs=1e-18)
        opt.step()
        lambda_lr.step()


# ---------------------------------------------------------------------------
# transformers' get_scheduler (the hf_* types, for zerofit.hf)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["constant", "constant_with_warmup", "linear", "cosine"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (1, 1), (4, 25), (10, 10)])
def test_transformers_schedules_equal_get_scheduler_bitwise(name, warmup, total):
    from transformers import get_scheduler

    lr = 3e-4
    sched = SchedulerConfig(type=f"hf_{name}", warmup_steps=warmup, total_steps=total)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    hf = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total + 3):
        assert lr_at(step, lr, sched) == opt.param_groups[0]["lr"], (name, step)
        opt.step()
        hf.step()
    if name in ("linear", "cosine") and warmup < total:
        assert lr_at(total, lr, sched) == 0.0
    if warmup and name != "constant":
        assert lr_at(0, lr, sched) == 0.0  # transformers' warm-up starts at 0, zerofit's own does not
        assert (
            lr_at(
                0,
                lr,
                SchedulerConfig(
                    type=name if name != "constant_with_warmup" else "constant", warmup_steps=warmup, total_steps=total
                ),
            )
            > 0.0
        )


def test_transformers_decaying_schedules_need_the_run_length():
    with pytest.raises(ConfigError, match="scheduler.total_steps"):
        lr_at(5, 1e-3, SchedulerConfig(type="hf_linear", warmup_steps=2))
    assert lr_at(5, 1e-3, SchedulerConfig(type="hf_constant_with_warmup", warmup_steps=2)) == 1e-3
