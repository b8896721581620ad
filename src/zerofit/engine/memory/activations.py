"""Activations: where a step's block checkpoints wait for its backward (a part).

Block-major order keeps every micro-batch's block inputs from the forward to the backward. Kept on the device
by default; with ``plan.offload_checkpoints`` most of them in a pinned host arena ([Note: offloaded
checkpoints]); with ``plan.checkpoint_every`` = k only every k-th block's ([Note: checkpoints every k blocks],
schedule.py, which recomputes the others).

[Note: offloaded checkpoints]
With plan.offload_checkpoints, the inputs each block kept for its backward go down to a pinned host arena,
G micro-batches' worth (train_batch, or a DeepSpeed-shaped window, whose forwards come one at a time:
``first`` places each), right after the block's forward (download stream, after the compute that wrote them;
``record_stream`` keeps the allocator from reusing the device memory before the copy has read it), except
block 0's (it is the pre pass's output, alive anyway) and the last two's (needed first). The backward
brings each block's back up on the upload stream CKPT_AHEAD blocks ahead, into memory allocated on the
compute stream before the upload stream is told to wait for it, and the compute stream waits on the upload
before using them. A host slot is rewritten only by the next step's forward, which the compute stream
orders after this step's uploads of it.

Two blocks ahead, not one: a block updated on the device in the backward ([Note: assisted updates in the
backward], update/assisted.py) queues its state's chunks on the upload stream right after its compute, and a
checkpoint enqueued one block ahead sat behind them: in a step's trace of a 3B model at an 8 GiB cap, the
compute waited several ms before each block that followed an assisted one. Two ahead, the next block's
checkpoint is enqueued before those chunks, and the step got shorter (docs/benchmarks.md, the 3B model at an
8 GiB cap). On the device at once: block 0's, the one computing, the two coming up (within the planner's
CKPT_ON_DEVICE). Where a block's checkpoints outweigh those chunks and its weights, one ahead: [Note: one
checkpoint ahead], plan/activations.py.
"""

from __future__ import annotations

import torch

from zerofit.engine.device import Device
from zerofit.engine.memory.store import HostArena
from zerofit.engine.plan.search import CKPT_AHEAD, offloaded_blocks, offloaded_checkpoints


class Activations:
    """State: ``every`` (the step in progress keeps every k-th block's inputs), the host ``arena`` of offloaded
    checkpoints (grown to the largest window seen, ``g`` micro-batches), and ``ready``: the upload event of
    each block's checkpoints brought back for the backward."""

    def __init__(self, dev: Device, n_blocks: int, grad_accum: int, pinned: bool, arenas: list):
        self.dev, self.n_blocks, self.grad_accum, self.pinned = dev, n_blocks, grad_accum, pinned
        self.arenas = arenas  # the engine's pinned arenas (released with it)
        self.every = 1  # [Note: checkpoints every k blocks]: the step in progress's
        self.ahead = CKPT_AHEAD  # the backward brings checkpoints back this many blocks ahead (the plan's)
        self.arena: HostArena | None = None  # (offloaded checkpoints * g * tokens * hidden,) compute dtype
        self.g = 0
        self.ready: dict[int, object] = {}

    def reset(self) -> None:
        """A new step (or a dropped one): no checkpoint is on its way up."""
        self.ready = {}

    def keep_every(self, every: int, ahead: int = CKPT_AHEAD) -> None:
        """The training forward in progress keeps every ``every``-th block's inputs, and its backward brings the
        offloaded ones back ``ahead`` blocks ahead ([Note: one checkpoint ahead], plan/activations.py)."""
        self.every, self.ahead = every, ahead

    def offloaded(self, index: int) -> bool:
        return index in offloaded_blocks(self.n_blocks, self.every)

    def _slot(self, index: int) -> int:
        """Block ``index``'s place among the offloaded checkpoints."""
        return offloaded_blocks(self.n_blocks, self.every).index(index)

    def _view(self, index: int, m: int, like: torch.Tensor) -> torch.Tensor:
        """The pinned host slot of block ``index``'s checkpoint of micro-batch ``m`` (the arena grows to the
        batch the first time)."""
        n = like.numel()
        G = self.g
        need = offloaded_checkpoints(self.n_blocks, self.every) * G * n
        arena = self.arena
        if arena is None or arena.tensor.numel() < need or arena.tensor.dtype != like.dtype:
            if arena is not None:  # a larger batch than before: the smaller arena goes, once no copy
                self.dev.synchronize()  # reads it ([Note: events, not device syncs], device.py)
                self.arenas.remove(arena)
                arena.close()
            arena = self.arena = HostArena(need, like.dtype, self.pinned)
            self.arenas.append(arena)
        off = (self._slot(index) * G + m) * n
        return arena.tensor[off : off + n].view(like.shape)

    def down(self, micros: list, index: int, first: int = 0) -> None:
        """Block ``index``'s checkpoints of ``micros`` (the window's ``first`` onwards) into the host arena."""
        # the arena's layout is per window of G micro-batches (the DeepSpeed-shaped loop's come one at a time)
        self.g = max(self.g, first + len(micros), self.grad_accum)
        ev = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.download):
            self.dev.wait(self.dev.download, ev)
            with self.dev.timed("download", self.dev.download, f"ckpt[{index}]"):
                for m, micro in enumerate(micros, start=first):
                    x = micro.ckpts[index]
                    h = self._view(index, m, x)
                    h.copy_(x, non_blocking=True)
                    if self.dev.is_cuda:
                        x.record_stream(self.dev.download)
                    micro.ckpts[index] = h

    def up(self, micros: list, index: int) -> None:
        """Block ``index``'s checkpoints back on the device (enqueued; :meth:`wait` before use)."""
        first = micros[0].ckpts[index] if index >= 0 and micros else None
        if first is None or first.device == self.dev.device:
            return
        outs = [
            torch.empty(mc.ckpts[index].shape, dtype=mc.ckpts[index].dtype, device=self.dev.device) for mc in micros
        ]
        ev = self.dev.record(self.dev.compute)  # after the allocations: their memory is free on the device
        with self.dev.on(self.dev.upload):
            self.dev.wait(self.dev.upload, ev)
            with self.dev.timed("upload", self.dev.upload, f"ckpt[{index}]"):
                for mc, d in zip(micros, outs):
                    d.copy_(mc.ckpts[index], non_blocking=True)
                    mc.ckpts[index] = d
            self.ready[index] = self.dev.record(self.dev.upload)

    def wait(self, index: int) -> None:
        """The compute stream waits for block ``index``'s checkpoints to be back on the device."""
        ev = self.ready.pop(index, None)
        if ev is not None:
            self.dev.wait(self.dev.compute, ev)
