"""safetensors shards with an index, written tensor by tensor and read straight into their destination.

A shard is a plain safetensors file (8-byte little-endian header length, JSON
header, tensor bytes back to back), so ``safetensors.safe_open`` and Hugging Face
read it; the index is Hugging Face's ``{"metadata": {"total_size"}, "weight_map"}``.
The writer never gathers a state dict: each :class:`Entry` points into a buffer
the caller owns (a unit's flat fp32 master, a moment) or fetches one tensor; the
header is computed up front from names, shapes and dtypes, so a shard's size is
known before a byte is written (the free-space check uses that). Entries adjacent
in one host buffer go out as one large write; device tensors and dtype casts go
through a bounce buffer of at most ``CHUNK_BYTES``.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from zerofit.checkpoint.durable import CHUNK_BYTES, DurableWriter
from zerofit.checkpoint.errors import CheckpointCorruptError, ChecksumMismatchError, TruncatedFileError
from zerofit.models.safetensors import DTYPE_NAMES as DTYPE_CODES
from zerofit.models.safetensors import SafetensorsFormatError, TensorInfo
from zerofit.models.safetensors import read_header as safetensors_header


@dataclass(frozen=True, eq=False)
class Entry:
    """One tensor to write: ``base[offset: offset + numel]`` viewed as ``shape``, or ``fetch()``'s result,
    written as ``dtype`` (cast on the host when the source differs)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    base: torch.Tensor | None = None  # (N,) flat buffer, any device and dtype
    offset: int = 0
    fetch: Callable[[], torch.Tensor] | None = None  # alternative source, called once when written

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class Shard:
    """A planned shard: its file name, entries in file order, and its header bytes (length prefix included)."""

    file: str
    entries: tuple[Entry, ...]
    header: bytes

    @property
    def size(self) -> int:
        return len(self.header) + sum(e.nbytes for e in self.entries)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def header_bytes(entries: tuple[Entry, ...], metadata: dict[str, str] | None = None) -> bytes:
    head: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    pos = 0
    for e in entries:
        head[e.name] = {"dtype": DTYPE_CODES[e.dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors pads it
    return struct.pack("<Q", len(raw)) + raw


def plan_shards(entries: list[Entry], prefix: str, max_shard_bytes: int, single: str | None = None) -> list[Shard]:
    """Split ``entries`` (in order, never a tensor across two files) into shards of at most
    ``max_shard_bytes`` of data each (a larger tensor gets a shard of its own). Files are named
    ``{prefix}-0000k-of-0000N.safetensors``, or ``single`` when there is one shard and it is given."""
    groups: list[list[Entry]] = []
    size = 0
    for e in entries:
        if not groups or (size + e.nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    if not groups:
        groups = [[]]
    n = len(groups)
    names = [single] if (single and n == 1) else [f"{prefix}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    return [Shard(name, tuple(g), header_bytes(tuple(g))) for name, g in zip(names, groups)]


def index_bytes(shards: list[Shard]) -> bytes:
    """Hugging Face's shard index: total tensor bytes and name -> file."""
    weight_map = {e.name: s.file for s in shards for e in s.entries}
    total = sum(e.nbytes for s in shards for e in s.entries)
    return (
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
        ).encode()
        + b"\n"
    )


class _Aborted(Exception):
    """Another shard's writer failed: stop this one (the caller reports the first error)."""


class _Bounce:
    """A reusable host buffer for device tensors and dtype casts (pinned when the source is on a GPU)."""

    def __init__(self):
        self.t: torch.Tensor | None = None

    def get(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        need = numel * _itemsize(dtype)
        if self.t is None or self.t.numel() < need or (pinned and not self.t.is_pinned()):
            self.t = torch.empty(need, dtype=torch.uint8, pin_memory=pinned)
        return self.t[:need].view(dtype)


def _runs(entries: tuple[Entry, ...]):
    """Maximal runs of entries that are adjacent in one buffer: (flat source tensor, dtype to write)."""
    i = 0
    while i < len(entries):
        e = entries[i]
        if e.fetch is not None:
            yield e.fetch().detach().reshape(-1), e.dtype
            i += 1
            continue
        j, end = i + 1, e.offset + e.numel
        while (
            j < len(entries)
            and entries[j].fetch is None
            and entries[j].base is e.base
            and entries[j].offset == end
            and entries[j].dtype == e.dtype
        ):
            end += entries[j].numel
            j += 1
        yield e.base.detach()[e.offset : end], e.dtype
        i = j


def _host_bytes(src: torch.Tensor):
    return src.contiguous().view(torch.uint8).numpy()


def write_shard(folder: Path, shard: Shard, abort: threading.Event | None = None) -> tuple[str, int, int]:
    """Write one shard, fsynced: returns (file name, bytes, crc32). Sources are read as they are written."""
    bounce = _Bounce()
    with DurableWriter(folder / shard.file) as w:
        w.write(shard.header)
        for src, dtype in _runs(shard.entries):
            if src.device.type == "cpu" and src.dtype == dtype and src.is_contiguous():
                step = max(1, CHUNK_BYTES // _itemsize(dtype))
                for s in range(0, src.numel(), step):
                    if abort is not None and abort.is_set():
                        raise _Aborted()
                    w.write(_host_bytes(src[s : s + step]))
                continue
            step = max(1, CHUNK_BYTES // max(_itemsize(dtype), src.element_size()))
            for s in range(0, src.numel(), step):
                if abort is not None and abort.is_set():
                    raise _Aborted()
                part = src[s : s + step]
                buf = bounce.get(part.numel(), dtype, pinned=part.device.type == "cuda")
                buf.copy_(part)  # device -> host and/or cast; synchronous
                w.write(_host_bytes(buf))
        size, crc = w.finish()
    if size != shard.size:
        raise RuntimeError(f"{folder / shard.file}: wrote {size} bytes, planned {shard.size}")
    return shard.file, size, crc


def write_shards(folder: Path, shards: list[Shard], workers: int = 4) -> list[tuple[str, int, int]]:
    """Write ``shards`` with up to ``workers`` files in flight; the first error stops the others and is raised."""
    if workers <= 1 or len(shards) <= 1:
        return [write_shard(folder, s) for s in shards]
    abort = threading.Event()

    def one(shard: Shard):
        try:
            return write_shard(folder, shard, abort)
        except BaseException:
            abort.set()
            raise

    with ThreadPoolExecutor(min(workers, len(shards)), thread_name_prefix="zerofit-ckpt-write") as ex:
        futures = [ex.submit(one, s) for s in shards]
    errors = [f.exception() for f in futures if f.exception() is not None]
    real = [e for e in errors if not isinstance(e, _Aborted)]
    if errors:
        raise (real or errors)[0]
    return [f.result() for f in futures]


# ---------------------------------------------------------------------------------------------- reading


def read_header(path: Path) -> tuple[list[TensorInfo], dict]:
    """The tensors of a shard (in file order) and its ``__metadata__``; refuses a cut or malformed file.
    The one safetensors header reader (zerofit.models.safetensors), its errors as checkpoint errors."""
    try:
        infos, meta = safetensors_header(path)
    except SafetensorsFormatError as e:
        raise (TruncatedFileError if e.truncated else CheckpointCorruptError)(path, e.reason) from None
    return list(infos.values()), meta


def read_tensor(path: Path, info: TensorInfo) -> torch.Tensor:
    """One tensor from a shard into fresh host memory (shape and dtype from the header)."""
    out = torch.empty(info.numel, dtype=info.dtype)
    mv = memoryview(_host_bytes(out)).cast("B") if info.numel else memoryview(b"")
    with open(path, "rb", buffering=0) as f:
        f.seek(info.begin)
        got = 0
        while got < len(mv):
            k = f.readinto(mv[got:])
            if not k:
                raise TruncatedFileError(path, f"tensor {info.name}: file ends at {info.begin + got}")
            got += k
    return out.view(info.shape)


def read_into(
    path: Path,
    header_end: int,
    plan: list[tuple[TensorInfo, torch.Tensor | None]],
    crc_expected: int,
    size_expected: int,
) -> None:
    """Read a whole shard sequentially, copying each tensor into its destination (a flat tensor of the
    same numel, any device; None: read and checksummed only), and check the file's CRC32 at the end.

    The CRC covers every byte read, so a file that changed since it was verified is caught here too."""
    bounce = _Bounce()
    crc = 0
    with open(path, "rb", buffering=0) as f:

        def take(mv: memoryview) -> None:
            nonlocal crc
            got = 0
            while got < len(mv):
                k = f.readinto(mv[got:])
                if not k:
                    raise TruncatedFileError(path, f"file ends at byte {f.tell()}, {size_expected} recorded")
                got += k
            crc = zlib.crc32(mv, crc)

        take(memoryview(bytearray(header_end)))
        pos = header_end
        for info, dst in sorted(plan, key=lambda p: p[0].begin):
            if info.begin != pos:  # the plan must cover every tensor of the file, in order
                raise ValueError(f"{path}: read plan skips bytes [{pos}, {info.begin})")
            pos = info.end
            step = max(1, CHUNK_BYTES // _itemsize(info.dtype))
            for s in range(0, info.numel, step):
                k = min(step, info.numel - s)
                direct = (
                    dst is not None and dst.device.type == "cpu" and dst.dtype == info.dtype and dst.is_contiguous()
                )
                buf = dst[s : s + k] if direct else bounce.get(k, info.dtype, pinned=dst is not None and dst.is_cuda)
                take(memoryview(_host_bytes(buf)).cast("B"))
                if dst is not None and not direct:
                    dst[s : s + k].copy_(buf)
        if f.read(1):
            raise TruncatedFileError(path, f"longer than the {size_expected} bytes recorded")
    if crc != crc_expected:
        raise ChecksumMismatchError(
            path, f"CRC32 {crc:08x} while reading, {crc_expected:08x} recorded: the file changed after it was verified"
        )
