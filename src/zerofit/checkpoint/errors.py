"""The errors a checkpoint save, load or export raises: one type per thing that can go wrong.

Every message names the file (or tensor), says what was expected and what was
found, and what to do. Catch :class:`CheckpointError` for all of them.
"""

from __future__ import annotations

import errno
from pathlib import Path

from zerofit.errors import EXIT_FAILED, InputError


class CheckpointError(InputError, RuntimeError):
    """Base class of every checkpoint error."""


class CheckpointNotFoundError(CheckpointError):
    """The asked-for tag (or the folder) does not exist."""


class CheckpointIncompleteError(CheckpointError):
    """A tag folder without a valid commit record: a save that never finished, or not a zerofit checkpoint."""


class CheckpointCorruptError(CheckpointError):
    """A file of a committed checkpoint does not match its commit record. ``path`` names it."""

    def __init__(self, path: Path | str, message: str):
        self.path = Path(path)
        super().__init__(f"{self.path}: {message}")


class MissingFileError(CheckpointCorruptError):
    """A file the commit record lists is gone."""


class TruncatedFileError(CheckpointCorruptError):
    """A file is shorter (or longer) than the commit record says, or its header is cut."""


class ChecksumMismatchError(CheckpointCorruptError):
    """A file has its recorded size but not its recorded CRC32: some bytes changed."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit this model: a tensor missing, unexpected, or of another shape or dtype."""


class CheckpointStateError(CheckpointError):
    """The engine is in a state where saving or loading would lose information (mid-accumulation)."""


class EngineStateLostError(CheckpointError):
    """A load failed after tensors were already copied into the engine: the engine is unusable."""


class CheckpointDiskFullError(CheckpointError, OSError):
    """Not enough space for the checkpoint (found before writing, or ENOSPC while writing)."""

    exit_code = EXIT_FAILED  # the run failed while it ran: free space and resume

    def __init__(self, path: Path | str, needed: int, free: int, during: str):
        self.path = Path(path)
        self.needed = int(needed)
        self.free = int(free)
        msg = (
            f"{self.path}: not enough disk space {during}: the checkpoint needs {_size(needed)} "
            f"({needed} bytes), {_size(free)} ({free} bytes) are free. Free space on that disk, save "
            "elsewhere, or keep fewer checkpoints; the partial save was removed and the previous "
            "checkpoint is untouched."
        )
        OSError.__init__(self, errno.ENOSPC, msg)
        self.args = (msg,)

    def __str__(self) -> str:
        return self.args[0]


def _size(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"
