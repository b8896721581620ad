"""[Note: a fused linear cross-entropy] (engine/model/linear_loss.py): the loss and both gradients against
``cross_entropy(h @ W^T)`` as transformers computes it, in float64 (where the two differ only by the fp32 the loss
upcasts to, as transformers' does) and fp32: ignored labels, a given label count, chunks that do not divide the
tokens, the weight's gradient summed in its own dtype, a micro-batch with no label, and the compiled chunk."""

from __future__ import annotations

import pytest
import torch

from zerofit.engine.model.linear_loss import linear_cross_entropy

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _data(N=300, d=16, V=50, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g, dtype=dtype)
    w = torch.randn(V, d, generator=g, dtype=dtype) * 0.3
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    return h, w, labels


def _reference(h, w, labels, count, scale):
    h = h.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    logits = (h @ w.t()).float()  # transformers' ForCausalLMLoss upcasts the logits
    loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / count
    gh, gw = torch.autograd.grad(loss * scale, [h, w])
    return loss.detach(), gh, gw


def _fused(h, w, labels, count, scale, **kw):
    h = h.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    loss = linear_cross_entropy(h, w, labels, count, compiled=False, **kw)
    gh, gw = torch.autograd.grad(loss * scale, [h, w])
    return loss.detach(), gh, gw


@pytest.mark.parametrize("rows", [64, 256, 1000])
@pytest.mark.parametrize("count", [None, 500])
def test_loss_and_gradients_match_the_models_own(rows, count):
    h, w, labels = _data()
    n = (labels != -100).sum() if count is None else torch.tensor(count)
    ref = _reference(h, w, labels, n, 0.25)
    got = _fused(h, w, labels, n, 0.25, rows=rows)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=2e-6, atol=1e-7)


def test_float64_differs_only_by_the_fp32_upcast():
    h, w, labels = _data(dtype=torch.float64)
    n = (labels != -100).sum()
    ref = _reference(h, w, labels, n, 1.0)
    got = _fused(h, w, labels, n, 1.0, rows=100)
    torch.testing.assert_close(got[0].double(), ref[0].double(), rtol=1e-6, atol=0)
    for r, g in zip(ref[1:], got[1:]):  # the gradients are made in the logits' dtype from the fp32 softmax
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-8)


def test_weight_gradient_summed_in_its_own_dtype_is_close():
    h, w, labels = _data()
    n = (labels != -100).sum()
    a = _fused(h, w, labels, n, 1.0, rows=64, fp32_grad=True)
    b = _fused(h, w, labels, n, 1.0, rows=64, fp32_grad=False)
    torch.testing.assert_close(b[2], a[2], rtol=1e-5, atol=1e-7)
    assert torch.equal(a[1], b[1])  # the input's gradient does not depend on it


def test_a_micro_batch_with_no_label_has_a_nan_loss_and_no_gradient():
    h, w, labels = _data(N=40)
    labels[:] = -100
    loss, gh, gw = _fused(h, w, labels, (labels != -100).sum(), 1.0, rows=16)
    assert torch.isnan(loss)  # 0 / 0, as the model's own mean loss
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


def test_batched_inputs_and_a_frozen_weight():
    h, w, labels = _data(N=2 * 60)
    n = (labels != -100).sum()
    hb = h.reshape(2, 60, -1).requires_grad_(True)
    loss = linear_cross_entropy(hb, w, labels.reshape(2, 60), n, rows=32, compiled=False)  # w takes no gradient
    (gh,) = torch.autograd.grad(loss, [hb])
    ref = _reference(h, w, labels, n, 1.0)
    torch.testing.assert_close(loss, ref[0], rtol=2e-6, atol=0)
    torch.testing.assert_close(gh.reshape(120, -1), ref[1], rtol=2e-6, atol=1e-7)


def test_the_compiled_chunk_matches():
    h, w, labels = _data(N=200)
    n = (labels != -100).sum()
    h = h.requires_grad_(True)
    w = w.requires_grad_(True)
    loss = linear_cross_entropy(h, w, labels, n, rows=64, compiled=True)
    got = [loss.detach(), *torch.autograd.grad(loss, [h, w])]
    ref = _reference(h, w, labels, n, 1.0)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
