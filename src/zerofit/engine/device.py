"""The compute device and its streams, with one code path for CUDA and the CPU.

On a CUDA device the engine uses three streams: compute (the current stream),
upload (host -> device) and download (device -> host). On the CPU there are no
streams: every "copy" runs at once and every event is complete, so the same
engine code runs, in order, on a machine without a GPU.

[Note: events, not device syncs]
A device-wide ``torch.cuda.synchronize()`` waits for every stream, copies
included, and so serialises the pipeline. Inside a step's passes the engine
only ever waits on an event (``stream.wait_event`` on the GPU,
``event.synchronize()`` on a host thread) for the one piece of work it needs.
The host waits for the device at a step's end only, at three points, each named
where it is: the global norm's read (clipping, fp16: ``Step._global_norm``) or,
without a norm, the read of the step's count of non-finite gradients ([Note:
non-finite gradients without a norm], step/optimizer_step.py), both before the
device-optimized units' AdamW is enqueued; the loss read (``train_batch``'s
return value); and ``Timeline.end``'s ``synchronize()``, which reads the step's
timed regions (the copies still in flight then are waited for, so the next step
starts with idle streams). Under the user's loop the clip's read of the global norm
(``TorchClip.clip``, torch_clip.py: torch's own ``clip_grad_norm_`` reads it too) is the
norm's read, after an event wait for the downloads of the host gradients it views. One
more, rare: a batch with more or larger block checkpoints than any before grows the
pinned checkpoint arena (``Activations._view``, activations.py), which synchronizes once
before the smaller arena is unpinned. Outside a step's passes: a checkpoint,
``engine.module``, ``wait()``, ``close()`` and the reset after a failed step synchronize too.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TypeAlias, cast

import torch


class _DoneEvent:
    """Stand-in for ``torch.cuda.Event`` on the CPU: always complete."""

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


# an event on a stream: a CUDA event on a GPU, a complete stand-in on the CPU
Event: TypeAlias = "torch.cuda.Event | _DoneEvent"


@dataclass
class Interval:
    """A timed region on one stream (CUDA events) or on the host (perf_counter)."""

    phase: str
    start: float | torch.cuda.Event  # the host's perf_counter, or a timing event on a GPU stream (as ``end``)
    end: float | torch.cuda.Event
    label: str | None = None

    def seconds(self) -> float:
        if isinstance(self.start, float):  # both host clock readings, or both timing events
            return cast(float, self.end) - self.start
        return self.start.elapsed_time(cast(torch.cuda.Event, self.end)) / 1000.0


@dataclass
class Device:
    """Compute device plus the streams the engine schedules work on."""

    device: torch.device
    compute: torch.cuda.Stream | None = None  # the streams on a GPU; None on the CPU
    upload: torch.cuda.Stream | None = None
    download: torch.cuda.Stream | None = None
    intervals: list[Interval] = field(default_factory=list)

    @classmethod
    def create(cls, device: torch.device) -> Device:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            return cls(device, torch.cuda.current_stream(device), torch.cuda.Stream(device), torch.cuda.Stream(device))
        return cls(device)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def event(self, timing: bool = False) -> Event:
        return torch.cuda.Event(enable_timing=timing) if self.is_cuda else _DoneEvent()

    def record(self, stream: torch.cuda.Stream | None) -> Event:
        """An event recorded now on ``stream`` (done at once on the CPU)."""
        ev = self.event()
        if self.is_cuda:
            ev.record(stream)
        return ev

    def wait(self, stream, event) -> None:
        """Make ``stream`` wait for ``event`` (no host block). See [Note: events, not device syncs]."""
        if self.is_cuda and event is not None:
            stream.wait_event(event)

    @contextlib.contextmanager
    def on(self, stream):
        if self.is_cuda:
            with torch.cuda.stream(stream):
                yield
        else:
            yield

    @contextlib.contextmanager
    def timed(self, phase: str, stream=None, label: str | None = None):
        """Time a region on ``stream`` (GPU) or on the host, with a profiler range."""
        with torch.profiler.record_function(f"zerofit::{phase}[{label}]" if label else f"zerofit::{phase}"):
            if self.is_cuda:
                s = stream if stream is not None else self.compute
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(s)
                try:
                    yield
                finally:
                    b.record(s)
                    self.intervals.append(Interval(phase, a, b, label))
            else:
                t = time.perf_counter()
                try:
                    yield
                finally:
                    self.intervals.append(Interval(phase, t, time.perf_counter(), label))

    def mark(self) -> float | torch.cuda.Event:
        """A timing event recorded now on the compute stream (CUDA), or the host clock: a trace's origin."""
        if self.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.compute)
            return ev
        return time.perf_counter()

    def forget_intervals(self, since: int = 0) -> None:
        """Drop the intervals recorded after the first ``since`` (work that belongs to no step's timeline)."""
        del self.intervals[since:]

    def drain_intervals(self) -> tuple[dict[str, float], list[Interval]]:
        """Seconds per phase of the intervals recorded since the last drain (call after a sync), and the
        intervals themselves (for :meth:`trace_of`, built only when asked for)."""
        out: dict[str, float] = {}
        for iv in self.intervals:
            out[iv.phase] = out.get(iv.phase, 0.0) + iv.seconds()
        intervals, self.intervals = self.intervals, []
        return out, intervals

    @staticmethod
    def trace_of(intervals: list[Interval], origin) -> list[dict]:
        """Each interval as {lane, label, start, end} in seconds from ``origin`` (a :meth:`mark`)."""
        trace = []
        for iv in intervals:
            if isinstance(iv.start, float):
                start, end = iv.start - origin, iv.end - origin
            else:
                start = origin.elapsed_time(iv.start) / 1000.0
                end = start + iv.seconds()
            trace.append({"lane": iv.phase, "label": iv.label, "start": round(start, 6), "end": round(end, 6)})
        return trace

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def requested_device(want: str) -> torch.device:
    """The device the config (or the caller) asks for: "auto" is the GPU if torch sees one, else the CPU."""
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(want)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no CUDA GPU")
    return dev


def rank_device(dev: torch.device, ranks) -> torch.device:
    """The device this process computes on: with several ranks its local rank's GPU; a GPU with its index."""
    if ranks.many and dev.type == "cuda":
        dev = torch.device("cuda", ranks.local_rank)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    return dev


# [Note: page-locking fresh memory]
# cudaHostRegister of memory never touched makes the driver fault in, zero and lock every page on one thread
# (2.7 GB/s on an H100 host: 22 s for a 70B QLoRA run's 37 GiB of NF4 weights), and the caching host allocator
# (``pin_memory=True``) is slower still and rounds each block up to a power of two. A fresh arena is instead
# marked for transparent huge pages (madvise, where the kernel offers them), written once over torch's threads
# (its pages faulted in in parallel, 512 times fewer of them), then registered: 15 GB/s there
# (bench/probes/pin_speed.py, docs/benchmarks.md). Its contents are zeros, which no reader relies on.
MADV_HUGEPAGE = 14


def _huge_pages(t: torch.Tensor) -> None:
    """Ask the kernel for transparent huge pages over ``t``'s whole 2 MiB pages (best effort: a kernel without
    them, or another libc, leaves the memory as it is)."""
    page = 2 << 20
    start = (t.data_ptr() + page - 1) // page * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end - start < page:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, end - start, MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def fresh_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A new host tensor of ``numel`` elements, page-locked at its exact size ([Note: page-locking fresh
    memory]); zeros. Unregister it (``cudaHostUnregister``) before it is freed, as :func:`pin`'s."""
    t = torch.empty(numel, dtype=dtype)
    _huge_pages(t)
    t.zero_()
    return pin(t)


def pin(t: torch.Tensor) -> torch.Tensor:
    """Page-lock ``t``'s memory in place with cudaHostRegister (no rounding up, unlike the caching host allocator).

    The registration is undone when the tensor is freed (see ``HostBuffer``)."""
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes failed with CUDA error {rc}")
    return t
