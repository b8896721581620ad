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
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TensorInfo", "WeightFileError", "read_header", "read_into", "DTYPES"]

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_CHUNK = 256 << 20   # bytes per preadv call (Linux caps one read near 2 GiB)


class WeightFileError(ValueError):
    """A weight file is missing, truncated, malformed or does not match the model. The message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: file, dtype, shape and absolute byte range."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int   # absolute offset of the first byte in the file
    end: int     # absolute offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Every tensor of the file by name, and the file's string metadata. Checks the file is complete."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightFileError(f"{path}: truncated: {size} bytes, not even a safetensors header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise WeightFileError(f"{path}: truncated or not a safetensors file: header length {n} "
                                      f"> file size {size} - 8")
            raw = f.read(n)
    except FileNotFoundError:
        raise WeightFileError(f"{path}: no such file") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightFileError(f"{path}: malformed safetensors header ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, h in header.items():
        try:
            dtype = DTYPES[h["dtype"]]
            shape = tuple(int(s) for s in h["shape"])
            b, e = (int(x) for x in h["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WeightFileError(f"{path}: tensor {name!r}: malformed header entry {h!r}") from None
        want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if e - b != want:
            raise WeightFileError(f"{path}: tensor {name!r}: {e - b} bytes for shape {list(shape)} "
                                  f"{h['dtype']} (expected {want})")
        if data_start + e > size:
            raise WeightFileError(f"{path}: truncated: tensor {name!r} ends at byte {data_start + e}, "
                                  f"the file has {size}")
        out[name] = TensorInfo(path, name, dtype, shape, data_start + b, data_start + e)
    return out, meta


def _pread_exact(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + _CHUNK]], offset + done)
        if n <= 0:
            raise WeightFileError(f"{path}: truncated while reading tensor {name!r} "
                                  f"(byte {offset + done} of the file)")
        done += n


def read_into(info: TensorInfo, dst: torch.Tensor, fd: int | None = None) -> None:
    """Copy the tensor ``info`` into ``dst`` (same number of elements; any dtype and device). See
    [Note: one tensor's worth]. ``fd``: an open descriptor of ``info.file`` to reuse."""
    if dst.numel() != info.numel:
        raise WeightFileError(f"{info.file}: tensor {info.name!r} has shape {list(info.shape)} "
                              f"({info.numel} elements), the model expects {dst.numel()} elements")
    own = fd is None
    if own:
        fd = os.open(info.file, os.O_RDONLY)
    try:
        direct = dst.device.type == "cpu" and dst.dtype == info.dtype and dst.is_contiguous()
        buf = dst if direct else torch.empty(info.numel, dtype=info.dtype)   # (numel,) file dtype, host
        if info.numel:
            _pread_exact(fd, memoryview(buf.view(-1).view(torch.uint8).numpy()), info.begin, info.file, info.name)
        if not direct:
            dst.copy_(buf.view(dst.shape))
    finally:
        if own:
            os.close(fd)
