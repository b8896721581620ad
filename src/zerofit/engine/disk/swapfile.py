"""The disk tier's swap file (a part of the disk tier, disk.py): one preallocated file under
``offload.nvme_path``, each swapped unit's fields in 4 KiB-aligned regions (:func:`layout`), read and written
in aligned pieces by a thread pool doing ``preadv``/``pwritev`` on an ``O_DIRECT`` descriptor (buffered where the
file system refuses it), and mapped whole; the folder's checks (free space, speed).

[Note: the swap file is also a mapping]
The whole file is also mapped (``torch.from_file(shared=True)``), and a swapped unit's ``exp_avg``,
``exp_avg_sq`` (and ``master``) *are* views of that mapping. So everything that reads or writes the state
between steps (checkpoint save and load, export, ``engine.module``) works unchanged, through the page
cache, with no copy of the state in anonymous memory; only the optimizer step takes the direct path. The
two stay coherent because they never overlap in time: the engine drains the tier (every write done)
before a reader touches the mapping, and a write through the mapping (a checkpoint load) is flushed
(``msync``) before the next direct read. Linux also writes back dirty pages before a direct read and drops
cached pages after a direct write of the same range.

[Note: swap files are reused, never leaked]
Files are named ``zerofit-swap-<n>.bin`` and held with an exclusive ``flock`` while a run uses them. A run
takes the first name it can lock, so the file a crashed run left behind is reused (truncated and reserved
again), and any other unlocked swap file in the folder is stale and removed. ``close`` removes the file.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from zerofit.errors import ZerofitError

ALIGN = 4096  # O_DIRECT: buffer address, file offset and length aligned to this
SWAP_GLOB = "zerofit-swap-*.bin"

# the I/O calls, module-level so that tests can inject ENOSPC / EIO
_pread = os.preadv
_pwrite = os.pwritev


class DiskTierError(ZerofitError, RuntimeError):
    """The disk tier could not read or write its file (or reserve it): the message names the path."""


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a


@dataclass(frozen=True)
class Region:
    """Where one unit's swapped fields are in the file: byte offsets of each field's region."""

    numel: int
    offsets: dict  # field name -> byte offset (4 KiB aligned)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.offsets)


def layout(units: list[tuple[int, int, tuple[str, ...]]]) -> tuple[dict[int, Region], int]:
    """``units``: (key, numel, fields) -> regions by key, and the file's size in bytes."""
    regions, pos = {}, 0
    for key, numel, fields in units:
        offs = {}
        for f in fields:
            offs[f] = pos
            pos += align_up(numel * 4)
        regions[key] = Region(numel, offs)
    return regions, pos


def aligned_empty(nbytes: int) -> torch.Tensor:
    """(nbytes,) uint8 host tensor whose address is ALIGN-aligned (what O_DIRECT needs)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = -raw.data_ptr() % ALIGN
    return raw[off : off + nbytes]


class SwapFile:
    """One preallocated file under ``folder`` (see [Note: swap files are reused, never leaked]): direct I/O
    by a thread pool, and a shared mapping of the whole file (see [Note: the swap file is also a mapping])."""

    def __init__(self, folder: str | os.PathLike, nbytes: int, *, threads: int = 8, block_bytes: int = 4 << 20):
        self.folder = Path(folder).expanduser().absolute()
        self.nbytes = align_up(max(nbytes, ALIGN))
        self.block_bytes = align_up(max(block_bytes, ALIGN))
        _preflight(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path, self._lock_fd, self.reused = self._claim()
        self._fd = -1
        self.map: torch.Tensor | None = None
        self._mm: mmap.mmap | None = None
        self._pool: ThreadPoolExecutor | None = None
        try:
            self._remove_stale()
            os.ftruncate(self._lock_fd, 0)  # a reused file: its old contents must not show through
            try:
                os.posix_fallocate(self._lock_fd, 0, self.nbytes)  # reserved now: no ENOSPC mid-run
            except OSError as e:
                raise DiskTierError(
                    f"{self.path}: cannot reserve {self.nbytes / 2**30:.2f} GiB for the NVMe tier "
                    f"({e.strerror}); {_free(self.folder) / 2**30:.2f} GiB are free there. Free space, choose "
                    "another offload.nvme_path, or raise max_host_memory so that less goes to the disk"
                ) from e
            self._fd, self.direct = self._open_direct()
            self._mm = mmap.mmap(self._lock_fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.map = torch.frombuffer(self._mm, dtype=torch.float32)  # keeps the mapping alive
            self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="zerofit-disk")
        except BaseException:
            self.close()
            raise

    def _claim(self) -> tuple[Path, int, bool]:
        for n in range(10_000):
            path = self.folder / f"zerofit-swap-{n}.bin"
            existed = path.exists()
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another live run's file
                os.close(fd)
                continue
            return path, fd, existed
        raise DiskTierError(f"{self.folder}: 10,000 swap files in use")

    def _remove_stale(self) -> None:
        """Unlocked swap files besides ours were left by runs that died: remove them."""
        for p, _ in _unlocked_swap_files(self.folder, exclude=self.path):
            p.unlink(missing_ok=True)

    def _open_direct(self) -> tuple[int, bool]:
        """An O_DIRECT descriptor if the file system accepts one (probed with an aligned write and read),
        else a buffered one."""
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            try:
                fd = os.open(self.path, os.O_RDWR | flag)
            except OSError:
                fd = -1
            if fd >= 0:
                probe = aligned_empty(ALIGN).zero_()
                try:
                    # (numpy's stubs give ndarray the buffer protocol for Python 3.12+ only)
                    os.pwritev(fd, [memoryview(probe.numpy())], 0)  # type: ignore[arg-type]
                    os.preadv(fd, [memoryview(probe.numpy())], 0)  # type: ignore[arg-type]
                    return fd, True
                except OSError:
                    os.close(fd)
        return os.open(self.path, os.O_RDWR), False

    def view(self, offset: int, numel: int) -> torch.Tensor:
        """(numel,) fp32 view of the mapping at byte ``offset``."""
        assert self.map is not None  # mapped at __init__ (a failed one closed the file and raised)
        return self.map[offset // 4 : offset // 4 + numel]

    def submit(self, op: str, offset: int, buf: torch.Tensor, what: str) -> list[Future]:
        """Read (``op`` 'read') or write ``buf`` (uint8, aligned, length a multiple of ALIGN) at ``offset``,
        as requests of ``block_bytes`` on the pool. Each future raises :class:`DiskTierError` on failure."""
        mv = memoryview(buf.numpy())  # type: ignore[arg-type]  # (as in _open_direct)
        futs = []
        assert self._pool is not None  # made at __init__
        for a in range(0, len(mv), self.block_bytes):
            part = mv[a : a + self.block_bytes]
            futs.append(self._pool.submit(self._io, op, part, offset + a, what))
        return futs

    def _io(self, op: str, part: memoryview, offset: int, what: str) -> int:
        done = 0
        while done < len(part):
            try:
                n = (_pread if op == "read" else _pwrite)(self._fd, [part[done:]], offset + done)
            except OSError as e:
                raise DiskTierError(
                    f"{self.path}: {'reading' if op == 'read' else 'writing'} {len(part)} bytes at "
                    f"offset {offset} ({what}) failed: [Errno {e.errno}] "
                    # (an OSError without an errno has None, which names nothing: "")
                    f"{e.strerror or errno.errorcode.get(e.errno, '')}"  # type: ignore[arg-type]
                ) from e
            if n <= 0:
                raise DiskTierError(
                    f"{self.path}: short {op} at offset {offset + done} ({what}): the file is "
                    f"shorter than the {self.nbytes} bytes reserved"
                )
            done += n
        return done

    def flush_mapping(self) -> None:
        """Write back pages dirtied through the mapping (materialization, a checkpoint load) and let go of
        them: they leave this process's resident memory and the page cache (the next direct read needs
        neither). Called between steps only."""
        if self._lock_fd < 0:
            return
        os.fsync(self._lock_fd)
        if self._mm is not None:
            self._mm.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._lock_fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def drop_pages(self, offset: int, nbytes: int) -> None:
        """Write back and let go of the mapping's pages in ``[offset, offset + nbytes)`` (a unit's master just
        written at materialization): host memory holds at most one unit's worth of them at a time."""
        if self._mm is None or nbytes <= 0:
            return
        a = offset - offset % mmap.PAGESIZE
        n = min(align_up(offset + nbytes - a, mmap.PAGESIZE), self.nbytes - a)
        self._mm.flush(a, n)
        self._mm.madvise(mmap.MADV_DONTNEED, a, n)

    def _write_through(self, buf: torch.Tensor) -> None:
        """Write ``buf`` at offset 0 and wait until it is on the disk; buffered I/O: synced, and out of the
        page cache (a speed test's read must come from the disk)."""
        for f in self.submit("write", 0, buf, "speed test"):
            f.result()
        if not self.direct:
            os.fsync(self._fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, 0, buf.numel(), os.POSIX_FADV_DONTNEED)

    def measure(self, nbytes: int = 256 << 20) -> tuple[float, float]:
        """(write, read) GB/s of this file's own path (direct I/O, the pool's parallel requests), over the
        first ``nbytes`` (at most the file): zeros written, so the reserved file stays zero."""
        n = min(align_up(nbytes), self.nbytes)
        buf = aligned_empty(n).zero_()
        t = time.perf_counter()
        self._write_through(buf)
        w = time.perf_counter() - t
        t = time.perf_counter()
        for f in self.submit("read", 0, buf, "speed test"):
            f.result()
        r = time.perf_counter() - t
        return n / max(w, 1e-9) / 1e9, n / max(r, 1e-9) / 1e9

    def measure_mixed(self, nbytes: int = 1 << 30) -> float:
        """GB/s of reads and writes at once, as a step streams them (chunks read ahead of their updates while
        earlier ones are written behind): the first half of ``nbytes`` (at most the file) is written (untimed),
        then read back while zeros go to the second half, the requests interleaved; (bytes read + written) / s."""
        half = min(nbytes, self.nbytes) // 2 // ALIGN * ALIGN
        wbuf = aligned_empty(half).zero_()
        rbuf = aligned_empty(half)
        self._write_through(wbuf)
        t = time.perf_counter()
        futs = []
        for a in range(0, half, self.block_bytes):
            b = min(a + self.block_bytes, half)
            futs += self.submit("read", a, rbuf[a:b], "speed test")
            futs += self.submit("write", half + a, wbuf[a:b], "speed test")
        for f in futs:
            f.result()
        if not self.direct:
            os.fsync(self._fd)
        return 2 * half / max(time.perf_counter() - t, 1e-9) / 1e9

    def close(self) -> None:
        """Stop the I/O threads, remove the file, release the lock. Idempotent. Views of the mapping
        that are still referenced stay valid memory (the kernel keeps the removed file until they go)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.map = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still exist (a closed engine's module): they keep it mapped
                pass
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            try:
                self.path.unlink(missing_ok=True)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = -1


def _preflight(folder: Path) -> None:
    """The folder can hold a swap file (it exists or can be made, on a writable disk), or DiskTierError saying
    why not: what the config's check says (zerofit.config.check_nvme_path; /proc is "not writable", not "0 bytes
    free"), for callers whose path no config checked (generation's --nvme, estimate's speed test)."""
    from zerofit.config.schema import ConfigError, check_nvme_path

    try:
        check_nvme_path(folder, field="nvme_path")
    except ConfigError as e:
        raise DiskTierError(str(e)) from None


def measure_folder(folder, nbytes: int = 1 << 30, **io) -> tuple[float, float]:
    """(write, read) GB/s of the disk tier's I/O path under ``folder``: a swap file of ``nbytes`` reserved,
    written and read back as :meth:`SwapFile.measure` does, then removed (``zerofit estimate``)."""
    path = Path(folder).expanduser().absolute()
    _preflight(path)
    path.mkdir(parents=True, exist_ok=True)
    f = SwapFile(path, min(nbytes, max(ALIGN, _free(path) // 2)), **io)
    try:
        return f.measure(f.nbytes)
    finally:
        f.close()


def _free(folder: Path) -> int:
    try:
        st = os.statvfs(folder)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


def _unlocked_swap_files(folder: Path, exclude: Path | None = None):
    """(path, bytes on disk) of the swap files under ``folder`` no live run holds, each yielded while this
    process holds its lock ([Note: swap files are reused, never leaked])."""
    for p in folder.glob(SWAP_GLOB):
        if p == exclude:
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield p, os.fstat(fd).st_blocks * 512
        finally:
            os.close(fd)


def free_bytes(folder: str | os.PathLike | None) -> int | None:
    """Bytes the disk tier may take under ``folder`` (or its nearest existing parent): the free space plus
    the swap files there that a run would reuse or remove ([Note: swap files are reused, never leaked])."""
    if folder is None:
        return None
    p = Path(folder).expanduser().absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    reusable = sum(size for _, size in _unlocked_swap_files(p)) if p.is_dir() else 0
    return _free(p) + reusable
