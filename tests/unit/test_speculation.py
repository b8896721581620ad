"""[Note: speculative updates]: the rollback inverts the fused AdamW step, and a step that cannot be applied
(a non-finite gradient found after blocks were already updated speculatively) leaves the state as it was."""

from __future__ import annotations

import math

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.update.adamw import adamw_flat, adamw_rollback
from zerofit.optim.hyper import Hyper


@pytest.mark.parametrize("wd,steps", [(0.01, 1), (0.0, 5), (0.1, 3)])
def test_rollback_inverts_the_fused_adamw_step(wd, steps):
    g = torch.Generator().manual_seed(0)
    n = 50_000
    h = Hyper(1e-3, 0.9, 0.999, 1e-8, wd)
    p, m, v, st = torch.randn(n, generator=g) * 0.02, torch.zeros(n), torch.zeros(n), torch.zeros(())
    for _ in range(steps - 1):
        adamw_flat(p, torch.randn(n, generator=g) * 1e-3, m, v, st, h)
    before = [t.clone() for t in (p, m, v, st)]
    grad = torch.randn(n, generator=g) * 1e-3
    adamw_flat(p, grad, m, v, st, h)
    assert not torch.equal(p, before[0])
    adamw_rollback(p, grad, m, v, st, h)
    assert float(st) == float(before[3])
    torch.testing.assert_close(p, before[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(m, before[1], rtol=1e-5, atol=1e-10)
    torch.testing.assert_close(v, before[2], rtol=1e-5, atol=1e-14)
    assert bool((v >= 0).all())


def test_non_finite_gradient_after_speculation_rolls_back(monkeypatch):
    """The NaN is in block 0, the last block of the backward: every other block was already updated
    speculatively. The step raises FloatingPointError and every master and moment is as before (to rounding)."""
    torch.manual_seed(0)
    engine = zerofit.initialize(
        tm.llama(layers=4),
        {
            "device": "cpu",
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1e3,
            "optimizer": {"lr": 1e-3},
        },
    )
    data = tm.batches(3, 2)
    engine.train_batch(data[0])
    assert engine.speculation_stats["held"] == 1
    engine.wait()
    before = {u.name: [t.clone() for t in (u.master, u.exp_avg, u.exp_avg_sq, u.step)] for u in engine.units}
    hits = []
    inner = engine.grads.accumulate

    def poisoned(unit, dst, grads, names):
        inner(unit, dst, grads, names)
        if unit.index == 0:
            hits.append(unit.name)
            dst.view(-1)[0] = float("nan")

    engine.grads.accumulate = poisoned
    import zerofit.engine.update.unit_adamw as optimizer_module  # unit_adamw runs every rollback

    rolled = []
    monkeypatch.setattr(
        optimizer_module,
        "adamw_rollback",
        lambda master, *a: (rolled.append(master.data_ptr()), adamw_rollback(master, *a)),
    )
    with pytest.raises(FloatingPointError):
        engine.train_batch(data[1])
    assert hits, "the seam was not hit"
    engine.wait()
    for u in engine.units:
        for t, b in zip((u.master, u.exp_avg, u.exp_avg_sq, u.step), before[u.name]):
            torch.testing.assert_close(t, b, rtol=1e-5, atol=1e-9, msg=lambda msg, u=u: f"{u.name}: {msg}")
    assert len(rolled) == 3, "blocks 3, 2 and 1 were updated speculatively, then rolled back"
    assert engine.speculation_stats == {"held": 1, "rolled_back": 1, "waited": 0}
    engine.grads.accumulate = inner
    assert math.isfinite(engine.train_batch(data[2]))  # the engine goes on
