"""Helpers of the `zerofit train` tests (test_run_folder.py, test_signals.py): the tiny model directory and
data, the command line, running it in this process or as its own process, and reading what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tests.support.model_dirs import make_model_dir, write_data

REPO = Path(__file__).resolve().parents[2]


def workspace(root: Path) -> tuple[Path, list[Path]]:
    """A tiny Llama model directory (bf16 shards, tokenizer) and data files of every format under ``root``."""
    return make_model_dir(root / "model", "llama", torch.bfloat16), write_data(root / "data")


def train_args(model: Path, data: list[Path], out: Path, *extra: str) -> list[str]:
    """``zerofit train`` on a tiny model folder, on the CPU, in fp32, small windows and batches, no progress bar."""
    return [
        "train", "--model", str(model), "--data", *map(str, data), "--output", str(out), "--device", "cpu",
        "--seq-len", "32", "--micro-batch-size", "2", "--grad-accum", "2", "--lr", "1e-3", "--precision", "fp32",
        "--eval-size", "2", "--no-progress", *extra,
    ]  # fmt: skip


def args(model: Path, data: list[Path], out: Path, *extra: str) -> list[str]:
    """:func:`train_args` without evaluations or an export (the run-folder tests)."""
    return train_args(model, data, out, "--eval-every", "0", "--no-export", *extra)


def invoke(argv: list[str]):
    """The command in this process (no interpreter start, no torch import): typer's result."""
    return CliRunner().invoke(app(), argv)


def app():
    from zerofit.cli import app as zerofit_app

    return zerofit_app


def spawn(argv: list[str], **env: str) -> subprocess.Popen:
    """``python -m zerofit.cli ARGV`` as its own process (output merged, text), with this checkout's zerofit."""
    path = os.pathsep.join(
        [str(REPO / "src"), str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    )
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **env}
    for k in ("WORLD_SIZE", "RANK"):
        full.pop(k, None)
    return subprocess.Popen(
        [sys.executable, "-m", "zerofit.cli", *argv],
        cwd=REPO,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(run) if "loss" in r]


def wait_for_steps(p: subprocess.Popen, run: Path, n: int, timeout: float = 180) -> None:
    """Until ``run``'s metrics hold ``n`` training records (the process must still be running)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = run / "metrics.jsonl"
        if m.is_file() and sum('"loss"' in line for line in m.read_text().splitlines()) >= n:
            return
        assert p.poll() is None, p.communicate()[0][-4000:]
        time.sleep(0.02)
    raise AssertionError(f"{run}: fewer than {n} steps after {timeout} s")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (weights and moments) or of a model directory."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad[:5]}"
