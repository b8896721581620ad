"""Held-out loss and perplexity over packed windows, for any model behind a loss function.

    result = evaluate(data.eval, lambda batch: engine(**batch).loss, micro_batch_size=8)
    result.loss, result.perplexity, result.tokens

``loss_fn(micro_batch)`` gets a dict ``{"input_ids", "labels"}`` (``(B, T)`` int64, on the host: move it where
the model lives) and returns the *mean* loss over that micro-batch's target tokens, as a Hugging Face causal LM's
``output.loss`` is (labels shifted inside the model, ``-100`` ignored). :func:`evaluate` weights each micro-batch
by its number of targets, so the result is the mean over every target token of the set, whatever the batching:
``exp`` of it is the perplexity. It runs ``loss_fn`` under ``torch.no_grad()``; putting the model in eval mode
is the caller's (``engine.eval()``, ``model.eval()``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerofit.data.packing import IGNORE_INDEX, PackedDataset
from zerofit.data.pairs import PairDataset

LossFn = Callable[[dict[str, torch.Tensor]], torch.Tensor | float]


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per target token (nats)
    perplexity: float  # exp(loss)
    tokens: int  # target tokens scored
    windows: int


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    """Tokens a causal LM scores in ``batch``: labels other than -100 after the model's shift by one."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def model_loss_fn(model: torch.nn.Module) -> LossFn:
    """``loss_fn`` for a plain Hugging Face causal LM: a forward on the model's own device, its ``.loss``."""

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        device = next(model.parameters()).device
        return model(**{k: v.to(device) for k, v in batch.items()}).loss

    return loss_fn


@torch.no_grad()
def evaluate(
    data: PackedDataset | PairDataset, loss_fn: LossFn, micro_batch_size: int, max_windows: int | None = None
) -> EvalResult:
    """Token-weighted mean loss of ``loss_fn`` over the windows of ``data`` in order (the first ``max_windows``)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, found {micro_batch_size}")
    n = len(data) if max_windows is None else min(len(data), max_windows)
    total, tokens = 0.0, 0
    for start in range(0, n, micro_batch_size):
        stop = min(start + micro_batch_size, n)
        batch = data.batch(range(start, stop))
        k = data.scored(batch) if isinstance(data, PairDataset) else count_targets(batch)
        if k == 0:
            continue  # nothing scored; a model would return nan for it
        loss = float(loss_fn(batch))
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss_fn returned {loss} on eval windows {start}..{stop - 1}")
        total += loss * k
        tokens += k
    if tokens == 0:
        raise ValueError(f"no target token in the {n} evaluation windows")
    mean = total / tokens
    perplexity = math.exp(mean) if mean < 700 else math.inf  # exp overflows a float past ~709
    return EvalResult(loss=mean, perplexity=perplexity, tokens=tokens, windows=n)


def scored_tokens(data: PackedDataset | PairDataset, max_windows: int | None = None) -> int:
    """Target tokens in the first ``max_windows`` windows (all by default): what :func:`evaluate` scores.
    Window ``k`` scores stream positions ``k(T-1)+1 .. (k+1)(T-1)`` ([Note: packed targets])."""
    if isinstance(data, PairDataset):  # [Note: pairs for an encoder-decoder]
        return data.scored_tokens(max_windows)
    n = len(data) if max_windows is None else min(len(data), max_windows)
    return int(data.targets[1 : n * (data.seq_len - 1) + 1].sum())


def small_held_out(data: PackedDataset | PairDataset, max_windows: int | None = None) -> str | None:
    """Why the held-out loss will not mean much, or None: fewer scored tokens than one full window.

    Why one window: the mean loss over ``n`` tokens has a standard error of about ``s / sqrt(n)`` (``s``, the
    spread of one token's loss, is a nat or two for a language model), so under a window's worth (2048 tokens
    by default, a standard error near 0.03 nat) the held-out loss moves by more than a fine-tuning run changes
    it, and a held-out set smaller than one training sequence does not resemble what the model trains on."""
    n = scored_tokens(data, max_windows)
    if n >= data.seq_len:
        return None
    cut = max_windows is not None and max_windows < len(data)
    docs = data.num_documents
    return (
        f"the held-out set has only {n:,} tokens with a loss ({docs:,} document{'s' if docs != 1 else ''}"
        + (f", the first {max_windows} of its {len(data)} windows" if cut else "")
        + f"), less than one --seq-len window ({data.seq_len:,} tokens): a mean over so few tokens is noise, "
        "not a measure of the model. Hold out more with --eval-size (a fraction such as 0.05, or a number of "
        "documents)" + (", evaluate more windows with --eval-windows" if cut else "") + ", or add data."
    )
