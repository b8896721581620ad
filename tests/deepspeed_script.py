"""Real DeepSpeed on the CPU, for tests/test_deepspeed_checkpoints.py: each run trains a tiny Llama, saves a
DeepSpeed checkpoint and goes on training, and writes what DeepSpeed itself had and did.

Run in a subprocess of its own (DeepSpeed sets up its accelerator, logging and torch.distributed in the
process): ``python tests/deepspeed_script.py SPEC_JSON`` with ``DS_ACCELERATOR=cpu``. The spec:
``{"out": dir, "runs": [run, ...]}``, a run ``{"name", "stage", "precision", "G", "steps", "more", ...}``:

- trains ``steps`` optimizer steps (``G`` micro-batches each, DeepSpeed's loop: ``engine(**b)``,
  ``backward``, ``step`` per micro-batch) of ``tiny_models.batches(steps + more, G)``, then
  ``save_checkpoint(out/name, client_state=...)``; with ``"mid": k`` it runs ``k`` more micro-batches of
  the next step first and saves in the middle of that accumulation window, as a script may;
- writes ``out/name.pt``: per parameter (DeepSpeed's own accessors, ``safe_get_full_fp32_param`` and
  ``safe_get_full_optimizer_state``) the fp32 master and moments at the save, the losses of ``more`` further
  steps DeepSpeed takes itself (the window a mid-window save was in runs to its end first) and the fp32
  masters after them.

Several data-parallel ranks (``"world": 2``): the test starts one process per rank (RANK, WORLD_SIZE and a
``file://`` store in ``ZF_DS_STORE``); rank r trains on its half of each step's 2G micro-batches.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
import deepspeed.comm.torch as ds_comm_torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

from tests import tiny_models as tm  # noqa: E402

# world size 1 needs no shared-memory all-reduce; DeepSpeed would compile its C++ op (a minute) to get one
ds_comm_torch.build_shm_op = lambda: None


def ds_config(run: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": run["G"],
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.99], "eps": 1e-8,
                                                     "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}},
           "zero_optimization": {"stage": run["stage"]}, "gradient_clipping": run.get("clip", 0.0),
           "steps_per_print": 10**6}
    if run["precision"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(run.get("extra", {}))
    return cfg


def state_of(engine) -> dict:
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = (safe_get_full_fp32_param(p).clone(), safe_get_full_optimizer_state(p, "exp_avg").clone(),
                     safe_get_full_optimizer_state(p, "exp_avg_sq").clone())
    return out


def masters(engine) -> dict:
    return {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}


def micro(engine, b) -> float:
    out = engine(**b)
    engine.backward(out.loss)
    engine.step()
    return out.loss.item()


def one(run: dict, out_dir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tm.llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(run))
    G = run["G"]
    data = tm.batches(run["steps"] + run["more"], G * world)
    mine = [mbs[rank * G:(rank + 1) * G] for mbs in data]
    for mbs in mine[:run["steps"]]:
        for b in mbs:
            micro(engine, b)
    rest = [b for mbs in mine[run["steps"]:] for b in mbs]
    mid = run.get("mid", 0)
    done = [micro(engine, b) for b in rest[:mid]]
    state = state_of(engine)
    engine.save_checkpoint(os.path.join(out_dir, run["name"]),
                           client_state={"epoch": 3, "seen": torch.arange(4), "note": run["name"]})
    losses = done + [micro(engine, b) for b in rest[mid:]]
    result = {"state": state, "losses": losses, "final": masters(engine), "global_steps": engine.global_steps,
              "lr": engine.get_lr()}
    if rank == 0:
        torch.save(result, os.path.join(out_dir, run["name"] + ".pt"))
    del engine


def main() -> None:
    spec = json.loads(sys.argv[1])
    store = os.environ.get("ZF_DS_STORE")
    if store:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:       # one process: no rendezvous, no port
        os.environ.update(RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])     # DeepSpeed asks for it (one host)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in spec["runs"]:
        one(run, spec["out"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
