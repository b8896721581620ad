"""Durable file primitives: write with a running CRC32, fsync files and folders, replace atomically.

[Note: what durable means here]
A file is durable once its data and its size are fsynced; a name is durable once
the folder holding it is fsynced (POSIX does not order a rename before an earlier
write unless both are synced). The checkpoint protocol (commit.py) relies on exactly
these three calls: :meth:`DurableWriter.finish`, :func:`fsync_dir`, and
:func:`replace_file` for the ``latest`` pointer.

CRC32 (``zlib.crc32``, which releases the GIL on large buffers) runs over the very
buffers handed to ``write(2)``, so a file is never read back to checksum it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import zlib
from pathlib import Path

import zerofit.checkpoint.seams as seams

CHUNK_BYTES = 64 << 20
"""largest single write (and read) of the checkpoint IO: big enough for full disk speed"""


class DurableWriter:
    """A new file written sequentially; ``finish()`` fsyncs it and returns (bytes, crc32)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.bytes = 0
        self.crc = 0

    def write(self, data) -> None:
        """Write all of ``data`` (a bytes-like object), updating the size and the CRC."""
        mv = memoryview(data).cast("B")
        for start in range(0, len(mv), CHUNK_BYTES):
            part = mv[start : start + CHUNK_BYTES]
            seams.before_write(str(self.path), self.bytes, len(part))
            done = 0
            try:
                while done < len(part):
                    done += os.write(self.fd, part[done:])
            except OSError as e:
                if e.filename is None:  # name the file in the error (ENOSPC, EIO)
                    raise OSError(e.errno, e.strerror, str(self.path)) from e
                raise
            self.crc = zlib.crc32(part, self.crc)
            self.bytes += len(part)

    def finish(self) -> tuple[int, int]:
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        self.close()
        return self.bytes, self.crc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DurableWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_file(path: Path, data: bytes) -> tuple[int, int]:
    """A small file, durable: (bytes, crc32)."""
    with DurableWriter(path) as w:
        w.write(data)
        return w.finish()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, before_rename=None) -> None:
    """Replace ``path`` with ``data`` atomically: temp file beside it, fsync, rename, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        write_file(tmp, data)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def crc_of_file(path: Path, buf: bytearray | None = None) -> tuple[int, int]:
    """(bytes, crc32) of a whole file, read sequentially in large chunks."""
    if buf is None:
        buf = bytearray(max(1, min(CHUNK_BYTES, os.path.getsize(path))))
    mv = memoryview(buf)
    crc = n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(mv)
            if not k:
                return n, crc
            crc = zlib.crc32(mv[:k], crc)
            n += k


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def disk_bytes(sizes: list[int], path: Path) -> int:
    """Bytes ``sizes`` files take on the disk of ``path``: each rounded up to the block size, plus one
    block per file and folder for metadata (an estimate that errs high)."""
    bs = os.statvfs(path).f_frsize or 4096
    return sum(-(-s // bs) * bs + bs for s in sizes) + 4 * bs
