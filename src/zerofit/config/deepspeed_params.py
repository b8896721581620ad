"""The DeepSpeed keys of ``optimizer.params`` (Adam, AdamW) and of each scheduler's ``scheduler.params``."""

from __future__ import annotations

from zerofit.config.deepspeed_kinds import HONOURED, MAPPED, NA, Betas, Bool, Choice, Float, Int, Key, Section, na

ADAM_PARAMS: dict[str, Key | Section] = {
    "lr": Key(Float(0, lo_open=True), HONOURED, "-> optimizer.lr", auto=True, default=1e-3),
    "betas": Key(Betas(), HONOURED, "-> optimizer.betas", auto=True, default=(0.9, 0.999)),
    "eps": Key(Float(0, lo_open=True), HONOURED, "-> optimizer.eps", auto=True, default=1e-8),
    "weight_decay": Key(
        Float(0),
        HONOURED,
        "-> optimizer.weight_decay (decoupled, as AdamW); absent with "
        "torch_adam true and AdamW's math: torch.optim.AdamW's 0.01",
        auto=True,
        default=0.0,
    ),
    "adam_w_mode": Key(Bool(), MAPPED, "true = AdamW (type AdamW is AdamW whatever it says)", default=True),
    "torch_adam": Key(
        Bool(),
        NA,
        "DeepSpeed's choice of torch.optim.AdamW over its own kernels: zerofit's AdamW is "
        "torch.optim.AdamW's math either way (only the absent weight_decay follows it)",
        default=False,
    ),
    "fp32_optimizer_states": Key(
        Choice((True,)),
        NA,
        "zerofit always keeps fp32 optimizer state",
        hint="zerofit keeps the Adam moments in fp32; remove the key",
    ),
    "foreach": na(Bool(nullable=True), "zerofit's AdamW is its own kernel"),
    "bias_correction": Key(
        Choice((True,)),
        HONOURED,
        "zerofit's AdamW is always bias-corrected",
        hint="zerofit's AdamW is always bias-corrected; remove the key",
        default=True,
    ),
    "amsgrad": Key(
        Choice((False,)),
        HONOURED,
        "zerofit's AdamW has no amsgrad variant",
        hint="zerofit's AdamW has no amsgrad variant; remove the key",
        default=False,
    ),
}
"""``max_grad_norm`` is not in the table: DeepSpeed 0.19.8 raises for it, and so does zerofit, before the walk."""

TORCH_ADAMW_WEIGHT_DECAY = 0.01
"""``torch.optim.AdamW``'s default weight decay: DeepSpeed's with ``torch_adam`` true and AdamW's math"""

_LAST_ITERATION = Key(
    Choice((-1,)),
    NA,
    "zerofit resumes the schedule from its checkpoint",
    hint="zerofit resumes the schedule from its checkpoint; remove the key",
    default=-1,
)
_WARMUP_COMMON: dict[str, Key | Section] = {
    "warmup_num_steps": Key(Int(0), HONOURED, "-> scheduler.warmup_steps", auto=True, default=1000),
    "warmup_type": Key(Choice(("log", "linear")), HONOURED, "-> scheduler.warmup_type", default="log"),
    "last_batch_iteration": _LAST_ITERATION,
}
_WARMUP_LR: dict[str, Key | Section] = {
    **_WARMUP_COMMON,
    "warmup_min_lr": Key(Float(0), HONOURED, "-> scheduler.warmup_min_lr", auto=True, default=0.0),
    "warmup_max_lr": Key(
        Float(0, lo_open=True),
        HONOURED,
        "-> scheduler.warmup_max_lr; absent: the optimizer's lr",
        auto=True,
        default=None,
    ),
}
_TOTAL = Key(Int(1), HONOURED, "-> scheduler.total_steps (DeepSpeed requires it)", auto=True)
_MOM = Float(0, 1, hi_open=True)  # Adam's beta1: the schema's [0, 1)
SCHEDULER_PARAMS: dict[str, dict[str, Key | Section]] = {
    "WarmupLR": _WARMUP_LR,
    "WarmupDecayLR": {
        **_WARMUP_LR,
        "total_num_steps": _TOTAL,
        "warmup_max_lr": Key(Float(0, lo_open=True), HONOURED, "-> scheduler.warmup_max_lr", auto=True, default=0.001),
    },
    "WarmupCosineLR": {
        **_WARMUP_COMMON,
        "total_num_steps": _TOTAL,
        "warmup_min_ratio": Key(Float(0, 1), HONOURED, "-> scheduler.warmup_min_ratio", default=0.0),
        "cos_min_ratio": Key(Float(0, 1), HONOURED, "-> scheduler.min_lr_ratio", default=0.0001),
    },
    # [Note: OneCycle and LRRangeTest] (zerofit/optim/schedules.py)
    "OneCycle": {
        "cycle_min_lr": Key(Float(0), HONOURED, "-> scheduler.one_cycle.cycle_min_lr (DeepSpeed requires it)"),
        "cycle_max_lr": Key(Float(0), HONOURED, "-> scheduler.one_cycle.cycle_max_lr (DeepSpeed requires it)"),
        "decay_lr_rate": Key(Float(0), HONOURED, "-> scheduler.one_cycle.decay_lr_rate", default=0.0),
        "cycle_first_step_size": Key(
            Float(0, lo_open=True), HONOURED, "-> scheduler.one_cycle.cycle_first_step_size", default=2000
        ),
        "cycle_second_step_size": Key(
            Float(0),
            HONOURED,
            "-> scheduler.one_cycle.cycle_second_step_size; absent: cycle_first_step_size",
            default=None,
        ),
        "cycle_first_stair_count": Key(Int(0), HONOURED, "-> scheduler.one_cycle.cycle_first_stair_count", default=0),
        "cycle_second_stair_count": Key(
            Int(0, nullable=True),
            HONOURED,
            "-> scheduler.one_cycle.cycle_second_stair_count; absent: cycle_first_stair_count",
            default=None,
        ),
        "decay_step_size": Key(Float(0), HONOURED, "-> scheduler.one_cycle.decay_step_size (0: no decay)", default=0),
        "cycle_momentum": Key(
            Bool(),
            HONOURED,
            "-> scheduler.one_cycle.cycle_momentum: Adam's beta1 cycles inversely "
            "to the lr and beta2 is 0.99, as DeepSpeed sets the optimizer's betas",
            default=True,
        ),
        "cycle_min_mom": Key(_MOM, HONOURED, "-> scheduler.one_cycle.cycle_min_mom", default=0.8),
        "cycle_max_mom": Key(_MOM, HONOURED, "-> scheduler.one_cycle.cycle_max_mom", default=0.9),
        "decay_mom_rate": Key(Float(0), HONOURED, "-> scheduler.one_cycle.decay_mom_rate", default=0.0),
        "last_batch_iteration": _LAST_ITERATION,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": Key(Float(0), HONOURED, "-> scheduler.lr_range_test.min_lr", default=1e-3),
        "lr_range_test_step_size": Key(Int(1), HONOURED, "-> scheduler.lr_range_test.step_size", default=2000),
        "lr_range_test_step_rate": Key(Float(0), HONOURED, "-> scheduler.lr_range_test.step_rate", default=1.0),
        "lr_range_test_staircase": Key(Bool(), HONOURED, "-> scheduler.lr_range_test.staircase", default=False),
        "last_batch_iteration": _LAST_ITERATION,
    },
}
