"""Attention's backend ([Note: attention's backend], zerofit/engine/model/attention.py): the kernel a block's
attention runs on first, forced by name or timed per shape; refused by name where the device has no such kernel."""

import logging

import pytest
import torch
from torch.nn.attention import SDPBackend
from transformers import LlamaConfig, LlamaForCausalLM

import zerofit
from zerofit.engine.model import attention as att

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _model(**kw):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**CFG, "num_key_value_heads": 2, **kw}))


def _first() -> int:
    return torch._C._get_sdp_priority_order()[0]


def test_a_kernel_the_cpu_lacks_is_refused_by_name():
    for name in ("cudnn", "efficient"):
        with pytest.raises(att.AttentionError, match=f"attention_backend '{name}': the CPU has no such kernel"):
            att.check(name, on_cuda=False)
        att.check(name, on_cuda=True)
    for name in ("auto", "flash", "math"):
        att.check(name, on_cuda=False)
    with pytest.raises(att.AttentionError, match="cudnn"):
        zerofit.initialize(_model(), {"device": "cpu", "precision": "fp32", "attention_backend": "cudnn"})


def test_heads_from_the_config():
    assert att.heads(_model()) == (4, 2, 8)
    assert att.heads(_model(num_key_value_heads=None, head_dim=16)) == (4, 4, 16)
    assert att.heads(torch.nn.Linear(2, 2)) is None


def test_probe_shape_is_the_call_or_at_most_probe_tokens():
    P = att.PROBE_TOKENS
    assert att.probe_shape(2, 16) == (2, 16)
    assert att.probe_shape(1, 131072) == (1, P)
    assert att.probe_shape(4, P // 2) == (2, P // 2)
    assert att.probe_shape(16, P // 4) == (4, P // 4)


def test_a_kernel_that_cannot_serve_runs_as_none():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 32, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 32, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 32, 8, generator=g, requires_grad=True)
    grad = torch.randn(1, 4, 32, 8, generator=g)
    ran = {}
    for name in ("flash", "math"):
        r = att.run_backend(name, q, k, v, grad)
        assert r is not None and r[0] > 0
        assert [t.shape for t in r[1]] == [q.shape, q.shape, k.shape, v.shape]
        assert q.grad is None and k.grad is None  # the probe leaves its inputs as it found them
        ran[name] = r[1]
    assert 0 < att.distance(ran["math"], ran["flash"]) < att.AGREE[torch.float32]
    assert att.run_backend("efficient", q, k, v, grad) is None
    assert att.run_backend("cudnn", q, k, v, grad) is None


def test_a_named_kernel_is_first_around_the_call_only():
    a = att.Attention(_model(), "math", torch.device("cpu"))
    before = _first()
    with a.around(torch.zeros(2, 16, 32)):
        assert _first() == SDPBackend.MATH.value
    assert _first() == before
    auto = att.Attention(_model(), "auto", torch.device("cpu"))
    assert not auto.timed  # torch's own order
    with auto.around(torch.zeros(2, 16, 32)):
        assert _first() == before
    assert auto.chosen == {} and auto.describe() == "attention: torch's own choice"


def _auto(monkeypatch, wrong: str | None = None):
    """A timed Attention (the CPU's kernels cudnn and efficient cannot serve, flash and math can: math made a
    candidate here), ``wrong``'s results spoiled; and the calls it made."""
    a = att.Attention(_model(), "timed", torch.device("cpu"))
    assert a.timed
    monkeypatch.setattr(att, "TIMED", ("cudnn", "flash", "efficient", "math"))
    timed = []
    real = att.run_backend

    def spy(name, q, k, v, grad, reps=2):
        timed.append((name, tuple(q.shape), tuple(k.shape), q.dtype))
        r = real(name, q, k, v, grad, reps)
        if r is not None and name == wrong:
            r = (r[0] / 1000, [t * 1.5 for t in r[1]])  # the fastest, and wrong
        return r

    monkeypatch.setattr(att, "run_backend", spy)
    return a, timed


def test_timed_times_each_shape_once_and_runs_the_fastest_first(monkeypatch, caplog):
    a, timed = _auto(monkeypatch)
    x = torch.zeros(2, 16, 32, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="zerofit"):
        for _ in range(3):
            with a.around(x):
                first = _first()
    fastest = min(("flash", "math"), key=lambda n: a.times[(2, 16)][n])
    assert first == att.BACKENDS[fastest].value
    # once each, at the shape; flash first (the others' results are held against its)
    assert sorted(timed) == sorted((n, (2, 4, 16, 8), (2, 2, 16, 8), torch.bfloat16) for n in att.TIMED)
    assert timed[0][0] == "flash"
    assert a.chosen == {(2, 16): fastest} and a.rejected[(2, 16)] == {}
    assert a.times[(2, 16)]["cudnn"] is None and a.times[(2, 16)]["flash"] > 0
    assert f"attention for 2 x 16 tokens: {fastest} first" in caplog.text and "cudnn cannot" in caplog.text
    with a.around(torch.zeros(1, 24, 32)):  # a new shape is timed again
        pass
    assert set(a.chosen) == {(2, 16), (1, 24)} and len(timed) == 2 * len(att.TIMED)


def test_a_fast_kernel_off_flashs_results_is_never_chosen(monkeypatch, caplog):
    a, _ = _auto(monkeypatch, wrong="math")
    with caplog.at_level(logging.INFO, logger="zerofit"):
        with a.around(torch.zeros(1, 16, 32)):
            assert _first() == SDPBackend.FLASH_ATTENTION.value
    assert a.times[(1, 16)]["math"] < a.times[(1, 16)]["flash"]  # it was the fastest
    assert set(a.rejected[(1, 16)]) == {"math"} and a.rejected[(1, 16)]["math"] > 0.4
    assert "math off flash's results by 5.0e-01: not used" in caplog.text


def test_the_engine_runs_each_block_with_the_named_kernel_first(monkeypatch):
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(_first())
        return sdpa(*a, **k)

    def losses(cfg):
        eng = zerofit.initialize(_model(), {"device": "cpu", "precision": "fp32", "optimizer": {"lr": 1e-2}, **cfg})
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        return [float(eng.train_batch([{"input_ids": ids, "labels": ids}])) for _ in range(3)]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    plain = losses({})
    assert seen and set(seen) == {torch._C._get_sdp_priority_order()[0]}
    seen.clear()
    math = losses({"attention_backend": "math"})
    # every block's attention (2 blocks: the forward, and the recompute for the backward, each step)
    assert seen == [SDPBackend.MATH.value] * (2 * 2 * 3)
    assert math == pytest.approx(plain, rel=1e-6)
    seen.clear()
    timed = losses({"attention_backend": "timed"})  # on the CPU only flash can serve of the timed kernels
    assert seen[-2 * 2 * 3 :] == [SDPBackend.FLASH_ATTENTION.value] * (2 * 2 * 3)
    assert timed == pytest.approx(plain, rel=1e-6)
