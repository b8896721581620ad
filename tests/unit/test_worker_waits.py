"""[Note: the worker's waits] (src/zerofit/engine/update/worker.py): the CPU optimizer thread's time in the step's
trace and timeline is its working time; where a task waits for a gradient or for the disk, that time is on the
"cpu wait" lane and in ``optimizer_wait``."""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.disk import swapfile as swapfile_mod
from zerofit.engine.update import host as host_mod
from zerofit.engine.update.worker import HostWorker, waiting


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _tiled(pieces: list[tuple]) -> None:
    """Pieces of one thread's time never overlap."""
    pieces = sorted(pieces, key=lambda p: (p[-2], p[-1]))
    for a, b in zip(pieces, pieces[1:]):
        assert b[-2] >= a[-1] - 1e-9, (a, b)


def test_a_tasks_waits_are_not_its_work():
    w = HostWorker()

    def task():
        with waiting("gradient"):
            time.sleep(0.2)
        _spin(0.01)
        with waiting("disk"):
            time.sleep(0.15)
        _spin(0.01)

    w.drain_spans()
    w.submit(task, label="adamw[b]")
    w.drain()
    spans = w.drain_spans()
    work = [s for s in spans if s[0] == "cpu"]
    waits = [s for s in spans if s[0] == "cpu wait"]
    assert {s[1] for s in work} == {"adamw[b]"} and 2 <= len(work) <= 3  # (+ the instant before the first wait)
    assert [s[1] for s in waits] == ["adamw[b](gradient)", "adamw[b](disk)"]
    _tiled(spans)
    assert w.wait_seconds >= 0.35
    assert 0.02 <= w.busy_seconds < 0.3, w.busy_seconds  # with the waits it would be over 0.37
    assert sum(b - a for _, _, a, b in work) == pytest.approx(w.busy_seconds, abs=1e-4)
    before = w.wait_seconds
    with waiting("disk"):  # not on the worker's thread: nothing is recorded
        time.sleep(0.01)
    assert w.wait_seconds == before and w.drain_spans() == []
    w.close()


def test_a_disk_bound_step_shows_the_cpu_waiting_for_the_disk(tmp_path, monkeypatch):
    """A read of the tier cannot finish until an update has asked for a chunk, then takes 20 ms: each step's first
    disk-tier update waits for its chunk (reads ahead of the others may finish before theirs are asked for, on a
    busy machine or not, so only that one is sure to wait). The trace shows those waits as the tasks' own, on
    the "cpu wait" lane; the working pieces and the waits of the worker never overlap; the timeline's optimizer
    seconds leave them out."""
    real, asked = swapfile_mod._pread, threading.Event()

    def slow(fd, bufs, offset):
        asked.wait(2.0)  # (bounded: a read nobody waits for is not held forever)
        time.sleep(0.02)
        return real(fd, bufs, offset)

    @contextlib.contextmanager
    def watched(what):
        try:
            with waiting(what):  # (its clock starts before the read may go on)
                if what == "disk":
                    asked.set()
                yield
        finally:
            asked.clear()

    monkeypatch.setattr(swapfile_mod, "_pread", slow)
    monkeypatch.setattr(host_mod, "waiting", watched)
    torch.manual_seed(0)
    model = tm.llama(layers=4)
    ref = zerofit.initialize(
        copy.deepcopy(model),
        {"device": "cpu", "precision": "bf16", "micro_batch_size": 2, "gradient_accumulation_steps": 2},
    )
    eng = zerofit.initialize(
        model,
        {
            "device": "cpu",
            "precision": "bf16",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "offload": {"optimizer_device": "nvme", "nvme_path": str(tmp_path), "disk_blocks": 2, "disk_weights": True},
        },
    )
    data = tm.batches(3, 2)
    assert [eng.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]  # the same math
    trace, tl = eng.trace(), eng.timeline()
    waits = [e for e in trace if e["lane"] == "cpu wait"]
    swapped = {u.name for u in eng.blocks if u.swap}
    assert swapped
    disk_waits = [e for e in waits if e["label"].endswith("(disk)")]
    waited = {e["label"][len("adamw[") : -len("](disk)")] for e in disk_waits}
    assert waited and waited <= swapped, (waited, swapped)  # the tasks' own waits, of swapped units only
    assert all(e["label"].startswith("adamw[") for e in disk_waits), disk_waits
    assert tl["optimizer_wait"] >= 0.02
    worker = [(e["label"], e["start"], e["end"]) for e in trace if e["lane"] in ("cpu", "cpu wait")]
    _tiled(worker)
    tasks = {t["label"]: t for t in tm.bench_module("trace").cpu_tasks(trace)}  # bench/trace.py --gaps
    for name in waited:
        t = tasks[f"adamw[{name}]"]
        assert t["wait"] > 0.0 and t["work"] > 0.0, t
    within = [e for e in trace if e["lane"] == "cpu" and e["start"] >= 0.0]
    assert sum(e["end"] - e["start"] for e in within) <= tl["optimizer"] + 1e-3
    assert sum(e["end"] - e["start"] for e in waits if e["start"] >= 0.0) <= tl["optimizer_wait"] + 1e-3
    ref.close()
    eng.close()


class _Flag:
    """A task's input that arrives when ``set`` (a download's event): ``query`` says whether it has."""

    def __init__(self):
        self.event = threading.Event()

    def query(self) -> bool:
        return self.event.is_set()


def test_the_worker_runs_a_ready_task_before_one_still_waiting_for_its_input():
    """[Note: ready tasks first]: the first task in line (lowest priority) whose input is not there yet does not
    hold up a later one whose input is; with none ready, the one submitted first runs (its input comes first);
    tasks without a check keep their order."""
    w = HostWorker()
    gate, order = threading.Event(), []

    def task(name, flag=None):
        def run():
            if flag is not None:
                with waiting("gradient"):
                    flag.event.wait(5)
            order.append(name)

        return run

    w.submit(lambda: gate.wait(5), label="gate")  # the queue fills behind it
    late, ready, first, second = _Flag(), _Flag(), _Flag(), _Flag()
    ready.event.set()
    w.submit(task("disk-1"), 10)  # no check: never taken out of order
    w.submit(task("first-submitted", first), 5, ready=first.query)
    w.submit(task("late", late), 0, ready=late.query)
    w.submit(task("ready", ready), 1, ready=ready.query)
    w.submit(task("second-submitted", second), 3, ready=second.query)
    w.submit(task("disk-2"), 11)
    gate.set()
    _until(lambda: order)
    assert order == ["ready"]  # run ahead of "late"; then the worker waits for one
    first.event.set()  # of the three not ready: the first submitted of them
    _until(lambda: len(order) == 2)  # (had it taken another, it would still wait here)
    assert order == ["ready", "first-submitted"]
    late.event.set()
    second.event.set()
    w.drain()
    assert order == ["ready", "first-submitted", "late", "second-submitted", "disk-1", "disk-2"]
    assert w.taken_ahead == 2
    w.close()


def _until(cond, seconds: float = 5.0) -> None:
    end = time.time() + seconds
    while not cond() and time.time() < end:
        time.sleep(0.002)


class _LateEvent:
    """A device event on the CPU that completes ``delay`` seconds after it is recorded, as a download does."""

    def __init__(self, delay: float):
        self.at = time.perf_counter() + delay

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        left = self.at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def record(self, stream=None):
        return None


def test_updates_taken_out_of_order_are_the_same_updates():
    """With every device event completing 50 ms late, the backward's updates run ready first (at least one ahead
    of its order); the weights, the moments and the losses are bitwise the reference's."""
    torch.manual_seed(0)
    model = tm.llama(layers=6)
    cfg = {
        "device": "cpu",
        "precision": "bf16",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    ref = zerofit.initialize(copy.deepcopy(model), cfg)
    eng = zerofit.initialize(model, cfg)
    eng.dev.record = lambda stream: _LateEvent(0.05)
    data = tm.batches(4, 2)
    assert [eng.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]
    assert eng.worker.taken_ahead >= 1
    a, b = eng.master_state_dict(), ref.master_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in b)
    for x, y in zip(eng.units, ref.units):
        if x.exp_avg is not None:
            assert torch.equal(x.exp_avg, y.exp_avg) and torch.equal(x.exp_avg_sq, y.exp_avg_sq), x.name
    ref.close()
    eng.close()


def test_a_readiness_check_that_raises_runs_its_task_and_reports_the_tasks_error():
    """A device error can surface in the check itself (``event.query()``): the worker must not die of it unreported.
    The task runs; its own wait raises; the worker reports that, and runs nothing after it."""
    from zerofit.engine.update.worker import WorkerError

    w = HostWorker()
    gate, ran = threading.Event(), []

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def task():
        ran.append("task")
        broken()  # its event.synchronize() raises the same error

    w.submit(lambda: gate.wait(5), label="gate")
    w.submit(task, 0, label="adamw[b]", ready=broken)
    w.submit(lambda: ran.append("later"), 1, label="adamw[c]", ready=lambda: True)
    gate.set()
    errors = []

    def drain():
        try:
            w.drain()
        except WorkerError as e:
            errors.append(e)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the worker ended without reporting: drain() never returns"
    assert len(errors) == 1 and "illegal memory access" in str(errors[0])
    assert ran == ["task"] and w.alive
    w.close()


def test_trace_tools_task_list_joins_each_tasks_pieces():
    """bench/trace.py's ``cpu_tasks``: a task is the run of adjacent pieces with its label (working, waiting); the
    same label later in the step is another task; a trace without waits counts every span as work."""
    trace = [
        {"lane": "cpu", "label": "adamw[a]", "start": 0.000, "end": 0.001},
        {"lane": "cpu wait", "label": "adamw[a](gradient)", "start": 0.001, "end": 0.050},
        {"lane": "cpu", "label": "adamw[a]", "start": 0.050, "end": 0.090},
        {"lane": "cpu wait", "label": "adamw[b](disk)", "start": 0.090, "end": 0.300},
        {"lane": "cpu", "label": "adamw[b]", "start": 0.300, "end": 0.380},
        {"lane": "compute", "label": "model.layers.0", "start": 0.0, "end": 0.4},
        {"lane": "cpu", "label": "adamw[a]", "start": 0.500, "end": 0.540},
    ]
    tasks = tm.bench_module("trace").cpu_tasks(trace)
    got = [(t["label"], round(t["work"], 3), round(t["wait"], 3), t["start"]) for t in tasks]
    assert got == [("adamw[a]", 0.041, 0.049, 0.0), ("adamw[b]", 0.08, 0.21, 0.09), ("adamw[a]", 0.04, 0.0, 0.5)]
