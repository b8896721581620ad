"""One rank of a ``torchrun --max-restarts 1`` run (tests/processes/test_ranks.py): trains ``steps`` steps through
``zerofit.initialize``, saving a checkpoint after each; on the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0)
rank ``fail_rank`` raises after step ``fail_after``, and torchrun restarts every rank; the restarted attempt loads
the latest checkpoint and goes on. Writes ``OUT.<rank>``: the attempt, the first step it trained, its losses and
(rank 0) the final weights.

Arguments: ``OUT CKPT STEPS G FAIL_RANK FAIL_AFTER``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zerofit  # noqa: E402
from tests.support import tiny_models as tm  # noqa: E402


def main(out: str, ckpt: str, steps: int, G: int, fail_rank: int, fail_after: int) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    engine = zerofit.initialize(
        tm.llama(),
        {
            "device": "cpu",
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": G,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        },
    )
    rank, world = engine.ranks.rank, engine.ranks.world
    if (Path(ckpt) / "latest").exists():
        engine.load_checkpoint(ckpt)
    first = engine.global_step
    data = tm.batches(steps, G * world)
    losses = []
    for step in range(first, steps):
        losses.append(engine.train_batch(data[step][rank * G : (rank + 1) * G]))
        engine.save_checkpoint(ckpt)
        if attempt == 0 and rank == fail_rank and step + 1 == fail_after:
            raise RuntimeError(f"rank {rank} fails after step {step + 1} (the test's injected failure)")
    master = engine.master_state_dict()
    record = {"attempt": attempt, "first": first, "losses": losses}
    if rank == 0:
        record["master"] = master
    torch.save(record, f"{out}.{rank}")
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7]))
