"""Small views of DeepSpeed's engine objects that scripts and DeepSpeed's tests read: ``engine.tput_timer``
(DeepSpeed's ThroughputTimer counters) and ``optimizer.loss_scaler`` (DeepSpeed's loss scaler), over zerofit's
engine (deepspeed_surface.py returns them)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from zerofit.engine.deepspeed_names import refuse_attribute


class ThroughputTimerView:
    """``engine.tput_timer`` (DeepSpeed's ``ThroughputTimer``, deepspeed/utils/timer.py): the counters with
    DeepSpeed's meaning, ``epoch_count`` (``update_epoch_count()`` adds one and restarts ``micro_step_count``),
    ``micro_step_count`` (the engine's micro-batches in this epoch), ``global_step_count`` (``engine.global_steps``),
    ``batch_size`` (the micro batch). Its timing (``start``, ``stop``, ``avg_samples_per_sec``, its periodic
    throughput log) is refused by name: the engine's own timings are ``engine.timeline()`` and ``engine.trace()``."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.epoch_count = 0
        self._epoch_start = 0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self._epoch_start = self._engine().micro_steps

    @property
    def micro_step_count(self) -> int:
        return self._engine().micro_steps - self._epoch_start

    @property
    def global_step_count(self) -> int:
        return self._engine().global_steps

    @property
    def batch_size(self) -> int:
        return self._engine().train_micro_batch_size_per_gpu()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise refuse_attribute("tput_timer", name, "it keeps DeepSpeed's counters (epoch_count, update_epoch_count(), "
                                                   "micro_step_count, global_step_count, batch_size); the engine's "
                                                   "timings are engine.timeline() and engine.trace()")


@dataclass(frozen=True)
class LossScalerView:
    """``optimizer.loss_scaler`` (DeepSpeed's Static/DynamicLossScaler): the fp16 scale, read live."""

    _optimizer: object         # deepspeed_surface.OptimizerView

    @property
    def loss_scale(self) -> float:
        return self._optimizer.loss_scale

    cur_scale = loss_scale

    @property
    def dynamic(self) -> bool:
        return self._optimizer.dynamic_loss_scale
