"""The views of DeepSpeed's engine objects that ``zerofit.deepspeed.initialize`` returns and scripts read, over
zerofit's engine (deepspeed_surface.py returns them): the optimizer (``DeepSpeedOptimizer``) and lr scheduler
(``DeepSpeedScheduler``) ``initialize`` returns, ``engine.tput_timer`` (DeepSpeed's ThroughputTimer counters) and
``optimizer.loss_scaler`` (DeepSpeed's loss scaler). A leaf of the DeepSpeed face: deepspeed/runtime/lr_schedules.py
subclasses the scheduler's view without importing the face."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported, refuse_attribute
from zerofit.engine.faces.views import OptimizerView, SchedulerView

if TYPE_CHECKING:
    from torch import nn

    from zerofit.engine.faces.deepspeed_surface import DeepSpeedFace
    from zerofit.engine.step.hypers import Hypers
    from zerofit.optim.loss_scaler import LossScaler

log = logging.getLogger("zerofit")


class ThroughputTimerView:
    """``engine.tput_timer`` (DeepSpeed's ``ThroughputTimer``, deepspeed/utils/timer.py): the counters with
    DeepSpeed's meaning, ``epoch_count`` (``update_epoch_count()`` adds one and restarts ``micro_step_count``),
    ``micro_step_count`` (the engine's micro-batches in this epoch), ``global_step_count`` (``engine.global_steps``),
    ``batch_size`` (the micro batch). Its timing (``start``, ``stop``, ``avg_samples_per_sec``, its periodic
    throughput log) is refused by name: the engine's own timings are ``engine.timeline()`` and ``engine.trace()``."""

    def __init__(self, engine: DeepSpeedFace) -> None:
        self._engine = weakref.ref(engine)
        self.epoch_count = 0
        self._epoch_start = 0

    def _live(self) -> DeepSpeedFace:
        engine = self._engine()
        assert engine is not None  # the face holds its timer (its record): read through a live face
        return engine

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self._epoch_start = self._live().micro_steps

    @property
    def micro_step_count(self) -> int:
        return self._live().micro_steps - self._epoch_start

    @property
    def global_step_count(self) -> int:
        return self._live().global_steps

    @property
    def batch_size(self) -> int:
        return self._live().train_micro_batch_size_per_gpu()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise refuse_attribute(
            "tput_timer",
            name,
            "it keeps DeepSpeed's counters (epoch_count, update_epoch_count(), "
            "micro_step_count, global_step_count, batch_size); the engine's "
            "timings are engine.timeline() and engine.trace()",
        )


@dataclass(frozen=True)
class LossScalerView:
    """``optimizer.loss_scaler`` (DeepSpeed's Static/DynamicLossScaler): the fp16 scale, read live."""

    _optimizer: DeepSpeedOptimizer

    @property
    def loss_scale(self) -> float:
        return self._optimizer.loss_scale

    cur_scale = loss_scale

    @property
    def dynamic(self) -> bool:
        return self._optimizer.dynamic_loss_scale


class DeepSpeedOptimizer(OptimizerView):
    """The optimizer ``zerofit.deepspeed.initialize`` returns (``engine.optimizer``): views.py's, with the fp16
    loss scale and DeepSpeed's refusals. The engine takes the step (``engine.step()``); gradients and moments
    live in its buffers, and its checkpoints hold them (``engine.save_checkpoint``)."""

    def __init__(self, hypers: Hypers, model: nn.Module, scaler: LossScaler | None, names: tuple | None = None) -> None:
        super().__init__(hypers, model, names)
        self._scaler = scaler

    @property
    def loss_scale(self) -> float:
        """The fp16 dynamic loss scale (1.0 in bf16/fp32, where no scaling is done)."""
        return float(self._scaler.scale) if self._scaler is not None else 1.0

    cur_scale = loss_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the fp16 loss scale is dynamic (DeepSpeed's FP16 optimizers' attribute)."""
        return self._scaler is not None and bool(self._scaler.dynamic)

    @property
    def loss_scaler(self) -> LossScalerView:
        """DeepSpeed's FP16 optimizers' ``loss_scaler``: ``loss_scale`` (= ``cur_scale``) and ``dynamic``."""
        from zerofit.engine.faces.deepspeed_views import LossScalerView

        return LossScalerView(self)

    @property
    def loss_scale_config(self):
        """DeepSpeed's ``optimizer.loss_scale_config`` (its FP16 optimizer's): the fp16 scale, its window, its
        counters, read live from the engine's scaler ([Note: fp16 without ZeRO], optim/loss_scaler.py)."""
        from zerofit.optim.loss_scaler import DeepSpeedLossScaleConfig

        return DeepSpeedLossScaleConfig(self._scaler)

    def step(self, closure=None):
        raise DeepSpeedUnsupported(
            "optimizer.step(): engine.step() takes the optimizer step (at the gradient "
            "accumulation boundary), as with DeepSpeed; call engine.step() instead"
        )

    def state_dict(self):
        raise DeepSpeedUnsupported(
            "optimizer.state_dict(): the AdamW moments live in the engine's host buffers; "
            "engine.save_checkpoint(dir) saves them with the weights, step count and RNG "
            "states, and engine.load_checkpoint(dir) restores them"
        )

    def load_state_dict(self, state_dict):
        raise DeepSpeedUnsupported(
            "optimizer.load_state_dict(): restore the optimizer state with engine.load_checkpoint(dir)"
        )

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise refuse_attribute(
            "optimizer",
            name,
            "it offers param_groups, defaults, loss_scale, loss_scale_config, "
            "dynamic_loss_scale, loss_scaler, "
            "zero_grad() (a no-op); the engine steps and checkpoints the "
            "optimizer",
        )

    def __repr__(self) -> str:
        return f"zerofit AdamW view ({len(self.hypers())} group(s), lr {self.lrs()})"


class DeepSpeedScheduler(SchedulerView):
    """The lr scheduler ``zerofit.deepspeed.initialize`` returns (``engine.lr_scheduler``) when the config has a
    schedule: the engine steps it inside ``engine.step()`` after every applied optimizer step, as DeepSpeed
    steps a scheduler from its config; so ``step()`` here does nothing (with a warning, once)."""

    def __init__(self, hypers: Hypers, optimizer: OptimizerView) -> None:
        super().__init__(hypers, optimizer)
        self._warned = False

    def step(self, last_batch_iteration=None) -> None:
        if last_batch_iteration is not None:
            raise DeepSpeedUnsupported(
                f"lr_scheduler.step({last_batch_iteration!r}): the schedule's position is the "
                "engine's count of applied optimizer steps and cannot be set"
            )
        if not self._warned:
            self._warned = True
            log.warning(
                "zerofit: lr_scheduler.step() does nothing: engine.step() steps the schedule after every "
                "applied optimizer step (DeepSpeed does the same, and a second step() there would advance "
                "the schedule twice)"
            )

    def load_state_dict(self, state_dict):
        raise DeepSpeedUnsupported(
            "lr_scheduler.load_state_dict(): the schedule's position is the engine's step "
            "count; engine.load_checkpoint(dir) restores it"
        )

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise refuse_attribute(
            "lr_scheduler",
            name,
            "it offers get_last_lr(), get_lr(), state_dict(), last_batch_iteration and step() (a no-op)",
        )

    def __repr__(self) -> str:
        return f"zerofit {self._hypers.config.scheduler.type} schedule view (lr {self.get_last_lr()})"
