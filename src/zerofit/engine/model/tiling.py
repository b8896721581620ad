"""Blocks over sequence tiles: a block's working set bounded by the tile, not the sequence. Llama-family layers
run whole over tiles ([Note: a block over sequence tiles], below), other layers their MLP alone; packed documents
reach the tiled core without a mask ([Note: documents without a mask]).

[Note: MLP over sequence tiles]
A decoder block's MLP (gate, up, act, down: Llama, Qwen3, Mistral, and PEFT LoRA layers inside them) is per token:
row ``i`` of its output depends on row ``i`` of its input only. So it may run over the micro-batch's tokens (its
``batch x seq`` rows, flattened) a tile of ``tile`` rows at a time: :class:`TiledRegion`'s forward runs each tile
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

A MoE block's sparse MLP (Mixtral, Qwen3-MoE: a module with ``experts``) is not tiled alone. Its routing is per
token too (top-k of each token's router logits), but transformers records its router's logits through hooks while
a model's forward asks for them (``output_router_logits``), and Mixtral's router jitters its input in place: run
per tile under ``no_grad`` and again in the backward, the hooks would record each tile twice, without a gradient.
:func:`tileable` says why. Within a layer over tiles it runs in the tiled part when nothing records ([Note: a
block over sequence tiles]).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

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


class TiledRegion(torch.autograd.Function):
    """``fn`` over sequence tiles ([Note: MLP over sequence tiles], [Note: a block over sequence tiles]).

    ``spec``: a :class:`_Region` (the function, the module whose parameters it reads and their names, the tile's
    length along each input's sequence dimension, the dimensions); ``tensors``: the inputs (each sliced along its
    sequence dimension) then the parameters (whole). The forward runs every tile under ``no_grad`` and keeps only
    the inputs; the backward recomputes each tile with grad enabled and backpropagates that tile's share of the
    outputs' gradients: the inputs' gradients written tile by tile, the parameters' summed in fp32 and cast once."""

    @staticmethod
    def forward(ctx, spec, *tensors):
        n = len(spec.in_dims)
        inputs, params = tensors[:n], tensors[n:]
        ctx.spec = spec
        ctx.autocast = _autocast_state(inputs[0])
        ctx.save_for_backward(*tensors)
        length = inputs[0].shape[spec.in_dims[0]]
        outs: list[torch.Tensor] = []
        with torch.no_grad():
            for s in range(0, length, spec.step):
                ys = _as_tuple(spec.fn(*_slices(inputs, spec.in_dims, s, spec.step)))
                if not outs:
                    outs = [_full(y, d, length) for y, d in zip(ys, spec.out_dims)]
                for out, y, d in zip(outs, ys, spec.out_dims):
                    out.narrow(d, s, y.shape[d]).copy_(y)
        del params
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        spec = ctx.spec
        n = len(spec.in_dims)
        saved = ctx.saved_tensors
        inputs, params = saved[:n], saved[n:]
        want = [ctx.needs_input_grad[1 + i] for i in range(n)]
        trained = [i for i in range(len(params)) if ctx.needs_input_grad[1 + n + i]]
        gins = [torch.zeros_like(x) if w else None for x, w in zip(inputs, want)]
        sums: list[torch.Tensor | None] = [None] * len(params)
        length = inputs[0].shape[spec.in_dims[0]]
        with contextlib.ExitStack() as stack:
            stack.enter_context(_reparametrize_module(spec.module, dict(zip(spec.names, params)), strict=False))
            stack.enter_context(_replayed(spec.rng, inputs[0].device))
            stack.enter_context(_autocast(inputs[0], ctx.autocast))
            stack.enter_context(torch.enable_grad())
            for s in range(0, length, spec.step):
                xs = [
                    t.detach().requires_grad_(w) if d is not None else t
                    for t, w, d in zip(_slices(inputs, spec.in_dims, s, spec.step), want, spec.in_dims)
                ]
                ys = _as_tuple(spec.fn(*xs))
                pairs = [
                    (y, g.narrow(d, s, y.shape[d])) for y, g, d in zip(ys, grad_outs, spec.out_dims) if y.requires_grad
                ]
                wanted = [xs[i] for i in range(n) if want[i]] + [params[i] for i in trained]
                if not pairs or not wanted:
                    continue
                grads = torch.autograd.grad([y for y, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                k = 0
                for i in range(n):
                    if want[i]:
                        gin = gins[i]
                        assert gin is not None
                        if grads[k] is not None:
                            gin.narrow(spec.in_dims[i], s, xs[i].shape[spec.in_dims[i]]).copy_(grads[k])
                        k += 1
                for i, g in zip(trained, grads[k:]):
                    if g is None:
                        continue
                    acc = sums[i]
                    if acc is None:
                        sums[i] = g.float() if g.dtype != torch.float32 else g
                    else:
                        acc.add_(g)
        pgrads = [None if s is None else s.to(p.dtype) for s, p in zip(sums, params)]
        return (None, *gins, *pgrads)


class _Region:
    """What :class:`TiledRegion` runs: ``fn`` over tiles of ``step`` positions along each input's dimension in
    ``in_dims`` (None: the input whole), its outputs' sequence dimensions ``out_dims``; ``module`` and ``names``:
    where the backward puts the parameters back; ``rng``: the RNG state the forward began with (None: no dropout)."""

    def __init__(self, fn, module, names, step, in_dims, out_dims, rng):
        self.fn, self.module, self.names, self.step = fn, module, names, step
        self.in_dims, self.out_dims, self.rng = tuple(in_dims), tuple(out_dims), rng


def _as_tuple(y) -> tuple:
    return y if isinstance(y, tuple) else (y,)


def _slices(inputs, dims, s: int, step: int) -> list:
    return [t if d is None else t.narrow(d, s, min(step, t.shape[d] - s)) for t, d in zip(inputs, dims)]


def _full(y: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(y.shape)
    shape[dim] = length
    return y.new_empty(shape)


def region(fn, module: nn.Module, prefixes: tuple[str, ...], step: int, inputs, in_dims, out_dims):
    """``fn(*inputs)`` over tiles of ``step`` positions ([Note: a block over sequence tiles]), with ``module``'s
    parameters under ``prefixes`` now (those a ``functional_call`` substituted) as the tensors whose gradients the
    backward returns."""
    named = [(n, p) for n, p in module.named_parameters() if n.startswith(prefixes)]
    spec = _Region(
        fn, module, [n for n, _ in named], step, in_dims, out_dims, _rng_state(module, inputs[0].device, prefixes)
    )
    return TiledRegion.apply(spec, *inputs, *(p for _, p in named))


def _autocast_state(x: torch.Tensor) -> tuple[bool, torch.dtype] | None:
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return True, torch.get_autocast_dtype(kind)


def _autocast(x: torch.Tensor, state):
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, dtype=state[1])


def _rng_state(module: nn.Module, device: torch.device, prefixes: tuple[str, ...] = ("",)):
    """The RNG state a region's forward begins with, for its recompute: in training, where it may draw (dropout, a
    MoE router's jitter: any module of its may), else None."""
    if not module.training or not any(m.training for n, m in module.named_modules() if n.startswith(prefixes)):
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
    """``fn(x)`` (``mlp``'s own forward) over tiles of ``tile`` tokens (``x``'s rows, the leading dimensions
    flattened), with ``mlp``'s parameters now (those a ``functional_call`` substituted) as the tensors whose
    gradients the backward returns."""
    rows = x.reshape(-1, x.shape[-1])
    (y,) = region(fn, mlp, ("",), tile, (rows,), (0,), (0,))
    return y.reshape(*x.shape[:-1], *y.shape[1:])


def _tiled_forward(self: nn.Module, x, *args, **kwargs):
    """The wrapped module's forward ([Note: MLP over sequence tiles]): over tiles while the plan has a tile smaller
    than the call's tokens, else its own. A method of the module (a deep copy of it is wrapped over the copy)."""
    own = self.__dict__[TILED]
    tile = self.__dict__[TILE_OF]()
    if args or kwargs or tile is None or x.numel() // max(1, x.shape[-1]) <= tile:
        return own(x, *args, **kwargs)
    return tiled_call(self, own, x, tile)


# [Note: a block over sequence tiles]
# A pre-norm decoder layer (Llama, Mistral, Qwen2/3 and their MoE kin: input norm, attention, residual, post norm,
# MLP, residual) is per token except for attention's core, softmax(q k^T) v. So with a tile, :func:`_block_over_tiles`
# runs it in three parts: the input norm and the attention module's own projections, norms and RoPE over tiles
# (:class:`TiledRegion`, keeping only the block's input), which give q, k and v for the whole sequence; the core
# once over the whole sequence, through the attention function the model's config names (SDPA's flash or
# memory-efficient kernels on a GPU: no sequence x sequence tensor unless the model builds a mask); then o_proj,
# the residual, the post norm, the MLP and the residual over tiles again (keeping the core's output and the
# block's input). What the block holds for the whole sequence is then q, k, v, the core's output and their
# gradients; everything else (the norms' fp32 copies, the projections' inputs, the MLP's intermediates) exists
# for one tile at a time. The attention module's own code makes q, k and v: its forward runs per tile with the
# attention function replaced, through a copy of its config, by one that hands the three back (``_capture``),
# so its projections, LoRA paths, q/k norms and RoPE are the model's, and the core receives the arguments
# (mask, scaling, sliding window, dropout) the module would have given it. A MoE layer's sparse MLP is per token
# too (each token's top-k experts from its own router logits; training's router jitter replayed with the forward's
# RNG state) and runs in the tiled part, except while transformers records router logits (a model's forward with
# ``output_router_logits``): then it runs whole after it ([Note: MLP over sequence tiles] says why). The engine's
# streamed blocks run outside any model forward, where nothing records. Layers of other shapes, or a call with a
# KV cache, run their own forward.
TILED_LAYERS = frozenset(
    {
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "MixtralDecoderLayer",
        "Qwen3MoeDecoderLayer",
    }
)
_CAPTURE = "zerofit_sequence_tiles"  # the attention function that hands q, k and v back


class _Captured(Exception):
    def __init__(self, q, k, v, call):
        super().__init__("q, k and v")
        self.qkv, self.call = (q, k, v), call


def _capture(module, query, key, value, attention_mask, **kwargs):
    raise _Captured(query, key, value, (attention_mask, kwargs))


@contextlib.contextmanager
def _capturing(attn: nn.Module):
    """``attn``'s forward with its attention function ``_capture``: through a copy of its config, so that nothing
    else reading the model's config sees it."""
    from transformers import AttentionInterface

    if _CAPTURE not in AttentionInterface._global_mapping:
        AttentionInterface.register(_CAPTURE, _capture)
    own = attn.__dict__["config"]
    cfg = copy.copy(own)
    cfg._attn_implementation_internal = _CAPTURE
    attn.__dict__["config"] = cfg
    try:
        yield
    finally:
        attn.__dict__["config"] = own


def block_tileable(block: nn.Module) -> str | None:
    """None when ``block`` may run over sequence tiles as a whole ([Note: a block over sequence tiles]), else why
    not."""
    name = type(block).__name__
    if name not in TILED_LAYERS:
        return f"{name} is not a decoder layer zerofit runs over sequence tiles ({', '.join(sorted(TILED_LAYERS))})"
    attn = getattr(block, "self_attn", None)
    parts = ("input_layernorm", "post_attention_layernorm", "mlp")
    if not all(isinstance(getattr(block, n, None), nn.Module) for n in parts) or not isinstance(
        getattr(attn, "o_proj", None), nn.Module
    ):
        return f"{name} lacks one of {', '.join(parts)}, self_attn.o_proj"
    if "config" not in vars(attn) or not hasattr(sys.modules[type(attn).__module__], "eager_attention_forward"):
        return f"{type(attn).__name__} has no config or eager attention function of its own"
    return None


def _recording_router_logits() -> bool:
    """Whether transformers is recording router logits now (a model's forward called with
    ``output_router_logits``: its hooks append each router call's logits, which tiles would split and the
    backward's recompute append again)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output capturing: it records nothing through hooks
        return False
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


def _core(attn: Any):
    """The attention function ``attn``'s own forward would call."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(attn).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)


def _block_over_tiles(layer: Any, x: torch.Tensor, kwargs: dict, step: int) -> torch.Tensor:
    """``layer(x, **kwargs)`` in three parts, the first and last over tiles of ``step`` positions ([Note: a block
    over sequence tiles])."""
    attn = layer.self_attn
    cos, sin = kwargs["position_embeddings"]
    call = {k: v for k, v in kwargs.items() if k != "position_embeddings"}
    seen: list = []

    def qkv(x_t, cos_t, sin_t):
        h = layer.input_layernorm(x_t)
        try:
            with _capturing(attn):
                attn(hidden_states=h, position_embeddings=(cos_t, sin_t), **call)
        except _Captured as c:
            if not seen:
                seen.append(c.call)
            return c.qkv
        raise RuntimeError(f"{type(attn).__name__} returned without calling its attention function")

    heads = ("input_layernorm.",) + tuple(f"self_attn.{n}." for n, _ in attn.named_children() if n != "o_proj")
    q, k, v = region(qkv, layer, heads, step, (x, cos, sin), (1, 1, 1), (2, 2, 2))
    mask, kw = seen[0]
    positions = getattr(mask, DOCUMENTS, None)
    if positions is not None:  # [Note: documents without a mask]
        out = _documents_attention(q, k, v, positions, kw)
    else:
        out, _ = _core(attn)(attn, q, k, v, mask, **kw)
    moe = tileable(layer.mlp) is not None and _recording_router_logits()

    def tail(o_t, x_t):
        h = x_t + attn.o_proj(o_t.reshape(*o_t.shape[:2], -1))
        return h if moe else h + layer.mlp(layer.post_attention_layernorm(h))

    tails = ("self_attn.o_proj.",) + (() if moe else ("post_attention_layernorm.", "mlp."))
    (y,) = region(tail, layer, tails, step, (out, x), (1, 1), (1,))
    if moe:
        y = y + layer.mlp(layer.post_attention_layernorm(y))
    return y


# [Note: documents without a mask]
# Packed documents (position ids that restart at each document's first token, zerofit/data/packing.py) make
# transformers build a 4-D mask of batch x T x T booleans, in the pre pass and again in each chunk of the post pass:
# 16 GiB at 131,072 tokens, more than the whole block's working set over tiles. Where every block runs over
# sequence tiles ([Note: a block over sequence tiles]) and a micro-batch has more tokens than the tile, packed
# documents and no padding, the engine hands the model a stand-in instead (:func:`documents_in`): a 4-D boolean of
# that shape with no memory (one element, expanded), carrying the position ids, which transformers passes to the
# blocks as it would any prepared mask; the tiled block's core then runs attention document by document
# (:func:`_documents_attention`: causal SDPA over each document's q, k and v, within the sliding window where the
# model has one). Each token attends to exactly the keys the mask would allow, so the math is the masked
# attention's; the rounding is that of each document's attention alone.
DOCUMENTS = "_zerofit_documents"


def documents_in(batch: dict, tile: int | None) -> dict:
    """``batch`` with the stand-in mask of [Note: documents without a mask] where it applies, else as it is."""
    pos, ids = batch.get("position_ids"), batch.get("input_ids")
    if tile is None or not isinstance(pos, torch.Tensor) or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return batch
    B, T = ids.shape
    if B * T <= tile or pos.shape[-1] != T:
        return batch
    mask = batch.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.all())):
        return batch  # padding, or a mask of the caller's: the model's own
    pos = pos.expand(B, T) if pos.dim() == 2 else pos.view(1, T).expand(B, T)
    if not bool((pos[:, 1:] != pos[:, :-1] + 1).any()):
        return batch  # one document a row: causal attention needs no mask
    stand_in = torch.zeros((), dtype=torch.bool, device=ids.device).expand(B, 1, T, T)
    setattr(stand_in, DOCUMENTS, pos)
    return {**batch, "attention_mask": stand_in}


def documents_hook(blocks, tile_of: Callable[[], int | None]) -> Callable[[dict], dict] | None:
    """The adapter's inputs hook for [Note: documents without a mask], or None where some block would not run over
    tiles whole (its own forward would receive the stand-in)."""
    if not len(blocks) or any(block_tileable(b) is not None for b in blocks):
        return None
    return lambda batch: documents_in(batch, tile_of())


def _documents_attention(q, k, v, positions: torch.Tensor, kw: dict) -> torch.Tensor:
    """Causal attention of each document of each row alone ([Note: documents without a mask]); ``q`` (B, H, T, d),
    ``k`` and ``v`` (B, H_kv, T, d); returns (B, T, H, d), as transformers' attention functions do."""
    scale, dropout, window = kw.get("scaling"), float(kw.get("dropout", 0.0) or 0.0), kw.get("sliding_window")
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for b in range(q.shape[0]):
        p = positions[b]
        cuts = (torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1).tolist()
        edges = [0, *cuts, q.shape[2]]
        pieces = []
        for s, e in zip(edges, edges[1:]):
            mask = None
            if window is not None and e - s > window:
                i = torch.arange(e - s, device=q.device)
                mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1, :, s:e],
                k[b : b + 1, :, s:e],
                v[b : b + 1, :, s:e],
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            pieces.append(o.transpose(1, 2))
        rows.append(torch.cat(pieces, 1))
    return torch.cat(rows, 0)


def _tiled_block(self: nn.Module, hidden_states, *args, **kwargs):
    """The wrapped layer's forward ([Note: a block over sequence tiles]): over tiles while the plan has a tile
    smaller than the call's tokens and the call has no KV cache, else its own."""
    own = self.__dict__[TILED]
    tile = self.__dict__[TILE_OF]()
    if (
        args
        or tile is None
        or kwargs.get("position_embeddings") is None
        or kwargs.get("past_key_values") is not None
        or hidden_states.dim() != 3
        or hidden_states.shape[0] * hidden_states.shape[1] <= tile
    ):
        return own(hidden_states, *args, **kwargs)
    return _block_over_tiles(self, hidden_states, kwargs, max(1, tile // hidden_states.shape[0]))


def _wrap(module: nn.Module, forward, tile_of) -> None:
    # its own forward as a bound method (a deep copy binds it to the copy), then the wrapper over it
    module.__dict__[TILED] = module.forward
    module.__dict__[TILE_OF] = tile_of
    module.__dict__["forward"] = types.MethodType(forward, module)


def _unwrap(module) -> None:
    if isinstance(module, nn.Module) and TILED in module.__dict__:
        own = module.__dict__.pop(TILED)
        del module.__dict__[TILE_OF], module.__dict__["forward"]
        if getattr(own, "__func__", None) is not getattr(type(module), "forward", None):
            module.__dict__["forward"] = own  # an instance's own forward it had before


def install(blocks, tile_of: Callable[[], int | None], attr: str = "mlp") -> int:
    """Wrap each block (once) so that, while ``tile_of()`` is a number of tokens smaller than a call's, it runs
    over tiles of that many: the whole block where :func:`block_tileable` allows ([Note: a block over sequence
    tiles]), and its ``attr`` module where :func:`tileable` does ([Note: MLP over sequence tiles]: the MLP alone,
    for the blocks not tiled whole); otherwise their own forwards run, as before. Returns how many blocks were
    wrapped (whole or their MLP); what cannot be tiled is left as it is (logged once)."""
    wrapped, why = 0, None
    for block in blocks:
        mlp = getattr(block, attr, None)
        if TILED in block.__dict__ or (isinstance(mlp, nn.Module) and TILED in mlp.__dict__):
            continue
        whole = attr == "mlp" and block_tileable(block) is None
        if whole:
            _wrap(block, _tiled_block, tile_of)
        if isinstance(mlp, nn.Module):
            why = tileable(mlp) or why
            if tileable(mlp) is None:
                _wrap(mlp, _tiled_forward, tile_of)
                whole = True
        wrapped += whole
    if why is not None:
        log.info("zerofit: the MLP over sequence tiles: %s", why)
    return wrapped


def uninstall(blocks, attr: str = "mlp") -> None:
    """Undo :func:`install`: each wrapped module's own forward again."""
    for block in blocks:
        _unwrap(block)
        _unwrap(getattr(block, attr, None))


def tile_of(engine_ref):
    """The MLP tile of the plan the step in progress follows (None: the whole sequence); the engine held weakly
    (the model's wrapped modules keep this, and must not keep a closed engine)."""

    def tile() -> int | None:
        planning = getattr(engine_ref(), "planning", None)
        return None if planning is None else planning.current.sequence_tile

    return tile
