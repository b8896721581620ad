"""Documents packed back to back into windows of ``seq_len`` tokens for causal-LM training.

Hugging Face's convention: ``labels`` are aligned with ``input_ids`` and the model shifts them itself (the
logits at position ``t`` are scored against ``labels[t + 1]``); ``-100`` means no loss. So in a window the label
at position 0 is never scored, and a token is predicted only from the tokens before it *in the same window*.

[Note: packed targets] The documents form one stream ``s_0 .. s_{N-1}`` with a target flag per token. Window
``k`` covers ``s[k(T-1) : k(T-1)+T]``: consecutive windows overlap by one token, so the last token of a window is
the first (context only) of the next. Every stream position ``i >= 1`` then sits at a position ``>= 1`` of
exactly one window, where it is scored if it is a target: every target of the stream is a prediction target
exactly once, and nothing is dropped (the last window is padded with ``pad_id``, label ``-100``; right padding
under causal attention changes nothing before it). The first token of each document is never a target: what
precedes it in the stream is another document.

[Note: one document's attention] A token attends only to the tokens of its own document inside its window: each
window comes with ``position_ids`` that restart at every document's first token (and at the window's first, where
a document continues from the window before). Transformers' models read restarting positions as packed
sequences and mask attention across them, as its padding-free collator (``DataCollatorWithFlattening``) relies
on; a window is then exactly its documents' pieces trained apart, and a position never passes the window's length
(a learnt position table is never indexed past it). No attention mask is emitted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from zerofit.data.encode import Document

IGNORE_INDEX = -100


@dataclass(frozen=True, eq=False)
class PackedDataset:
    """Windows of ``seq_len`` tokens over a packed token stream (see [Note: packed targets]).

    ``len(ds)`` windows; ``ds.batch(indices)`` gives one micro-batch. Held as the stream itself (5 bytes a token),
    windows are cut on demand.
    """

    stream: torch.Tensor  # (W*(T-1)+1,) int32, host: documents back to back, then pad_id
    targets: torch.Tensor  # (W*(T-1)+1,) bool, host: True where the stream token is a prediction target
    starts: torch.Tensor  # (W*(T-1)+1,) bool, host: True at each document's first token and the padding's
    seq_len: int  # T
    pad_id: int
    num_tokens: int  # N: tokens of the documents (the rest of ``stream`` is padding)
    num_documents: int

    def __post_init__(self) -> None:
        n = len(self) * (self.seq_len - 1) + 1 if self.num_tokens > 1 else self.num_tokens
        if self.stream.shape != (n,) or self.targets.shape != (n,) or self.starts.shape != (n,):
            raise ValueError(
                f"stream {tuple(self.stream.shape)}, targets {tuple(self.targets.shape)} and starts "
                f"{tuple(self.starts.shape)} must be ({n},) for {self.num_tokens} tokens in windows of {self.seq_len}"
            )

    def __len__(self) -> int:
        return 0 if self.num_tokens < 2 else -(-(self.num_tokens - 1) // (self.seq_len - 1))

    def windows_without_targets(self) -> int:
        """Windows that score no token (inside a long prompt): a micro-batch of only such windows has no loss."""
        if len(self) == 0:
            return 0
        scored = self.targets.clone()
        scored[0] = False  # the stream's first token is never scored
        per = scored[1:].reshape(len(self), self.seq_len - 1).any(dim=1)  # position 0 of a window is context
        return int((~per).sum())

    @property
    def num_target_tokens(self) -> int:
        """Tokens scored over all windows (each target once; the stream's first token never is)."""
        return int(self.targets[1:].sum())

    def batch(self, indices: Sequence[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """Windows ``indices`` as one micro-batch ``{"input_ids", "labels", "position_ids"}``, each ``(B, T)`` int64
        ([Note: one document's attention])."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)  # (B,)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"window index out of range 0..{len(self) - 1}: {idx.tolist()}")
        pos = idx[:, None] * (self.seq_len - 1) + torch.arange(self.seq_len)  # (B, T) stream positions
        ids = self.stream[pos].long()  # (B, T) int64
        labels = torch.where(self.targets[pos], ids, IGNORE_INDEX)  # (B, T) int64
        labels[:, 0] = IGNORE_INDEX  # context only: scored as the last token of the window before
        return {"input_ids": ids, "labels": labels, "position_ids": document_positions(self.starts[pos])}

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        """Window ``k``: ``{"input_ids", "labels", "position_ids"}``, each ``(T,)`` int64."""
        return {name: t[0] for name, t in self.batch([k]).items()}

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the windows' content: a resumed loader checks it is fed the same data."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray([self.seq_len, self.pad_id, self.num_tokens], dtype=np.int64).tobytes())
        h.update(self.stream.numpy().tobytes())
        h.update(self.targets.numpy().tobytes())
        return h.hexdigest()


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) int64 positions that restart at each True of ``starts`` (B, T) bool and at each window's first
    token: the distance to the latest start at or before each token."""
    t = torch.arange(starts.shape[-1])  # (T,)
    marks = torch.where(starts, t, 0)  # (B, T): a start's own index, 0 elsewhere (the window's first is one)
    return t - torch.cummax(marks, dim=-1).values


def pack(documents: Sequence[Document], seq_len: int, pad_id: int) -> PackedDataset:
    """``documents`` in the order given, back to back, cut into windows (see [Note: packed targets])."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (a token and the one it predicts), found {seq_len}")
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    n = int(lengths.sum())
    windows = 0 if n < 2 else -(-(n - 1) // (seq_len - 1))
    total = windows * (seq_len - 1) + 1 if n >= 2 else n
    stream = np.full(total, pad_id, dtype=np.int32)  # (total,) int32
    targets = np.zeros(total, dtype=bool)  # (total,) bool
    starts = np.zeros(total, dtype=bool)  # (total,) bool
    if n < total:
        starts[n] = True  # the padding: a piece of its own, attending to no document
    if documents:
        stream[:n] = np.concatenate([d.input_ids for d in documents])
        targets[:n] = np.concatenate([d.targets for d in documents])
        first = np.concatenate([[0], np.cumsum(lengths)[:-1]])[lengths > 0]
        targets[first] = False  # a document's first token: its context is another document
        starts[first] = True
    return PackedDataset(
        torch.from_numpy(stream),
        torch.from_numpy(targets),
        torch.from_numpy(starts),
        seq_len,
        int(pad_id),
        n,
        len(documents),
    )
