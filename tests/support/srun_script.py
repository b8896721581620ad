"""One task of an ``srun`` job on the CPU (tests/processes/test_ranks.py): only SLURM's variables are set, none of
torchrun's; the script is a user's, which reads no rank itself: ``zerofit.initialize`` makes the group from SLURM's
variables ([Note: srun is a launcher too]), and the rank comes from the engine. Trains ``steps`` steps on its part of
each global batch (rank r takes micro-batches r*G .. r*G+G-1) and writes ``OUT.<rank>``: its losses and (rank 0)
the final weights.

Arguments: ``OUT STEPS G``."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import zerofit  # noqa: E402
from tests.support import tiny_models as tm  # noqa: E402


def main(out: str, steps: int, G: int) -> None:
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
    losses = [engine.train_batch(mbs[rank * G : (rank + 1) * G]) for mbs in tm.batches(steps, G * world)]
    master = engine.master_state_dict()  # a collective
    record = {"losses": losses, "world": world, "env_rank": os.environ.get("RANK")}
    if rank == 0:
        record["master"] = master
    torch.save(record, f"{out}.{rank}")
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
