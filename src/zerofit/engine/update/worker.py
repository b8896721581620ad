"""The host worker: one thread that runs the CPU's tasks (AdamW updates, gradient adds) by priority.

[Note: CPU optimizer overlap]
Host-optimized units are updated by one worker thread as their gradients
arrive (backward order: last block first; [Note: ready tasks first]), while
the GPU computes the backward of the blocks before them. A unit's ``updated`` event is set when
its update is done; the next forward's upload of that unit waits for it (on the host, before
enqueueing the copy: :meth:`HostWorker.wait_for`). The fused kernel and the cast release the GIL
and use torch's intra-op threads.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager

from zerofit.errors import ZerofitError


class WorkerError(ZerofitError, RuntimeError):
    """A task on the CPU optimizer thread raised. The update it ran may be half applied, and the
    thread skips every later task: the engine that owns it cannot go on (see [Note: failure semantics])."""


# [Note: the worker's waits]
# A task of the worker waits for its inputs before it works: an update for its gradient to come down from the
# device (``event.synchronize()``), a disk-tier update for each chunk's read (``DiskTier.acquire``). The task
# wraps each such wait in ``waiting(what)``. The step's trace then shows the task's working time on the "cpu"
# lane (its span cut where it waited) and each wait on the "cpu wait" lane; the timeline's ``optimizer`` is the
# working seconds, ``optimizer_wait`` the waiting ones. Before, a task's span ran from the moment the worker
# took it: an update taken before its gradient was down counted the backward's compute as the CPU's work, and
# a disk-bound step showed the CPU "busy" for the disk's whole time.
_current = threading.local()

# [Note: ready tasks first]
# The worker runs queued tasks lowest priority first: for the backward's immediate updates, the lowest block first,
# which the next forward needs first. But the main thread queues a block's update when it has queued the block's
# backward, well ahead of the device, and the backward hands the gradients over last block first: the task first in
# line is then the one whose gradient comes down last. Taking it, the worker waited for it while gradients of
# higher blocks sat ready in host memory. A step's trace (``bench/trace.py --gaps``) showed each of the backward's
# updates waiting about as long for its gradient as it then worked, and updates left over for the next forward, which
# waited on them (docs/benchmarks.md, the CPU worker's waits and ready tasks first). So a task may say when its inputs
# are there (``submit(..., ready=)``: its gradient's download event has completed). When the task first in line has such
# a check and is not ready, the worker takes the first queued task in priority order whose check passes; when none does,
# the one with a check that was submitted first (the device runs its downloads in submission order: that one comes down
# first). Tasks without a check (disk-tier updates, which must run in the order the tier reads ahead: [Note: disk
# updates in order]; speculation, whose order decides what is speculated; deferred updates and moments passes) are never
# taken out of their order. Which task runs when changes; what each computes does not: each is one unit's own update.


@contextmanager
def waiting(what: str):
    """Around a blocking wait inside a worker task (see [Note: the worker's waits]); on any other thread (the main
    thread's checkpoint or flush calls) it records nothing."""
    worker = getattr(_current, "worker", None)
    t = time.perf_counter()
    try:
        yield
    finally:
        if worker is not None:
            worker._task_waits.append((what, t, time.perf_counter()))


def wait_event(event, what: str = "gradient") -> None:
    """``event.synchronize()`` inside a worker task, counted as its wait for ``what`` ([Note: the worker's
    waits]): a device event, that of the download of the task's gradient."""
    with waiting(what):
        event.synchronize()


class HostWorker:
    """One thread that runs host-side tasks (AdamW updates, gradient adds) by priority, then in submission order
    ([Note: ready tasks first] for the tasks that may run ahead).

    A task that raises stops the work: the error is kept (not cleared by reading it), every later task is
    skipped, and every :meth:`check` raises :class:`WorkerError`, so that no caller waits forever on an
    update that will never run."""

    def __init__(self) -> None:
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = 0
        self._error: BaseException | None = None
        self._stopping = False
        self.busy_seconds = 0.0  # working, waits excluded ([Note: the worker's waits])
        self.wait_seconds = 0.0  # waiting inside tasks
        self.spans: list[tuple[str | None, float, float]] = []  # (label, start, end) working, host clock
        self.wait_spans: list[tuple[str, float, float]] = []  # ("label(what)", start, end) waiting
        self._task_waits: list[tuple[str, float, float]] = []
        self.taken_ahead = 0  # tasks run ahead of one not yet ready ([Note: ready tasks first])
        self._thread = threading.Thread(target=self._loop, name="zerofit-cpu-optimizer", daemon=True)
        self._thread.start()

    def _loop(self):
        _current.worker = self
        while True:
            _, _, label, task, _ = self._take()
            if task is None:
                self._q.task_done()
                return
            t = time.perf_counter()
            self._task_waits = []
            try:
                if self._error is None and not self._stopping:
                    task()
            except BaseException as e:  # surfaced on the main thread by check()
                self._error = e
            finally:
                self._record(label, t, time.perf_counter())
                task = None  # a done task must not keep its engine alive while the queue is idle
                self._q.task_done()

    def _take(self) -> tuple:
        """The next task ([Note: ready tasks first])."""
        head = self._q.get()
        if self._ready(head):
            return head
        queued = [head]
        while True:
            try:
                queued.append(self._q.get_nowait())
            except queue.Empty:
                break
        queued.sort()
        checked = [item for item in queued if item[4] is not None]
        chosen = next((item for item in checked if self._ready(item)), None) or min(checked, key=lambda item: item[1])
        if chosen is not head:
            self.taken_ahead += 1
        for item in queued:
            if item is not chosen:
                self._q.put(item)
                self._q.task_done()  # (a put counts a task: this one was counted when first submitted)
        return chosen

    @staticmethod
    def _ready(item: tuple) -> bool:
        """Whether a queued task's inputs are there. A check that raises (a device error) counts as ready: the task
        then runs, and its own wait raises the error where the worker reports it (a raise here, outside any task,
        would end the thread unreported and leave the main thread waiting on an update that never comes)."""
        try:
            return item[4] is None or bool(item[4]())
        except Exception:
            return True

    def _record(self, label: str | None, start: float, end: float) -> None:
        """The task's span, cut at its waits: working pieces (at least one, possibly empty) and waits."""
        work, waits = [], []
        a = start
        for what, ws, we in self._task_waits:
            if we - ws < 1e-5:  # an input that was ready: no wait worth a piece of the trace
                continue
            if ws - a >= 1e-5:  # (the few microseconds from a task's start to its first wait: no piece)
                work.append((label, a, ws))
            waits.append((f"{label}({what})", ws, we))
            a = max(a, we)
        if end > a or not work:
            work.append((label, a, max(a, end)))
        waited = sum(we - ws for _, ws, we in waits)
        self.busy_seconds += (end - start) - waited
        self.wait_seconds += waited
        if len(self.spans) < 100_000:  # drained every step; bounded if nobody drains
            self.spans += work
            self.wait_spans += waits

    def submit(self, fn, priority: int = 0, label: str | None = None, ready=None) -> None:
        """Queue ``fn``; among queued tasks the lowest ``priority`` runs first, ties in submission order.
        ``label`` names the task in the step's trace. ``ready``: a check that ``fn``'s inputs are there; a task
        with one may run ahead of one whose check fails ([Note: ready tasks first])."""
        self.check()
        self._seq += 1
        self._q.put((priority, self._seq, label, fn, ready))

    def drain_spans(self) -> list[tuple[str, str | None, float, float]]:
        """(lane, label, start, end) since the last call: "cpu" (working) and "cpu wait"."""
        spans, waits = self.spans, self.wait_spans
        self.spans, self.wait_spans = [], []
        return [("cpu", *s) for s in spans] + [("cpu wait", *w) for w in waits]

    def drain(self) -> None:
        """Wait until every submitted task ran (or was skipped after an error)."""
        self._q.join()
        self.check()

    def wait_until(self, ready, block) -> float | None:
        """Block the calling (main) thread until ``ready()``, sleeping in ``block(timeout)`` (an event's
        ``wait``, a condition's ``wait``) and checking every 50 ms that this thread has not failed (a task that
        raised never frees what it held: WorkerError instead of a hang). The seconds waited, or None when
        ``ready()`` held at once. The one poll-and-check wait of the engine: for a unit's update, its moments
        pass, a staging buffer."""
        if ready():
            return None
        t = time.perf_counter()
        while not ready():
            block(0.05)
            if not ready():
                self.check()
        return time.perf_counter() - t

    def check(self) -> None:
        if self._error is not None:
            raise WorkerError(f"the CPU optimizer thread failed: {self._error!r}") from self._error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 60.0) -> bool:
        """Stop the thread: it finishes the task it is running, skips the queued ones, and is joined.

        Returns whether it stopped within ``timeout`` seconds. See [Note: engine lifecycle] (lifecycle.py)."""
        self._stopping = True
        if self._thread.is_alive():
            self._seq += 1
            self._q.put((2**62, self._seq, None, None, None))
            if threading.current_thread() is self._thread:
                return True  # the engine was collected on this thread (a task held its last reference)
            self._thread.join(timeout)
        return not self._thread.is_alive()
