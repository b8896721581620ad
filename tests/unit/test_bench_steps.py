"""bench/'s step check: a figure is the median of at least three timed steps, a timed step over 1.5x the median is
named with what its timeline says it paid for, and bench/run.py raises too few steps and prints the flag in its
table. The case is a clipped W1 run whose second step still paid a warm-up (16.97, 3.97, 1.17 s: the median of its
two timed steps, 2.57 s, was printed as its speed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}_steps_under_test", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def common():
    return bench_module("common")


@pytest.fixture(scope="module")
def run():
    return bench_module("run")


def _line(step, optimizer, wait, compute=0.85):
    return {"step": step, "compute": compute, "upload": 0.3, "optimizer": optimizer, "wait": wait}


# the clipped run's three steps, and two more steady ones; the second step's optimizer and wait still warming up
STEPS = [16.97, 3.97, 1.17, 1.15, 1.18]
LINES = [_line(16.97, 6.1, 9.0), _line(3.97, 3.05, 2.86), _line(1.17, 0.2, 0.2), _line(1.15, 0.21, 0.19), None]


def test_two_timed_steps_are_too_few_and_the_slow_one_is_named(common):
    check = common.step_check(STEPS[:3], 1, LINES[:3])
    assert check["timed"] == 2 and not check["enough"]
    assert check["median_s"] == pytest.approx(2.57)
    (slow,) = check["slow"]  # 3.97 > 1.5 x 2.57: even the median of two flags it
    assert slow["step"] == 1 and slow["x_median"] == pytest.approx(1.54, abs=0.01)
    text = common.step_check_text(check)
    assert text.startswith("only 2 timed steps (fewer than 3)") and "step 1 took 3.97 s" in text


def test_a_slow_step_among_three_says_what_it_paid_for(common):
    check = common.step_check(STEPS, 1, LINES)
    assert check["timed"] == 4 and check["enough"]
    assert check["median_s"] == pytest.approx(1.175)
    (slow,) = check["slow"]
    assert slow["step"] == 1 and slow["s"] == 3.97 and slow["x_median"] == pytest.approx(3.38, abs=0.01)
    # each phase against its own median over the timed steps' timelines; "step" (the wall time) is not a phase
    paid = dict(slow["paid"])
    assert set(paid) == {"optimizer", "wait"}, paid
    assert paid["optimizer"] == pytest.approx(3.05 - 0.21) and paid["wait"] == pytest.approx(2.86 - 0.2)
    assert slow["paid"][0][0] == "optimizer"  # the largest first
    assert common.step_check_text(check) == (
        "step 1 took 3.97 s, 3.4x the median 1.18 s: optimizer +2.84 s, wait +2.66 s"
    )


def test_steady_steps_pass_and_a_step_without_timeline_is_still_flagged(common):
    assert common.step_check([9.0, 1.2, 1.1, 1.3], 1) == {"timed": 3, "enough": True, "median_s": 1.2, "slow": []}
    assert common.step_check_text(common.step_check([9.0, 1.2, 1.1, 1.3], 1)) == ""
    (slow,) = common.step_check([9.0, 1.2, 1.1, 1.9], 1)["slow"]  # 1.9 > 1.5 x 1.2
    assert slow == {"step": 3, "s": 1.9, "x_median": 1.58}
    assert common.step_check([5.0], 1) == {"timed": 0, "enough": False, "median_s": None, "slow": []}


def test_the_result_carries_the_check(common):
    res = common.Result(engine="zerofit", workload="W1", tokens_per_step=16384, params=3_212_749_824)
    res.step_s, res.extra["timelines"] = list(STEPS), list(LINES)
    s = res.to_json()
    assert s["s_per_step"] == pytest.approx(1.175) and s["step_check"]["slow"][0]["step"] == 1


def test_run_raises_too_few_steps_and_renders_the_flag(run):
    assert run.effective_steps(2, 3) == 4 and run.effective_steps(5, 3) == 5 and run.effective_steps(2, 1) == 2
    args = run.parse_args(["--workload", "W1", "--steps", "3"])
    assert args.min_timed == 3 and run.effective_steps(args.steps, args.min_timed) == 4
    meta = {
        "workload": "W1",
        "date": "2031-01-02 03:04 UTC",
        "commit": "abcdef1",
        "machine": {"gpu": "test", "cpu_count": 2, "ram_gib": 8},
        "command": "python3 bench/run.py --workload W1",
        "cap": "24GiB",
        "plain_cap": "none",
        "steps": 5,
        "fsdp2_steps": 4,
        "min_timed": 3,
        "engines": ["plain", "zerofit"],
    }
    zf = {"engine": "zerofit", "status": "ok", "step_s": STEPS, "warmup_steps": 1, "extra": {"timelines": LINES}}
    zf["tokens_per_s"], zf["s_per_step"] = 16384 / 1.175, 1.175  # an older result: no step_check recorded
    plain = {"engine": "plain", "status": "ok", "step_s": [9.0, 1.2, 1.1, 1.3], "warmup_steps": 1}
    md = run.render({"meta": meta, "results": [plain, zf]})
    (row,) = [ln for ln in md.splitlines() if ln.startswith("| zerofit |")]
    assert "step 1 took 3.97 s, 3.4x the median 1.18 s: optimizer +2.84 s, wait +2.66 s" in row
    (row,) = [ln for ln in md.splitlines() if ln.startswith("| plain |")]
    assert row.endswith(" |  |")  # nothing to say
    assert "plain 9.00 | 1.20, 1.10, 1.30; zerofit 16.97 | 3.97, 1.17, 1.15, 1.18" in md
