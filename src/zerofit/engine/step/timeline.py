"""The step's clock: what ``engine.timeline()`` and ``engine.trace()`` report, and the host's peak memory (a part).

A step (``train_batch``, or a DeepSpeed-shaped window from its first forward to its ``step()``) starts the clock;
the device's timed regions (device.py), the worker's working and waiting spans ([Note: the worker's waits],
update/worker.py), the disk tier's reads and writes and the main thread's waits (on a CPU update, a moments
pass, a staging buffer) are collected until it ends; the trace is built from them only when asked for.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import psutil
import torch

if TYPE_CHECKING:
    from zerofit.engine.device import Device
    from zerofit.engine.update.worker import HostWorker


class Timeline:
    """State: the step in progress's clock (its start, the worker's seconds then, the device trace's origin) and
    the main thread's waits so far; the last step's seconds by resource and its trace; the host's peak RSS.
    ``timeline()`` between a step's start and end reports its waits so far (as it always did)."""

    def __init__(self, dev: Device, worker: HostWorker) -> None:
        self.dev, self.worker = dev, worker
        self._t0 = time.perf_counter()
        self._worker0 = (0.0, 0.0)
        self._origin: float | torch.cuda.Event | None = None  # the step's Device.mark()
        self._seconds: dict[str, float] = {}  # the last step's seconds per phase, or the waits of the one running
        self._wait_spans: list[tuple] = []  # (label, start, end) of the main thread's waits, this step
        self._trace: list[dict] | tuple = []  # the last step's trace, or what trace() builds it from
        self.peak_host = 0  # the host's peak RSS seen (bytes)

    def start(self) -> None:
        """A step's clocks start: wall time, the worker's working and waiting seconds, the device trace's origin."""
        self.dev.forget_intervals()  # regions between steps (evaluation forwards) belong to no step
        self.worker.drain_spans()
        self._seconds, self._wait_spans = {}, []
        self._origin = self.dev.mark()
        self._t0, self._worker0 = time.perf_counter(), (self.worker.busy_seconds, self.worker.wait_seconds)

    def add_wait(self, seconds: float, label: str) -> None:
        """The main thread waited ``seconds`` just now (for ``label``: a unit's update, a staging buffer)."""
        self._seconds["wait"] = self._seconds.get("wait", 0.0) + seconds
        end = time.perf_counter()
        self._wait_spans.append((label, end - seconds, end))

    def end(self, tier=None) -> None:
        """The step ended: wait for the device (the step's one sync besides the loss read, for its timed regions:
        [Note: events, not device syncs], device.py), sum each lane, keep what the trace is built from."""
        self.dev.synchronize()
        tl, intervals = self.dev.drain_intervals()
        tl["optimizer"] = self.worker.busy_seconds - self._worker0[0]  # [Note: the worker's waits]
        tl["optimizer_wait"] = self.worker.wait_seconds - self._worker0[1]
        tl["wait"] = self._seconds.get("wait", 0.0)
        tl["step"] = time.perf_counter() - self._t0
        for k in ("compute", "upload", "download"):
            tl.setdefault(k, 0.0)
        self._seconds = tl
        host = self.worker.drain_spans()
        if tier is not None:
            host += [("disk", label, a, b) for label, a, b in tier.drain_spans()]
        host += [("wait", label, a, b) for label, a, b in self._wait_spans]
        self._trace = (intervals, self._origin, host, self._t0)  # built by trace(), if anyone asks
        self.note_host()

    def note_host(self) -> None:
        self.peak_host = max(self.peak_host, psutil.Process().memory_info().rss)

    def memory_stats(self, device_planned: int, host_planned: int) -> dict[str, int]:
        """The device's peak allocated and reserved bytes and its allocator's retries, the host's bytes now and at
        their peak, beside what the plan predicted (``device_planned``, ``host_planned``)."""
        self.note_host()
        cuda, device = self.dev.is_cuda, self.dev.device
        return {
            "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0,
            "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else 0,
            # the caching allocator freed its cache and retried an allocation (each a device sync)
            "gpu_alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if cuda else 0,
            "gpu_predicted_bytes": device_planned,
            "host_bytes": psutil.Process().memory_info().rss,
            "host_peak_bytes": self.peak_host,
            "host_predicted_bytes": host_planned,
        }

    def timeline(self) -> dict[str, float]:
        """Seconds per phase of the last step: step (wall), compute (device), upload, download,
        optimizer (the CPU worker working), optimizer_wait (its tasks waiting for a gradient or the disk),
        wait (the main thread blocked on the CPU optimizer or pinned buffers)."""
        return dict(self._seconds)

    def trace(self) -> list[dict]:
        """The last step's timeline interval by interval: {lane, label, start, end} in seconds from the
        step's start. Lanes: compute, upload, download (device streams; from CUDA events), cpu (the host
        optimizer thread's tasks, working), cpu wait (those tasks waiting for a gradient or the disk: [Note: the
        worker's waits]), disk (the tier's reads and writes) and wait (the main thread blocked on the CPU
        optimizer or on pinned buffers). Device and host intervals come from different clocks that start
        together: compare them to a millisecond. A CPU task of the previous step still running when this one
        started has a negative start."""
        if isinstance(self._trace, tuple):
            intervals, origin, host, t0 = self._trace
            trace = self.dev.trace_of(intervals, origin)
            trace += [
                {"lane": lane, "label": label, "start": round(a - t0, 6), "end": round(b - t0, 6)}
                for lane, label, a, b in host
                if b >= t0
            ]
            self._trace = sorted(trace, key=lambda e: (e["lane"], e["start"]))
        return list(self._trace)
