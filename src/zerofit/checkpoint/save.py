"""Writing one checkpoint: shards, side files, commit record, rename, pointer (engine-agnostic).

:func:`write_checkpoint` takes a :class:`Content` (tensor entries pointing into the
caller's buffers, small side files, a JSON state) and runs the protocol of
[Note: checkpoint commit protocol] (commit.py). The bytes needed are known before
anything is written, so a disk that cannot hold the checkpoint is refused up front;
an ENOSPC while writing anyway (another writer filled the disk) removes the partial
folder and raises the same :class:`CheckpointDiskFullError`.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import zerofit.checkpoint.seams as seams
from zerofit.checkpoint.commit import RECORD, CommitRecord, FileEntry, begin, check_tag, commit, set_latest
from zerofit.checkpoint.durable import disk_bytes, free_bytes, write_file
from zerofit.checkpoint.errors import CheckpointDiskFullError
from zerofit.checkpoint.format import Entry, index_bytes, plan_shards, write_shards
from zerofit.checkpoint.lock import hold_save_dir

WEIGHTS = "weights"
OPTIMIZER = "optimizer"
WEIGHTS_INDEX = "weights.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9
_RECORD_RESERVE = 256 << 10  # the commit record is written last (RNG states make it ~25 KB): room for it


@dataclass(frozen=True)
class SideFile:
    name: str
    data: bytes


@dataclass(frozen=True)
class Content:
    """Everything one checkpoint holds. ``weights`` and ``optimizer`` are written as separate shard sets
    (export reads only the weights); ``state`` goes into the commit record."""

    tag: str
    weights: list[Entry]
    optimizer: list[Entry] = field(default_factory=list)
    side_files: list[SideFile] = field(default_factory=list)
    state: dict = field(default_factory=dict)


def write_checkpoint(
    save_dir: Path | str,
    content: Content,
    save_latest: bool = True,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    workers: int = 4,
    holder=None,
) -> Path:
    """Write ``content`` as ``save_dir/<tag>/`` atomically and (``save_latest``) point ``latest`` at it.
    Returns the checkpoint folder. ``save_dir`` is held first ([Note: one writer per folder], lock.py): for the
    life of ``holder`` (an object with a ``locks`` dict, such as an engine's resources), else for this save;
    a folder another holder has raises :class:`~zerofit.checkpoint.lock.CheckpointFolderInUseError`."""
    save_dir = Path(save_dir)
    tag = check_tag(content.tag)
    own = hold_save_dir(save_dir, holder)
    try:
        return _write(save_dir, tag, content, save_latest, max_shard_bytes, workers)
    finally:
        if own is not None:
            own.release()


def _write(save_dir: Path, tag: str, content: Content, save_latest: bool, max_shard_bytes: int, workers: int) -> Path:
    w_shards = plan_shards(content.weights, WEIGHTS, max_shard_bytes)
    o_shards = plan_shards(content.optimizer, OPTIMIZER, max_shard_bytes) if content.optimizer else []
    small = [SideFile(WEIGHTS_INDEX, index_bytes(w_shards))]
    if o_shards:
        small.append(SideFile(OPTIMIZER_INDEX, index_bytes(o_shards)))
    small += content.side_files
    names = [s.file for s in w_shards + o_shards] + [f.name for f in small]
    if len(set(names)) != len(names) or RECORD in names:
        raise ValueError(f"checkpoint file names collide: {sorted(names)}")
    save_dir.mkdir(parents=True, exist_ok=True)
    needed = disk_bytes(
        [s.size for s in w_shards + o_shards] + [len(f.data) for f in small] + [_RECORD_RESERVE], save_dir
    )
    if seams.space_check:
        free = free_bytes(save_dir)
        if needed > free:
            raise CheckpointDiskFullError(save_dir / tag, needed, free, "before writing")
    tmp = begin(save_dir, tag)
    try:
        # optimizer shards first in the queue: they are the larger half, the pool then evens out
        written = write_shards(tmp, o_shards + w_shards, workers)
        for f in small:
            written.append((f.name, *write_file(tmp / f.name, f.data)))
        seams.reached("shards")
        record = CommitRecord(tag, tuple(FileEntry(*w) for w in sorted(written)), content.state)
        final = commit(tmp, save_dir, record)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise CheckpointDiskFullError(e.filename or tmp, needed, free_bytes(save_dir), "while writing") from e
        raise
    if save_latest:
        set_latest(save_dir, tag)
    return final
