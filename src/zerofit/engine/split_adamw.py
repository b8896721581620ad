"""AdamW in two passes over host memory: the new master weights now, the moments later.

[Note: moments after the forward]
With deferred updates (clipping, fp16) every host update waits for the global norm and then sits on the
next forward's critical path, where the host's memory bandwidth binds (docs/benchmarks.md, issue 6). torch's
fused CPU AdamW reads master, gradient and both moments and writes master, both moments and, given a
``grad_scale`` (the clipping factor), the unscaled gradient too: 16 bytes read and 16 written per parameter.
The forward needs only the new master. So the update can be split in two passes:

* the **master pass** (on the critical path) reads the four and writes the master: 20 bytes of host memory;
* the **moments pass** (later, while the post pass and the backward run and the host's memory is mostly
  idle) reads moments and gradient again and writes the moments: 20 bytes.

Both passes are torch's own fused kernel, run on chunks small enough to stay in the CPU's caches: the master
pass gives it scratch copies of a chunk's gradient and moments (read once from memory; what it writes to them
stays in the cache and is dropped), the moments pass scratch copies of the chunk's gradient and master. So
each pass's results are bitwise the fused kernel's (its arithmetic is elementwise: chunks change nothing), and
the gradient is left unscaled.

The moments pass must run before the moments or the gradient buffer are read or written again: the engine
waits for it before the unit's next gradient comes down ([Note: moments after the forward] in engine.py), and
every reader of the optimizer state drains the worker first.
"""

from __future__ import annotations

import threading

import torch
from torch.optim.adamw import adamw

CHUNK = 1 << 20      # elements per chunk: 3 scratch tensors of 4 MiB, in the caches of a server CPU
_local = threading.local()


def _scratch(n: int, k: int) -> list[torch.Tensor]:
    """``k`` fp32 scratch tensors of ``n`` elements, kept per thread (no page faults on every pass)."""
    have = getattr(_local, "bufs", None)
    if have is None or have[0].numel() < n or len(have) < k:
        _local.bufs = have = [torch.empty(n, dtype=torch.float32) for _ in range(max(k, 3))]
    return [b[:n] for b in have[:k]]


def _step(p, g, m, v, step, h: dict, scale):
    adamw([p], [g], [m], [v], [], [step], fused=True, amsgrad=False, beta1=h["beta1"], beta2=h["beta2"], lr=h["lr"],
          weight_decay=h["weight_decay"], eps=h["eps"], maximize=False, grad_scale=scale, found_inf=None)


def _scale_of(factor: float):
    return None if factor == 1.0 else torch.tensor(1.0 / factor, dtype=torch.float32)


def fused_step(master, grad, exp_avg, exp_avg_sq, step, h: dict, factor: float = 1.0) -> None:
    """torch's fused step in one pass (what the two passes split), as optimizer.adamw_flat runs it on the host."""
    _step(master, grad, exp_avg, exp_avg_sq, step, h, _scale_of(factor))


def master_pass(master, grad, exp_avg, exp_avg_sq, step, h: dict, factor: float = 1.0, chunk: int = CHUNK) -> None:
    """``master`` takes its AdamW step (``step`` is incremented); moments and gradient are left as they were."""
    scale = _scale_of(factor)
    n = master.numel()
    sg, sm, sv = _scratch(min(chunk, n), 3)
    for a in range(0, n, chunk):
        k = min(chunk, n - a)
        sg[:k].copy_(grad[a:a + k])
        sm[:k].copy_(exp_avg[a:a + k])
        sv[:k].copy_(exp_avg_sq[a:a + k])
        _step(master[a:a + k], sg[:k], sm[:k], sv[:k], step.clone(), h, scale)
    step.add_(1)


def moments_pass(grad, exp_avg, exp_avg_sq, step_before, h: dict, factor: float = 1.0, chunk: int = CHUNK) -> None:
    """The moments of the same step (the same gradient, moments and factor as its master pass; ``step_before``
    the step count the master pass started from: AdamW's moments do not depend on it, the kernel wants it)."""
    scale = _scale_of(factor)
    n = exp_avg.numel()
    sp, sg = _scratch(min(chunk, n), 2)
    for a in range(0, n, chunk):
        k = min(chunk, n - a)
        sg[:k].copy_(grad[a:a + k])     # (sp: any values; AdamW's moments do not read the weights)
        _step(sp[:k], sg[:k], exp_avg[a:a + k], exp_avg_sq[a:a + k], step_before.clone(), h, scale)
