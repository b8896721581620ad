"""Reading a committed checkpoint: find it, verify it, match its tensors, copy them into place.

[Note: verify before copying]
A load verifies every file it will read (size, then CRC32 of every byte, against
the commit record) and matches every tensor's name, shape and dtype against the
destination *before* it writes a single byte into the engine. A corrupt, truncated
or missing file, or a checkpoint of another model, therefore leaves the engine
exactly as it was. The price is one extra sequential read of the checkpoint (the
second, copying pass often comes from the page cache). The copying pass checks the
CRC32 again; if a file changed between the two passes or the disk fails then, the
engine is already partly overwritten and is made unusable (:class:`EngineStateLostError`
on its next use), never left to continue silently.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zerofit.checkpoint.commit import CommitRecord, resolve
from zerofit.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, MissingFileError
from zerofit.checkpoint.format import TensorInfo, read_header, read_into

Located = dict[str, tuple[str, TensorInfo]]  # tensor name -> (file name, its place in the file)


def open_checkpoint(load_dir: Path | str, tag: str | None) -> tuple[Path, CommitRecord] | None:
    """The checkpoint folder and its validated commit record; None when ``tag`` is None and nothing was saved."""
    folder = resolve(Path(load_dir), tag)
    if folder is None:
        return None
    return folder, CommitRecord.read(folder)


def shard_files(folder: Path, record: CommitRecord, index_name: str) -> list[str]:
    """The shard files an index names (the index itself must be in the record)."""
    if record.file(index_name) is None:
        raise MissingFileError(folder / index_name, "not in the commit record")
    try:
        index = json.loads((folder / index_name).read_bytes())
        files = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointCorruptError(folder / index_name, f"unreadable shard index ({e})") from None
    for f in files:
        if record.file(f) is None:
            raise MissingFileError(folder / f, f"named by {index_name} but not in the commit record")
    return files


def locate(folder: Path, files: list[str], index_name: str) -> Located:
    """Every tensor of ``files`` (from their headers), checked against the index's weight map."""
    index = json.loads((folder / index_name).read_bytes())["weight_map"]
    out: Located = {}
    for f in files:
        for info in read_header(folder / f)[0]:
            if index.get(info.name) != f:
                raise CheckpointCorruptError(
                    folder / f, f"holds {info.name}, which {index_name} places in {index.get(info.name)!r}"
                )
            out[info.name] = (f, info)
    missing = sorted(set(index) - set(out))
    if missing:
        raise CheckpointCorruptError(
            folder / index_name, f"names {len(missing)} tensors no shard holds, e.g. {missing[0]}"
        )
    return out


def match(found: Located, expected: dict[str, tuple[tuple[int, ...], torch.dtype]], folder: Path, what: str) -> None:
    """Refuse a checkpoint whose tensors are not exactly ``expected`` (names, shapes, dtypes)."""
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} {what} tensors of this model are not in it (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} of its tensors are not in this model (e.g. {extra[0]})")
        raise CheckpointMismatchError(
            f"{folder}: the checkpoint is of another model: {'; '.join(parts)}. "
            "Load it into the model it was saved from."
        )
    for n, (shape, dtype) in expected.items():
        f, info = found[n]
        if info.shape != tuple(shape) or info.dtype != dtype:
            raise CheckpointMismatchError(
                f"{folder / f}: tensor {n} is {list(info.shape)} {info.dtype} in the checkpoint, "
                f"{list(shape)} {dtype} in this model: the checkpoint is of another model configuration"
            )


def copy_into(
    folder: Path, record: CommitRecord, found: Located, targets: dict[str, torch.Tensor], workers: int = 4
) -> None:
    """Read every file of ``found`` once, sequentially, into ``targets`` (name -> flat destination)."""
    by_file: dict[str, list] = {}
    for name, (f, info) in found.items():
        by_file.setdefault(f, []).append((info, targets.get(name)))

    def one(f: str) -> None:
        plan = by_file[f]
        header_end = min((i.begin for i, _ in plan), default=record.file(f).bytes)
        entry = record.file(f)
        read_into(folder / f, header_end, plan, entry.crc32, entry.bytes)

    files = sorted(by_file)
    with ThreadPoolExecutor(max(1, min(workers, len(files))), thread_name_prefix="zerofit-ckpt-read") as ex:
        list(ex.map(one, files))
