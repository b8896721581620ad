"""Model adapter: splits a model into the *shell* and its repeated *blocks*.

The blocks are the longest ``nn.ModuleList`` of same-class modules holding
most of the parameters (``model.layers`` of Llama, Mistral, Qwen2/3, Gemma,
Phi-3; ``transformer.h`` of GPT-2; the block list of any similar module). The
shell is everything else: embeddings, rotary tables, final norm, head, loss.

The engine never edits the model's code. It runs the model's *own* forward
with the block list swapped, for the duration of one call, for a list of stubs:

* **pre pass** (:meth:`Adapter.pre`): stubs record what the model passes to
  every block (hidden state, masks, rotary embeddings...) and the last one
  stops the forward. Everything before the first block runs as the model wrote it.
* **post pass** (:meth:`Adapter.post`): stubs pass their input through, and the
  last one returns the final hidden state the engine computed. Everything after
  the last block (final norm, head, loss, soft-capping...) runs as the model
  wrote it, and the model's own output object (with ``.loss``) comes back.

[Note: sequential blocks]
Streaming a block at a time is only valid when block *i*'s output is block
*i+1*'s first input and nothing else reads it. The pre pass checks that each
stub receives exactly the object the previous stub returned; a model that does
anything else raises :class:`NonSequentialModel`. With ``adapter="auto"`` the
engine then falls back to the generic path by itself (see [Note: generic
fallback] in engine.py); with ``adapter="blocks"`` the error reaches the caller.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerofit.engine.model.hooked import hooked_units
from zerofit.errors import InputError


class _StopForward(Exception):
    pass


@dataclass
class BlockCall:
    """What the model passed to one block, minus the hidden state."""

    args: tuple
    kwargs: dict


@dataclass
class PreResult:
    """Result of the pre pass for one micro-batch."""

    hidden: torch.Tensor  # (B, T, H) input of block 0, with its autograd graph to the shell
    calls: list[BlockCall]  # per block


def _is_cache(value) -> bool:
    """Whether ``value`` is a Hugging Face key/value cache (transformers' ``Cache``), which a block call fills."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


class _Recorder(nn.Module):
    def __init__(self, index: int, last: int, sink: list):
        super().__init__()
        self.index, self.last, self.sink = index, last, sink

    def forward(self, hidden, *args, **kwargs):
        if self.index != len(self.sink):
            raise NonSequentialModel(
                f"block {self.index} was called when block {len(self.sink)} was expected (the model does not "
                "run its blocks once each, in order)"
            )
        if self.index > 0 and hidden is not self.sink[-1][0]:
            raise NonSequentialModel(
                f"block {self.index} did not receive block {self.index - 1}'s output as its first argument"
            )
        if any(_is_cache(v) for v in (*args, *kwargs.values())):
            raise NonSequentialModel(
                f"block {self.index} was handed a key/value cache (past_key_values) that it appends to: recomputed "
                "for the backward, it would append the same keys and values again ([Note: no key/value cache in "
                "training], adapter.py); train without past_key_values"
            )
        self.sink.append((hidden, BlockCall(args, kwargs)))
        if self.index == self.last:
            raise _StopForward
        return hidden


class _Passthrough(nn.Module):
    def __init__(self, index: int, last: int, final: list):
        super().__init__()
        self.index, self.last, self.final, self.called = index, last, final, False

    def forward(self, hidden, *args, **kwargs):
        if self.called:
            raise NonSequentialModel(f"block {self.index} was called twice in one forward")
        self.called = True
        return self.final[0] if self.index == self.last else hidden


class NonSequentialModel(InputError, RuntimeError):
    """The model does not feed each block's output straight to the next block."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"{reason}; this model cannot stream block by block: pass adapter='generic' "
            "(adapter='auto' falls back to it by itself before the first step)"
        )


def _find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    total = sum(p.numel() for p in model.parameters())
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        if len({type(m) for m in mod}) != 1:
            continue
        n = sum(p.numel() for p in mod.parameters())
        if n and (best is None or n > best[2]):
            best = (name, mod, n)
    if best is None or best[2] < 0.3 * total:
        return None
    return best[0], best[1]


class Adapter:
    """How the engine runs one model: its block list and the shell around it; or, in the hooked mode ([Note: the
    hooked mode], hooked.py), its units (``blocks``, any submodules, at ``paths``) and the shell around them."""

    def __init__(self, model: nn.Module, kind: str = "auto", units: Sequence[str] = (), share: float = 0.02):
        self.model = model
        if kind == "auto" and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            kind = "hooked"  # two stacks, not one chain: [Note: the hooked mode]
        self.hooked = kind == "hooked"
        found = _find_blocks(model) if kind in ("auto", "blocks") else None
        if kind == "blocks" and found is None:
            raise ValueError("adapter='blocks' but no list of repeated blocks holding most parameters was found")
        self.blocks_path, self.blocks = found if found else ("", nn.ModuleList())
        self.paths: list[str] = []  # the hooked mode's units' module paths
        if self.hooked:
            chosen = hooked_units(model, units, share)
            self.paths, self.blocks = [p for p, _ in chosen], nn.ModuleList(m for _, m in chosen)
        params = inspect.signature(model.forward).parameters
        # [Note: no key/value cache in training]
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._accepts_use_cache = "use_cache" in params or (
            takes_kwargs and hasattr(getattr(model, "config", None), "use_cache")
        )
        # any module's config with a use_cache setting (Hugging Face's PretrainedConfig, found by the name)
        self._configs: list[Any] = list(
            {id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "use_cache")}.values()
        )
        # what the engine makes of a micro-batch's inputs before the model sees them ([Note: documents without a
        # mask], tiling.py); None: the inputs as given
        self.inputs_hook: Callable[[dict], dict] | None = None
        self.has_dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) or any(
            isinstance(v, float) and v > 0 and "dropout" in k
            for k, v in getattr(getattr(model, "config", None), "to_dict", dict)().items()
        )

    @property
    def chunkable_loss(self) -> bool:
        """Whether the head and loss may run over token chunks ([Note: a smaller GPU floor], plan/search.py): the
        model computes its loss with ``loss_function(..., **kwargs)`` (it then takes already-shifted labels and
        the batch's label count, as Hugging Face causal LMs do), and nothing after the blocks draws random
        numbers (dropout), which chunks would draw differently."""
        fwd = inspect.signature(self.model.forward).parameters.values()
        inside = {id(m) for m in self.blocks.modules()}
        shell_dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.model.modules() if id(m) not in inside)
        return (
            self.streaming
            and not shell_dropout
            and hasattr(self.model, "loss_function")
            and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in fwd)
        )

    @property
    def streaming(self) -> bool:
        """Whether the blocks stream as one chain (the block path); the hooked mode streams its units by their
        calls instead."""
        return len(self.blocks) > 0 and not self.hooked

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def describe_units(self) -> str:
        """The hooked mode's units, for the start-up log."""
        shown = ", ".join(self.paths[:4]) + (", ..." if len(self.paths) > 4 else "")
        return (
            f"the hooked mode: {len(self.paths)} units streamed by their modules' calls ({shown}), the rest of the "
            "model on the device"
        )

    def block_prefix(self, i: int) -> str:
        if self.hooked:
            return self.paths[i]
        return f"{self.blocks_path}.{i}" if self.blocks_path else str(i)

    @contextlib.contextmanager
    def _swapped(self, stubs: Sequence[nn.Module]):
        parent_path, _, attr = self.blocks_path.rpartition(".")
        parent = self.model.get_submodule(parent_path) if parent_path else self.model
        original = getattr(parent, attr)
        setattr(parent, attr, nn.ModuleList(stubs))
        try:
            yield
        finally:
            setattr(parent, attr, original)

    def _inputs(self, batch: dict) -> dict:
        kw = dict(batch) if self.inputs_hook is None else self.inputs_hook(dict(batch))
        if self._accepts_use_cache:
            kw["use_cache"] = False
        return kw

    @contextlib.contextmanager
    def _no_cache(self):
        """[Note: no key/value cache in training]
        A model that caches keys and values hands its blocks a cache object that each block call appends to: the
        engine calls a block again for its backward (recomputed from its checkpoint), which would append the same
        keys and values a second time and attend over both (the first without their gradient): wrong gradients
        for k_proj and v_proj, with no error. Training needs no cache, so every call the engine makes runs with it
        off: ``use_cache=False`` where the model takes it, and ``config.use_cache`` off on every module that has a
        config for the duration of the call, so that a Hugging Face model called by the user's own wrapper
        (``self.lm(input_ids=x, labels=x)``, ``use_cache`` at its default) makes none either. A cache handed to
        the blocks anyway (``past_key_values`` given by the caller) is refused by the pre pass
        (:class:`NonSequentialModel`: ``adapter='auto'`` trains such a model on the generic path, which calls
        each block once)."""
        saved = [(c, c.use_cache) for c in self._configs]
        for c, _ in saved:
            c.use_cache = False
        try:
            yield
        finally:
            for c, value in saved:
                c.use_cache = value

    def pre(self, shell_call, batch: dict) -> PreResult:
        """Run the model up to its first block; record every block's call. ``shell_call(kwargs)`` runs the model,
        with the micro-batch as the user's forward takes it (``labels`` too: a forward may require it, keyword-only
        or through ``**kwargs``, before its first block)."""
        sink: list = []
        last = self.num_blocks - 1
        stubs = [_Recorder(i, last, sink) for i in range(self.num_blocks)]
        kw = self._inputs(batch)
        with self._swapped(stubs), self._no_cache():
            try:
                shell_call(kw)
            except _StopForward:
                pass
            else:
                raise NonSequentialModel("the model's forward finished without calling its last block")
        return PreResult(sink[0][0], [c for _, c in sink])

    def post(self, shell_call, batch: dict, final: torch.Tensor):
        """Run the model's forward with ``final`` as the last block's output; return the model's output."""
        holder = [final]
        last = self.num_blocks - 1
        stubs = [_Passthrough(i, last, holder) for i in range(self.num_blocks)]
        with self._swapped(stubs), self._no_cache():
            return shell_call(self._inputs(batch))

    def full(self, shell_call, batch: dict):
        """Generic path: the model's whole forward (no blocks)."""
        with self._no_cache():
            return shell_call(self._inputs(batch))


def post_in_chunks(
    adapter: Adapter,
    shell_call,
    batch: dict,
    final: torch.Tensor,
    leaves: list[torch.Tensor],
    seed_scale: float,
    chunks: int,
    accumulate,
    fork_rng=contextlib.nullcontext,
    weights=contextlib.nullcontext,
):
    """The post pass and its backward over token chunks ([Note: a smaller GPU floor], plan/search.py): the model's
    own head and loss run on each chunk of the final hidden state ``final`` (detached), with the labels already
    shifted (``shift_labels``) and the micro-batch's whole label count (``num_items_in_batch``), so that each
    chunk's loss is its sum over the count and the chunks add up to the model's mean loss; each chunk's
    backward runs at once, so one chunk's logits exist at a time. ``accumulate(grads)`` takes each chunk's
    gradients of ``leaves`` (the shell's weights); ``fork_rng()`` wraps each chunk's forward, ``weights()`` its
    backward ([Note: the model's own checkpointing], compute.py). Returns (the
    gradient of ``final``, the micro-batch's loss). The engine's post pass, and what ``zerofit estimate``
    times for it."""
    labels = batch["labels"]
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    count = (shift != -100).sum()
    grad = torch.zeros_like(final)

    def chunk(a: int, b: int) -> torch.Tensor:
        """Tokens a..b: their loss (returned), the gradient of their final hidden state into ``grad``; nothing else
        of the chunk outlives the call ([Note: one micro-batch's gradients at a time])."""
        part = final[:, a:b].detach().requires_grad_(True)
        lab = shift[:, a:b].contiguous()
        with fork_rng():
            loss = loss_of(
                adapter.post(
                    shell_call, {**batch, "labels": lab, "shift_labels": lab, "num_items_in_batch": count}, part
                )
            )
        with weights():
            (g,) = backward_into(loss * seed_scale, [part], leaves, accumulate)
        if g is not None:
            grad[:, a:b] = g
        return loss.detach()

    T = final.shape[1]
    size = -(-T // chunks)
    losses = [chunk(a, min(T, a + size)) for a in range(0, T, size)]
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return grad, total


def backward_into(output: torch.Tensor, inputs: list, leaves: list, accumulate, grad_output=None) -> tuple:
    """The backward of ``output`` (seeded with ``grad_output``): the gradients of ``leaves`` (weights) go to
    ``accumulate(grads)`` and are gone when this returns; those of ``inputs`` are returned (None where unused).
    [Note: one micro-batch's gradients at a time]"""
    grads = torch.autograd.grad(output, [*inputs, *leaves], grad_output, allow_unused=True)
    accumulate(list(grads[len(inputs) :]))
    return grads[: len(inputs)]


# [Note: one micro-batch's gradients at a time]
# A backward over the micro-batches (or a micro-batch's loss chunks) makes each one's weight gradients, adds them into
# the unit's fp32 gradient and must drop them before the next one's backward makes its own: a loop variable holding
# them kept two sets alive at once. A 3B model at an 8 GiB cap peaked with two shell-sized 16-bit gradients alive:
# the head's, in the chunked post pass, and, with the chunks mended, the embeddings', kept by the pre pass's backward
# (the allocation history names no frames; a CPU test found it). With every site mended one was alive and the peak
# fell by the size of the other (bench/probes/mem_peak.py; docs/benchmarks.md, where the GPU memory peaks). So every
# backward of the engine goes through backward_into, whose weight gradients die with its frame, and the block's backward
# of a micro-batch is a method of its own (Schedule._block_backward), whose input and output die with it.


def loss_of(output) -> torch.Tensor:
    """The loss of a model's output: a tensor, or an object/dict with ``loss``."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)  # ModelOutput too
    if loss is None:
        raise ValueError("the model returned no loss: pass 'labels' in every micro-batch")
    return loss


def block_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out
