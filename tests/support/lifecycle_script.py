"""A training script for the exit-status tests (test_engine_lifecycle.py on the CPU, test_gpu.py on the GPU):

    python tests/support/lifecycle_script.py {return,raise,raise-forward,sigint} [--device cpu|cuda]

return: trains a few steps with clipping, so that the CPU worker is still applying the last step's updates
        when the script ends, and returns. Expected: exit status 0.
raise:  block 0 raises in the backward, after the CPU worker began updating the later blocks (no clipping:
        updates overlap the backward); the EngineFailedError is not caught. Expected: exit status 1.
raise-forward: with clipping, block 0 raises in the forward of the step after a step whose updates the
        worker is still applying; the error (the engine stays usable) is not caught. Expected: exit status 1.
sigint: prints "training" after its first step and trains until SIGINT. Expected: KeyboardInterrupt.

Never ``terminate called without an active exception`` (exit status 134), never a hang. Only torch and
zerofit are imported (a subprocess start is mostly torch's import).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import zerofit

VOCAB = 97
MODES = ("return", "raise", "raise-forward", "sigint")


class Block(nn.Module):
    def __init__(self, d: int, index: int, fault: dict):
        super().__init__()
        self.index, self.fault = index, fault
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        phase = "backward" if torch.is_grad_enabled() else "forward"  # the backward recomputes with autograd
        if self.fault.get(phase) == self.index:
            raise RuntimeError(f"injected failure in block {self.index}'s {phase}")
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LM(nn.Module):
    def __init__(self, d: int, n: int):
        super().__init__()
        self.fault: dict = {}
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, i, self.fault) for i in range(n))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    torch.manual_seed(0)
    d, n = (1024, 8) if cuda else (256, 16)
    model = LM(d, n)
    config = {
        "device": args.device,
        "precision": "bf16" if cuda else "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "seq_len": 64,
        "optimizer": {"lr": 1e-4},
        "gradient_clipping": 0.0 if args.mode == "raise" else 1.0,
        "offload": {"resident_blocks": 0},
    }
    if cuda:
        config["max_gpu_memory"] = "8GiB"  # the cap is lifted at release
    engine = zerofit.initialize(model, config)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB, (2, 64), generator=g) for _ in range(2)]
    mbs = [{"input_ids": t, "labels": t} for t in ids]
    if args.mode == "return":
        for _ in range(2):
            engine.train_batch(mbs)
        print("trained", flush=True)
        return  # the worker is still updating: exit status 0
    if args.mode == "raise":
        engine.train_batch(mbs)
        model.fault["backward"] = 0
        engine.train_batch(mbs)  # EngineFailedError, not caught: exit status 1
        return
    if args.mode == "raise-forward":
        engine.train_batch(mbs)
        model.fault["forward"] = 0
        engine.train_batch(mbs)  # RuntimeError, not caught: exit status 1
        return
    engine.train_batch(mbs)
    print("training", flush=True)
    while True:
        engine.train_batch(mbs)


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    seconds_after_sigint: float | None = None


def run_all(device: str, modes: tuple[str, ...] = MODES, timeout: float = 120.0) -> dict[str, Outcome]:
    """Run these modes of this script at once in child processes (their start is mostly torch's import) and
    return how each ended. The ``sigint`` child gets SIGINT shortly after it reports that it trains."""
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(root / "src"), str(root), os.environ.get("PYTHONPATH")])),
    )
    procs = {
        mode: subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), mode, "--device", device],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in modes
    }
    deadline = time.monotonic() + timeout
    sig = procs.get("sigint")
    first = ""
    while sig and time.monotonic() < deadline and "training" not in first and sig.poll() is None:
        ready, _, _ = select.select([sig.stdout], [], [], 1.0)
        if ready:
            first += sig.stdout.readline()
    sent = None
    if "training" in first:
        time.sleep(0.3)  # into the next step
        sig.send_signal(signal.SIGINT)
        sent = time.monotonic()
    out = {}
    for mode in sorted(procs, key=lambda m: m != "sigint"):  # sigint first: its time after the signal
        proc = procs[mode]
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\n[killed: still running after {timeout:.0f} s]"
        after = time.monotonic() - sent if mode == "sigint" and sent is not None else None
        out[mode] = Outcome(proc.returncode, (first if mode == "sigint" else "") + stdout, stderr, after)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
