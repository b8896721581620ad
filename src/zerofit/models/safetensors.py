"""Reading safetensors files one tensor at a time, straight into a destination buffer.

A safetensors file is ``u64 header length | JSON header | raw tensor bytes``;
the header maps each name to its dtype, shape and ``[begin, end)`` byte range
in the data section. :func:`read_header` parses and checks it (a truncated
file is caught here, before any tensor is read), and :func:`read_into` reads
one tensor with ``os.preadv`` into the caller's memory.

[Note: one tensor's worth]
Loading a model must not hold it twice on the host. :func:`read_into` reads
the bytes of a tensor whose dtype matches the destination (a CPU tensor)
directly into the destination's memory: no copy at all. Otherwise (another
dtype, or a destination on the GPU) it reads into one temporary tensor of that
tensor's size and converts from there, so the extra host memory of a load is at
most the largest tensor. Reads go through the page cache (which is not the
process's resident memory), not ``mmap``: mapped pages that were touched count
towards the process's RSS until they are unmapped.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from zerofit.errors import InputError

__all__ = ["TensorInfo", "WeightFileError", "SafetensorsFormatError", "read_header", "read_into", "DTYPES"]

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_CHUNK = 256 << 20  # bytes per preadv call (Linux caps one read near 2 GiB)
_MAX_HEADER = 100 << 20  # safetensors' own limit


class WeightFileError(InputError, ValueError):
    """A weight file is missing, truncated, malformed or does not match the model. The message names the file."""


class SafetensorsFormatError(WeightFileError):
    """A safetensors file's header or size is wrong: ``path``, ``reason`` and whether it is ``truncated`` (shorter
    than its header says) let a caller raise its own error type (the checkpoint loader does)."""

    def __init__(self, path: Path, reason: str, truncated: bool):
        self.path, self.reason, self.truncated = Path(path), reason, truncated
        super().__init__(f"{path}: {'truncated: ' if truncated else ''}{reason}")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: file, name, dtype, shape and absolute byte range ``[begin, end)``."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset of the first byte in the file
    end: int  # absolute offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Every tensor of the file by name (in file order), and the file's string metadata.

    Checks what the format promises (the safetensors spec: the data section is the tensors back to back, no
    gap, no overlap, nothing after): a cut or padded file is refused before any tensor is read.
    Raises :class:`SafetensorsFormatError` (a missing file: :class:`WeightFileError`)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsFormatError(path, f"{size} bytes: too short for a safetensors header", True)
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsFormatError(
                    path,
                    f"the header says {n} bytes but the file has {size}: truncated or not a safetensors file",
                    True,
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise WeightFileError(f"{path}: no such file") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsFormatError(path, f"unreadable safetensors header ({e})", False) from None
    meta = header.pop("__metadata__", None) or {}
    start = 8 + n
    infos = []
    for name, h in header.items():
        try:
            dtype = DTYPES[h["dtype"]]
            shape = tuple(int(s) for s in h["shape"])
            b, e = (int(x) for x in h["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError(path, f"tensor {name!r}: malformed header entry {h!r}", False) from None
        infos.append(TensorInfo(path, name, dtype, shape, start + b, start + e))
    infos.sort(key=lambda t: t.begin)
    pos = start
    for t in infos:
        want = t.numel * torch.empty((), dtype=t.dtype).element_size()
        if t.begin != pos or t.nbytes != want:
            raise SafetensorsFormatError(
                path,
                f"tensor {t.name!r}: byte range [{t.begin}, {t.end}) does not follow "
                f"at {pos} with {t.numel} x {t.dtype}",
                False,
            )
        if t.end > size:
            raise SafetensorsFormatError(path, f"tensor {t.name!r} ends at byte {t.end}, the file has {size}", True)
        pos = t.end
    if pos != size:
        raise SafetensorsFormatError(path, f"the header describes {pos} bytes, the file has {size}", False)
    return {t.name: t for t in infos}, meta


def _pread_exact(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + _CHUNK]], offset + done)
        if n <= 0:
            raise WeightFileError(f"{path}: truncated while reading tensor {name!r} (byte {offset + done} of the file)")
        done += n


# [Note: reads over every core]
# One thread reading a tensor at a time holds a fast NVMe (or the page cache) to what one core copies: a 70B
# QLoRA model's start-up read at ~65 MB/s on one core of sixteen. A tensor above PARALLEL_MIN bytes is read in
# PIECE-sized pieces by a pool of threads (os.preadv releases the GIL), each into its own slice of the one destination:
# the memory of a read stays one tensor's worth ([Note: one tensor's worth]).
PIECE = 32 << 20
PARALLEL_MIN = 2 * PIECE
_POOL = None
_POOL_LOCK = threading.Lock()


def _pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            _POOL = ThreadPoolExecutor(max_workers=max(1, min(16, cores)), thread_name_prefix="zerofit-read")
        return _POOL


def _pread_parallel(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    if len(view) < PARALLEL_MIN:
        _pread_exact(fd, view, offset, path, name)
        return
    pieces = [
        _pool().submit(_pread_exact, fd, view[at : at + PIECE], offset + at, path, name)
        for at in range(0, len(view), PIECE)
    ]
    for f in pieces:
        f.result()


def descriptor(fds: dict | None, path: Path) -> int | None:
    """An open read-only descriptor of ``path`` kept in ``fds`` (by path) for the reads after it; None without
    ``fds`` (the read opens and closes its own). The caller closes the descriptors of ``fds``."""
    if fds is None:
        return None
    fd = fds.get(path)
    if fd is None:
        fd = fds[path] = os.open(path, os.O_RDONLY)
    return fd


def read_into(info: TensorInfo, dst: torch.Tensor, fd: int | None = None) -> None:
    """Copy the tensor ``info`` into ``dst`` (same number of elements; any dtype and device). See
    [Note: one tensor's worth]. ``fd``: an open descriptor of ``info.file`` to reuse."""
    if dst.numel() != info.numel:
        raise WeightFileError(
            f"{info.file}: tensor {info.name!r} has shape {list(info.shape)} "
            f"({info.numel} elements), the model expects {dst.numel()} elements"
        )
    own = fd is None
    if own:
        fd = os.open(info.file, os.O_RDONLY)
    try:
        direct = dst.device.type == "cpu" and dst.dtype == info.dtype and dst.is_contiguous()
        buf = dst if direct else torch.empty(info.numel, dtype=info.dtype)  # (numel,) file dtype, host
        if info.numel:
            _pread_parallel(fd, memoryview(buf.view(-1).view(torch.uint8).numpy()), info.begin, info.file, info.name)
        if not direct:
            dst.copy_(buf.view(dst.shape))
    finally:
        if own:
            os.close(fd)
