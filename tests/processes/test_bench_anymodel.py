"""bench/run.py on the models that are not one chain of blocks (bench/anymodels.py: T5's shape, a Llama-shaped
U-Net) as a dry run on the CPU, each engine in a process of its own as on the GPU machine: zerofit streams them in
the hooked mode, plain PyTorch and DeepSpeed ZeRO-3 train the same model, every run ends ok with a finite loss, so
`bench/gpu/anymodel_job.sh` finds its harness working."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("workload", "engines"), [("T5-smoke", ["zerofit-hooked", "plain", "deepspeed"]), ("U-smoke", ["zerofit-hooked"])]
)
def test_the_any_model_workloads_run_as_a_dry_run(tmp_path, workload, engines):
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--workload", workload, "--engines", ",".join(engines)]
    cmd += ["--steps", "2", "--device", "cpu", "--out", str(tmp_path)]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["engine"]: r for r in json.loads((tmp_path / f"results_{workload}.json").read_text())["results"]}
    assert set(rows) == set(engines), rows.keys()
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("error"))
        assert all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) >= 2, name
    hooked = rows["zerofit-hooked"]["extra"]
    assert hooked["streaming"] == "hooked" and hooked["units"] >= 2, hooked
