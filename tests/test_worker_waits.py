"""[Note: the worker's waits] (src/zerofit/engine/optimizer.py): the CPU optimizer thread's time in the step's
trace and timeline is its working time; where a task waits for a gradient or for the disk, that time is on the
"cpu wait" lane and in ``optimizer_wait``."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import zerofit
from tests import tiny_models as tm
from zerofit.engine import disk as disk_mod
from zerofit.engine.optimizer import HostWorker, waiting


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
    assert [s[1] for s in work] == ["adamw[b]", "adamw[b]"]
    assert [s[1] for s in waits] == ["adamw[b](gradient)", "adamw[b](disk)"]
    _tiled(spans)
    assert w.wait_seconds >= 0.35
    assert 0.02 <= w.busy_seconds < 0.3, w.busy_seconds        # with the waits it would be over 0.37
    assert sum(b - a for _, _, a, b in work) == pytest.approx(w.busy_seconds, abs=1e-4)
    before = w.wait_seconds
    with waiting("disk"):          # not on the worker's thread: nothing is recorded
        time.sleep(0.01)
    assert w.wait_seconds == before and w.drain_spans() == []
    w.close()


def test_a_disk_bound_step_shows_the_cpu_waiting_for_the_disk(tmp_path, monkeypatch):
    """Each read of the tier takes 20 ms more: the disk-tier blocks' updates wait for their chunks. The trace
    shows those waits as the tasks' own, on the "cpu wait" lane; the working pieces and the waits of the worker
    never overlap; the timeline's optimizer seconds leave them out."""
    real = disk_mod._pread

    def slow(fd, bufs, offset):
        time.sleep(0.02)
        return real(fd, bufs, offset)
    monkeypatch.setattr(disk_mod, "_pread", slow)
    torch.manual_seed(0)
    model = tm.llama(layers=4)
    ref = zerofit.initialize(copy.deepcopy(model), {"device": "cpu", "precision": "bf16", "micro_batch_size": 2,
                                                    "gradient_accumulation_steps": 2})
    eng = zerofit.initialize(model, {"device": "cpu", "precision": "bf16", "micro_batch_size": 2,
                                     "gradient_accumulation_steps": 2,
                                     "offload": {"optimizer_device": "nvme", "nvme_path": str(tmp_path),
                                                 "disk_blocks": 2, "disk_weights": True}})
    data = tm.batches(3, 2)
    assert [eng.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]    # the same math
    trace, tl = eng.trace(), eng.timeline()
    waits = [e for e in trace if e["lane"] == "cpu wait"]
    swapped = [u.name for u in eng.blocks if u.swap]
    assert swapped
    for name in swapped:
        assert any(e["label"] == f"adamw[{name}](disk)" for e in waits), (name, waits)
    assert tl["optimizer_wait"] >= 0.02
    worker = [(e["label"], e["start"], e["end"]) for e in trace if e["lane"] in ("cpu", "cpu wait")]
    _tiled(worker)
    within = [e for e in trace if e["lane"] == "cpu" and e["start"] >= 0.0]
    assert sum(e["end"] - e["start"] for e in within) <= tl["optimizer"] + 1e-3
    assert sum(e["end"] - e["start"] for e in waits if e["start"] >= 0.0) <= tl["optimizer_wait"] + 1e-3
    ref.close()
    eng.close()
