"""examples/: each door's minimal script runs as a user runs it, in a process of its own on the CPU, and prints a
finite loss for every step; the scripts that train the same micro-batches every step (``train_batch.py``,
``peft_lora.py``) print a lower loss at the last step than at the first. ``train_batch.py`` also reads a Hugging
Face model folder (``--model DIR``). Every script in examples/ is run here and listed in examples/README.md."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
STEPS = 2

# script -> the optional package it needs (skipped where it is not installed), and whether its loss must fall
SCRIPTS = {
    "train_batch.py": (None, True),
    "deepspeed_loop.py": (None, False),
    "fsdp_loop.py": (None, False),
    "hf_trainer.py": ("accelerate", False),  # transformers' Trainer needs accelerate (zerofit[hf])
    "accelerate_loop.py": ("accelerate", False),
    "lightning_fabric.py": ("lightning", False),
    "peft_lora.py": ("peft", True),
    "grpo_arithmetic.py": ("trl", False),  # TRL's GRPOTrainer on zerofit (docs/rl.md)
}

# "step 1 loss 5.5560" (the scripts' own lines), or the Trainer's logs: {'loss': '5.548', ...} or {'loss': 5.548, ...}
LOSS = re.compile(r"^step \d+ loss (\S+)|'loss': '?([^',}]+)", re.MULTILINE)


def _run(script: str, *extra: str) -> list[float]:
    """Run ``examples/<script> --steps 2 --device cpu``; its exit status must be 0. Returns the printed losses."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    }
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", str(STEPS), "--device", "cpu", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    losses = [float(a or b) for a, b in LOSS.findall(r.stdout)]
    assert len(losses) == STEPS, f"{script}: expected {STEPS} losses, found {losses} in:\n{r.stdout[-2000:]}"
    assert all(math.isfinite(x) for x in losses), f"{script}: {losses}"
    return losses


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_example_runs_and_prints_a_finite_loss_per_step(script):
    package, falls = SCRIPTS[script]
    if package is not None:
        pytest.importorskip(package)
    losses = _run(script)
    if falls:  # the same micro-batches every step: the model memorizes them
        assert losses[-1] < losses[0], f"{script} did not train: {losses}"


def test_train_batch_reads_a_model_folder(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=97)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    losses = _run("train_batch.py", "--model", str(tmp_path / "model"))
    assert losses[-1] < losses[0], losses


def test_every_example_is_run_here_and_listed_in_the_readme():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(SCRIPTS)
    readme = (EXAMPLES / "README.md").read_text()
    assert [s for s in scripts if f"python examples/{s}" not in readme] == []
