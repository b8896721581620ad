"""Child process of tests/processes/test_checkpoint_resume.py: train, save, or load and continue, then dump the results.

    python tests/support/resume_run.py save   OUT   # per variant: N steps, save_checkpoint, N more steps; dump
    python tests/support/resume_run.py resume OUT   # per variant: a fresh engine (the variant's load placement),
                                                    # load_checkpoint, the remaining steps; dump

Each step's micro-batches are picked with Python's ``random`` and cropped with numpy, and the
models have dropout, so the runs agree only if every generator and the data position resume too.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zerofit  # noqa: E402
from tests.support import tiny_models as tm  # noqa: E402
from zerofit.checkpoint.state import optimizer_entries, weight_entries  # noqa: E402

N, G = 3, 2
_BASE = {
    "device": os.environ.get("ZEROFIT_RESUME_DEVICE", "cpu"),  # tests/gpu/test_gpu.py runs it on cuda too
    "micro_batch_size": 2,
    "gradient_accumulation_steps": G,
    "gradient_clipping": 1.0,
    "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
    "scheduler": {"type": "cosine", "warmup_steps": 2, "total_steps": 2 * N},
}
# name -> (model builder, precision, extra config at save, extra config at load)
VARIANTS = {
    "fp32-dropout": (lambda: tm.llama(dropout=0.1), "fp32", {}, {}),
    "bf16": (lambda: tm.llama(tied=False), "bf16", {}, {}),
    "fp16-scaler": (
        tm.llama,
        "fp16",
        {"fp16": {"initial_scale_power": 24, "loss_scale_window": 2, "hysteresis": 1}},
        None,
    ),
    "placement": (
        lambda: tm.gpt2(dropout=0.1),
        "fp32",
        {"offload": {"resident_blocks": 1}},
        {"offload": {"resident_blocks": 0, "shell_optimizer": "host"}},
    ),
}
POOL = tm.batches(8, G, T=20, seed=3)


def _config(precision: str, extra: dict) -> dict:
    return {**_BASE, "precision": precision, **extra}


def _step(engine) -> float:
    mbs = POOL[random.randrange(len(POOL))]
    cut = int(np.random.randint(12, 21))
    return engine.train_batch([{k: v[:, :cut] for k, v in mb.items()} for mb in mbs])


def _dump(engine, losses: list[float]) -> dict:
    engine.wait()
    grab = lambda entries: {e.name: e.base[e.offset : e.offset + e.numel].clone() for e in entries}  # noqa: E731
    return {
        "losses": losses,
        "master": grab(weight_entries(engine)),
        "moments": grab(optimizer_entries(engine)),
        "unit_steps": [float(u.step) for u in engine.units],
        "global_step": engine.global_step,
        "skipped": engine.skipped_steps,
        "scale": engine.scaler.scale if engine.scaler else None,
    }


def main(mode: str, out: Path) -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    results = {}
    for name, (build, precision, at_save, at_load) in VARIANTS.items():
        random.seed(7)
        np.random.seed(7)
        torch.manual_seed(0)
        model = build()
        if mode == "save":
            engine = zerofit.initialize(model, _config(precision, at_save))
            losses = [_step(engine) for _ in range(N)]
            scales = [engine.scaler.scale] if engine.scaler else []
            engine.save_checkpoint(out / name, client_state={"next_step": N, "losses": list(losses)})
            losses += [_step(engine) for _ in range(N)]
            results[name] = _dump(engine, losses) | {"scale_at_save": scales}
        else:
            engine = zerofit.initialize(model, _config(precision, at_save if at_load is None else at_load))
            torch.manual_seed(123)  # the load must bring every generator back, whatever they are now
            random.seed(123)
            np.random.seed(123)
            path, client = engine.load_checkpoint(out / name)
            losses = list(client["losses"])
            losses += [_step(engine) for _ in range(client["next_step"], 2 * N)]
            results[name] = _dump(engine, losses) | {
                "path": path,
                "plan": (engine.plan.resident_blocks, engine.plan.shell_optimizer_on_device),
            }
        engine.close()
    torch.save(results, out / f"{mode}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
