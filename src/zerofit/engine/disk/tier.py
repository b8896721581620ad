"""The disk (NVMe) tier: optimizer state that host memory cannot hold, in one preallocated file.

The planner (plan/search.py) puts the fp32 Adam moments of some streamed blocks, and if host memory is still
short their fp32 master weights too, on the disk: a *swapped* unit. Its state lives in one file under
``offload.nvme_path`` (a :class:`SwapFile`), each field of each unit in its own 4 KiB-aligned region, and
is streamed through a small pool of aligned host buffers around each update (:class:`DiskTier`): read ahead
of the update, written behind it, in chunks, by a thread pool doing ``preadv``/``pwritev`` on an
``O_DIRECT`` descriptor (buffered where the file system refuses it). Pure Python and PyTorch: no compiled
op, no libaio.

[Note: chunked updates]
A unit's update runs chunk by chunk: read master/moments of elements ``[a, a+k)``, AdamW on that range
(``unit_adamw(..., start=a)`` with a copy of the step count the chunk started from), write the range back.
AdamW is elementwise, so the chunks give the whole-buffer result bitwise; chunk sizes are multiples of
1024 elements (4 KiB), so every chunk starts aligned. The unit's step count advances once, at the end.

[Note: a frozen base on the disk]
A LoRA model's frozen base may not fit host memory (a 70B bf16 base is 137 GB; the benchmark machine has 125
GiB). The planner then puts the 16-bit frozen weights of the last streamed blocks on the disk, each block's in
a region of its own (key ``frozen_key(i)``, one field ``w16``: the compute-dtype bytes, counted in 4-byte
elements), written once at materialization through the mapping and never again. Its upload reads them
(read ahead: the streamer announces the blocks it will upload next, in the order of the step, forward then
backward) chunk by chunk into the tier's buffers and copies each chunk into the block's weight slot; a chunk's
buffer is free again as soon as its copy is done (``release(..., write=False)``: nothing to write back).
``frozen_host`` of such a unit is a view of the mapping, so checkpoints, the base's fingerprint and
``master_state_dict`` read it as before. Read twice per optimizer step (forward and backward), never written.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from zerofit.engine.disk.swapfile import (
    ALIGN,
    SWAP_GLOB,  # noqa: F401 (re-exported)
    DiskTierError,
    Region,
    SwapFile,  # noqa: F401 (re-exported)
    align_up,
    aligned_empty,
    free_bytes,  # noqa: F401 (re-exported)
    layout,  # noqa: F401 (re-exported)
    measure_folder,  # noqa: F401 (re-exported)
)

CHUNK_ALIGN = ALIGN // 4  # elements: chunk starts stay 4 KiB aligned


def tier_chunk(max_block: int, limit: int = 4 << 20) -> int:
    """Elements per chunk of a swapped unit's update: a quarter of the largest block (so that even small
    models stream in several chunks), at most ``limit``, a multiple of 1024 (see [Note: chunked updates])."""
    return max(CHUNK_ALIGN, min(limit, align_up(-(-max(max_block, 1) // 4), CHUNK_ALIGN)))


def frozen_key(i: int) -> int:
    """The tier's key of block ``i``'s frozen weights ([Note: a frozen base on the disk]); ``i`` is its state's."""
    return -1 - i


def tier_buffers(max_block: int, most: int) -> int:
    """Chunk buffers of the tier: ``most``, but no more than one largest block's worth of chunks (at least 4:
    one reading ahead, one computed, two writing behind)."""
    return max(4, min(most, -(-max(max_block, 1) // tier_chunk(max_block))))


@dataclass
class _Buf:
    """One host chunk buffer of the pool and what it holds."""

    data: torch.Tensor  # (nbytes,) uint8, aligned
    key: tuple | None = None  # (unit key, chunk) it holds or is reading/writing
    futures: list = field(default_factory=list)
    acquired: bool = False
    fields: tuple | None = None  # the fields it holds (None: all of the unit's)


class DiskTier:
    """Swapped units' state streamed through a pool of chunk buffers: read ahead, written behind.

    [Note: no waiting under the lock]
    Every request's completion callback takes the tier's lock (to free its buffer, count, pump more reads).
    A thread that waited on a request while holding the lock could wait forever: the pool's threads would sit
    in callbacks of earlier requests, blocked on that lock, with the awaited request still queued behind them.
    So requests are only awaited with the lock released (``acquire`` after its loop, ``reset`` in two phases),
    and a loop that needs a request done polls ``done()`` and waits on the condition (which releases it).


    The engine announces the order of the coming updates (:meth:`expect`); reads are issued in that order
    while buffers are free. An update takes each chunk (:meth:`acquire`: waits for its read, issuing it
    if needed, taking back a buffer read ahead for another chunk if none is free), computes, and hands the
    chunk back (:meth:`release`: its write is queued; the buffer is free once it is written). A read of a
    range still being written waits for that write. Errors are :class:`DiskTierError`, kept: every later
    call raises them too (the engine fails: a half-written step cannot be continued)."""

    def __init__(self, file: SwapFile, regions: dict[int, Region], chunk: int, buffers: int):
        self.file, self.regions, self.chunk = file, regions, chunk
        nf = max((len(r.fields) for r in regions.values()), default=1)
        self._bytes = chunk * 4
        self._bufs = [_Buf(aligned_empty(nf * self._bytes)) for _ in range(max(2, buffers))]
        self._free = list(range(len(self._bufs)))
        self._held: dict[tuple, int] = {}  # key -> buffer index (reading, read, or acquired)
        self._writing: dict[tuple, int] = {}  # key -> buffer index (write in flight)
        self._expect: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closing = False  # no more reads: the pool is stopping
        self.bytes_read = self.bytes_written = 0
        self.spans: list[tuple[str, float, float]] = []  # (label, start, end): per chunk read/write

    def chunks(self, key: int) -> list[tuple[int, int]]:
        n = self.regions[key].numel
        return [(a, min(self.chunk, n - a)) for a in range(0, n, self.chunk)]

    def view(self, key: int, name: str) -> torch.Tensor:
        r = self.regions[key]
        return self.file.view(r.offsets[name], r.numel)

    # -------------------------------------------------------------- scheduling

    def expect(self, keys) -> None:
        """The updates of ``keys`` come next, in this order: read their chunks ahead."""
        with self._cv:
            queued = set(self._expect)
            for key in keys:
                for c in range(len(self.chunks(key))):
                    k = (key, c)
                    if k not in self._held and k not in queued:
                        self._expect.append(k)
            self._pump()

    def reset(self) -> None:
        """Forget the expected reads and drop chunks read ahead but not taken (a step was abandoned)."""
        with self._cv:
            self._expect.clear()
            ahead = [(k, i, list(self._bufs[i].futures)) for k, i in self._held.items() if not self._bufs[i].acquired]
        for _, _, futs in ahead:  # outside the lock: a request's completion callback takes it
            self._wait_futures(futs, raise_=False)
        with self._cv:
            for k, i, _ in ahead:
                if self._held.get(k) == i and not self._bufs[i].acquired:
                    self._drop(k, i)

    def _drop(self, k: tuple, i: int) -> None:
        del self._held[k]
        b = self._bufs[i]
        b.key, b.futures, b.acquired = None, [], False
        self._free.append(i)

    def _pump(self) -> None:
        """Issue expected reads into free buffers (lock held)."""
        while self._free and self._expect and self._error is None and not self._closing:
            k = self._expect[0]
            if k in self._held:  # someone holds it (a gradient being stashed): read on demand after
                self._expect.popleft()
                continue
            if k in self._writing:  # its last write is in flight: read after it (its completion pumps)
                return
            self._expect.popleft()
            self._read(k, self._free.pop())

    def _fields(self, k: tuple, i: int):
        """(field, file offset, buffer slice as uint8, fp32 view of the chunk) of chunk ``k`` in buffer i: the
        fields the buffer holds (all of the unit's, or the subset a write-only acquire took)."""
        key, c = k
        r = self.regions[key]
        a, n = self.chunks(key)[c]
        nbytes = align_up(n * 4)
        out = []
        only = self._bufs[i].fields
        for j, f in enumerate(r.fields):
            if only is not None and f not in only:
                continue
            raw = self._bufs[i].data[j * self._bytes : j * self._bytes + nbytes]
            out.append((f, r.offsets[f] + a * 4, raw, raw[: n * 4].view(torch.float32)))
        return out

    def _read(self, k: tuple, i: int) -> None:
        b = self._bufs[i]
        b.key, b.acquired, b.futures, b.fields = k, False, [], None
        self._held[k] = i
        t = time.perf_counter()
        for f, off, raw, _ in self._fields(k, i):
            b.futures += self.file.submit("read", off, raw, f"unit {k[0]} {f} chunk {k[1]}")
            self.bytes_read += raw.numel()
        self._span_on_done(b.futures, f"read[{k[0]}:{k[1]}]", t)

    def _span_on_done(self, futs: list, label: str, t: float) -> None:
        remaining = [len(futs)]

        def done(_):
            with self._cv:
                remaining[0] -= 1
                if remaining[0] == 0 and len(self.spans) < 100_000:
                    self.spans.append((label, t, time.perf_counter()))

        for f in futs:
            f.add_done_callback(done)

    def _take_buffer(self) -> int | None:
        """A free buffer, or one taken back from a chunk read ahead but not acquired (lock held; None: wait)."""
        if self._free:
            return self._free.pop()
        for k in reversed(list(self._held)):
            i = self._held[k]
            b = self._bufs[i]
            if not b.acquired and all(f.done() for f in b.futures):
                del self._held[k]
                b.key, b.futures = None, []
                self._expect.appendleft(k)
                return i
        return None

    # -------------------------------------------------------------- the update's side

    def acquire(self, key: int, c: int, write_only: tuple | None = None) -> dict[str, torch.Tensor]:
        """Chunk ``c`` of unit ``key``: field -> (k,) fp32 host tensor holding the state read from disk.

        ``write_only``: those fields only, not read (their contents are the caller's to fill; ``release``
        writes just them): a gradient stashed on the disk ([Note: gradients on the disk], step/optimizer_step.py)."""
        k = (key, c)
        with self._cv:
            while True:
                self.check()
                if write_only is not None:
                    if k in self._held and not self._bufs[self._held[k]].acquired:  # read ahead too early:
                        j = self._held[k]  # its data is stale
                        if all(f.done() for f in self._bufs[j].futures):
                            self._drop(k, j)
                        # (never wait on a request while holding the lock: its completion callback takes it)
                    if k in self._held or k in self._writing:  # let that update or write finish first
                        self._cv.wait(0.05)
                        continue
                    i = self._take_buffer()
                    if i is None:
                        self._cv.wait(0.05)
                        continue
                    b = self._bufs[i]
                    b.key, b.futures, b.fields = k, [], tuple(write_only)
                    self._held[k] = i
                    break
                if k in self._held:
                    i = self._held[k]
                    break
                if k not in self._writing:
                    i = self._take_buffer()
                    if i is not None:
                        try:
                            self._expect.remove(k)
                        except ValueError:
                            pass
                        self._read(k, i)
                        break
                self._cv.wait(0.05)
            b = self._bufs[i]
            b.acquired = True
            futs = b.futures
        self._wait_futures(futs)
        return {f: view for f, _, _, view in self._fields(k, i)}

    def release(self, key: int, c: int, write: bool = True) -> None:
        """Chunk ``c`` of unit ``key`` is updated: write it back; its buffer is free once written. ``write``
        False: it was only read (frozen weights: [Note: a frozen base on the disk]), the buffer is free now."""
        k = (key, c)
        with self._cv:
            self.check()
            i = self._held.pop(k)
            b = self._bufs[i]
            b.acquired, b.futures = False, []
            if not write:
                b.key, b.fields = None, None
                self._free.append(i)
                self._pump()
                self._cv.notify_all()
                return
            self._writing[k] = i
            futs = []
            t = time.perf_counter()
            for f, off, raw, _ in self._fields(k, i):
                futs += self.file.submit("write", off, raw, f"unit {key} {f} chunk {c}")
                self.bytes_written += raw.numel()
            self._span_on_done(futs, f"write[{key}:{c}]", t)
            left = [len(futs)]

        def written(fut: Future):
            with self._cv:
                if fut.exception() is not None and self._error is None:
                    self._error = fut.exception()
                left[0] -= 1
                if left[0] == 0:
                    del self._writing[k]
                    b.key, b.fields = None, None
                    self._free.append(i)
                    self._pump()
                    self._cv.notify_all()

        for f in futs:
            f.add_done_callback(written)

    def _wait_futures(self, futs: list, raise_: bool = True) -> None:
        """Wait for requests; never called with the lock held (see [Note: no waiting under the lock])."""
        for f in futs:
            try:
                f.result()
            except BaseException as e:
                with self._cv:
                    if self._error is None:
                        self._error = e
                if raise_:
                    raise

    def drain(self) -> None:
        """Wait until every write is done; raise the first I/O error of the tier."""
        with self._cv:
            while self._writing:
                self._cv.wait(0.05)
            self.check()

    def check(self) -> None:
        if self._error is not None:
            raise self._error if isinstance(self._error, DiskTierError) else DiskTierError(str(self._error))

    def drain_spans(self) -> list[tuple[str, float, float]]:
        with self._cv:
            spans, self.spans = self.spans, []
        return spans

    def close(self) -> None:
        """Read nothing more, then stop the file's pool (it finishes the requests in flight). A write completing
        meanwhile frees its buffer and pumps; without the flag that pump would submit a read to the stopping
        pool, which raises in the write's completion callback."""
        with self._cv:
            self._closing = True
            self._expect.clear()
        self.file.close()
