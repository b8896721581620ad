"""An encoder-decoder's training pairs: each row's input and target, tokenized as the model's own pipeline tokenizes
them, padded into micro-batches of one shape.

[Note: pairs for an encoder-decoder]
An encoder-decoder (T5, BART, Whisper's text side) reads its input with its encoder and is trained to write the target
with its decoder: nothing is packed, each row is one example. ``input_ids`` is the tokenizer's encoding of the input
and ``labels`` that of the target, each with the tokenizer's own special tokens (T5's tokenizer ends a text with EOS,
BART's wraps it in BOS and EOS), as transformers' seq2seq examples tokenize them (``tokenizer(text_target=...)``), and
a target the tokenizer does not close gets the EOS (the model learns where a target ends); the model builds its
decoder's inputs by shifting the labels right, so every label is a target, the closing EOS too. A
row is ``input``+``target``, or ``prompt``+``completion`` (the same thing named as for a causal LM); text and chat rows
are refused, naming the row. An input longer than ``seq_len`` keeps its first ``seq_len`` tokens (the run says how
many were cut), a target likewise. Every micro-batch has the same shape, the planner's: inputs padded to ``seq_len``
with the pad token (``attention_mask`` 0 there), labels to the longest target of the data set with -100 (never
scored).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from zerofit.data.formats import KINDS, CompletionRow, PairRow, Row
from zerofit.data.sources import DataError

IGNORE_INDEX = -100
log = logging.getLogger("zerofit")


@dataclass(frozen=True, eq=False)
class Pair:
    """One tokenized row of an encoder-decoder's data."""

    input_ids: np.ndarray  # (S,) int32
    labels: np.ndarray  # (L,) int32
    source: str  # "file, row N"


def encode_pairs(tokenizer: Any, rows: Sequence[Row], sources: Sequence[str]) -> list[Pair]:
    """The rows as pairs (see [Note: pairs for an encoder-decoder]); a row of another kind is refused by name."""
    pairs: list[tuple[str, str, str]] = []
    for row, where in zip(rows, sources):
        if isinstance(row, PairRow):
            pairs.append((row.input, row.target, where))
        elif isinstance(row, CompletionRow):
            pairs.append((row.prompt, row.completion, where))
        else:
            raise DataError(
                f"{where}: a {KINDS[type(row)]} row, but an encoder-decoder trains on pairs: give each row "
                "'input' and 'target' (or 'prompt' and 'completion')"
            )
    if not pairs:
        return []
    inputs = tokenizer([p[0] for p in pairs], verbose=False)["input_ids"]
    targets = tokenizer(text_target=[p[1] for p in pairs], verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is not None:  # the model learns where a target ends: EOS closes it where the tokenizer adds none
        targets = [list(t) if list(t[-1:]) == [eos] else [*t, eos] for t in targets]
    return [
        Pair(np.asarray(i, dtype=np.int32), np.asarray(t, dtype=np.int32), where)
        for i, t, (_, _, where) in zip(inputs, targets, pairs)
        if len(t)
    ]


@dataclass(frozen=True, eq=False)
class PairDataset:
    """Pairs as micro-batches ``{"input_ids", "attention_mask", "labels"}`` of one shape: ``len(ds)`` examples,
    ``ds.batch(indices)`` one micro-batch ([Note: pairs for an encoder-decoder])."""

    pairs: tuple[Pair, ...]
    seq_len: int  # inputs' length in a batch (longer ones are cut)
    target_len: int  # labels' length in a batch: the longest target, at most seq_len
    pad_id: int

    @classmethod
    def of(cls, pairs: Sequence[Pair], seq_len: int, pad_id: int, target_len: int | None = None) -> PairDataset:
        longest = max((len(p.labels) for p in pairs), default=1)
        cut = sum(len(p.input_ids) > seq_len for p in pairs) + sum(len(p.labels) > seq_len for p in pairs)
        if cut:
            log.warning("zerofit: %d inputs or targets are longer than --seq-len %d and were cut to it", cut, seq_len)
        return cls(tuple(pairs), seq_len, target_len or min(longest, seq_len), pad_id)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def num_documents(self) -> int:
        return len(self.pairs)

    def windows_without_targets(self) -> int:
        return 0  # (a pair without a target is dropped when encoded)

    @property
    def num_target_tokens(self) -> int:
        return sum(min(len(p.labels), self.target_len) for p in self.pairs)

    def scored(self, batch: dict[str, torch.Tensor]) -> int:
        """Labels the model scores in ``batch`` (an encoder-decoder's are not shifted out of the window)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def scored_tokens(self, max_windows: int | None = None) -> int:
        n = len(self) if max_windows is None else min(len(self), max_windows)
        return sum(min(len(p.labels), self.target_len) for p in self.pairs[:n])

    def batch(self, indices: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).tolist()
        if idx and (min(idx) < 0 or max(idx) >= len(self)):
            raise IndexError(f"example index out of range 0..{len(self) - 1}: {idx}")
        ids = torch.full((len(idx), self.seq_len), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(idx), self.seq_len), dtype=torch.int64)
        labels = torch.full((len(idx), self.target_len), IGNORE_INDEX, dtype=torch.int64)
        for row, k in enumerate(idx):
            p = self.pairs[k]
            s, t = min(len(p.input_ids), self.seq_len), min(len(p.labels), self.target_len)
            ids[row, :s] = torch.from_numpy(p.input_ids[:s].astype(np.int64))
            mask[row, :s] = 1
            labels[row, :t] = torch.from_numpy(p.labels[:t].astype(np.int64))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return {name: t[0] for name, t in self.batch([k]).items()}

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the examples: a resumed loader checks it is fed the same data."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray([self.seq_len, self.target_len, self.pad_id, len(self)], dtype=np.int64).tobytes())
        for p in self.pairs:
            h.update(np.asarray([len(p.input_ids)], dtype=np.int64).tobytes())
            h.update(p.input_ids.tobytes())
            h.update(p.labels.tobytes())
        return h.hexdigest()
