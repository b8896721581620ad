"""bench/run.py's W7 engines (bench/engine_userloop.py: the user's own loop on zerofit.fsdp, through accelerate and
Lightning Fabric) as a dry run on the CPU (the smoke workload), each in a process of its own as on the GPU
machine: every one ends ok with a loss and the engine's timeline, so the GPU suite (`bench/gpu/suite.sh
userloop`) finds its harness working. The torch FSDP peers need a GPU (torch's FSDP refuses a machine without
one) and are not run here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_w7_engines_run_as_a_dry_run(tmp_path):
    engines = ["zerofit-fsdp1", "zerofit-fsdp1-w4-list", "zerofit-accelerate-w4", "zerofit-fabric-w4"]
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "run.py"),
        "--workload",
        "smoke",
        "--engines",
        ",".join(engines),
        "--steps",
        "2",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    ]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads((tmp_path / "results_smoke.json").read_text())
    rows = {r["engine"]: r for r in results["results"]}
    assert set(rows) == set(engines), rows.keys()
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("error"))
        assert r["timeline"]["compute"] > 0 and r["extra"]["trace"], name  # the engine's own timeline
