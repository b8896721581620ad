"""The head and the cross-entropy loss in one pass over token chunks, the logits never held whole.

[Note: a fused linear cross-entropy]
A causal LM's loss is ``cross_entropy(h @ W^T, labels)`` over a vocabulary of 32k-256k: the logits of a micro-batch
of 4,096 tokens and a 128k vocabulary are 1 GiB in bf16 and 2 GiB again in the fp32 the loss upcasts them to, and
the loss and its backward pass over them several times (upcast, log-softmax, gather, softmax minus one-hot, cast).
:class:`LinearCrossEntropy` computes, per chunk of ``rows`` tokens, the chunk's logits (one GEMM, bf16 out, fp32
accumulation), the log-sum-exp, the loss and, at once, the gradient of the logits, ``(softmax - onehot) / count``,
which gives the chunk's gradients of ``h`` and ``W`` (two GEMMs) before the next chunk: three GEMMs, as the
separate head and loss run, and one chunk's logits at a time. The elementwise part is compiled
(``torch.compile``, one fused kernel per chunk on a GPU). Since the gradients are made in the forward, the
backward only scales them by the incoming gradient (1 in a training step). ``W``'s gradient is summed over the
chunks in fp32 (cast once to ``W``'s dtype, as autograd hands it on) where that buffer fits the memory the
logits would have used, else in ``W``'s dtype (one rounding per chunk more).

The arithmetic differs from the model's own loss in rounding only: the logits are rounded to the compute dtype
and upcast as transformers does, but the softmax and its gradient are fused (fp32 throughout, no bf16 copy of the
logits' gradient before the GEMMs) and the chunks' sums are added in another order. It is the ``kernels: "fast"``
path's loss ([Note: fast kernels], kernels.py), tested against the model's own (tests/unit/engine/model/
test_linear_loss.py).
"""

from __future__ import annotations

import functools

import torch

IGNORE = -100  # transformers' ignore_index


def _chunk_grad(logits: torch.Tensor, labels: torch.Tensor, inv_count: torch.Tensor):
    """One chunk's summed loss and the gradient of its logits, ``(softmax - onehot) * inv_count`` (zero on ignored
    tokens), in the logits' dtype. ``logits`` (n, V) in the compute dtype; the arithmetic in fp32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    keep = labels != IGNORE
    safe = torch.where(keep, labels, 0)
    target = x.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(keep, lse - target, 0.0).sum()
    p = torch.exp(x - lse[:, None])
    onehot = torch.nn.functional.one_hot(safe, x.shape[1]).to(p.dtype)
    g = (p - onehot) * torch.where(keep, inv_count, 0.0)[:, None]
    return loss, g.to(logits.dtype)


@functools.cache
def _compiled(device_type: str):
    """The chunk's elementwise part, compiled once per device type (dynamic: the last chunk is shorter)."""
    return torch.compile(_chunk_grad, dynamic=True)


class LinearCrossEntropy(torch.autograd.Function):
    """``sum(cross_entropy(h @ W^T, labels, ignore_index=-100)) / count`` with its gradients made in the forward
    ([Note: a fused linear cross-entropy]); ``h`` (N, d), ``W`` (V, d), ``labels`` (N,) already shifted."""

    @staticmethod
    def forward(ctx, h, weight, labels, count, rows: int, fp32_grad: bool, compiled: bool):
        chunk = _compiled(h.device.type) if compiled else _chunk_grad
        inv = (1.0 / count.to(torch.float32)).reshape(())
        grad_h = torch.empty_like(h) if h.requires_grad else None
        grad_w = None
        if weight.requires_grad:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32 if fp32_grad else weight.dtype, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for a in range(0, h.shape[0], rows):
            hc = h[a : a + rows]
            logits = hc @ weight.t()
            loss, g = chunk(logits, labels[a : a + rows], inv)
            del logits
            total += loss
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[a : a + rows])
            if grad_w is not None:
                part = g.t() @ hc
                grad_w += part
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        return total * inv

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        has_h, has_w = ctx.has
        gh = saved.pop(0).mul_(grad_out) if has_h else None  # ours alone: scaled in place
        gw = saved.pop(0).mul_(grad_out) if has_w else None
        return gh, gw, None, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    count: torch.Tensor | int,
    *,
    rows: int | None = None,
    fp32_grad: bool = True,
    compiled: bool = True,
) -> torch.Tensor:
    """The mean loss of ``h @ weight^T`` over ``count`` labels ([Note: a fused linear cross-entropy]): ``h``
    (..., d), ``labels`` (...) already shifted (-100: ignored), ``count`` the divisor (the micro-batch's label
    count, or the batch's: ``num_items_in_batch``). ``rows``: tokens per chunk (default: a quarter of them, at
    least 256)."""
    flat = h.reshape(-1, h.shape[-1])
    lab = labels.reshape(-1).to(flat.device)
    n = flat.shape[0]
    rows = rows or max(256, -(-n // 4))
    count_t = torch.as_tensor(count, device=flat.device)
    return LinearCrossEntropy.apply(flat, weight, lab, count_t, rows, fp32_grad, compiled)
