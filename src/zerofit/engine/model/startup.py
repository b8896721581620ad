"""The model's materialization as it goes: parameters done, rate, time left; seconds per phase.

[Note: start-up progress]
Materializing a 70B model (reading 40-140 GB, or initializing and quantizing it) takes minutes: a silent terminal
for that long reads as a hang. :class:`Startup` counts the parameters materialized against the model's total as
each tensor lands (materialize.py) and the seconds each phase takes (``allocate``: the host arenas, page-locked;
``read``: the files; ``init``: a meta model's own init; ``quantize``: to 4 bits; ``copy``: into the units' buffers;
``pin``: page-locking after the fact). Every few seconds it tells its listeners: ``zerofit.initialize`` logs a line
at INFO, ``zerofit train`` draws a progress bar (:func:`listen`). At the end :meth:`summary` names where the time
went, for the start-up line and for a profile. The phases overlap where the work does (a thread reads ahead while
the device quantizes): their seconds are each one's own wall time, and may add up to more than the whole.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict

log = logging.getLogger("zerofit")

EVERY = 5.0  # seconds between two reports
_LISTENERS: list = []


@contextlib.contextmanager
def listen(fn):
    """``fn(done, total, seconds)`` called as materialization goes (params done, params in all, seconds so far),
    and once more at its end, for the duration of the block."""
    _LISTENERS.append(fn)
    try:
        yield
    finally:
        _LISTENERS.remove(fn)


class Startup:
    """Progress and phase times of one materialization of ``total`` parameters."""

    def __init__(self, total: int, what: str = "materializing the model"):
        self.total, self.what = max(int(total), 1), what
        self.done = 0
        self.seconds: dict[str, float] = defaultdict(float)
        self.t0 = self.last = time.perf_counter()
        self.took: float | None = None
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            with self.lock:
                self.seconds[name] += dt

    def advance(self, params: int) -> None:
        """``params`` more parameters are in place: the listeners hear at once, the log every EVERY seconds."""
        with self.lock:
            self.done += int(params)
            now = time.perf_counter()
            due = now - self.last >= EVERY
            if due:
                self.last = now
        for fn in list(_LISTENERS):
            fn(self.done, self.total, now - self.t0)
        if due:
            self._log(now)

    def finish(self) -> None:
        self.done = self.total
        now = time.perf_counter()
        self.took = now - self.t0
        self._tell(now)

    def elapsed(self) -> float:
        """Seconds the materialization took (so far, before its end)."""
        return self.took if self.took is not None else time.perf_counter() - self.t0

    def _tell(self, now: float) -> None:
        secs = now - self.t0
        for fn in list(_LISTENERS):
            fn(self.done, self.total, secs)
        log.info("zerofit: %s took %.1f s (%s)", self.what, secs, self.summary())

    def _log(self, now: float) -> None:
        secs = now - self.t0
        rate = self.done / secs if secs > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        log.info(
            "zerofit: %s: %.1f of %.1f B parameters (%d%%), %.0f M/s, about %.0f s left",
            self.what,
            self.done / 1e9,
            self.total / 1e9,
            100 * self.done // self.total,
            rate / 1e6,
            left,
        )

    def summary(self) -> str:
        """Seconds per phase, the longest first: ``read 41.2 s, quantize 12.0 s, ...``."""
        parts = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {v:.1f} s" for k, v in parts if v >= 0.05) or "nothing measurable"
