"""Exact resume across processes (RELIABILITY.md: 2N steps straight vs N steps, save, new process, load,
N steps: every loss, the final weights, optimizer state, scaler, RNG and data position bitwise equal).

This process trains every variant of tests/support/resume_run.py for 2N steps, saving at step N (a save must not
disturb the run either); a new Python process loads each checkpoint and trains the last N steps. Variants:
fp32 with dropout (the RNG must resume), bf16, fp16 with a loss scale that overflows (the scaler must
resume), and GPT-2 saved with one resident block and loaded with none and a host-optimized shell.
All use clipping 1.0 and a warm-up + cosine schedule.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.support import resume_run

ROOT = Path(__file__).resolve().parents[2]


def test_resume_in_a_new_process_is_bitwise_exact(tmp_path):
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        resume_run.main("save", tmp_path)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "resume_run.py"), "resume", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    straight = torch.load(tmp_path / "save.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resume.pt", weights_only=False)
    assert set(straight) == set(resumed) == set(resume_run.VARIANTS)
    for name, a in straight.items():
        b = resumed[name]
        assert len(a["losses"]) == 2 * resume_run.N
        assert a["losses"] == b["losses"], f"{name}: losses differ after the resume"
        for kind in ("master", "moments"):
            diff = [k for k in a[kind] if not torch.equal(a[kind][k], b[kind][k])]
            assert not diff, f"{name}: {kind} differ for {diff[:3]}"
        for k in ("unit_steps", "global_step", "skipped", "scale"):
            assert a[k] == b[k], f"{name}: {k} {a[k]} != {b[k]}"
    fp16 = straight["fp16-scaler"]
    assert fp16["skipped"] > 0 and fp16["scale"] != fp16["scale_at_save"][0], "the fp16 variant never overflowed"
    assert resumed["placement"]["plan"] == (0, False)
    assert resumed["fp32-dropout"]["global_step"] == 2 * resume_run.N


def test_the_users_loop_saved_with_torch_save_resumes_in_a_new_process_bitwise(tmp_path):
    """zerofit.fsdp's loop checkpointed the plain PyTorch way (torch.save of the model's, the optimizer's: the
    engine's moments in torch's format, and the scheduler's state_dict), loaded in a new process into a new
    wrapper, optimizer and scheduler: the same losses and weights as the run straight through."""
    script = ROOT / "tests" / "support" / "userloop_resume.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for mode in ("save", "resume"):
        p = subprocess.run(
            [sys.executable, str(script), mode, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    want = torch.load(tmp_path / "want.pt", weights_only=False)
    got = torch.load(tmp_path / "got.pt", weights_only=False)
    assert got["losses"] == want["losses"] and len(got["losses"]) == 2
    assert got["weights"].keys() == want["weights"].keys()
    assert all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items())
