"""[Note: one end of a step] (engine/step/step_end.py): the order every door's step end runs in, recorded over stand-in
parts, and the same sequence through train_batch and the DeepSpeed-shaped loop on a tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import zerofit
import zerofit.deepspeed as deepspeed
from tests.support import tiny_models as tm
from zerofit.engine.step.step_end import StepEnd


def _parts(spec=None):
    calls: list = []
    stepper = SimpleNamespace(
        prepare=lambda: calls.append("prepare") or SimpleNamespace(norm=2.5, spec=spec),
        apply=lambda p: calls.append("apply") or (True, p.norm),
        discard_grads=lambda: calls.append("discard_grads"),
        drop=lambda s: calls.append(("drop", s)),
    )
    window = SimpleNamespace(before_step=lambda: calls.append("before_step"), stepped=lambda: calls.append("stepped"))
    end = StepEnd(stepper, window, lambda applied, norm: calls.append(("ended", applied, norm)))
    return end, calls


def test_a_windowed_step_closes_the_window_prepares_applies_reopens_then_ends():
    end, calls = _parts()
    end.finish(before_end=lambda: calls.append("loss read"))
    assert calls == ["before_step", "prepare", "apply", "stepped", "loss read", ("ended", True, 2.5)]


def test_a_skipped_step_drops_its_gradients_and_ends_unapplied_with_its_norm():
    end, calls = _parts()
    prepared = end.prepare()
    end.skip(prepared)
    assert calls == ["before_step", "prepare", "discard_grads", "stepped", ("ended", False, 2.5)]


def test_a_skipped_step_drops_its_speculation_before_its_gradients():
    """A speculation's work (updates to undo, casts still running on the worker) is dropped before the gradients
    it reads are."""
    end, calls = _parts(spec="spec")
    end.skip(end.prepare())
    assert calls == ["before_step", "prepare", ("drop", "spec"), "discard_grads", "stepped", ("ended", False, 2.5)]


def test_train_batch_has_no_window():
    end, calls = _parts()
    end.finish(windowed=False)
    assert calls == ["prepare", "apply", ("ended", True, 2.5)]


@pytest.mark.usefixtures("one_thread")
def test_train_batch_and_the_deepspeed_loop_end_their_steps_alike():
    """The same micro-batches through train_batch and the DeepSpeed-shaped loop: the same step count, weights and
    last norm (clipping on: the norm is taken), each step ended once."""
    cfg = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    cfg |= {"gradient_clipping": 1.0, "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}
    data = tm.batches(2, 2)
    torch.manual_seed(0)
    a = zerofit.initialize(tm.llama(tied=False), cfg)
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    b, *_ = deepspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3},
        },
    )
    for mbs in data:
        a.train_batch(mbs)
        for mb in mbs:
            b.backward(b(**mb).loss)
            b.step()
    assert a.global_steps == b.global_steps == 2
    assert a.last_grad_norm == pytest.approx(b.last_grad_norm, rel=1e-5)
    wa, wb = dict(a.module.named_parameters()), dict(b.module.named_parameters())
    for n in wa:
        torch.testing.assert_close(wa[n], wb[n], rtol=1e-5, atol=1e-6)
    a.close()
    b.close()
