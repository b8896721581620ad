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


def test_a_kernel_that_cannot_serve_times_as_none():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 32, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 32, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 32, 8, generator=g, requires_grad=True)
    for name in ("flash", "math"):
        s = att.time_backend(name, q, k, v)
        assert s is not None and s > 0
        assert q.grad is None and k.grad is None  # the probe leaves its inputs as it found them
    assert att.time_backend("efficient", q, k, v) is None
    assert att.time_backend("cudnn", q, k, v) is None


def test_a_named_kernel_is_first_around_the_call_only():
    a = att.Attention(_model(), "math", torch.device("cpu"), timed=False)
    before = _first()
    with a.around(torch.zeros(2, 16, 32)):
        assert _first() == SDPBackend.MATH.value
    assert _first() == before
    auto = att.Attention(_model(), "auto", torch.device("cpu"), timed=True)
    assert not auto.timed  # auto times on a GPU only: torch's own order here
    with auto.around(torch.zeros(2, 16, 32)):
        assert _first() == before
    assert auto.describe() == "attention: torch's own choice"


def test_auto_times_each_shape_once_and_runs_the_fastest_first(monkeypatch, caplog):
    a = att.Attention(_model(), "auto", torch.device("cpu"), timed=False)
    a.timed = True  # as on a GPU: the CPU's kernels cudnn and efficient cannot serve, flash can
    timed = []
    real = att.time_backend

    def spy(name, q, k, v, reps=2):
        timed.append((name, tuple(q.shape), tuple(k.shape), q.dtype))
        return real(name, q, k, v, reps)

    monkeypatch.setattr(att, "time_backend", spy)
    x = torch.zeros(2, 16, 32, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="zerofit"):
        for _ in range(3):
            with a.around(x):
                assert _first() == SDPBackend.FLASH_ATTENTION.value
    assert timed == [(n, (2, 4, 16, 8), (2, 2, 16, 8), torch.bfloat16) for n in att.TIMED]  # once, at the shape
    assert a.chosen == {(2, 16): "flash"}
    assert a.times[(2, 16)]["cudnn"] is None and a.times[(2, 16)]["flash"] > 0
    assert "attention for 2 x 16 tokens: flash first" in caplog.text and "cudnn cannot" in caplog.text
    with a.around(torch.zeros(1, 24, 32)):  # a new shape is timed again
        pass
    assert set(a.chosen) == {(2, 16), (1, 24)} and len(timed) == 2 * len(att.TIMED)


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
