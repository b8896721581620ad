"""AdamW on flat fp32 buffers: the kernels every update and rollback of the engine runs (a leaf module).

The math is ``torch.optim.AdamW``'s (its functional form, fused kernel) applied to a unit's flat fp32 master
weights; :func:`adamw_rollback` is its exact algebraic inverse ([Note: speculative updates], speculation.py).
:func:`~zerofit.engine.update.unit_adamw.unit_adamw` runs them per parameter group.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw

from zerofit.optim.hyper import Hyper


def adamw_flat(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    h: Hyper,
    factor: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One AdamW step on flat fp32 tensors (``step`` is incremented), as ``torch.optim.AdamW(fused=True)``,
    on the gradient times ``factor`` (clipping, fp16 unscaling; ``grad`` is left scaled).

    On the host the factor rides in the fused kernel (as its ``grad_scale``, 1/factor): one pass over the
    state instead of two, the binding resource of a clipped step being host memory bandwidth. A separate
    multiply on the device, where it is cheap. ``found_inf``: a () fp32 tensor on ``master``'s device; when it is
    nonzero the kernel leaves master, moments and ``step`` as they are (torch's own GradScaler protocol)."""
    scale = None
    if factor != 1.0:
        if grad.is_cuda:
            grad.mul_(factor)
        else:
            scale = torch.tensor(1.0 / factor, dtype=torch.float32)
    adamw(
        [master],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step],
        fused=True,
        amsgrad=False,
        beta1=h.beta1,
        beta2=h.beta2,
        lr=h.lr,
        weight_decay=h.weight_decay,
        eps=h.eps,
        maximize=False,
        grad_scale=scale,
        found_inf=found_inf,
    )


_CHUNK = 1 << 22  # elements per rollback chunk: bounds the temporaries to a few 16 MiB buffers


@torch.no_grad()
def adamw_rollback(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    h: Hyper,
) -> None:
    """Undo one ``adamw_flat`` step (in place, ``step`` decremented), given the gradient it used.

    The fused step (torch's ``_fused_adamw_``, ADAMW mode) computes, with ``s`` the incremented step::

        p1 = p0 * (1 - lr*wd) - (lr / bc1) * m1 / (sqrt(v1) / sqrt(bc2) + eps)
        m1 = m0 + (1 - b1) * (g - m0)          v1 = b2 * v0 + (1 - b2) * g * g

    with ``bc1 = 1 - b1**s``, ``bc2 = 1 - b2**s``. Solved for ``p0, m0, v0`` (``v0`` clamped at 0 against
    rounding)."""
    s = float(step.item())
    bc1, bc2 = 1.0 - h.beta1**s, 1.0 - h.beta2**s
    step_size, bc2_sqrt, decay = h.lr / bc1, math.sqrt(bc2), 1.0 - h.lr * h.weight_decay
    n = master.numel()
    for a in range(0, n, _CHUNK):
        p, m, v, g = (t[a : a + _CHUNK] for t in (master, exp_avg, exp_avg_sq, grad))
        denom = v.sqrt().div_(bc2_sqrt).add_(h.eps)
        p.addcdiv_(m, denom, value=step_size)
        if decay != 1.0:
            p.div_(decay)
        m.sub_(g, alpha=1.0 - h.beta1).div_(h.beta1)
        v.addcmul_(g, g, value=-(1.0 - h.beta2)).div_(h.beta2).clamp_(min=0.0)
    step.sub_(1)
