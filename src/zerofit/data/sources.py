"""Which local files make up the user's data, and their rows, read through Hugging Face ``datasets``.

A PATH is a file or a folder. A folder contributes every supported file below it (recursively, hidden files and
folders left out), in sorted order of their paths; a file given by name must have a supported extension.

=============  ======================  ====================================================
extension      ``datasets`` builder    a row is
=============  ======================  ====================================================
``.txt``       ``text``                one whole file (``sample_by="document"``), or one
                                       paragraph / line with ``text_unit``
``.jsonl``     ``json``                one JSON object per line
``.json``      ``json``                one object per line, or the objects of a top-level list
``.parquet``   ``parquet``             one row of the table
=============  ======================  ====================================================

[Note: local only] Every read goes through ``datasets.load_dataset(<builder>, data_files=[local paths])``, the
packaged builders, with the Hub switched off for the call (:func:`offline_hub`): a path that does not exist is
refused here before ``datasets`` could take it for a Hub repository name, and nothing is ever fetched. The Arrow
files ``datasets`` writes go to ``cache_dir`` when given, else to a temporary folder removed after the read (the
rows are then held in memory), never to ``~/.cache``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from zerofit.errors import InputError

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TextUnit = Literal["document", "paragraph", "line"]
READ_BATCH = 1024  # rows per batch handed to the tokenizer


class DataError(InputError, ValueError):
    """The user's data cannot be used as given; the message names the file (and row and field) and the fix."""


@dataclass(frozen=True)
class DataFile:
    path: Path  # absolute
    builder: str  # "text" | "json" | "parquet"

    def __str__(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class FileList:
    """The files to read, and those a folder held that are not data (reported, not read)."""

    files: tuple[DataFile, ...]
    skipped: tuple[Path, ...]


def _supported() -> str:
    return ", ".join(BUILDERS)


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def find_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> FileList:
    """The data files named by ``paths`` (files or folders), in the order given, each folder's files sorted."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise DataError("no data path given: pass one or more files or folders of .txt, .jsonl, .json or .parquet")
    files: dict[Path, DataFile] = {}  # insertion-ordered; a file named twice is read once
    skipped: list[Path] = []
    for given in paths:
        p = Path(given).expanduser()
        if not p.exists():
            raise DataError(f"data path {given}: no such file or folder (resolved to {p.absolute()})")
        p = p.resolve()
        if p.is_dir():
            found = 0
            for q in sorted(x for x in p.rglob("*") if x.is_file() and _visible(x, p)):
                builder = BUILDERS.get(q.suffix.lower())
                if builder is None:
                    skipped.append(q)
                    continue
                files.setdefault(q, DataFile(q, builder))
                found += 1
            if not found:
                raise DataError(
                    f"data folder {p} holds no supported file (expected {_supported()});"
                    f" found {len(skipped)} other files"
                )
        else:
            builder = BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise DataError(
                    f"data file {p}: unsupported extension {p.suffix or '(none)'!r}; expected one of"
                    f" {_supported()} (convert it, or rename a plain-text file to .txt)"
                )
            files.setdefault(p, DataFile(p, builder))
    return FileList(tuple(files.values()), tuple(skipped))


@contextlib.contextmanager
def offline_hub() -> Iterator[None]:
    """The Hugging Face Hub switched off (environment and the already-imported flags) for the duration.

    ``datasets`` and ``huggingface_hub`` read ``HF_HUB_OFFLINE`` once at import, so the flags of an
    already-imported library are set too, and everything is put back afterwards.
    """
    import huggingface_hub.constants as hub_constants

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    import datasets.config as ds_config

    saved = (hub_constants.HF_HUB_OFFLINE, ds_config.HF_HUB_OFFLINE, ds_config.HF_DATASETS_OFFLINE)
    hub_constants.HF_HUB_OFFLINE = ds_config.HF_HUB_OFFLINE = ds_config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE, ds_config.HF_HUB_OFFLINE, ds_config.HF_DATASETS_OFFLINE = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars or logs from ``datasets`` while reading: the caller reports progress itself, and a file it
    cannot read itself (its JSON reader logs the parse error before it raises it: zerofit's error names the file
    and the cause once)."""
    from datasets import utils as ds_utils
    from datasets.utils import logging as ds_logging

    bars_were_off = ds_utils.are_progress_bars_disabled()
    verbosity = ds_logging.get_verbosity()
    ds_utils.disable_progress_bars()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if not bars_were_off:
            ds_utils.enable_progress_bars()


class _ReadFailed(Exception):
    """``datasets`` could not read the files (their content, not a bug of ours): the cause is chained."""


def _load(builder: str, files: list[str], cache_dir: str | None, **kwargs: Any):
    """One ``datasets.load_dataset`` call over local files (see [Note: local only])."""
    import datasets

    with offline_hub(), _quiet_datasets(), contextlib.ExitStack() as stack:
        cache = cache_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="zerofit-data-"))
        try:
            return datasets.load_dataset(
                builder,
                data_files=files,
                split="train",
                cache_dir=str(cache),
                keep_in_memory=cache_dir is None,
                **kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - whatever the reader raises, the caller names the file
            raise _ReadFailed() from exc


def _read_error(file: DataFile, exc: _ReadFailed) -> DataError:
    cause = exc.__cause__
    while cause.__cause__ is not None:  # datasets wraps the reader's own error (pyarrow's, the codec's)
        cause = cause.__cause__
    what = f"{type(cause).__name__}: {cause}".strip().rstrip(":")
    hint = {
        "text": "is it UTF-8 text?",
        "json": "each line must be one JSON object (.jsonl), or the file one JSON list of objects (.json)",
        "parquet": "is it a complete Parquet file?",
    }[file.builder]
    return DataError(f"data file {file.path}: cannot be read as {file.builder} ({what}); {hint}")


def _load_file(file: DataFile, cache_dir: str | None, text_unit: TextUnit):
    kwargs = {"sample_by": text_unit} if file.builder == "text" else {}
    if file.path.stat().st_size == 0:
        return None  # datasets fails on an empty JSON file; an empty file simply has no rows
    try:
        return _load(file.builder, [str(file.path)], cache_dir, **kwargs)
    except _ReadFailed as exc:
        raise _read_error(file, exc) from exc.__cause__


def iter_rows(
    files: Iterable[DataFile], cache_dir: str | os.PathLike | None = None, text_unit: TextUnit = "document"
) -> Iterator[tuple[DataFile, int, list[dict[str, Any]]]]:
    """Batches of rows: ``(file, index of the batch's first row in that file, rows)``, files in order.

    The ``.txt`` files are read together in one ``datasets`` call (thousands of small documents stay fast); the
    others one file at a time so that an error can name the file and row.
    """
    if text_unit not in ("document", "paragraph", "line"):
        raise DataError(f"text_unit must be 'document', 'paragraph' or 'line', found {text_unit!r}")
    cache = None if cache_dir is None else str(cache_dir)
    files = list(files)
    texts = [f for f in files if f.builder == "text"]
    text_rows: dict[DataFile, list[str]] = {}
    if texts and text_unit == "document" and len(texts) > 1:
        try:
            ds = _load("text", [str(f.path) for f in texts], cache, sample_by="document")
        except _ReadFailed:  # read one by one below, which names the failing file
            ds = None
        if ds is not None and len(ds) == len(texts):  # one row per file, in the order given
            text_rows = {f: [t] for f, t in zip(texts, ds["text"])}
    for f in files:
        if f in text_rows:
            yield f, 0, [{"text": t} for t in text_rows[f]]
            continue
        ds = _load_file(f, cache, text_unit)
        if ds is None:
            continue
        for start in range(0, len(ds), READ_BATCH):
            batch = ds[start : start + READ_BATCH]  # columns -> lists
            names = list(batch)
            n = len(batch[names[0]]) if names else 0
            yield f, start, [{k: batch[k][i] for k in names} for i in range(n)]
