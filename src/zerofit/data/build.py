"""From PATHs and a tokenizer to a packed training set and a held-out evaluation set.

    tokenizer = load_tokenizer("path/to/model_dir")
    data = build_datasets(["corpus/", "chats.jsonl"], tokenizer, seq_len=2048, eval_size=0.02, seed=0)
    data.train, data.eval, data.stats    # PackedDataset, PackedDataset | None, DataStats

The steps, each usable alone: :func:`load_documents` (files -> rows -> tokenized documents),
:func:`split_documents` (the held-out split, by documents), :func:`~zerofit.data.packing.pack` (windows).

[Note: data determinism] The same files, tokenizer, ``seq_len`` and ``seed`` give the same windows in the same
order, on any machine: the split and the packing order are seeded permutations
(:mod:`zerofit.data.shuffle`), files are read in a fixed order, and nothing depends on the clock or on hashing.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from zerofit.data.encode import Document, Encoder
from zerofit.data.formats import parse_row
from zerofit.data.packing import PackedDataset, pack
from zerofit.data.pairs import Pair, PairDataset, encode_pairs
from zerofit.data.shuffle import ORDER, SPLIT, permutation
from zerofit.data.sources import DataError, TextUnit, find_files, iter_rows, offline_hub

PathArg = str | os.PathLike | Sequence[str | os.PathLike]
T = TypeVar("T")  # a document, or an encoder-decoder's pair
log = logging.getLogger("zerofit")


@dataclass(frozen=True)
class DataStats:
    """What was read: enough for a run's start-up summary."""

    files: int
    skipped_files: tuple[str, ...]  # found in a folder but not a supported data file
    rows: int
    documents: tuple[tuple[str, int], ...]  # (kind, count): "text", "prompt/completion", "messages"
    rows_without_targets: int  # empty texts and chats without an assistant turn: nothing to learn, dropped
    tokens: int
    target_tokens: int  # tokens with a loss, before packing


@dataclass(frozen=True, eq=False)
class Documents:
    """Tokenized documents in the order read, and what reading them found."""

    documents: tuple[Document, ...]
    stats: DataStats


class DataSplit(NamedTuple):
    train: PackedDataset | PairDataset  # an encoder-decoder's: pairs ([Note: pairs for an encoder-decoder])
    eval: PackedDataset | PairDataset | None  # None when nothing is held out
    stats: DataStats


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """The tokenizer of a local model directory (``AutoTokenizer``), never fetched from the Hub."""
    from transformers import AutoTokenizer

    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise DataError(f"model directory {model_dir}: no such folder (resolved to {path.absolute()})")
    with offline_hub():
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised with the folder named
            raise DataError(
                f"model directory {path}: cannot load its tokenizer ({type(exc).__name__}: {exc});"
                " it needs tokenizer.json or the tokenizer files the model was saved with"
            ) from exc


def _tokenizer(tokenizer: Any) -> Any:
    return load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer


def load_documents(
    paths: PathArg, tokenizer: Any, *, cache_dir: str | os.PathLike | None = None, text_unit: TextUnit = "document"
) -> Documents:
    """Every row of the files under ``paths``, tokenized with ``tokenizer`` (an object or a model directory).

    See :mod:`zerofit.data.sources` for the files, :mod:`zerofit.data.formats` for the rows and
    :mod:`zerofit.data.encode` for the tokens and their targets. An empty result is an error.
    """
    found = find_files(paths)
    encoder = Encoder(_tokenizer(tokenizer))
    docs: list[Document] = []
    rows = 0
    for file, first, batch in iter_rows(found.files, cache_dir=cache_dir, text_unit=text_unit):
        sources = [f"{file.path}, row {first + i + 1}" for i in range(len(batch))]
        parsed = [parse_row(r, where) for r, where in zip(batch, sources)]
        docs.extend(encoder.encode(parsed, sources))
        rows += len(batch)
    if not docs:
        names = ", ".join(str(f.path) for f in found.files[:3]) + (" ..." if len(found.files) > 3 else "")
        raise DataError(
            f"the data set is empty: {len(found.files)} files ({names}) gave {rows} rows and no"
            " document with a token to learn (empty texts, chats without an assistant turn)"
        )
    kinds = Counter(d.kind for d in docs)
    stats = DataStats(
        files=len(found.files),
        skipped_files=tuple(str(p) for p in found.skipped),
        rows=rows,
        documents=tuple(sorted(kinds.items())),
        rows_without_targets=rows - len(docs),
        tokens=sum(len(d) for d in docs),
        target_tokens=sum(int(d.targets[1:].sum()) for d in docs),
    )
    return Documents(tuple(docs), stats)


def load_pairs(
    paths: PathArg, tokenizer: Any, *, cache_dir: str | os.PathLike | None = None
) -> tuple[list[Pair], DataStats]:
    """Every row of the files under ``paths`` as an encoder-decoder's pair ([Note: pairs for an encoder-decoder])."""
    found = find_files(paths)
    tok = _tokenizer(tokenizer)
    pairs: list[Pair] = []
    rows = 0
    for file, first, batch in iter_rows(found.files, cache_dir=cache_dir, text_unit="document"):
        sources = [f"{file.path}, row {first + i + 1}" for i in range(len(batch))]
        pairs.extend(encode_pairs(tok, [parse_row(r, where) for r, where in zip(batch, sources)], sources))
        rows += len(batch)
    if not pairs:
        raise DataError(f"the data set is empty: {len(found.files)} files gave {rows} rows and no pair with a target")
    stats = DataStats(
        files=len(found.files),
        skipped_files=tuple(str(p) for p in found.skipped),
        rows=rows,
        documents=(("input/target", len(pairs)),),
        rows_without_targets=rows - len(pairs),
        tokens=sum(len(p.input_ids) + len(p.labels) for p in pairs),
        target_tokens=sum(len(p.labels) for p in pairs),
    )
    return pairs, stats


def _eval_count(eval_size: float | int, n: int) -> int:
    if isinstance(eval_size, bool) or not isinstance(eval_size, (int, float)):
        raise ValueError(f"eval_size must be a fraction in [0, 1) or a count of documents, found {eval_size!r}")
    if isinstance(eval_size, float):
        if not 0.0 <= eval_size < 1.0:
            raise ValueError(f"eval_size as a fraction must be in [0, 1), found {eval_size}")
        # a fraction of a single document would be all of it: nothing is held out then (the run says so)
        count = 0 if eval_size == 0 or n < 2 else max(1, round(eval_size * n))
    else:
        count = eval_size
    if count < 0 or (count and count >= n):
        raise DataError(
            f"cannot hold out {count} of {n} documents (eval_size={eval_size!r}): at least one must"
            " be left to train on; use a smaller eval_size, more documents, or text_unit='paragraph'"
            " to cut .txt files into more documents"
        )
    return count


def split_documents(
    documents: Sequence[T], eval_size: float | int, seed: int, shuffle: bool = True
) -> tuple[list[T], list[T]]:
    """``(train, held_out)`` by whole documents; ``eval_size`` is a fraction (``float``) or a count (``int``).

    The held-out documents are a seeded random choice (in their original order); the training documents come in
    a seeded random order when ``shuffle`` (so that windows mix the sources), else in their original order.
    """
    n = len(documents)
    n_eval = _eval_count(eval_size, n)
    held = sorted(permutation(n, seed, SPLIT)[:n_eval].tolist())
    held_set = set(held)
    rest = [i for i in range(n) if i not in held_set]
    if shuffle:
        rest = [rest[j] for j in permutation(len(rest), seed, ORDER).tolist()]
    return [documents[i] for i in rest], [documents[i] for i in held]


def build_datasets(
    paths: PathArg,
    tokenizer: Any,
    seq_len: int,
    eval_size: float | int = 0.0,
    seed: int = 0,
    *,
    cache_dir: str | os.PathLike | None = None,
    text_unit: TextUnit = "document",
    shuffle: bool = True,
    seq2seq: bool = False,
) -> DataSplit:
    """Read, tokenize, split and pack: the training windows and the held-out windows (``None`` if
    ``eval_size`` is 0). Padding uses the tokenizer's pad token, else its EOS (never scored either way). With
    ``seq2seq`` (an encoder-decoder) each row is one example: [Note: pairs for an encoder-decoder]."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, found {seq_len}")
    tok = _tokenizer(tokenizer)
    if seq2seq:
        pairs, stats = load_pairs(paths, tok, cache_dir=cache_dir)
        train_pairs, eval_pairs = split_documents(pairs, eval_size, seed, shuffle=shuffle)  # (whole examples)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        train_set = PairDataset.of(train_pairs, seq_len, pad)
        held_set = PairDataset.of(eval_pairs, seq_len, pad) if eval_pairs else None
        return DataSplit(train_set, held_set, stats)
    docs = load_documents(paths, tok, cache_dir=cache_dir, text_unit=text_unit)
    train_docs, eval_docs = split_documents(docs.documents, eval_size, seed, shuffle=shuffle)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train = pack(train_docs, seq_len, pad_id)
    held = pack(eval_docs, seq_len, pad_id) if eval_docs else None
    _warn_long_prompts(train_docs, train, seq_len)
    return DataSplit(train, held, docs.stats)


def _warn_long_prompts(documents: Sequence[Document], packed: PackedDataset, seq_len: int) -> None:
    """Documents whose first scored token lies more than a window into them (a prompt longer than ``seq_len``):
    their answers are scored without the start of their prompt in view, and the windows inside such a prompt score
    nothing (a micro-batch of only such windows has no loss, and no gradient)."""
    long = sum(1 for d in documents if d.targets.any() and int(d.targets.argmax()) >= seq_len - 1)
    empty = packed.windows_without_targets()
    if long or empty:
        log.warning(
            "zerofit: %d documents have a prompt longer than --seq-len %d, so their answers are scored "
            "without the start of the prompt in view; %d of %d windows score no token (a step's loss is over "
            "the micro-batches that do). Raise --seq-len, or shorten those prompts",
            long,
            seq_len,
            empty,
            len(packed),
        )
