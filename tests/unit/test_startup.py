"""[Note: start-up progress] (src/zerofit/engine/model/startup.py): the materialization tells its listeners (zerofit
train's progress bar) as each unit lands, logs at INFO, and names where its seconds went."""

from __future__ import annotations

import logging

import pytest

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.model import startup

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_materialization_reports_its_progress_and_its_phases(caplog):
    heard = []
    model = tm.llama(layers=3)
    total = sum(p.numel() for p in model.parameters())
    with caplog.at_level(logging.INFO, logger="zerofit"), startup.listen(lambda *a: heard.append(a)):
        engine = zerofit.initialize(model, {"device": "cpu", "precision": "fp32", "micro_batch_size": 1})
    assert [d for d, _, _ in heard] == sorted(d for d, _, _ in heard)  # done only grows
    assert len(heard) >= 4 and heard[-1][:2] == (total, total)  # each unit, then the end
    assert engine.startup.total == total and engine.startup.took is not None
    assert "copy" in engine.startup.seconds
    assert any("materializing the model took" in r.message for r in caplog.records)
    engine.close()


def test_a_slow_materialization_logs_its_rate_and_time_left(caplog, monkeypatch):
    monkeypatch.setattr(startup, "EVERY", 0.0)  # every unit is "a few seconds later"
    s = startup.Startup(4_000_000_000)
    with caplog.at_level(logging.INFO, logger="zerofit"):
        with s.phase("read"):
            s.advance(1_000_000_000)
        s.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert any("1.0 of 4.0 B parameters (25%)" in line and "s left" in line for line in lines), lines
    assert "read" in s.summary() or s.seconds["read"] < 0.05
