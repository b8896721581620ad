"""A block's MLP over sequence tiles: its working set bounded by the tile, not the sequence.

[Note: MLP over sequence tiles]
A decoder block's MLP (gate, up, act, down: Llama, Qwen3, Mistral, and PEFT LoRA layers inside them) is per token:
row ``i`` of its output depends on row ``i`` of its input only. So it may run over the micro-batch's tokens (its
``batch x seq`` rows, flattened) a tile of ``tile`` rows at a time: :class:`TiledMLP`'s forward runs each tile
under ``no_grad`` and keeps only the input and the (hidden-sized) output; its backward recomputes each tile with
grad enabled and backpropagates that tile's share of the output gradient, writing the tile's input gradient
and adding the tile's parameter gradients into a sum. The intermediate-sized tensors (the gate's, up's and the
activation's outputs, their product, and the gradients of each) then exist for one tile at a time: for a
long sequence they are most of a block's working set (plan/search.py, ``activation_bytes``).

What holds (measured on the CPU in fp32, tests/unit/engine/model/test_tiling.py):

- per-token outputs and the input gradient: a tile's rows go through the same kernels as the whole sequence's,
  but not bitwise: torch's CPU GEMM over fewer rows blocks its inner products otherwise (measured on tiny Llama,
  Qwen3, Mistral and LoRA MLPs, tiles of 1 to 64 of 74 rows: at most 5e-7 of the tensor's largest entry, never
  bitwise at any tile); the tests hold them to 2e-6 of it;
- the parameters' gradients: sums over the tiles of the tiles' gradients, i.e. the untiled sum over tokens in
  another order (measured: at most 5.2e-7 of the gradient's largest entry; held to 2e-6). Tiles' gradients of
  16-bit parameters are summed in fp32 and cast once (an fp32 buffer the size of the trained MLP parameters while
  the backward runs: a full fine-tune's MLP, twice its 16-bit gradient);
- the recompute is per tile, in the backward, with the parameters the forward used (saved with the input: the
  backward puts them back on the module, whether or not the ``functional_call`` that ran the forward has ended)
  and the RNG state the forward began with (LoRA dropout draws the same masks tile by tile), under the autocast
  state the forward ran in;
- a micro-batch of no more tokens than the tile, or no tile, calls the MLP's own forward: bitwise today's.

Gradients reach the engine's leaves: the wrapper passes the module's parameters as the function's inputs at
call time, which inside ``functional_call`` (compute.py) are the unit's device weights (leaves that take a
gradient for the trained ones, plain tensors for frozen ones), and returns their gradients.

A MoE block's sparse MLP (Mixtral, Qwen3-MoE: a module with ``experts``) is not tiled. Its routing is per
token too (top-k of each token's router logits), but its router's logits are recorded by hooks for the
load-balancing loss, and in training Mixtral's router jitters its input with fresh noise: run per tile under
``no_grad`` and again in the backward, the hooks would record each tile twice, without a gradient.
:func:`tileable` says why; such a module keeps its own forward (the planner's count of its working set is then
optimistic for that block).
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

log = logging.getLogger(__name__)

TILED = "_zerofit_own_forward"  # the attribute a wrapped module keeps its own forward under
TILE_OF = "_zerofit_tile_of"  # ... and the plan's tile (a callable: None, or tokens)


def tileable(mlp: nn.Module) -> str | None:
    """None when ``mlp`` may run over sequence tiles, else why not."""
    if hasattr(mlp, "experts"):
        return (
            f"{type(mlp).__name__} is a MoE block's sparse MLP: its router's logits are recorded for the "
            "load-balancing loss (and jittered in training), which tiles run under no_grad and recomputed in the "
            "backward would record twice and without a gradient; it runs over the whole sequence"
        )
    return None


def _has_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


class TiledMLP(torch.autograd.Function):
    """``fn(x)`` over tiles of ``tile`` rows of ``x`` (flattened to rows of its last dimension); ``names`` and
    ``params``: the module's parameters ``fn`` reads, put back on ``module`` for the backward's recompute."""

    @staticmethod
    def forward(ctx, fn, module, tile, names, rng, x, *params):
        ctx.fn, ctx.module, ctx.tile, ctx.names, ctx.rng, ctx.shape = fn, module, tile, names, rng, x.shape
        ctx.autocast = _autocast_state(x)
        ctx.save_for_backward(x, *params)
        rows = x.reshape(-1, x.shape[-1])
        out = None
        with torch.no_grad():
            for s in range(0, rows.shape[0], tile):
                y = fn(rows[s : s + tile])
                if out is None:
                    out = y.new_empty((rows.shape[0], *y.shape[1:]))
                out[s : s + y.shape[0]] = y
        assert out is not None
        return out.reshape(*x.shape[:-1], *out.shape[1:])

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        g_rows = grad_out.reshape(rows.shape[0], -1)
        want_x = ctx.needs_input_grad[5]
        trained = [i for i, p in enumerate(params) if ctx.needs_input_grad[6 + i]]
        gx = torch.empty_like(rows) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_reparametrize_module(ctx.module, dict(zip(ctx.names, params)), strict=False))
            stack.enter_context(_replayed(ctx.rng, x.device))
            stack.enter_context(_autocast(x, ctx.autocast))
            stack.enter_context(torch.enable_grad())
            for s in range(0, rows.shape[0], ctx.tile):
                xt = rows[s : s + ctx.tile].detach().requires_grad_(want_x)
                yt = ctx.fn(xt)
                inputs = ([xt] if want_x else []) + [params[i] for i in trained]
                if not inputs:
                    continue
                grads = torch.autograd.grad(yt, inputs, g_rows[s : s + yt.shape[0]], allow_unused=True)
                if want_x:
                    assert gx is not None
                    gx[s : s + xt.shape[0]] = grads[0]
                    grads = grads[1:]
                for i, g in zip(trained, grads):
                    if g is None:
                        continue
                    acc = sums[i]
                    if acc is None:
                        sums[i] = g.float() if g.dtype != torch.float32 else g
                    else:
                        acc.add_(g)
        pgrads = [None if s is None else s.to(p.dtype) for s, p in zip(sums, params)]
        return (None, None, None, None, None, None if gx is None else gx.reshape(ctx.shape), *pgrads)


def _autocast_state(x: torch.Tensor) -> tuple[bool, torch.dtype] | None:
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return True, torch.get_autocast_dtype(kind)


def _autocast(x: torch.Tensor, state):
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, dtype=state[1])


def _rng_state(module: nn.Module, device: torch.device):
    if not (module.training and _has_dropout(module)):
        return None
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _replayed(state, device: torch.device):
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def tiled_call(mlp: nn.Module, fn: Callable, x: torch.Tensor, tile: int) -> torch.Tensor:
    """``fn(x)`` (``mlp``'s own forward) over tiles of ``tile`` tokens, with ``mlp``'s parameters now (those a
    ``functional_call`` substituted) as the tensors whose gradients the backward returns."""
    named = list(mlp.named_parameters())
    names = [n for n, _ in named]
    params = [p for _, p in named]
    return TiledMLP.apply(fn, mlp, tile, names, _rng_state(mlp, x.device), x, *params)


def _tiled_forward(self: nn.Module, x, *args, **kwargs):
    """The wrapped module's forward ([Note: MLP over sequence tiles]): over tiles while the plan has a tile smaller
    than the call's tokens, else its own. A method of the module (a deep copy of it is wrapped over the copy)."""
    own = self.__dict__[TILED]
    tile = self.__dict__[TILE_OF]()
    if args or kwargs or tile is None or x.numel() // max(1, x.shape[-1]) <= tile:
        return own(x, *args, **kwargs)
    return tiled_call(self, own, x, tile)


def install(blocks, tile_of: Callable[[], int | None], attr: str = "mlp") -> int:
    """Wrap each block's ``attr`` module's forward (once) so that, while ``tile_of()`` is a number of tokens
    smaller than a call's, it runs over tiles of that many ([Note: MLP over sequence tiles]); otherwise its own
    forward runs, as before. Returns how many were wrapped; modules that cannot be tiled (:func:`tileable`) are
    left as they are (logged once)."""
    wrapped, why = 0, None
    for block in blocks:
        mlp = getattr(block, attr, None)
        if not isinstance(mlp, nn.Module) or TILED in mlp.__dict__:
            continue
        why = tileable(mlp) or why
        if tileable(mlp) is not None:
            continue
        # its own forward as a bound method (a deep copy binds it to the copy), then the wrapper over it
        mlp.__dict__[TILED] = mlp.forward
        mlp.__dict__[TILE_OF] = tile_of
        mlp.__dict__["forward"] = types.MethodType(_tiled_forward, mlp)
        wrapped += 1
    if why is not None:
        log.info("zerofit: the MLP over sequence tiles: %s", why)
    return wrapped


def uninstall(blocks, attr: str = "mlp") -> None:
    """Undo :func:`install`: each wrapped module's own forward again."""
    for block in blocks:
        mlp = getattr(block, attr, None)
        if isinstance(mlp, nn.Module) and TILED in mlp.__dict__:
            own = mlp.__dict__.pop(TILED)
            del mlp.__dict__[TILE_OF], mlp.__dict__["forward"]
            if getattr(own, "__func__", None) is not getattr(type(mlp), "forward", None):
                mlp.__dict__["forward"] = own  # an instance's own forward it had before
