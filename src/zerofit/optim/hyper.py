"""One parameter group's AdamW settings for one step: what a schedule computes (schedules.py, client_schedule.py)
and what the engine's kernels take (engine/update/adamw.py)."""

from __future__ import annotations

from dataclasses import dataclass

from zerofit.config.schema import OptimizerConfig


@dataclass(frozen=True)
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, cfg: OptimizerConfig, lr: float) -> Hyper:
        return cls(lr, cfg.betas[0], cfg.betas[1], cfg.eps, cfg.weight_decay)
