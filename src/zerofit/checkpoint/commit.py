"""The commit protocol of a checkpoint folder: a temporary folder, the commit record last, a rename,
then the ``latest`` pointer. Only folders whose commit record exists and validates are ever loaded.

[Note: checkpoint commit protocol]
::

    save_dir/
      latest                          the tag of the newest complete checkpoint (text)
      global_step100/                 a complete checkpoint: its zerofit_checkpoint.json is valid
      .tmp-global_step200-<pid>-<x>/  a save in progress, or killed: never loaded, removed by the next save

A save: (1) makes the temporary folder beside its final name (same filesystem, so the
rename is atomic); (2) writes and fsyncs every data and side file (phase ``shards``);
(3) writes the commit record ``zerofit_checkpoint.json`` last, with each file's size and
CRC32, fsyncs it and the folder (phase ``record``); (4) renames the folder to its tag and
fsyncs the parent (phase ``rename``): an existing folder of the same tag is swapped in one
step with ``renameat2(RENAME_EXCHANGE)``, or, where the filesystem lacks it, moved aside to
``.replaced-<tag>-…`` first (a loader that finds the tag missing recovers from there);
(5) replaces ``latest`` through a temporary file, fsync, rename, parent fsync (phase
``pointer`` is just before that rename). A SIGKILL anywhere leaves ``latest`` naming either
the previous complete checkpoint or the new complete one. The phases are where
:func:`zerofit.checkpoint.seams.reached` lets a test stop the process.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import zerofit.checkpoint.seams as seams
from zerofit.checkpoint.durable import CHUNK_BYTES, crc_of_file, exchange, fsync_dir, replace_file, write_file
from zerofit.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    MissingFileError,
    TruncatedFileError,
)

RECORD = "zerofit_checkpoint.json"
LATEST = "latest"
FORMAT = "zerofit-checkpoint"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"

log = logging.getLogger("zerofit")


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    crc32: int


@dataclass(frozen=True)
class CommitRecord:
    """What the commit record holds: the files (sizes, CRC32s) and the training state (JSON)."""

    tag: str
    files: tuple[FileEntry, ...]
    state: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def file(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT,
            "format_version": self.format_version,
            "tag": self.tag,
            "files": {f.name: {"bytes": f.bytes, "crc32": f.crc32} for f in self.files},
            "state": self.state,
        }
        body["record_crc32"] = _crc_json(body)
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def read(cls, folder: Path) -> CommitRecord:
        """The folder's commit record; :class:`CheckpointIncompleteError` when it has none."""
        path = folder / RECORD
        if not path.is_file():
            raise CheckpointIncompleteError(
                f"{folder}: no {RECORD}: a save that did not finish (or not a zerofit checkpoint). "
                "Load another tag; a later save removes unfinished ones."
            )
        try:
            body = json.loads(path.read_bytes())
            crc = body.pop("record_crc32")
            if body.get("format") != FORMAT:
                raise ValueError(f"format {body.get('format')!r}")
        except (ValueError, KeyError, AttributeError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointCorruptError(path, f"unreadable commit record ({e})") from None
        if _crc_json(body) != crc:
            raise ChecksumMismatchError(path, "the commit record's own CRC32 does not match its content")
        if body["format_version"] > FORMAT_VERSION:
            raise CheckpointCorruptError(
                path,
                f"format version {body['format_version']}; this zerofit reads up to {FORMAT_VERSION}: upgrade zerofit",
            )
        files = tuple(FileEntry(n, int(v["bytes"]), int(v["crc32"])) for n, v in body["files"].items())
        for f in files:
            if Path(f.name).name != f.name or f.name.startswith("."):
                raise CheckpointCorruptError(path, f"file name {f.name!r} is not a plain name in the folder")
        return cls(body["tag"], files, body["state"], body["format_version"])


def _crc_json(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..", LATEST) or "/" in tag or "\\" in tag or tag.startswith(".") or "\0" in tag:
        raise ValueError(
            f"checkpoint tag {tag!r}: expected a plain folder name (no '/', not starting with '.', "
            f"not {LATEST!r}), such as 'global_step100'"
        )
    return tag


def _pid_of(name: str) -> int | None:
    try:
        return int(name.rsplit("-", 2)[-2])
    except (IndexError, ValueError):
        return None


def _alive_other(pid: int | None) -> bool:
    if pid is None or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(save_dir: Path) -> list[Path]:
    """Remove what killed saves left behind (temporary folders, pointer temp files, swapped-out tags whose
    replacement is complete), except a live process's. Returns what was removed."""
    removed = []
    for p in save_dir.iterdir() if save_dir.is_dir() else ():
        name = p.name
        if name.startswith(TMP_PREFIX) or name.startswith(f".{LATEST}.tmp-"):
            if _alive_other(_pid_of(name) if name.startswith(TMP_PREFIX) else int(name.rsplit("-", 1)[-1])):
                continue
        elif name.startswith(REPLACED_PREFIX):
            tag = name[len(REPLACED_PREFIX) :].rsplit("-", 2)[0]
            if not (save_dir / tag / RECORD).is_file():
                continue  # still the only copy of that tag: resolve() recovers from it
        else:
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def begin(save_dir: Path, tag: str) -> Path:
    """A fresh temporary folder for ``tag``'s save, beside where it will live."""
    save_dir.mkdir(parents=True, exist_ok=True)
    cleanup_stale(save_dir)
    tmp = save_dir / f"{TMP_PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, save_dir: Path, record: CommitRecord) -> Path:
    """Steps 3 and 4 of [Note: checkpoint commit protocol]: the record, then the folder under its tag."""
    write_file(tmp / RECORD, record.to_bytes())
    fsync_dir(tmp)
    seams.reached("record")
    final = save_dir / record.tag
    old = None
    if final.exists():
        if exchange(tmp, final):  # final is the new one, tmp holds the old one
            old = tmp
        else:
            old = save_dir / f"{REPLACED_PREFIX}{record.tag}-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(tmp, final)
    else:
        os.rename(tmp, final)
    fsync_dir(save_dir)
    seams.reached("rename")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def set_latest(save_dir: Path, tag: str) -> None:
    """Step 5: ``latest`` names ``tag``, atomically."""
    replace_file(save_dir / LATEST, tag.encode(), before_rename=lambda: seams.reached("pointer"))


def read_latest(save_dir: Path) -> str | None:
    """The tag ``save_dir/latest`` names; None without the file; :class:`CheckpointCorruptError` naming the
    file when it holds anything but a tag name (bytes that are not UTF-8 text, a path, nothing)."""
    path = save_dir / LATEST
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointCorruptError(
            path,
            f"holds {len(raw)} bytes that are not UTF-8 text ({raw[:16]!r}), not a tag name: {_latest_fix(save_dir)}",
        ) from None
    try:
        return check_tag(tag)
    except ValueError:
        raise CheckpointCorruptError(path, f"holds {tag[:80]!r}, not a tag name: {_latest_fix(save_dir)}") from None


def _latest_fix(save_dir: Path) -> str:
    """What to do about a damaged ``latest``: the tags it could name."""
    tags = list_tags(save_dir)
    if not tags:
        return f"no complete checkpoint is in {save_dir} either; remove the file"
    return (
        f"write the tag of the checkpoint to load into it (complete-looking ones there: {', '.join(tags[-3:])}"
        f"{'' if len(tags) <= 3 else f' and {len(tags) - 3} older'}), or remove it"
    )


def list_tags(save_dir: Path) -> list[str]:
    """Tags of complete-looking checkpoints (a commit record present), oldest first: by the global step
    their records hold, then by commit time (see :func:`survey` for which are complete)."""
    if not save_dir.is_dir():
        return []
    found = [p for p in save_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / RECORD).is_file()]
    return [p.name for p in sorted(found, key=lambda p: (_recorded_step(p), (p / RECORD).stat().st_mtime))]


def _recorded_step(folder: Path) -> int:
    try:
        return int(json.loads((folder / RECORD).read_bytes())["state"]["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


@dataclass(frozen=True)
class Found:
    """A tag folder of a save folder, as :func:`survey` sees it."""

    tag: str
    step: int | None  # the global step its commit record holds; None when it is not complete
    problem: str | None = None  # why it is not complete, in words

    @property
    def complete(self) -> bool:
        return self.problem is None


def survey(save_dir: Path) -> list[Found]:
    """Every tag folder of ``save_dir``: the complete ones (a commit record that reads and matches its own
    CRC32, every file it lists present at its recorded size; the CRC32s of their bytes are checked by the
    load), oldest first by recorded global step (then commit time), then the others with what is wrong.
    Hidden folders (saves in progress or killed, ``.replaced-`` spares) are not tags."""
    if not save_dir.is_dir():
        return []
    done, broken = [], []
    for p in save_dir.iterdir():
        if not p.is_dir() or p.name.startswith("."):
            continue
        try:
            record = CommitRecord.read(p)
            for f in record.files:
                size = (p / f.name).stat().st_size if (p / f.name).is_file() else None
                if size != f.bytes:
                    raise CheckpointIncompleteError(
                        f"{f.name} is " + ("missing" if size is None else f"{size} bytes, {f.bytes} recorded")
                    )
            step = int(record.state.get("global_step", -1))
        except (CheckpointCorruptError, CheckpointIncompleteError, ValueError, TypeError) as e:
            why = "no commit record (a save that did not finish)" if not (p / RECORD).is_file() else str(e)
            broken.append(Found(p.name, None, why.replace(f"{p}: ", "").replace(f"{p / RECORD}: ", "")))
            continue
        done.append((step, (p / RECORD).stat().st_mtime, Found(p.name, step)))
    return [f for _, _, f in sorted(done, key=lambda x: x[:2])] + sorted(broken, key=lambda f: f.tag)


def resolve(load_dir: Path, tag: str | None) -> Path | None:
    """The folder to load: ``load_dir/tag``, or the one ``latest`` names; ``load_dir`` itself when it is a
    checkpoint folder and no tag is given; None when ``tag`` is None and there is no ``latest``."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointNotFoundError(f"{load_dir}: no such checkpoint folder")
    if tag is None:
        if (load_dir / RECORD).is_file():
            return load_dir
        tag = read_latest(load_dir)
        if tag is None:
            return None
    folder = load_dir / check_tag(tag)
    if not folder.is_dir():
        spare = sorted(p for p in load_dir.glob(f"{REPLACED_PREFIX}{tag}-*") if (p / RECORD).is_file())
        if spare:  # a replacement of the same tag killed between its two renames
            log.warning("%s: missing, recovering it from %s (a save was interrupted)", folder, spare[0].name)
            return spare[0]
        tags = list_tags(load_dir)
        raise CheckpointNotFoundError(
            f"{folder}: no checkpoint with tag {tag!r} in {load_dir} (tags there: {', '.join(tags) or 'none'})"
        )
    return folder


def verify(folder: Path, record: CommitRecord, names: list[str] | None = None, workers: int = 4) -> None:
    """Check that each recorded file (or those in ``names``) exists with its recorded size and CRC32.
    Sizes first (cheap, all files), then the CRCs read in parallel."""
    files = [f for f in record.files if names is None or f.name in names]
    for f in files:
        path = folder / f.name
        if not path.is_file():
            raise MissingFileError(path, f"missing; the commit record lists it ({f.bytes} bytes)")
        size = path.stat().st_size
        if size != f.bytes:
            raise TruncatedFileError(path, f"{size} bytes, {f.bytes} recorded: truncated or overwritten")

    local = threading.local()  # one read buffer per thread, no larger than the largest file

    def crc(f: FileEntry) -> tuple[FileEntry, int]:
        if getattr(local, "buf", None) is None:
            local.buf = bytearray(max(1, min(CHUNK_BYTES, max(x.bytes for x in files))))
        return f, crc_of_file(folder / f.name, local.buf)[1]

    with ThreadPoolExecutor(max(1, min(workers, len(files))), thread_name_prefix="zerofit-ckpt-verify") as ex:
        for f, got in ex.map(crc, files):
            if got != f.crc32:
                raise ChecksumMismatchError(
                    folder / f.name,
                    f"CRC32 {got:08x}, {f.crc32:08x} recorded: the file's bytes changed after it was saved",
                )


def prune(save_dir: Path | str, keep: int, protect: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Delete all but the ``keep`` newest complete checkpoints (newest: by the global step their commit records
    hold), never the one ``latest`` names nor any in ``protect`` (a trainer protects the checkpoint it resumed
    from and every one newer than it that was there before it started); for a trainer's ``--keep K``. Refused
    (:class:`~zerofit.checkpoint.lock.CheckpointFolderInUseError`) while another process holds the folder
    ([Note: one writer per folder]). Returns the removed tags."""
    from zerofit.checkpoint.lock import SAVE_LOCK, held_here, hold_save_dir

    if keep < 1:
        raise ValueError(f"keep must be >= 1, found {keep}")
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    own = None if held_here(save_dir, SAVE_LOCK) else hold_save_dir(save_dir, None)
    try:
        tags = [f.tag for f in survey(save_dir) if f.complete]
        latest = read_latest(save_dir)
        doomed = [t for t in tags[: max(0, len(tags) - keep)] if t != latest and t not in protect]
        for t in doomed:  # rename first: a kill mid-removal leaves a hidden folder, never a partial tag
            hidden = save_dir / f"{TMP_PREFIX}{t}-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(save_dir / t, hidden)
            shutil.rmtree(hidden, ignore_errors=True)
        if doomed:
            fsync_dir(save_dir)
    finally:
        if own is not None:
            own.release()
    return doomed
