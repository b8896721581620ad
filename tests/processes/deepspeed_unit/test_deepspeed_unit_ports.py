"""DeepSpeed 0.19.8's own unit tests, ported into unit/ (DeepSpeed's tests/unit layout: each file says what it
keeps, what it leaves out and why), run with the one change docs/migration.md names, ``import
zerofit.deepspeed.alias`` as each file's first line, in a pytest process of their own (this one has the real
DeepSpeed imported). Every case must pass, except the ones listed in XFAIL, which are marked
``xfail(strict=True, raises=...)`` in their files with the reason (a difference from DeepSpeed that zerofit
keeps or has not closed yet: docs/migration.md); none may be skipped. The cases are counted, so that a case lost
from a file fails here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

FILES = [
    "unit/runtime/test_ds_initialize.py",
    "unit/runtime/test_data.py",
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/runtime/half_precision/test_dynamic_loss_scale.py",
    "unit/runtime/half_precision/test_fp16.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_zero_optimizer.py",
]

# the cases that fail on zerofit, each for the reason its xfail mark gives
XFAIL = {
    "unit.runtime.test_ds_initialize.TestNoOptim::test[0]",  # offload_param with stage 0
    "unit.runtime.test_ds_initialize.TestClientOptimizer::test[Optimizer]",  # the optimizer is a view
    "unit.runtime.test_ds_initialize.TestClientOptimizer::test[Callable]",
    "unit.runtime.test_ds_initialize.TestClientLrScheduler::test[_LRScheduler-None]",  # scheduler over another
    "unit.runtime.test_ds_initialize.TestClientLrScheduler::test[_LRScheduler-Callable]",  # optimizer
    "unit.runtime.test_ds_config_dict.TestConfigLoad::test_hjson",  # JSON only
    "unit.runtime.half_precision.test_dynamic_loss_scale.TestFused::test_no_overflow",  # hand-written p.grad
    "unit.runtime.half_precision.test_dynamic_loss_scale.TestFused::test_all_overflow",
    "unit.runtime.half_precision.test_dynamic_loss_scale.TestFused::test_some_overflow",
    "unit.checkpoint.test_latest_checkpoint.TestLatestCheckpoint::test_existing_latest",  # load_lr_scheduler_states
    "unit.checkpoint.test_zero_optimizer.TestZeROSaveLoadEdgeCase::test_immediate_save_load[0]",  # =False
    "unit.checkpoint.test_zero_optimizer.TestZeROSaveLoadEdgeCase::test_immediate_save_load[2]",
    "unit.checkpoint.test_zero_optimizer.TestZeROSaveLoadEdgeCase::test_load_immediate_save[2]",
}
CASES = 97  # 84 pass, 13 xfail


@pytest.mark.slow
def test_deepspeed_unit_tests_run_with_the_alias_line(tmp_path):
    report = tmp_path / "report.xml"
    env = {**os.environ, "ZEROFIT_DS_UNIT_PORT": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("DS_ACCELERATOR", None)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            f"--junitxml={report}",
            "-o",
            "junit_family=xunit1",
            *FILES,
        ],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert report.exists(), r.stdout[-4000:] + r.stderr[-4000:]
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname").removeprefix("tests.processes.deepspeed_unit.")  # junit's path from the root
        name = f"{module}::{case.get('name')}"  # unit.x.test_y[.Class]::test[params]
        kinds = {child.tag for child in case}
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("type") == "pytest.xfail":
            outcome = "xfailed"
        elif kinds & {"failure", "error"}:
            outcome = "failed"
        elif skipped is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        outcomes[name] = outcome
    bad = {n: o for n, o in outcomes.items() if o != ("xfailed" if n in XFAIL else "passed")}
    assert not bad, f"{bad}\n{r.stdout[-6000:]}"
    assert set(outcomes) >= XFAIL, XFAIL - set(outcomes)
    assert len(outcomes) == CASES, (len(outcomes), r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-6000:]
