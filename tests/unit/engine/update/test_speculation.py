"""Speculation and its rollback (update/speculation.py ``Speculation``, ``Speculator``; update/adamw.py
``adamw_flat``, ``adamw_rollback``).

[Note: speculative updates]: with clipping the CPU worker updates each streamed block during the backward as if
unclipped, while the running sum of the blocks' squared norms (in backward order) cannot prove clipping; when the
global norm is known the speculative updates are kept (no clipping: they *are* the step, bitwise) or rolled back
(the exact algebraic inverse of the fused AdamW step, in fp32: the state restored to rounding, not bitwise) and
redone. A step speculates only after a step that was not clipped (and on the first); fp16 never does.
tests/unit/test_speculation.py covers the rollback's closeness at fixed tolerances and a non-finite gradient's
rollback; here: its error bound in fp32 roundings, the step count, the policy, and the engine's choice of blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.update.adamw import adamw_flat, adamw_rollback
from zerofit.engine.update.speculation import Speculation, Speculator
from zerofit.optim.hyper import Hyper

pytestmark = pytest.mark.usefixtures("one_thread")

EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("wd,steps,lr", [(0.01, 1, 1e-3), (0.0, 5, 1e-3), (0.1, 3, 1e-2), (0.01, 40, 1e-4)])
def test_rollback_restores_the_state_to_a_few_fp32_roundings_and_the_step_exactly(wd, steps, lr):
    """An update then its rollback (same gradient, same hyperparameters): the step count is restored exactly;
    master, exp_avg and exp_avg_sq each within 4 fp32 roundings of the magnitudes the inverse computes with
    (|p0| + |p1 - p0|; |m1| + |g|; |v1| + g^2), which is what "differs by rounding only" promises; v stays >= 0.
    The fused step leaves an unscaled (factor 1) gradient as it was, so the rollback reads the gradient used."""
    g = torch.Generator().manual_seed(steps)
    n = 100_000
    h = Hyper(lr, 0.9, 0.999, 1e-8, wd)
    p, m, v, st = torch.randn(n, generator=g) * 0.02, torch.zeros(n), torch.zeros(n), torch.zeros(())
    for _ in range(steps - 1):
        adamw_flat(p, torch.randn(n, generator=g) * 1e-3, m, v, st, h)
    p0, m0, v0, s0 = (t.clone() for t in (p, m, v, st))
    grad = torch.randn(n, generator=g) * 1e-3
    grad0 = grad.clone()
    adamw_flat(p, grad, m, v, st, h)
    assert torch.equal(grad, grad0)
    assert float(st) == float(s0) + 1
    p1, m1, v1 = p.clone(), m.clone(), v.clone()
    adamw_rollback(p, grad, m, v, st, h)
    assert float(st) == float(s0)
    assert bool(((p - p0).abs() <= 4 * EPS * (p0.abs() + (p1 - p0).abs())).all())
    assert bool(((m - m0).abs() <= 4 * EPS * (m1.abs() + grad.abs())).all())
    assert bool(((v - v0).abs() <= 4 * EPS * (v1.abs() + grad * grad)).all())
    assert bool((v >= 0).all())


def test_a_found_inf_step_leaves_the_state_bitwise_and_a_factor_scales_the_gradient_in_place():
    """adamw_flat's documented contracts: with found_inf nonzero, master, moments and step stay bitwise as they
    were (torch's GradScaler protocol); on the host a factor rides in the fused kernel as grad_scale = 1/factor,
    leaving the gradient divided by fp32(1/factor) in place, and the update is bitwise the factor-1 update of that
    gradient."""
    g = torch.Generator().manual_seed(0)
    n = 10_000
    h = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01)
    state = [torch.randn(n, generator=g), torch.rand(n, generator=g), torch.rand(n, generator=g), torch.tensor(3.0)]
    before = [t.clone() for t in state]
    adamw_flat(*state[:1], torch.randn(n, generator=g), *state[1:], h, found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(state, before))

    factor = 0.3
    grad = torch.randn(n, generator=g)
    scaled = grad / torch.tensor(1.0 / factor, dtype=torch.float32)
    other = [t.clone() for t in state]
    adamw_flat(state[0], grad, *state[1:], h, factor=factor)
    assert torch.equal(grad, scaled)
    adamw_flat(other[0], scaled.clone(), *other[1:], h)
    assert all(torch.equal(a, b) for a, b in zip(state, other))


def test_the_partial_norm_admits_blocks_until_it_proves_clipping_then_none():
    """Speculation.admit: blocks are admitted while the running sum of squared norms stays <= clip^2 (equal is
    not clipped); the first that passes it, or a non-finite one, abandons the step's speculation, and every later
    block is refused, however small. usable() needs both betas positive (the rollback divides by them)."""
    s = Speculation(clip_sq=1.0)
    assert s.admit(0.5) and s.admit(0.5)
    assert s.partial == 1.0 and not s.abandoned
    assert not s.admit(1e-9)
    assert s.abandoned and not s.admit(0.0)
    nan = Speculation(clip_sq=1.0)
    assert not nan.admit(float("nan")) and nan.abandoned
    inf = Speculation(clip_sq=math.inf)
    assert not inf.admit(math.inf) and inf.abandoned, "a non-finite partial sum is refused even without a bound"
    assert Speculation.usable(0.9, 0.999)
    assert not Speculation.usable(0.0, 0.999) and not Speculation.usable(0.9, 0.0)


def test_the_speculator_speculates_on_the_first_step_and_after_unclipped_ones_only():
    """Speculator.begin opens a Speculation when it can and the last step was not clipped (and on the first step);
    after a clipped one it counts a step that waited instead; never when it cannot (fp16, no clipping) or on the
    generic path (not streaming). take() hands the record over once; settled counts held and rolled-back steps."""
    s = Speculator(clip=2.0, can=True)
    s.begin(streaming=True)
    spec = s.current
    assert spec is not None and spec.clip_sq == 4.0
    assert s.take() is spec and s.take() is None and s.current is None
    s.settled(clipped=True)
    s.norm_taken(clipped=True)
    s.begin(streaming=True)
    assert s.current is None and s.stats == {"held": 0, "rolled_back": 1, "waited": 1}
    s.norm_taken(clipped=False)
    s.begin(streaming=False)
    assert s.current is None and s.stats["waited"] == 1
    s.begin(streaming=True)
    assert s.take() is not None
    s.settled(clipped=False)
    s.resume(next_speculates=False)
    s.begin(streaming=True)
    assert s.current is None and s.stats == {"held": 1, "rolled_back": 1, "waited": 2}
    never = Speculator(clip=1.0, can=False)
    never.begin(streaming=True)
    assert never.current is None and never.stats == {"held": 0, "rolled_back": 0, "waited": 0}


def _engine(precision="fp32", clip=1.0, optimizer=None, **offload):
    torch.manual_seed(0)
    return zerofit.initialize(
        tm.llama(layers=4),
        {
            "device": "cpu",
            "precision": precision,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": clip,
            "optimizer": {"lr": 1e-3, **(optimizer or {})},
            "offload": {"resident_blocks": 0, **offload},
        },
    )


@pytest.mark.parametrize(
    "kw,can",
    [
        ({}, True),
        ({"precision": "bf16"}, True),
        ({"clip": 0.0}, False),
        ({"precision": "fp16"}, False),
        ({"speculative_updates": False}, False),
        ({"optimizer": {"betas": [0.0, 0.999]}}, False),
    ],
)
def test_whether_an_engine_can_speculate_follows_the_documented_conditions(kw, can):
    """Speculation needs clipping, a precision other than fp16, offload.speculative_updates, and positive betas."""
    engine = _engine(**kw)
    assert engine.speculator.can is can
    engine.close()


def _state(engine) -> list[torch.Tensor]:
    engine.wait()
    return [t.clone() for u in engine.units for t in (u.master, u.exp_avg, u.exp_avg_sq, u.step)]


def test_kept_speculation_is_the_deferred_step_bitwise_and_a_clipped_one_rolls_back_then_waits():
    """A clip no step reaches: every step speculates and keeps its updates (held), and master, moments and steps
    are bitwise those of the same engine without speculation. A clip every step reaches: the first step speculates
    and is rolled back and redone, the later ones wait for the norm; the state matches the engine without
    speculation to rounding (a rolled-back block differs from a directly updated one by rounding only)."""
    data = tm.batches(3, 2)
    for clip in (1e3, 1e-3):
        runs = []
        for speculate in (True, False):
            engine = _engine(clip=clip, speculative_updates=speculate)
            losses = [engine.train_batch(mbs) for mbs in data]
            runs.append((losses, _state(engine), dict(engine.speculation_stats)))
            engine.close()
        (l_spec, s_spec, stats), (l_plain, s_plain, plain) = runs
        assert plain == {"held": 0, "rolled_back": 0, "waited": 0}
        if clip == 1e3:
            assert stats == {"held": 3, "rolled_back": 0, "waited": 0}
            assert l_spec == l_plain
            assert all(torch.equal(a, b) for a, b in zip(s_spec, s_plain))
        else:
            assert stats == {"held": 0, "rolled_back": 1, "waited": 2}
            for a, b in zip(s_spec, s_plain):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_blocks_speculated_are_the_backward_orders_prefix_within_the_clip():
    """The speculated blocks are those of the backward order (last block first) whose running squared norm stays
    within clip^2: with a clip between the last two blocks' sum and the last three's, exactly blocks 3 and 2 are
    updated early and the speculation is abandoned; the shell never speculates. The gradients are the data's (the
    first step's, the same for any clip), so the set depends on the data only."""
    probe = _engine(clip=1e3)
    sq = []
    settle = probe.stepper.settle

    def read_norms(spec, *a):
        probe.worker.drain()
        sq.extend(float(x) for x in probe.grads.block_sq)
        return settle(spec, *a)

    probe.stepper.settle = read_norms
    mbs = tm.batches(1, 2)[0]
    probe.train_batch(mbs)
    probe.close()
    assert len(sq) == 4 and all(x > 0 for x in sq)
    clip = math.sqrt(sq[3] + sq[2] + 0.5 * sq[1])

    engine = _engine(clip=clip)
    seen = []
    settle = engine.stepper.settle

    def record(spec, host_units, *a):
        engine.worker.drain()
        seen.append(({u.index for u in host_units if id(u) in spec.speculated}, spec.abandoned, spec.partial))
        return settle(spec, host_units, *a)

    engine.stepper.settle = record
    engine.train_batch(mbs)
    engine.wait()
    (speculated, abandoned, partial) = seen[0]
    assert speculated == {3, 2} and abandoned
    assert partial == pytest.approx(sq[3] + sq[2] + sq[1], rel=1e-12)
    assert engine.speculation_stats == {"held": 0, "rolled_back": 1, "waited": 0}
    engine.close()
