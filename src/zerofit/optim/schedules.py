"""Learning-rate schedules: the lr of each optimizer step, as a pure function.

``lr_at(step, optimizer_lr, sched)`` is the learning rate used by optimizer step
number ``step``, where ``step`` counts the optimizer steps *applied* before it
(0 for the first). fp16 steps skipped for overflow do not count, as in DeepSpeed
(its engine calls ``lr_scheduler.step()`` only when the step was applied).

``make_lambda`` gives the same schedule as a multiplier for
``torch.optim.lr_scheduler.LambdaLR(optimizer, make_lambda(lr, sched))`` stepped
once after every applied optimizer step.

zerofit's own schedules (``constant``, ``linear``, ``cosine``), with ``W =
warmup_steps``, ``T = total_steps``, ``r = min_lr_ratio`` and ``lr`` the optimizer's lr:

* warm-up, ``step < W``: ``lr * (step + 1) / (W + 1)`` (never 0, reaches ``lr`` at ``step == W``);
* then ``p = clamp((step - W) / max(1, T - W), 0, 1)``:
  constant ``lr``; linear ``lr * (1 - (1 - r) * p)``; cosine ``lr * (r + (1 - r) * (1 + cos(pi p)) / 2)``.
  Both reach ``r * lr`` at ``step == T`` and stay there.

transformers' schedules (``hf_constant``, ``hf_constant_with_warmup``, ``hf_linear``, ``hf_cosine``: what
``transformers.get_scheduler`` builds for ``"constant"``, ``"constant_with_warmup"``, ``"linear"``, ``"cosine"``)
are ``lr * lambda(step)`` with the lambdas of ``transformers/optimization.py`` (5.17), computed with the same
float operations, so every step's lr equals ``LambdaLR``'s bitwise: warm-up ``step / max(1, W)`` (0 at the
first step); then linear ``max(0, (T - step) / max(1, T - W))``, cosine
``max(0, (1 + cos(pi * 0.5 * 2 * p)) / 2)`` with ``p = (step - W) / max(1, T - W)``; ``hf_constant`` ignores the
warm-up, as transformers does. ``min_lr_ratio`` does not apply to them.

DeepSpeed's schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``) follow
``deepspeed/runtime/lr_schedules.py`` (deepspeedai/DeepSpeed, read at commit
22779f2c6e335b494c90c05917206d3b14510d2d) exactly. See [Note: DeepSpeed's step offset].

[Note: DeepSpeed's step offset]
DeepSpeed builds the scheduler with ``last_batch_iteration=-1`` and its
``__init__`` already writes ``get_lr()`` into the optimizer; the engine then
calls ``scheduler.step()`` after each applied optimizer step, which increments
``last_batch_iteration`` first and then sets the lr. So the lr used by applied
step ``s`` is ``get_lr()`` evaluated at ``last_batch_iteration = s - 1``:

* ``s = 0``: ``last_batch_iteration = -1``, for which DeepSpeed returns
  ``warmup_min_lr`` (WarmupLR/WarmupDecayLR) and ``0.0`` (WarmupCosineLR);
* ``s = 1``: ``last_batch_iteration = 0``; the log warm-up gives
  ``log(0 + 1) = 0``, so again ``warmup_min_lr`` (or ``warmup_min_ratio * lr``).

The warm-up length is ``max(2, warmup_num_steps)`` (DeepSpeed's floor). We keep
all of this, so a run resumed from DeepSpeed or compared against it sees the
same learning rate at every step.

[Note: OneCycle and LRRangeTest]
DeepSpeed's ``OneCycle`` and ``LRRangeTest`` (deepspeed/runtime/lr_schedules.py, DeepSpeed 0.19.8) follow
the same step offset, with their own start: their ``__init__`` writes ``cycle_min_lr`` (and, cycling
momentum, the betas ``(cycle_min_mom, 0.99)``) or ``lr_range_test_min_lr`` into the optimizer, so applied
step 0 uses those, and step ``s >= 1`` the values at ``last_batch_iteration = s - 1``
(:func:`one_cycle_lr`, :func:`one_cycle_betas`, :func:`lr_range_test_lr`, the float operations of DeepSpeed's
code in its order). Both broadcast one value to every parameter group, and OneCycle with
``cycle_momentum`` (its default) sets each group's betas to ``(beta1, 0.99)``: a per-step beta1 and a beta2
of 0.99 whatever the optimizer's. zerofit's AdamW takes both per step (``optimizer.client_schedule``
supplies them to the engine's hyperparameters), bias corrections included, as DeepSpeed's Adam reads
``group['betas']`` at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from zerofit.config.schema import ConfigError, LRRangeTestConfig, OneCycleConfig, SchedulerConfig

__all__ = [
    "lr_at",
    "make_lambda",
    "deepspeed_lr",
    "transformers_lambda",
    "HF_SCHEDULES",
    "one_cycle_lr",
    "one_cycle_betas",
    "lr_range_test_lr",
    "betas_at",
]


def lr_at(step: int, optimizer_lr: float, sched: SchedulerConfig) -> float:
    """Learning rate of the optimizer step taken after ``step`` applied steps (see the module docstring)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0 (applied optimizer steps so far), found {step!r}")
    if sched.type in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        # [Note: DeepSpeed's step offset]
        return deepspeed_lr(step - 1, optimizer_lr, sched)
    if sched.type == "OneCycle":  # [Note: OneCycle and LRRangeTest]
        return sched.one_cycle.cycle_min_lr if step == 0 else one_cycle_lr(step - 1, sched.one_cycle)
    if sched.type == "LRRangeTest":
        return lr_range_test_lr(step - 1, sched.lr_range_test or LRRangeTestConfig())
    if sched.type in HF_SCHEDULES:
        return optimizer_lr * transformers_lambda(step, sched)

    warmup = sched.warmup_steps
    if step < warmup:
        return optimizer_lr * (step + 1) / (warmup + 1)
    if sched.type == "constant":
        return optimizer_lr
    total = _total_steps(sched)
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    floor = sched.min_lr_ratio
    if sched.type == "linear":
        return optimizer_lr * (1.0 - (1.0 - floor) * progress)
    # cosine
    return optimizer_lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


HF_SCHEDULES = ("hf_constant", "hf_constant_with_warmup", "hf_linear", "hf_cosine")


def transformers_lambda(step: int, sched: SchedulerConfig) -> float:
    """The multiplier ``transformers.get_scheduler``'s LambdaLR applies at ``step`` (see the module docstring)."""
    warmup = sched.warmup_steps
    if sched.type == "hf_constant":
        return 1  # transformers' _get_constant_lambda: warm-up ignored
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if sched.type == "hf_constant_with_warmup":
        return 1.0
    total = _total_steps(sched)
    if sched.type == "hf_linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))  # hf_cosine, num_cycles 0.5
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def deepspeed_lr(last_batch_iteration: int, optimizer_lr: float, sched: SchedulerConfig) -> float:
    """DeepSpeed's ``get_lr()`` for ``WarmupLR``/``WarmupDecayLR``/``WarmupCosineLR`` at ``last_batch_iteration``.

    A statement of DeepSpeed's formulas in DeepSpeed's own terms; :func:`lr_at`
    calls it with ``last_batch_iteration = step - 1``.
    """
    it = last_batch_iteration
    warmup = max(2, sched.warmup_steps)  # DeepSpeed: self.warmup_num_steps = max(2, warmup_num_steps)
    if sched.type == "WarmupCosineLR":
        if it < 0:
            return 0.0  # DeepSpeed: get_lr() before the schedule has started returns 0.0
        if it < warmup:
            ratio = _warmup_gamma(it, warmup, sched.warmup_type)
            return optimizer_lr * (sched.warmup_min_ratio + ratio * (1.0 - sched.warmup_min_ratio))
        total = _total_steps(sched)
        progress = min(1.0, (it - warmup + 1) / max(1, total - warmup))
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return optimizer_lr * max(0.0, sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * ratio)

    min_lr = sched.warmup_min_lr
    max_lr = optimizer_lr if sched.warmup_max_lr is None else sched.warmup_max_lr
    if it < 0:
        return min_lr  # DeepSpeed: get_lr() before the schedule has started returns the min lrs
    if it < warmup:
        gamma = _warmup_gamma(it, warmup, sched.warmup_type)
    elif sched.type == "WarmupLR":
        gamma = 1.0
    else:  # WarmupDecayLR
        total = _total_steps(sched)
        gamma = max(0.0, float(total - it) / float(max(1.0, total - warmup)))
    return min_lr + (max_lr - min_lr) * gamma


def _warmup_gamma(it: int, warmup: int, kind: str) -> float:
    if kind == "log":
        return (1.0 / math.log(warmup)) * math.log(it + 1)  # DeepSpeed: inverse_log_warm_up * log(it + 1)
    return it / warmup


def _total_steps(sched: SchedulerConfig) -> int:
    if sched.total_steps is None:
        raise ConfigError(
            "scheduler.total_steps",
            f"the run's length in optimizer steps ({sched.type} decays over it)",
            "nothing",
            "set scheduler.total_steps, or let the engine supply the run length",
        )
    return sched.total_steps


def betas_at(step: int, betas: tuple[float, float], sched: SchedulerConfig) -> tuple[float, float]:
    """Adam's betas at applied step ``step``: OneCycle's cycled ``(beta1, 0.99)`` when it cycles momentum, else
    ``betas`` (the optimizer's). [Note: OneCycle and LRRangeTest]"""
    c = sched.one_cycle
    if sched.type != "OneCycle" or not c.cycle_momentum:
        return betas
    return (c.cycle_min_mom, _ONE_CYCLE_BETA2) if step == 0 else one_cycle_betas(step - 1, c)


_ONE_CYCLE_BETA2 = 0.99  # DeepSpeed: self.min_moms = [(mom, 0.99) ...], self.max_moms likewise


def _one_cycle_shape(c: OneCycleConfig) -> tuple[float, float, float, float, int, int]:
    """DeepSpeed's ``OneCycle._initialize_cycle``: (first, second, total_size, step_ratio, first and second stair
    counts)."""
    first = float(c.cycle_first_step_size)
    second = float(c.cycle_second_step_size) if c.cycle_second_step_size is not None else first
    total = first + second
    second_stairs = c.cycle_first_stair_count if c.cycle_second_stair_count is None else c.cycle_second_stair_count
    return first, second, total, first / total, c.cycle_first_stair_count, second_stairs


def _one_cycle_scale(it: int, c: OneCycleConfig) -> float:
    """DeepSpeed's ``OneCycle._get_scale_factor`` at ``last_batch_iteration = it``."""
    first, second, total, step_ratio, first_stairs, second_stairs = _one_cycle_shape(c)
    batch_iteration = it + 1
    cycle = math.floor(1 + batch_iteration / total)
    x = 1.0 + batch_iteration / total - cycle
    if x <= step_ratio:
        scale_factor, stair_count = x / step_ratio, first_stairs
    else:
        scale_factor, stair_count = (x - 1) / (step_ratio - 1), second_stairs
    if stair_count > 0:
        cycle_iteration = batch_iteration % total
        if cycle_iteration <= first:
            stair_position = cycle_iteration * stair_count / first
        else:
            stair_position = (total - cycle_iteration) * stair_count / second
        scale_factor = math.floor(stair_position) / stair_count
    return scale_factor


def _decays(c: OneCycleConfig, rate: float) -> bool:
    """DeepSpeed's ``skip_lr_decay`` / ``skip_mom_decay``, negated: a decay step size and a rate, both non-zero."""
    return not (math.isclose(c.decay_step_size, 0) or math.isclose(rate, 0))


def one_cycle_lr(it: int, c: OneCycleConfig) -> float:
    """DeepSpeed's ``OneCycle.get_lr()`` at ``last_batch_iteration = it`` (>= 0), one group's."""
    total = _one_cycle_shape(c)[2]
    if it < total:
        base_height = (c.cycle_max_lr - c.cycle_min_lr) * _one_cycle_scale(it, c)
        return c.cycle_min_lr + base_height
    if not _decays(c, c.decay_lr_rate):
        return c.cycle_min_lr
    decay_interval = (it - total + 1) / c.decay_step_size
    return c.cycle_min_lr / (1 + c.decay_lr_rate * decay_interval)


def one_cycle_betas(it: int, c: OneCycleConfig) -> tuple[float, float]:
    """DeepSpeed's ``OneCycle.get_mom()`` at ``last_batch_iteration = it`` (>= 0), one group's ``(beta1, beta2)``."""
    total = _one_cycle_shape(c)[2]
    if it < total:
        base_height = (c.cycle_max_mom - c.cycle_min_mom) * _one_cycle_scale(it, c)
        return c.cycle_max_mom - base_height, _ONE_CYCLE_BETA2
    if not _decays(c, c.decay_mom_rate):
        return c.cycle_max_mom, _ONE_CYCLE_BETA2
    decay_interval = (it - total + 1) / c.decay_step_size
    return c.cycle_max_mom * (1 + c.decay_mom_rate * decay_interval), _ONE_CYCLE_BETA2


def lr_range_test_lr(it: int, c: LRRangeTestConfig) -> float:
    """DeepSpeed's ``LRRangeTest.get_lr()`` at ``last_batch_iteration = it`` (>= -1), one group's."""
    if c.staircase:
        interval = math.floor(float(it + 1) / c.step_size)
    else:
        interval = float(it + 1) / c.step_size
    return c.min_lr * (1 + c.step_rate * interval)


def make_lambda(optimizer_lr: float, sched: SchedulerConfig) -> Callable[[int], float]:
    """``step -> lr_at(step) / optimizer_lr``, for ``torch.optim.lr_scheduler.LambdaLR``.

    ``LambdaLR`` calls it with 0 at construction and with ``k`` after its ``k``-th
    ``step()``; stepping it once after every applied optimizer step therefore
    gives step ``k`` the learning rate ``lr_at(k, optimizer_lr, sched)``.
    """
    if not optimizer_lr > 0:
        raise ValueError(f"optimizer_lr must be > 0 to express the schedule as a multiplier, found {optimizer_lr}")
    return lambda step: lr_at(step, optimizer_lr, sched) / optimizer_lr
