"""Test seams of the checkpoint writer: pause at a named phase, fail a write, skip the space check.

Production code calls :func:`reached` at each phase of a save and :func:`before_write`
before each ``write(2)``; both do nothing unless a test armed them. The pause lets
a test SIGKILL the saving process at an exact point (``ZEROFIT_CHECKPOINT_PAUSE_AT=record``
stops the process with SIGSTOP right after the commit record is durable); the write
fault injects ENOSPC or EIO without a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Iterator

PAUSE_ENV = "ZEROFIT_CHECKPOINT_PAUSE_AT"
PHASES = ("shards", "record", "rename", "pointer")
"""shards: every data and side file written and fsynced, no commit record yet;
record: the commit record durable in the temporary folder, not yet renamed;
rename: the folder renamed to its tag and the parent fsynced, ``latest`` not yet touched;
pointer: the new ``latest`` written to its temporary name and fsynced, not yet renamed."""

_write_fault: dict | None = None
space_check = True
"""False skips the free-space check before writing (tests that need a real ENOSPC mid-write)."""


def reached(phase: str) -> None:
    """A save reached ``phase``: stop this process here if a test asked for it (SIGSTOP; the test kills it)."""
    if os.environ.get(PAUSE_ENV) == phase:
        os.kill(os.getpid(), signal.SIGSTOP)


def before_write(path: str, offset: int, nbytes: int) -> None:
    """Raise the armed fault when a write would cross its byte offset in a matching file."""
    f = _write_fault
    if f is None or (f["match"] and f["match"] not in os.path.basename(path)):
        return
    f["seen"] += nbytes
    if f["seen"] > f["after"]:
        raise OSError(f["errno"], os.strerror(f["errno"]), path)


@contextlib.contextmanager
def fail_writes(err: int = errno.ENOSPC, after_bytes: int = 0, match: str = "") -> Iterator[None]:
    """Within the block, the write that brings the bytes written (to files whose name contains ``match``)
    past ``after_bytes`` fails with ``err``."""
    global _write_fault
    _write_fault = {"errno": err, "after": after_bytes, "match": match, "seen": 0}
    try:
        yield
    finally:
        _write_fault = None
