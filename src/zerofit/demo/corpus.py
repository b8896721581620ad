"""Training text that ships with Python itself: the standard library's own source.

Read in sorted file order so that the same Python gives the same bytes every
time; nothing is downloaded. The last ``eval_fraction`` of the bytes is held out
for the evaluation loss.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 4 << 20  # 4 MiB: far more than the demo's budget reads, and ~0.1 s to load


@dataclass(frozen=True)
class Corpus:
    """The token stream, split once into a training and a held-out part."""

    train: torch.Tensor  # (N_train,) uint8, host
    eval: torch.Tensor  # (N_eval,) uint8, host
    files: int  # source files read
    root: str  # folder they came from

    def __len__(self) -> int:
        return self.train.numel() + self.eval.numel()


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """The top-level ``*.py`` files of the standard library, in sorted (deterministic) order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_corpus(
    max_bytes: int = DEFAULT_MAX_BYTES,
    eval_fraction: float = 0.05,
    root: str | Path | None = None,
    min_bytes: int = 64 << 10,
) -> Corpus:
    """Concatenate standard-library sources (separated by a blank line) up to ``max_bytes``."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), found {eval_fraction}")
    files = stdlib_sources(root)
    chunks, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        data = (path.read_bytes() + b"\n\n")[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    if total < min_bytes:
        where = root or sysconfig.get_paths()["stdlib"]
        raise RuntimeError(
            f"the demo needs at least {min_bytes} bytes of Python source in {where}, found {total}"
            f" in {len(chunks)} files: this Python ships without its standard library sources"
            " (install the distribution's python3 'lib' or '-dev' package)"
        )
    data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # (total,) uint8
    n_eval = max(int(total * eval_fraction), 1)
    return Corpus(train=data[:-n_eval], eval=data[-n_eval:], files=len(chunks), root=str(root or files[0].parent))


def random_windows(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One micro-batch of ``batch_size`` windows of ``seq_len`` tokens at random offsets.

    ``labels`` equals ``input_ids``: the model shifts them (Hugging Face causal-LM convention).
    """
    if data.numel() <= seq_len:
        raise ValueError(f"seq_len ({seq_len}) must be smaller than the text ({data.numel()} tokens)")
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)  # (B,)
    ids = data[starts[:, None] + torch.arange(seq_len)].long()  # (B, T) int64
    return {"input_ids": ids, "labels": ids.clone()}


def micro_batches(
    data: torch.Tensor, batch_size: int, seq_len: int, grad_accum: int, seed: int
) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Endless optimizer steps, each a list of ``grad_accum`` micro-batches; same seed, same stream."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield [random_windows(data, batch_size, seq_len, g) for _ in range(grad_accum)]
