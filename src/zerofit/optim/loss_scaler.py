"""fp16 loss scaling with DeepSpeed's semantics.

The engine multiplies the loss by ``scaler.scale`` before backward, checks the
gradients for inf/NaN, and calls ``scaler.update(overflow)`` once per optimizer
step; ``update`` returns True when the step must be skipped (weights and
optimizer state left untouched) and adjusts the scale.

:class:`DynamicLossScaler` restates ``DynamicLossScaler.update_scale`` from
``deepspeed/runtime/fp16/loss_scaler.py`` (deepspeedai/DeepSpeed, read at commit
18fd4c973de35381257542d2c99177a82a4b525a), with the same attribute names:

* on an overflow with hysteresis left (``delayed_shift > 1`` and
  ``cur_hysteresis > 1``): ``cur_hysteresis -= 1``, the scale is kept;
* on an overflow with no hysteresis left: the scale halves, floored at
  ``min_scale``; if it is already at ``min_scale``, :class:`LossScaleUnderflowError`
  (DeepSpeed raises a bare ``Exception``);
* on a clean step: with ``consecutive_hysteresis`` the hysteresis is refilled;
  after every ``scale_window`` clean steps since the last overflow the scale
  doubles (and, without ``consecutive_hysteresis``, the hysteresis is refilled).

Every overflow skips its step, hysteresis or not. ``cur_iter`` counts calls to
``update`` (applied and skipped steps).

[Note: fp16 without ZeRO]
DeepSpeed 0.19.8 has two fp16 loss scalers: its ZeRO optimizers (stages 1-3) use ``DynamicLossScaler`` as
above; without ZeRO (stage 0) its ``FP16_Optimizer`` keeps a ``LossScaleConfig`` and halves the scale at every
overflow (no hysteresis) and, at ``min_loss_scale``, keeps it there and skips the step without stopping. A
DeepSpeed config without ZeRO reads to ``hysteresis`` 1 and ``raise_at_min_scale`` false, which is that
arithmetic (zerofit.config.deepspeed). :class:`DeepSpeedLossScaleConfig` is that optimizer's
``loss_scale_config`` (``engine.optimizer.loss_scale_config``), read from zerofit's scaler.
"""

from __future__ import annotations

from typing import Any

from zerofit.config.schema import LossScaleConfig
from zerofit.errors import ZerofitError

__all__ = [
    "LossScaleUnderflowError",
    "DynamicLossScaler",
    "StaticLossScaler",
    "LossScaler",
    "make_loss_scaler",
    "DeepSpeedLossScaleConfig",
]


class LossScaleUnderflowError(ZerofitError, RuntimeError):
    """The gradients overflowed with the dynamic loss scale already at ``min_loss_scale``."""


class DynamicLossScaler:
    """Dynamic fp16 loss scale: halves on overflow (after ``delayed_shift`` of them), doubles after a clean window."""

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        if not init_scale > 0 or not min_scale > 0:
            raise ValueError(f"init_scale and min_scale must be > 0, found {init_scale} and {min_scale}")
        if scale_window < 1 or delayed_shift < 1:
            raise ValueError(f"scale_window and delayed_shift must be >= 1, found {scale_window} and {delayed_shift}")
        self.cur_scale = float(init_scale)
        """the scale the next backward uses"""
        self.cur_iter = 0
        """calls to update() so far"""
        self.last_overflow_iter = -1
        """cur_iter of the last overflow (-1: none yet)"""
        self.scale_factor = 2.0
        self.scale_window = scale_window
        """clean steps since the last overflow before the scale doubles"""
        self.min_scale = float(min_scale)
        self.delayed_shift = delayed_shift
        """overflows tolerated before the scale halves (fp16.hysteresis)"""
        self.cur_hysteresis = delayed_shift
        """overflows still tolerated before the next halving"""
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.skipped_steps = 0
        """optimizer steps skipped for overflow"""

    @classmethod
    def from_config(cls, cfg: LossScaleConfig) -> DynamicLossScaler:
        return cls(
            init_scale=2.0**cfg.initial_scale_power,
            scale_window=cfg.loss_scale_window,
            min_scale=cfg.min_loss_scale,
            delayed_shift=cfg.hysteresis,
            consecutive_hysteresis=cfg.consecutive_hysteresis,
            raise_error_at_min_scale=cfg.raise_at_min_scale,
        )

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self.cur_scale

    def update(self, overflow: bool) -> bool:
        """Record one optimizer step's overflow check; return True if the step must be skipped."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleUnderflowError(
                        f"fp16 gradients overflowed at optimizer step {self.cur_iter} with the loss scale already "
                        f"at its minimum (fp16.min_loss_scale = {self.min_scale:g}), so the scale cannot go lower. "
                        "The gradients are not finite even barely scaled: look for inf/NaN in the data or the loss, "
                        "lower the learning rate or enable gradient_clipping, or train in bf16 "
                        "(precision='bf16'), which needs no loss scaling. Lowering fp16.min_loss_scale only "
                        "helps when the overflow comes from the scale itself."
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
            self.skipped_steps += 1
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        return overflow

    _STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "skipped_steps")

    def state_dict(self) -> dict[str, Any]:
        """The evolving state (the settings come from the config, which is saved with the checkpoint)."""
        return {"kind": "dynamic", **{k: getattr(self, k) for k in self._STATE}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, "dynamic", self._STATE)
        for k in self._STATE:
            setattr(self, k, type(getattr(self, k))(state[k]))


class StaticLossScaler:
    """A fixed loss scale (``fp16.loss_scale > 0``): overflowing steps are skipped, the scale never changes."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"a static loss scale must be > 0, found {scale}")
        self.cur_scale = float(scale)
        self.cur_iter = 0
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> bool:
        """Record one optimizer step's overflow check; return True if the step must be skipped."""
        self.cur_iter += 1
        if overflow:
            self.skipped_steps += 1
        return overflow

    _STATE = ("cur_scale", "cur_iter", "skipped_steps")

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "static", **{k: getattr(self, k) for k in self._STATE}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state, "static", self._STATE)
        for k in self._STATE:
            setattr(self, k, type(getattr(self, k))(state[k]))


LossScaler = DynamicLossScaler | StaticLossScaler


def make_loss_scaler(cfg: LossScaleConfig) -> LossScaler:
    """The scaler ``cfg`` describes: static when ``loss_scale > 0``, dynamic otherwise (DeepSpeed's rule)."""
    if cfg.loss_scale > 0:
        return StaticLossScaler(cfg.loss_scale)
    return DynamicLossScaler.from_config(cfg)


def _check_state(state: dict[str, Any], kind: str, keys: tuple[str, ...]) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"loss scaler state: expected a {kind} scaler's state, found {found!r}; "
            "the checkpoint was written with a different fp16.loss_scale setting"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"loss scaler state: missing {', '.join(missing)}")


class DeepSpeedLossScaleConfig:
    """DeepSpeed's ``FP16_Optimizer.loss_scale_config`` (deepspeed/runtime/fp16/loss_scaler.py, 0.19.8), read
    live from zerofit's scaler (``None``: no fp16): what scripts and DeepSpeed's unit tests read as
    ``optimizer.loss_scale_config.cur_scale`` and the like. Read-only."""

    def __init__(self, scaler: LossScaler | None) -> None:
        self._scaler = scaler

    def _dynamic(self, name: str):
        s = self._scaler
        return getattr(s, name) if s is not None and s.dynamic else None

    @property
    def use_grad_scaling(self) -> bool:
        return self._scaler is not None

    @property
    def dynamic_loss_scale(self) -> bool:
        return self._scaler is not None and self._scaler.dynamic

    @property
    def cur_scale(self) -> float:
        return self._scaler.cur_scale if self._scaler is not None else 1.0

    @property
    def cur_iter(self) -> int:
        return self._scaler.cur_iter if self._scaler is not None else 0

    @property
    def last_overflow_iter(self) -> int | None:
        return self._dynamic("last_overflow_iter")

    @property
    def scale_factor(self) -> float | None:
        return self._dynamic("scale_factor")

    @property
    def scale_window(self) -> int | None:
        return self._dynamic("scale_window")

    @property
    def min_loss_scale(self) -> float | None:
        return self._dynamic("min_scale")

    @property
    def cur_hysteresis(self) -> int | None:
        """(a later DeepSpeed's field: the overflows still absorbed before the scale halves)"""
        return self._dynamic("cur_hysteresis")

    def __repr__(self) -> str:
        return (
            f"LossScaleConfig(use_grad_scaling={self.use_grad_scaling}, dynamic_loss_scale="
            f"{self.dynamic_loss_scale}, cur_iter={self.cur_iter}, cur_scale={self.cur_scale})"
        )
