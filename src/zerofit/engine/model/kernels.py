"""Kernels: which code computes the blocks and the loss (a part; it owns the compiled block and its counts).

[Note: fast kernels]
``kernels: "exact"`` runs the model's own modules op by op, as PyTorch would without zerofit: the CPU's default,
bitwise the plain model. ``kernels: "fast"`` (the default on a GPU) runs

* every block through one ``torch.compile``'d function of (block module, input, the model's call): the block's
  parameters are inputs of the graph (the engine sets each block's device weights on its module for the call, and
  dynamo inlines ``nn.Module`` code), so one graph serves every block of a class, whichever block's weights
  stream in. The GPU then runs each RMSNorm, RoPE, SwiGLU and LoRA scale-and-add as one or two fused kernels
  instead of tens of elementwise passes over the activations (the GEMMs and attention stay cuBLAS's and SDPA's).
  It compiles once per shape and grad mode (the forward under no_grad, the recompute with its backward): the
  first step pays it and the log says how long;
* in a block's recompute for its backward, its last linear (the MLP's ``down_proj``, whose output is only added
  to the residual to make the block's output) without its GEMM: [Note: a recompute's unread output];
* ``train_batch``'s head and loss as one fused linear cross-entropy over token chunks ([Note: a fused linear
  cross-entropy], linear_loss.py): the logits never exist whole, and the gradients come out of the forward.

Both compute the same function as the model's own code, rounded differently: a fused kernel keeps fp32 between
ops where the eager ops round to bf16 after each, and sums in another order (tests/gpu/test_gpu_kernels.py bounds
the difference per op; the convergence check on the benchmarks page compares loss curves). Where a kernel cannot
serve a case the exact code runs, and :meth:`Kernels.describe` (logged at start-up) says which:

* blocks that draw random numbers in training (dropout): the compiled forward and its recompute would each draw
  from inductor's own generator, not the RNG state the engine replays, so the recompute could drop other units;
* a call over sequence tiles ([Note: a block over sequence tiles], tiling.py), whose autograd function keeps
  eager code per tile;
* a loss the model changes after its head (soft-capping, a logit scale, a MoE's router loss), a head with its own
  adapters, a door that hands the model's output (its logits) back to the caller (the DeepSpeed-shaped loop, the
  user's loop): the model's own head and loss;
* a block whose compilation fails: the error is logged once and the block runs its own code from then on.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from zerofit.engine.model.adapter import Adapter, block_output
from zerofit.engine.model.linear_loss import IGNORE, linear_cross_entropy

log = logging.getLogger("zerofit")

# model types whose forward returns the head's output as its logits untouched (and computes the loss from them)
PLAIN_HEADS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "olmo2", "granite")


# [Note: a recompute's unread output]
# The backward of a block recomputes its forward from its input, only to rebuild the autograd graph: the output's
# value is never read (the engine backpropagates the next block's input gradient into it). In a Llama-family
# layer (Llama, Mistral, Qwen2, Qwen3: ``residual + mlp(norm(h))``, the MLP ``down_proj(act(gate(x)) * up(x))``)
# the MLP's ``down_proj`` output reaches the block's output through that sum alone, so no gradient depends on its
# value: its backward needs only its input and weight. So in the recompute its frozen base linear runs as
# :class:`_OutputUnread`, which returns an uninitialized tensor of the output's shape and, in the backward, the
# input's (and a trained weight's) gradient as ``F.linear``'s backward computes them: the GEMM of 22% of a 13B
# block's weights is not run, and every gradient is the same number (tests/unit/engine/model/test_kernels.py
# compares them bitwise). A LoRA path on ``down_proj`` runs as before (its gradients read its input and its own
# intermediate, not the sum); DoRA, which scales the base output, is left alone, as is any other block class.
UNREAD_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


class _OutputUnread(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for a graph whose output's value is never read: an uninitialized output, and
    ``F.linear``'s own backward ([Note: a recompute's unread output])."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.bias = bias is not None
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        flat = g.reshape(-1, g.shape[-1])
        gw = flat.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = flat.sum(0) if ctx.bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _unread_forward(self, x):
    if x.dtype != self.weight.dtype:  # a cast on the way (DequantizedLinear's): its own forward
        return type(self).forward(self, x)
    return _OutputUnread.apply(x, self.weight, self.bias)


def unread_linear(block: nn.Module) -> nn.Module | None:
    """The linear layer of ``block`` whose output a recompute need not compute ([Note: a recompute's unread
    output]), or None."""
    from zerofit.engine.model.nf4 import DequantizedLinear

    mlp = getattr(block, "mlp", None)
    if (
        mlp is None
        or type(block).__name__ not in UNREAD_LAYERS
        or not all(isinstance(getattr(mlp, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
    ):
        return None
    down = mlp.down_proj
    dora = getattr(down, "use_dora", None)
    if isinstance(dora, dict) and any(dora.values()):
        return None
    base = getattr(down, "base_layer", down)  # PEFT's LoRA layer wraps it
    if type(base) not in (nn.Linear, DequantizedLinear) or "forward" in base.__dict__:
        return None
    return base


def _call_block(module: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict):
    return module(x, *args, **kwargs)


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (``get_base_model``), or ``model``."""
    get = getattr(model, "get_base_model", None)
    while callable(get) and get() is not model:
        model = get()
        get = getattr(model, "get_base_model", None)
    return model


def resolve(mode: str, on_cuda: bool) -> bool:
    """Whether ``mode`` ("auto", "exact", "fast") means the fast kernels on this device: auto is fast on a GPU."""
    return mode == "fast" or (mode == "auto" and on_cuda)


def _compiler_missing(on_cuda: bool) -> str | None:
    """Why ``torch.compile`` cannot build kernels here, or None."""
    if on_cuda:
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (torch.compile's GPU code generator)"
    import shutil

    return None if shutil.which("c++") or shutil.which("g++") else "no C++ compiler for torch.compile's CPU code"


class Kernels:
    """The compiled block function and the fused loss, with what each serves and why not elsewhere."""

    def __init__(self, model: nn.Module, adapter: Adapter, mode: str, on_cuda: bool, tile_of: Callable[[], int | None]):
        self.model, self.adapter, self.tile_of = model, adapter, tile_of
        self.fast = resolve(mode, on_cuda)
        self.blocks_why: str | None = None  # why the blocks run their own code (None: compiled)
        self.loss_why: str | None = None  # why the loss is the model's own (None: fused)
        self.compile_seconds: dict[str, float] = {}  # first call of each (grad mode, shape): its wall seconds
        self._block_fn: Callable | None = None
        if not self.fast:
            self.blocks_why = self.loss_why = "kernels: exact"
            return
        missing = _compiler_missing(on_cuda)
        if not adapter.streaming:
            self.blocks_why = "the model has no blocks apart (the generic path)"
        elif missing:
            self.blocks_why = missing
        elif adapter.has_dropout:
            self.blocks_why = (
                "the model has dropout: a compiled block draws its own random numbers, which the recompute for the "
                "backward would not replay"
            )
        else:
            self._block_fn = torch.compile(_call_block)
        self.loss_why = missing or self._head_why()

    # ------------------------------------------------------------------ blocks

    def compiled(self, x: torch.Tensor) -> bool:
        """Whether a block call on ``x`` runs compiled: fast kernels, and no sequence tile smaller than the call."""
        if self._block_fn is None:
            return False
        tile = self.tile_of()
        return tile is None or x.dim() != 3 or x.shape[0] * x.shape[1] <= tile

    def block(self, module: nn.Module, leaves: dict, x: torch.Tensor, call, unread: bool = False) -> torch.Tensor:
        """The block's output for ``x`` with ``leaves`` as its parameters, compiled where :meth:`compiled`.
        ``unread``: a recompute for the backward, whose output's value is not read ([Note: a recompute's unread
        output])."""
        if not self.compiled(x):
            from torch.func import functional_call

            return block_output(functional_call(module, leaves, (x, *call.args), call.kwargs, strict=False))
        assert self._block_fn is not None
        key = f"{'grad' if torch.is_grad_enabled() else 'no_grad'} {tuple(x.shape)}"
        first = key not in self.compile_seconds
        t0 = time.perf_counter()
        skip = unread_linear(module) if unread and torch.is_grad_enabled() else None
        if skip is not None:
            skip.__dict__["forward"] = types.MethodType(_unread_forward, skip)
        try:
            return self._compiled_call(module, leaves, x, call, key, first, t0)
        finally:
            if skip is not None:
                del skip.__dict__["forward"]

    def _compiled_call(self, module, leaves, x, call, key: str, first: bool, t0: float) -> torch.Tensor:
        assert self._block_fn is not None
        with _reparametrize_module(module, leaves, tie_weights=True, strict=False):
            try:
                out = block_output(self._block_fn(module, x, call.args, call.kwargs))
            except Exception as e:  # noqa: BLE001 - a compiler failure: this block's own code from now on
                if not first:
                    raise
                self._block_fn = None
                self.blocks_why = f"compiling the block failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                log.warning("zerofit: %s; the blocks run their own code", self.blocks_why)
                from torch.func import functional_call

                return block_output(functional_call(module, leaves, (x, *call.args), call.kwargs, strict=False))
        if first:
            if x.is_cuda:
                torch.cuda.current_stream(x.device).synchronize()  # once per shape: the compile's own wall time
            self.compile_seconds[key] = time.perf_counter() - t0
            log.info("zerofit: compiled the blocks for %s in %.1f s", key, self.compile_seconds[key])
        return out

    # ------------------------------------------------------------------ loss

    def _head_why(self) -> str | None:
        """Why the fused loss cannot stand for this model's head and loss, or None."""
        if not self.adapter.chunkable_loss:
            return "the model's head and loss do not take already-shifted labels (no loss_function(**kwargs))"
        base = _inner(self.model)
        config = getattr(base, "config", None)
        kind = getattr(config, "model_type", None)
        if kind not in PLAIN_HEADS:
            return f"model type {kind!r} is not one whose logits are its head's output as they are"
        if getattr(config, "output_router_logits", False):
            return "the model adds its router's load-balancing loss to the cross-entropy"
        get_head = getattr(base, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if type(head) is not nn.Linear or head.bias is not None:
            return f"the head is a {type(head).__name__}, not a plain bias-free nn.Linear"
        return None

    @property
    def fused_loss(self) -> bool:
        return self.fast and self.loss_why is None

    def post_loss(self, shell_call, batch: dict, final: torch.Tensor, chunks: int) -> torch.Tensor:
        """The micro-batch's loss from the final hidden state ``final`` through the model's own final norm and the
        fused head and loss ([Note: a fused linear cross-entropy]): the model's forward runs with its head
        handing back its input (and its weight noted), without labels, so it computes neither logits nor loss.
        ``chunks``: the plan's loss chunks, which bound the memory the logits may take."""
        head = _inner(self.model).get_output_embeddings()  # type: ignore[operator]  # (a transformers model)
        seen: list[torch.Tensor] = []

        def capture(x):
            seen.append(head.weight)
            return x

        labels = batch["labels"]
        shift = batch.get("shift_labels")
        if shift is None:
            shift = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        count = batch.get("num_items_in_batch")
        if count is None:
            count = (shift != IGNORE).sum()
        kw = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
        head.__dict__["forward"] = capture
        try:
            out = self.adapter.post(shell_call, kw, final)
        finally:
            del head.__dict__["forward"]
        hidden = out["logits"] if isinstance(out, dict) else out.logits
        weight = seen[0]
        n = hidden.shape[0] * hidden.shape[1]
        d = hidden.shape[-1]
        budget = -(-n // chunks)  # tokens whose logits the plan has room for at once
        rows = max(1, min(budget, max(256, -(-n // 4))))
        # W's gradient summed in fp32 where that buffer is no larger than the logits the plan made room for
        fp32_grad = 4 * d <= 7 * budget
        return linear_cross_entropy(hidden, weight, shift, count, rows=rows, fp32_grad=fp32_grad)

    # ------------------------------------------------------------------ what runs

    def describe(self) -> str:
        """One line for the start-up summary: what each of the blocks and the loss runs, and why."""
        if not self.fast:
            return "kernels: exact (the model's own code, op by op)"
        blocks = (
            "blocks compiled (torch.compile, one graph per shape)"
            if self.blocks_why is None
            else (f"blocks: their own code ({self.blocks_why})")
        )
        loss = (
            "loss: fused linear cross-entropy in train_batch"
            if self.loss_why is None
            else (f"loss: the model's own head and loss ({self.loss_why})")
        )
        return f"kernels: fast; {blocks}; {loss}"
