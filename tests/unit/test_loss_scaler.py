"""fp16 loss scaling: DeepSpeed's semantics, hysteresis, growth, the error at the minimum.

.venv/bin/python -m pytest tests/unit/test_loss_scaler.py -q
"""

from __future__ import annotations

import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerofit.config.schema import LossScaleConfig
from zerofit.optim.loss_scaler import (
    DynamicLossScaler,
    LossScaleUnderflowError,
    StaticLossScaler,
    make_loss_scaler,
)


class DeepSpeedReference:
    """A faithful restatement of ``DynamicLossScaler.update_scale`` from deepspeed/runtime/fp16/loss_scaler.py
    (deepspeedai/DeepSpeed @ 18fd4c973de35381257542d2c99177a82a4b525a), logging removed."""

    def __init__(
        self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis, raise_error_at_min_scale=True
    ):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise Exception(
                        "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
                    )
                else:
                    next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                    self.cur_scale = next_scale
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def _state(s):
    return (s.cur_scale, s.cur_iter, s.last_overflow_iter, s.cur_hysteresis)


@settings(max_examples=200, deadline=None)
@given(
    init_power=st.integers(0, 20),
    window=st.integers(1, 6),
    min_scale=st.sampled_from([0.25, 1.0, 3.0, 16.0]),
    hysteresis=st.integers(1, 4),
    consecutive=st.booleans(),
    raise_at_min=st.booleans(),
    overflows=st.lists(st.booleans(), max_size=80),
)
def test_matches_deepspeed_update_scale(
    init_power, window, min_scale, hysteresis, consecutive, raise_at_min, overflows
):
    ours = DynamicLossScaler(2.0**init_power, window, min_scale, hysteresis, consecutive, raise_at_min)
    ref = DeepSpeedReference(2.0**init_power, window, min_scale, hysteresis, consecutive, raise_at_min)
    skipped = 0
    for overflow in overflows:
        try:
            ref.update_scale(overflow)
        except Exception:
            with pytest.raises(LossScaleUnderflowError):
                ours.update(overflow)
            assert _state(ours) == _state(ref)  # nothing changed on the way out
            return
        assert ours.update(overflow) is overflow
        skipped += overflow
        assert _state(ours) == _state(ref)
        assert ours.scale == ref.cur_scale
    assert ours.skipped_steps == skipped


def test_hysteresis_delays_the_halving():
    s = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=3)
    assert s.update(True) is True and s.scale == 2.0**16 and s.cur_hysteresis == 2
    assert s.update(True) is True and s.scale == 2.0**16 and s.cur_hysteresis == 1
    assert s.update(True) is True and s.scale == 2.0**15  # hysteresis used up: halves
    assert s.update(True) is True and s.scale == 2.0**14  # and keeps halving until the scale grows again
    assert s.skipped_steps == 4


def test_scale_halves_each_overflow_without_hysteresis():
    s = DynamicLossScaler(init_scale=1024.0, scale_window=10, min_scale=1, delayed_shift=1)
    for expected in (512.0, 256.0, 128.0):
        assert s.update(True) is True
        assert s.scale == expected


def test_grows_after_loss_scale_window_clean_steps():
    s = DynamicLossScaler(init_scale=8.0, scale_window=5, min_scale=1, delayed_shift=2)
    s.update(True)  # iter 0: overflow, hysteresis 2 -> 1, scale kept
    assert s.scale == 8.0
    for _ in range(5):  # iters 1..5 clean: stable intervals 0..4
        assert s.update(False) is False
    assert s.scale == 8.0
    s.update(False)  # iter 6: stable interval 5 == window -> doubles, hysteresis refilled
    assert s.scale == 16.0 and s.cur_hysteresis == 2
    for _ in range(5):
        s.update(False)
    assert s.scale == 32.0  # every further window doubles again


def test_first_growth_from_a_fresh_scaler_follows_deepspeed():
    # last_overflow_iter starts at -1, so the first doubling comes after scale_window + 1 clean steps.
    s = DynamicLossScaler(init_scale=4.0, scale_window=3, min_scale=1, delayed_shift=2)
    scales = []
    for _ in range(8):
        s.update(False)
        scales.append(s.scale)
    assert scales == [4, 4, 4, 8, 8, 8, 16, 16]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    s = DynamicLossScaler(init_scale=64.0, scale_window=100, min_scale=1, delayed_shift=2, consecutive_hysteresis=True)
    for _ in range(10):  # alternating overflows never exhaust the hysteresis
        s.update(True)
        s.update(False)
    assert s.scale == 64.0 and s.skipped_steps == 10
    plain = DynamicLossScaler(init_scale=64.0, scale_window=100, min_scale=1, delayed_shift=2)
    for _ in range(3):
        plain.update(True)
        plain.update(False)
    assert plain.scale == 16.0  # without it, the hysteresis is spent once and each overflow halves


def test_named_error_at_min_loss_scale():
    s = DynamicLossScaler(init_scale=4.0, scale_window=1000, min_scale=1.0, delayed_shift=1)
    s.update(True)
    s.update(True)
    assert s.scale == 1.0  # reached the floor; one more overflow is fatal
    with pytest.raises(LossScaleUnderflowError, match="minimum") as info:
        s.update(True)
    assert isinstance(info.value, RuntimeError)
    assert "min_loss_scale" in str(info.value) and "bf16" in str(info.value)


def test_hysteresis_still_applies_at_the_floor():
    s = DynamicLossScaler(init_scale=1.0, scale_window=1000, min_scale=1.0, delayed_shift=2)
    assert s.update(True) is True  # hysteresis 2 -> 1, no error yet
    with pytest.raises(LossScaleUnderflowError):
        s.update(True)


def test_floor_is_not_undershot_and_can_be_allowed():
    s = DynamicLossScaler(
        init_scale=3.0, scale_window=1000, min_scale=1.0, delayed_shift=1, raise_error_at_min_scale=False
    )
    for _ in range(5):
        assert s.update(True) is True
    assert s.scale == 1.0


def test_static_scaler_skips_overflows_and_never_moves():
    s = StaticLossScaler(128.0)
    assert s.update(False) is False and s.update(True) is True and s.update(True) is True
    assert s.scale == 128.0 and s.skipped_steps == 2


def test_make_loss_scaler_from_config():
    dyn = make_loss_scaler(
        LossScaleConfig(
            initial_scale_power=12, loss_scale_window=7, hysteresis=3, min_loss_scale=2.0, consecutive_hysteresis=True
        )
    )
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.scale, dyn.scale_window, dyn.delayed_shift, dyn.min_scale, dyn.consecutive_hysteresis) == (
        4096.0,
        7,
        3,
        2.0,
        True,
    )
    static = make_loss_scaler(LossScaleConfig(loss_scale=1024.0))
    assert isinstance(static, StaticLossScaler) and static.scale == 1024.0


def test_state_dict_round_trip_resumes_bitwise():
    rng = random.Random(0)
    flags = [rng.random() < 0.2 for _ in range(300)]
    settings_ = dict(
        init_scale=2.0**16, scale_window=20, min_scale=1.0, delayed_shift=2, raise_error_at_min_scale=False
    )
    straight = DynamicLossScaler(**settings_)
    for f in flags:
        straight.update(f)
    first = DynamicLossScaler(**settings_)
    for f in flags[:150]:
        first.update(f)
    saved = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = DynamicLossScaler(**settings_)
    resumed.load_state_dict(saved)
    for f in flags[150:]:
        resumed.update(f)
    assert resumed.state_dict() == straight.state_dict()


def test_load_state_dict_refuses_the_other_kind():
    with pytest.raises(ValueError, match="dynamic"):
        DynamicLossScaler().load_state_dict(StaticLossScaler(8.0).state_dict())
    with pytest.raises(ValueError, match="missing"):
        DynamicLossScaler().load_state_dict({"kind": "dynamic", "cur_scale": 1.0})
