"""bench/grpo_bench.py (GRPO on one GPU, docs/rl.md) as a dry run on the CPU: zerofit's GRPOTrainer and stock TRL's
each in a process of its own on the smoke workload, as `bench/gpu/grpo_job.sh` runs them on the GPU machine; each
ends ok, with every step's seconds split into generation, scoring and training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("trl")


@pytest.mark.parametrize("engine", ["zerofit", "trl"])
def test_the_grpo_bench_runs_as_a_dry_run(tmp_path, engine):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--engine", engine, "--workload", "smoke"]
    cmd += ["--device", "cpu", "--steps", "2", "--prompt-len", "16", "--completion-len", "6", "--generations", "4"]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([*cmd, "--result", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and len(r["steps"]) == 2 and r["s_per_step"] > 0
    for step in r["steps"]:
        assert step["generation"] > 0 and step["scoring"] > 0 and step["training"] > 0  # beta 0.04: a reference pass
        assert abs(step["generation"] + step["scoring"] + step["training"] - step["s"]) < 1e-2
