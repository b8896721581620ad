"""Generation's weights on the disk, when host memory cannot hold every block's 16-bit weights.

The blocks that do not fit ``max_host_memory`` are written once, at load, into a swap file under the NVMe
path (the training engine's :class:`~zerofit.engine.disk.tier.SwapFile`: preallocated, flock-held, direct I/O on
a thread pool, removed at close), each block 4 KiB-aligned. Their parameters view the file's mapping while
idle. A streamed block on the disk is read into one of two page-locked staging buffers ahead of its turn,
in the upload cycle's order ([Note: the upload cycle], engine.py), then uploaded from there like a host
block; a resident one is read once when the plan places it.

[Note: staging buffers]
A staging buffer is refilled only after the upload that read it has finished (the reader thread waits on
that upload's event), and the upload of a block waits (on the host) for the read of its buffer. With two
buffers, the next disk block of the cycle is read while the current one uploads: the disk is the bound of
such a block, the PCIe link of the others.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zerofit.engine.device import pin
from zerofit.engine.disk.swapfile import SwapFile, align_up, aligned_empty


class DiskBlocks:
    """Blocks ``sizes[b]`` elements of ``dtype`` each for ``b`` in ``blocks``, in one swap file under
    ``folder``, read through two staging buffers (see the module docstring)."""

    def __init__(
        self,
        folder: str | Path,
        blocks: list[int],
        sizes: list[int],
        dtype: torch.dtype,
        pinned: bool,
        buffers: int = 2,
    ):
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.dtype = dtype
        self.regions: dict[int, tuple[int, int]] = {}  # block -> (byte offset, bytes)
        pos = 0
        for b in blocks:
            n = sizes[b] * self.elem
            self.regions[b] = (pos, n)
            pos += align_up(n)
        self.file = SwapFile(folder, pos)
        self.path = self.file.path
        self._typed_map = self.file.map.view(torch.uint8).view(dtype)
        most = max((n for _, n in self.regions.values()), default=0)
        self.pinned = pinned
        self._bufs = []
        for _ in range(buffers):
            buf = aligned_empty(align_up(max(most, 1)))
            if pinned:
                pin(buf)
            self._bufs.append(buf)
        self._free = collections.deque((buf, None) for buf in self._bufs)
        self._pending: dict[int, tuple[torch.Tensor, object]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zerofit-infer-disk")
        self.reads = 0
        self.read_bytes = 0

    # ------------------------------------------------------------------ load

    def write(self, b: int, fill) -> None:
        """Fill block ``b`` through ``fill(flat)`` (a flat tensor of the block's dtype and size) and write it."""
        off, n = self.regions[b]
        buf, _ = self._free[0]
        fill(buf[:n].view(self.dtype))
        for f in self.file.submit("write", off, buf[: align_up(n)], f"block {b}"):
            f.result()

    def mapped(self, b: int) -> torch.Tensor:
        """Block ``b``'s flat weights as a view of the file's mapping (what idle parameters view)."""
        off, n = self.regions[b]
        return self._typed_map[off // self.elem : (off + n) // self.elem]

    # ------------------------------------------------------------------ reads ([Note: staging buffers])

    def prefetch(self, b: int) -> bool:
        """Start reading block ``b`` if a staging buffer is free; whether it is (or was already) on its way."""
        if b in self._pending:
            return True
        if not self._free:
            return False
        buf, after = self._free.popleft()
        self._pending[b] = (buf, self._pool.submit(self._read, b, buf, after))
        return True

    def _read(self, b: int, buf: torch.Tensor, after) -> None:
        if after is not None:
            after.synchronize()  # the upload that last read this buffer is done
        off, n = self.regions[b]
        for f in self.file.submit("read", off, buf[: align_up(n)], f"block {b}"):
            f.result()
        self.reads += 1
        self.read_bytes += n

    def take(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``b`` read into a staging buffer: (its flat typed view, the buffer, for :meth:`give_back`).
        Waits for the read. A block out of the expected order first waits for every pending read."""
        if not self.prefetch(b):
            for other in list(self._pending):
                buf, fut = self._pending.pop(other)
                fut.result()
                self._free.append((buf, None))
            self.prefetch(b)
        buf, fut = self._pending.pop(b)
        fut.result()
        return buf[: self.regions[b][1]].view(self.dtype), buf

    def give_back(self, buf: torch.Tensor, after) -> None:
        """The buffer may be refilled once ``after`` (an event, or None) completes."""
        self._free.append((buf, after))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._pending.clear()
        if self.pinned:  # undo pin() before the memory can be reused
            for buf in self._bufs:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            self.pinned = False
        self._bufs = []
        self._free.clear()
        self._typed_map = None
        self.file.close()
