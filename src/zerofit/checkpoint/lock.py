"""One holder per folder: an exclusive lock on a run folder or a checkpoint folder that a crash releases.

[Note: one writer per folder]
Two processes (or two engines of one process) that write into one folder corrupt each other's work: their
``metrics.jsonl`` lines interleave, their saves of the same tag swap each other's folders in and out, and a
save's rename finds the folder the other just moved away (``FileNotFoundError .../zerofit_checkpoint.json``).
The commit protocol ([Note: checkpoint commit protocol], commit.py) makes each save atomic, not two writers
safe. So a folder that is written over a run is *held*:

* ``zerofit train`` holds its run folder (``OUTPUT/.zerofit-run.lock``) from before it reads or writes
  anything until it exits;
* an engine holds a checkpoint folder (``save_dir/.zerofit-save.lock``) from its first
  ``save_checkpoint`` into it until it closes (``engine.close()``, garbage collection, exit); a save with no
  holder (``write_checkpoint`` on its own, ``prune``) holds it for its own duration.

Holding is an exclusive ``flock`` on the lock file. The kernel drops it when the process ends, however it
ends (``kill -9`` included), so a crash never leaves a folder blocked: a later holder takes the lock and
overwrites what the dead one wrote. ``flock`` locks belong to an open file description, so a second ``open``
and lock of the same file in the same process is refused as well: two engines of one process cannot hold one
folder (holders of one process are also registered here, so the message can say so). After locking, the
holder writes who it is (pid, host, start time, command) into the file; a refused caller reads that for its
message. On release the holder removes the file, then unlocks; so an acquirer that opened the file just
before it was removed checks, once it holds the lock, that the path still names the file it locked, and
otherwise tries again (else two could hold "the" lock on two different files). The process ids in the
temporary names of a save (``cleanup_stale``) remain a second line of defence for writers that do not lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from zerofit.checkpoint.errors import CheckpointError
from zerofit.errors import EXIT_FAILED, ZerofitError

RUN_LOCK = ".zerofit-run.lock"  # OUTPUT/ of zerofit train
SAVE_LOCK = ".zerofit-save.lock"  # a save_checkpoint folder
_COMMAND_CHARS = 300  # a holder's command, as recorded (argv can be very long)

_registry_lock = threading.Lock()
_held: dict[str, FolderLock] = {}  # lock file (real path) -> this process's holder of it


class FolderInUseError(ZerofitError, RuntimeError):
    """Another process, or another holder in this process, holds the folder. ``holder``: what it recorded
    (pid, host, started, command), or None when it had not written it yet."""

    def __init__(self, folder: Path, holder: dict | None, advice: str, same_process: bool = False):
        self.folder, self.holder = Path(folder), holder
        super().__init__(f"{folder} is in use by {describe(holder, same_process)}; {advice}")


class CheckpointFolderInUseError(FolderInUseError, CheckpointError):
    """``save_checkpoint`` into a folder that another engine (of this process or another) holds."""

    exit_code = EXIT_FAILED  # a run that cannot go on while the other holds it


def describe(holder: dict | None, same_process: bool = False) -> str:
    """``pid 1234 on host h, started 12:03: `zerofit train ...```, from what a holder recorded."""
    if not holder:
        return "another process (it has not recorded who it is yet)"
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    if same_process:
        who = f"another {holder.get('what', 'holder')} of this process ({who})"
    started = holder.get("started")
    if isinstance(started, (int, float)):
        today = time.strftime("%Y-%m-%d") == time.strftime("%Y-%m-%d", time.localtime(started))
        who += ", started " + time.strftime("%H:%M" if today else "%Y-%m-%d %H:%M", time.localtime(started))
    if holder.get("command"):
        who += f": `{holder['command']}`"
    return who


def this_command() -> str:
    """This process's command line, as a user would type it (``zerofit train ...`` under the CLI)."""
    argv = list(sys.argv) or ["python"]
    if Path(argv[0]).name in ("zerofit", "commands.py", "__main__.py"):
        argv = ["zerofit", *argv[1:]]
    elif argv[0] == "-c":
        argv = ["python", "-c", "...", *argv[1:]]
    text = shlex.join(argv)
    if len(text) <= _COMMAND_CHARS:
        return text
    tail = _COMMAND_CHARS // 3  # the options at the end (--resume, --steps) say as much as the start
    return f"{text[: _COMMAND_CHARS - tail - 5]} ... {text[-tail:]}"


@dataclass
class FolderLock:
    """A held folder: an open, ``flock``-ed lock file that names its holder. Release with :meth:`release`
    (or as a context manager); the kernel releases it when the process ends."""

    folder: Path
    path: Path
    what: str  # who holds it, in words: "zerofit train", "engine"
    fd: int = -1
    info: dict = field(default_factory=dict)

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        """Remove the lock file (if it is still ours), then unlock. Idempotent; never raises."""
        if self.fd < 0:
            return
        with _registry_lock:
            if _held.get(str(self.path)) is self:
                del _held[str(self.path)]
        try:
            if _same_file(self.fd, self.path):
                self.path.unlink()
        except OSError:
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.fd = -1

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def read_holder(path: Path, tries: int = 20) -> dict | None:
    """What the holder of lock file ``path`` recorded; None if nothing readable (it may be writing it)."""
    for _ in range(tries):
        try:
            data = path.read_bytes()
            if data:
                return json.loads(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            pass
        time.sleep(0.01)  # a holder between its truncate and its write: a moment later it is there
    return None


def hold(
    folder: Path | str,
    name: str,
    *,
    what: str,
    advice: str,
    command: str | None = None,
    error: type[FolderInUseError] = FolderInUseError,
) -> FolderLock:
    """Hold ``folder`` (created if missing) through the lock file ``folder/name``, or raise ``error`` naming
    its holder. See [Note: one writer per folder]."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = (folder / name).resolve()
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            with _registry_lock:
                mine = _held.get(str(path))
            if mine is not None and mine.info.get("pid") == os.getpid():
                raise error(folder, mine.info, advice, same_process=True) from None
            raise error(folder, read_holder(path), advice) from None
        if not _same_file(fd, path):  # its holder removed it as we opened it: lock the new one
            os.close(fd)
            continue
        info = {
            "pid": os.getpid(),
            "host": _host(),
            "started": time.time(),
            "what": what,
            "command": command if command is not None else this_command(),
        }
        try:  # who holds it, for a refused caller's message; a full disk only makes that message vaguer
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError:
            pass
        lock = FolderLock(folder, path, what, fd, info)
        with _registry_lock:
            _held[str(path)] = lock
        return lock
    raise OSError(errno.EBUSY, f"{path}: the lock file keeps being replaced; is another program removing it?")


def held_here(folder: Path | str, name: str) -> FolderLock | None:
    """This process's holder of ``folder`` (through ``name``), if any."""
    with _registry_lock:
        return _held.get(str((Path(folder) / name).resolve()))


def _host() -> str:
    return socket.gethostname()


# ---------------------------------------------------------------------------------------------- checkpoint folders

SAVE_ADVICE = (
    "checkpoints of two writers in one folder would replace each other's tags. Save into another "
    "folder, or close the engine that holds it first (engine.close())"
)


def hold_save_dir(save_dir: Path | str, holder) -> FolderLock | None:
    """Make sure ``save_dir`` is held for a save. ``holder``: an object with a ``locks`` dict whose life the
    hold lasts (the engine's resources, released at close), or None to hold it for this save only: then the
    returned lock is to be released by the caller (None when ``holder`` already held it)."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    mine = holder.locks.get(str((save_dir / SAVE_LOCK).resolve())) if holder is not None else None
    if mine is not None and mine.held:
        return None
    lock = hold(save_dir, SAVE_LOCK, what="engine", advice=SAVE_ADVICE, error=CheckpointFolderInUseError)
    if holder is None:
        return lock
    holder.locks[str(lock.path)] = lock
    return None
