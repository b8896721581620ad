"""Attention's backend: which of SDPA's kernels computes the blocks' attention (a part; it owns the choice per
shape and the times it was made from).

[Note: attention's backend]
``torch.nn.functional.scaled_dot_product_attention`` (the attention of every transformers model run with
``attn_implementation="sdpa"``, the default) hands each call to one of its kernels: flash (FlashAttention-2),
cuDNN's, the memory-efficient one, or the math one (op by op). Each computes exact attention, each rounds its own
way, and which is fastest depends on the card, the shape and the torch build, whose own order need not pick the
fastest. ``attention_backend``:

* ``auto`` (the default): torch's own order: the plain model's kernels, bitwise.
* ``timed``: the first time a block is called on a shape the engine times one causal call, forward and backward,
  of each kernel in :data:`TIMED` the device has (math left out: its ``T x T`` scores are what the others avoid),
  with the model's heads, key-value heads and head size, in the compute dtype, at the call's tokens or
  :data:`PROBE_TOKENS` of them, whichever is fewer, and runs every block call of that shape with the fastest
  first. A kernel whose output or gradients are further from flash's than two kernels' rounding allows
  (:data:`AGREE`) is not used: a fast wrong kernel is never chosen. The choice, the times and any kernel left out
  are logged once per shape. (On the CPU only flash can serve: it is chosen.)
* a kernel's name: that kernel first in every block call.

The others stay behind the chosen one in the order (``sdpa_kernel(..., set_priority=True)``): a call the chosen
kernel cannot serve (a mask it does not take, a head size it does not support) runs on the next, as torch's own
dispatch would. The order is in force around each block's call only (Compute.block): the compiled block traces
its attention inside it, the tiled block's core runs inside it, and nothing outside the engine sees it.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from zerofit.errors import InputError

log = logging.getLogger("zerofit")

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CPU_BACKENDS = ("flash", "math")  # the kernels PyTorch has for the CPU
TIMED = ("cudnn", "flash", "efficient")  # timed's candidates
PROBE_TOKENS = 8192  # the longest sequence timed: long enough that attention's arithmetic binds each kernel


class AttentionError(InputError, ValueError):
    """An attention backend this device does not have."""


def check(name: str, on_cuda: bool) -> None:
    """Refuse by name a backend the device has no kernel for."""
    if name in BACKENDS and not on_cuda and name not in CPU_BACKENDS:
        raise AttentionError(
            f"attention_backend {name!r}: the CPU has no such kernel (it has {', '.join(CPU_BACKENDS)}); "
            "use auto, timed, or one of those"
        )


def heads(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(heads, key-value heads, head size) of ``model``'s attention from its config, or None."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    h, d_model = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
    if not isinstance(h, int) or not isinstance(d_model, int) or h <= 0:
        return None
    kv = getattr(cfg, "num_key_value_heads", None) or h
    d = getattr(cfg, "head_dim", None) or d_model // h
    return h, int(kv), int(d)


def probe_shape(batch: int, tokens: int) -> tuple[int, int]:
    """(sequences, tokens) timed for a call of ``batch`` sequences of ``tokens``: the call's own where it has
    no more than :data:`PROBE_TOKENS` tokens in all, else sequences of at most that many tokens, as many as fit."""
    if batch * tokens <= PROBE_TOKENS:
        return batch, tokens
    t = min(tokens, PROBE_TOKENS)
    return max(1, PROBE_TOKENS // t), t


def run_backend(name: str, q, k, v, grad, reps: int = 2) -> tuple[float, list[torch.Tensor]] | None:
    """One causal call of kernel ``name`` on ``q``, ``k``, ``v``, forward and backward of ``grad``: its seconds (the
    least of ``reps`` after a warm-up) and its results (the output and the gradients of q, k and v), or None where
    it cannot serve them."""
    gqa = q.shape[1] != k.shape[1]
    cuda = q.device.type == "cuda"
    best, results = None, []
    try:
        with sdpa_kernel([BACKENDS[name]]):
            for i in range(reps + 1):
                for t in (q, k, v):
                    t.grad = None
                if cuda:
                    torch.cuda.synchronize(q.device)
                t0 = time.perf_counter()
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                out.backward(grad)
                if cuda:
                    torch.cuda.synchronize(q.device)
                took = time.perf_counter() - t0
                if i:
                    best = took if best is None else min(best, took)
            results = [out.detach(), q.grad, k.grad, v.grad]
    except RuntimeError:
        return None
    finally:
        for t in (q, k, v):
            t.grad = None
    assert best is not None
    return best, results


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest relative distance (L2) between the tensors of ``a`` and ``b``, pairwise; inf where not finite."""
    worst = 0.0
    for x, y in zip(a, b):
        d = float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30))
        worst = max(worst, d if d == d else float("inf"))
    return worst


# how far a kernel's results may be from flash's on the probe's inputs: two exact kernels differ by their rounding
# (16-bit outputs and gradients: a few parts in a thousand); a kernel further off is not used
AGREE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


class Attention:
    """The order of SDPA's kernels around each block call, per shape (``mode``: ``attention_backend``)."""

    def __init__(self, model: torch.nn.Module, mode: str, device: torch.device):
        check(mode, device.type == "cuda")
        self.mode, self.device, self.heads = mode, device, heads(model)
        self.timed = mode == "timed" and self.heads is not None
        self.chosen: dict[tuple[int, int], str | None] = {}  # (sequences, tokens): the kernel first, or None
        self.times: dict[tuple[int, int], dict[str, float | None]] = {}  # (sequences, tokens): each kernel's s
        self.rejected: dict[tuple[int, int], dict[str, float]] = {}  # ... the kernels off flash's results, by how far

    def describe(self) -> str:
        """One line for the start-up summary."""
        if self.timed:
            return "attention: the fastest of cuDNN's, flash and memory-efficient, timed at each shape's first call"
        if self.mode in BACKENDS:
            return f"attention: {self.mode} first (attention_backend)"
        return "attention: torch's own choice"

    def around(self, x: torch.Tensor):
        """The order in force for a block's call on ``x`` ((sequences, tokens, hidden)): a context manager."""
        if x.dim() != 3:
            return self.context(None)
        return self.context((int(x.shape[0]), int(x.shape[1])), x.dtype)

    def context(self, shape: tuple[int, int] | None, dtype: torch.dtype = torch.bfloat16):
        """The order in force for a call of ``shape`` ((sequences, tokens); None: not a sequence) in ``dtype``: a
        context manager (``zerofit estimate``'s probes run under the order the run will)."""
        first: str | None = self.mode if self.mode in BACKENDS else None
        if self.timed and shape is not None:
            if shape not in self.chosen:
                self.chosen[shape] = self._time(shape, dtype)
            first = self.chosen[shape]
        if first is None:
            return contextlib.nullcontext()
        order = [BACKENDS[first]] + [b for n, b in BACKENDS.items() if n != first]
        return sdpa_kernel(order, set_priority=True)

    def _time(self, key: tuple[int, int], dtype: torch.dtype) -> str | None:
        assert self.heads is not None
        h, kv, d = self.heads
        b, t = probe_shape(*key)
        g = torch.Generator(self.device).manual_seed(0)

        def make(n):
            return torch.randn(b, n, t, d, device=self.device, dtype=dtype, generator=g).requires_grad_(True)

        q, k, v = make(h), make(kv), make(kv)
        grad = torch.randn(b, h, t, d, device=self.device, dtype=dtype, generator=g)
        # every kernel's results against flash's (torch's own first choice), kept alone: one that disagrees is
        # left out
        times: dict[str, float | None] = {}
        bad: dict[str, float] = {}
        ref = None
        with torch.enable_grad():
            for name in sorted(TIMED, key=lambda n: n != "flash"):
                r = run_backend(name, q, k, v, grad)
                times[name] = r[0] if r else None
                if r is None:
                    continue
                if ref is None:
                    ref = r[1]
                e = distance(r[1], ref)
                if not e <= AGREE.get(dtype, 3e-2):
                    bad[name] = e
                del r
        del q, k, v, grad, ref
        times = {n: times[n] for n in TIMED}
        self.times[key] = times
        ran = {n: s for n, s in times.items() if s is not None and n not in bad}
        best = min(ran, key=lambda n: ran[n]) if ran else None
        shown = ", ".join(f"{n} {s * 1e3:.2f} ms" if s is not None else f"{n} cannot" for n, s in times.items())
        shown += "".join(f"; {n} off flash's results by {e:.1e}: not used" for n, e in bad.items())
        self.rejected[key] = bad
        log.info(
            "zerofit: attention for %d x %s tokens: %s first (one call timed at %d x %s: %s)",
            key[0], f"{key[1]:,}", best or "torch's own choice", b, f"{t:,}", shown,
        )  # fmt: skip
        return best
