"""Checks of a user's batch before a step touches anything.

A bad batch found in the middle of a step costs the step's work, and on a GPU an out-of-range token id
is worse: the embedding's device-side assert poisons the CUDA context, and nothing can run afterwards.
These checks read only shapes, dtypes and devices, and the value range of token ids and labels that are
still in host memory (one min/max each, on the CPU, before the upload): no device sync, no copy.

[Note: token ids of any integer dtype]
Token ids and labels may come in any integer dtype that holds them exactly (int8 to int64, uint8 to uint32:
numpy token files are often int32 or uint16). The embedding takes int32 and int64 ids, but torch's (and
Hugging Face's) cross-entropy takes int64 targets only: int32 labels passed the checks here and failed in
the loss, after the step's forward. :func:`to_device`, which every batch goes through on its way to the
compute device, converts ``input_ids`` and ``labels`` of another integer dtype to int64 as it copies them:
exact (every value fits), and the copy is the upload the batch needs anyway. uint64 is refused (its values
need not fit int64).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zerofit.errors import InputError

IGNORE_INDEX = -100  # the labels Hugging Face's and torch's cross-entropy skip
TOKEN_KEYS = ("input_ids", "labels")  # converted to int64 on the way to the device: [Note: token ids of any ...]
_NARROW_INTS = (torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32)


class BatchError(InputError, ValueError):
    """A micro-batch does not have the keys, shapes, dtypes, devices or values the model needs."""


@dataclass(frozen=True)
class BatchSpec:
    """What the engine knows of the model's inputs."""

    accepted: frozenset[str] | None  # the forward's keyword parameters; None: it takes **kwargs
    vocab: int  # token ids must be < vocab; 0 = unknown (not checked)
    device: torch.device  # the compute device (tensors may also come from the host)
    loss_needs_labels: str = ""  # a Hugging Face model's class name: its loss exists only with labels
    seq2seq: bool = False  # an encoder-decoder (config.is_encoder_decoder): labels are the decoder's, of any length

    @classmethod
    def of(cls, model: nn.Module, vocab: int, device: torch.device) -> BatchSpec:
        params = inspect.signature(model.forward).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            accepted = None
        else:
            accepted = frozenset(
                p.name
                for p in params
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            )
        seq2seq = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        return cls(accepted, vocab, device, _labelled_loss(model), seq2seq)


def _labelled_loss(model: nn.Module) -> str:
    """The class name of a Hugging Face model (or of the one a PEFT model wraps) whose forward takes
    ``labels``: such a model returns a loss only when given labels (transformers' convention for every head).
    "" for any other model, which may compute its loss from other inputs."""
    transformers = sys.modules.get("transformers")  # a model of it means it is imported already
    if transformers is None:
        return ""
    # PEFT's get_base_model, found by name (torch types a module attribute as Tensor | Module)
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # type: ignore[operator]
    if not isinstance(base, transformers.PreTrainedModel):
        return ""
    return type(base).__name__ if "labels" in inspect.signature(base.forward).parameters else ""


def check_micro_batches(micro_batches, spec: BatchSpec) -> None:
    """Raise :class:`BatchError` naming the micro-batch and the field when a micro-batch is unusable."""
    if isinstance(micro_batches, Mapping):
        raise BatchError(
            "train_batch takes a list of micro-batches (dicts of tensors), got one dict: "
            "pass [batch], or split it into gradient_accumulation_steps micro-batches"
        )
    if not isinstance(micro_batches, Sequence) or isinstance(micro_batches, (str, bytes)):
        raise BatchError(
            f"train_batch takes a list of micro-batches (dicts of tensors), got a {type(micro_batches).__name__}"
        )
    if not micro_batches:
        raise BatchError("train_batch needs at least one micro-batch, got an empty list")
    for i, mb in enumerate(micro_batches):
        check_batch(mb, spec, f"micro-batch {i}")
        if spec.loss_needs_labels and "labels" not in mb:
            # without labels the model returns no loss, and train_batch would fail after the forward
            raise BatchError(
                f"micro-batch {i} has no 'labels' (keys {sorted(mb)}): {spec.loss_needs_labels} "
                "returns a loss only when given labels, and train_batch trains on the loss. Pass "
                "labels with input_ids' shape (a copy of input_ids for causal-LM training; the model "
                f"shifts them itself), {IGNORE_INDEX} where a token has no loss"
            )


def check_batch(batch, spec: BatchSpec, where: str = "the batch") -> None:
    """One micro-batch: a dict of tensors the model's forward accepts, with consistent shapes."""
    if not isinstance(batch, Mapping):
        raise BatchError(f"{where} is a {type(batch).__name__}; expected a dict of tensors: {_inputs(spec)}")
    if not batch:
        raise BatchError(f"{where} is an empty dict; expected {_inputs(spec)}")
    if spec.accepted is not None:
        unknown = sorted(k for k in batch if k not in spec.accepted)
        if unknown:
            raise BatchError(
                f"{where} has keys {unknown} that the model's forward does not take "
                f"(it takes {sorted(spec.accepted)}); remove them"
            )
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.device.type != "cpu" and value.device != spec.device:
            raise BatchError(
                f"{where}[{key!r}] is on {value.device}, the engine computes on {spec.device}: "
                "pass host tensors (the engine uploads them) or tensors on that device"
            )
    ids = batch.get("input_ids")
    if ids is None:
        return
    shape = _token_tensor(ids, "input_ids", where)
    if spec.vocab:
        _check_range(
            ids, 0, spec.vocab, "input_ids", where, f"token ids must be in [0, {spec.vocab}) (the model's vocab_size)"
        )
    labels = batch.get("labels")
    if labels is not None:
        got = _token_tensor(labels, "labels", where)
        if spec.seq2seq and got[:1] != shape[:1]:
            raise BatchError(
                f"{where}['labels'] has {got[0] if got else 0} rows, input_ids {shape[0]}: an encoder-decoder's "
                "labels are the targets of each input, one row each (of any length)"
            )
        if not spec.seq2seq and got != shape:
            raise BatchError(
                f"{where}['labels'] has shape {tuple(labels.shape)}, input_ids {tuple(shape)}: "
                "labels must have input_ids' shape (the model shifts them itself)"
            )
        if spec.vocab:
            _check_range(
                labels,
                0,
                spec.vocab,
                "labels",
                where,
                f"labels must be token ids in [0, {spec.vocab}) or {IGNORE_INDEX} (ignored)",
                ignore=IGNORE_INDEX,
            )
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise BatchError(f"{where}['attention_mask'] is a {type(mask).__name__}; expected a tensor")
        if mask.dim() < 2 or mask.shape[0] != shape[0] or mask.shape[-1] != shape[1]:
            raise BatchError(
                f"{where}['attention_mask'] has shape {tuple(mask.shape)}, input_ids "
                f"{tuple(shape)}: expected (batch, seq) = {tuple(shape)}"
            )


def _inputs(spec: BatchSpec) -> str:
    """What the model's forward takes, in words: a language model's keys, or its own parameters' names."""
    if spec.accepted is None or "input_ids" in spec.accepted:
        return "input_ids, labels (for a loss), optional attention_mask"
    return "the arguments of the model's forward (" + ", ".join(sorted(spec.accepted)) + ")"


def _token_tensor(t, key: str, where: str) -> torch.Size:
    if not isinstance(t, torch.Tensor):
        raise BatchError(f"{where}[{key!r}] is a {type(t).__name__}; expected a tensor of token ids")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise BatchError(f"{where}[{key!r}] has dtype {t.dtype}; expected integer token ids (torch.long)")
    if t.dtype == torch.uint64:
        raise BatchError(
            f"{where}[{key!r}] has dtype torch.uint64, whose values need not fit torch.long: pass "
            f"{key}.long() (any integer dtype up to int64 or uint32 is taken)"
        )
    if t.dim() != 2 or t.numel() == 0:
        raise BatchError(f"{where}[{key!r}] has shape {tuple(t.shape)}; expected (batch, seq) with both > 0")
    return t.shape


def _check_range(t: torch.Tensor, lo: int, hi: int, key: str, where: str, rule: str, ignore: int | None = None):
    if t.device.type != "cpu":  # reading a device tensor's values would be a device sync: skipped
        return
    if t.dtype in (torch.uint16, torch.uint32):  # no aminmax for them; every value fits int64
        t = t.long()
    vmin, vmax = (int(v) for v in torch.aminmax(t))  # one pass
    bad = None
    if vmax >= hi:
        bad = vmax
    elif vmin < lo and vmin != ignore:
        bad = vmin
    elif vmin < lo:  # ignored labels: is anything else below the range?
        outside = (t < lo) & (t != ignore)
        if outside.any():
            bad = int(t[outside][0])
    if bad is not None:
        raise BatchError(f"{where}[{key!r}] holds {bad}: {rule}")


def scores_tokens(batch: Mapping) -> bool:
    """Whether a micro-batch's loss scores any token: labels not all IGNORE_INDEX (or no labels: the model's own
    loss). Device labels are not read (a device sync): they count as scoring."""
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.device.type != "cpu" or labels.numel() == 0:
        return True
    return bool((labels != IGNORE_INDEX).any())


def to_device(batch: Mapping, device: torch.device) -> dict:
    """The micro-batch on ``device`` (asynchronous copies), ``input_ids`` and ``labels`` as int64 ([Note: token ids
    of any integer dtype]); other values as they are."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, torch.int64 if k in TOKEN_KEYS and v.dtype in _NARROW_INTS else None, non_blocking=True)
        out[k] = v
    return out


def vocab_of(model: nn.Module, default: int) -> int:
    """The number of token ids the model embeds: its input embedding's rows, else ``default``."""
    try:
        # Hugging Face's get_input_embeddings, tried by name (torch types a module attribute as Tensor | Module)
        weight = model.get_input_embeddings().weight  # type: ignore[operator]
        return int(weight.shape[0])
    except Exception:  # not a Hugging Face model, or one without a plain embedding
        return default
