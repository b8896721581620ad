"""Several ranks on the CPU (gloo), launched as torchrun launches them: the same math as one process.

Each test starts N processes of tests/ranks_script.py with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and compares rank 0's per-step losses and final
weights with plain PyTorch training on the same global batch (N x G micro-batches per step), at fp32
tolerances (RELIABILITY.md). 3 ranks make uneven shards (the units' sizes are not multiples of 3).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import tiny_models as tm

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ranks_script.py"
G = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, spec: dict, tmp: Path, timeout: float = 240.0, env_extra: dict | None = None):
    """Run ``world`` ranks; returns (return codes, stderr texts, rank 0's output or None)."""
    out = tmp / f"out-{time.monotonic_ns()}.pt"
    spec = {"G": G, **spec, "out": str(out)}
    port = _port()
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT),
               **(env_extra or {})}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"ranks still running after {timeout} s (a hang)")
        errs.append(err)
    rcs = [p.returncode for p in procs]
    result = torch.load(out, weights_only=False) if out.exists() else None
    return rcs, errs, result


def _cfg(**kw) -> dict:
    base = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": G,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01}}
    base.update(kw)
    return base


def _reference(world: int, steps: int, clip: float = 0.0, model: str = "llama"):
    torch.manual_seed(0)
    ref = getattr(tm, model)()
    data = tm.batches(steps, G * world)
    losses = tm.reference_train(ref, data, clip=clip)
    return losses, {n: p.detach() for n, p in ref.named_parameters()}


def _check(result, ref_losses, ref_weights, rtol=1.3e-6, atol=1e-5):
    torch.testing.assert_close(torch.tensor(result["state"]["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    for n, w in ref_weights.items():
        torch.testing.assert_close(result["master"][n], w, rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


def _ok(rcs, errs):
    assert rcs == [0] * len(rcs), "\n".join(f"rank {i} rc {rc}:\n{e[-3000:]}" for i, (rc, e) in enumerate(zip(rcs, errs)))


STEPS = 4
_PLACEMENTS = {
    # every block streamed, its state in the shared host arena, updated by the CPU worker shard by shard
    "offload": {"offload": {"param_device": "cpu", "optimizer_device": "cpu", "resident_blocks": 0,
                            "shell_optimizer": "host"}},
    # a resident block and the shell with their optimizer on the device: replicated, gradients all-reduced
    "mixed": {"offload": {"param_device": "cpu", "optimizer_device": "cpu", "resident_blocks": 1,
                          "shell_optimizer": "device"}},
    # no offload: every unit on the device (replicated, as DDP)
    "no-offload": {"offload": {"param_device": "none", "optimizer_device": "none"}},
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("placement", sorted(_PLACEMENTS))
def test_ranks_train_like_one_process(world, placement, tmp_path):
    rcs, errs, result = launch(world, {"steps": STEPS, "steps_total": STEPS, "config": _cfg(**_PLACEMENTS[placement])},
                               tmp_path)
    _ok(rcs, errs)
    ref_losses, ref_weights = _reference(world, STEPS)
    _check(result, ref_losses, ref_weights)


def test_a_failing_rank_ends_every_rank_naming_it(tmp_path):
    """Rank 1 gets a bad batch at its second step and raises; rank 0, waiting in a collective, must not hang:
    it fails too, naming rank 1 and the cause."""
    t = time.monotonic()
    rcs, errs, result = launch(2, {"steps": 3, "steps_total": 3, "config": _cfg(), "fail_rank": 1, "fail_step": 1},
                               tmp_path, timeout=120)
    assert rcs[0] != 0 and rcs[1] != 0, rcs
    assert "labels must have input_ids" in errs[1]
    assert "another rank failed first (rank 1: BatchError" in errs[0], errs[0][-3000:]
    assert result is None
    assert time.monotonic() - t < 90
