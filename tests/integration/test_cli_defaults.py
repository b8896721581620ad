"""``zerofit train`` with its defaults on the folders and data users bring: a GPT-2-shaped folder (learnt
positions, fewer than 2,048) and one text file; a window past the model's positions refused before anything
loads; the libraries' import-time noise gone from the commands' output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

from tests.support.model_dirs import make_model_dir
from zerofit.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _train(model: Path, data: Path, out: Path, *extra: str):
    return CliRunner().invoke(
        app,
        [
            "train",
            "--model",
            str(model),
            "--data",
            str(data),
            "--output",
            str(out),
            "--device",
            "cpu",
            "--steps",
            "1",
            "--micro-batch-size",
            "1",
            "--grad-accum",
            "1",
            "--precision",
            "fp32",
            "--no-progress",
            "--no-export",
            *extra,
        ],
    )


def test_a_gpt2_folder_and_one_text_file_train_with_the_defaults(tmp_path):
    """The window defaults to the model's 256 learnt positions (2,048 would index past them); one file of one
    document trains with nothing held out."""
    model = make_model_dir(tmp_path / "gpt2", "gpt2", torch.float32)
    book = tmp_path / "book.txt"
    book.write_text("It was the best of times, it was the worst of times. " * 200)
    r = _train(model, book, tmp_path / "run")
    assert r.exit_code == 0, r.output
    assert "windows of 256" in r.output, r.output


def test_a_window_past_the_models_learnt_positions_is_refused_before_anything_loads(tmp_path):
    model = make_model_dir(tmp_path / "gpt2", "gpt2", torch.float32)
    book = tmp_path / "book.txt"
    book.write_text("words " * 100)
    r = _train(model, book, tmp_path / "run", "--seq-len", "512")
    assert r.exit_code == 2, r.output
    assert "--seq-len 512 is longer than the model's 256 positions" in r.output
    assert "give --seq-len 256 or less" in r.output and "Traceback" not in r.output


def test_estimate_prints_no_library_noise():
    """bitsandbytes' CPU-kernel line and DeepSpeed's accelerator warning come from their imports: a fresh
    process shows what a user sees."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(
        [sys.executable, "-m", "zerofit.cli", "estimate", "--shape", "W1", "--lora", "--cpu", "--no-measure"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "kernels-community" not in out and "gemm_4bit" not in out, out
    assert "Setting ds_accelerator" not in out and "accelerator" not in out.lower(), out
