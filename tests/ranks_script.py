"""One rank of a multi-process CPU (gloo) run, launched by tests/test_ranks.py the way torchrun would.

Arguments: a JSON spec. Every rank trains the same tiny model on its part of each global batch (rank r takes
micro-batches r*G .. r*G+G-1 of the step's N*G) and writes, as rank 0, losses and final fp32 weights (and
moments) to ``out``. Optional: load a checkpoint first, save one at the end, raise on one rank at one step.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zerofit  # noqa: E402
from tests import tiny_models as tm  # noqa: E402


def main() -> None:
    """One spec, or ``{"runs": [spec, ...]}``: each run in turn in the same processes and process group (the
    imports and the group's start-up are paid once); run i writes ``<its out>.<rank>``."""
    spec = json.loads(sys.argv[1])
    runs = spec.pop("runs", None)
    if runs is None:
        run(spec)
        return
    import torch.distributed as dist

    dist.init_process_group("gloo" if all(r["config"].get("device") == "cpu" for r in runs) else "nccl")
    for r in runs:
        run({**spec, **r})
    dist.destroy_process_group()


def run(spec: dict) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(spec.get("model_seed", 0))
    model = getattr(tm, spec.get("model", "llama"))()
    for n, p in model.named_parameters():       # frozen parameters ([Note: frozen parameters])
        if any(f in n for f in spec.get("freeze", ())):
            p.requires_grad_(False)
    G = spec["G"]
    data = tm.batches(spec["steps_total"], G * world, seed=spec.get("data_seed", 1))[spec.get("first", 0):
                                                                                      spec.get("first", 0) + spec["steps"]]
    engine = zerofit.initialize(model, spec["config"])
    assert engine.ranks.world == world and engine.config.world_size == world
    if spec.get("load"):
        engine.load_checkpoint(spec["load"])
    losses = []
    for step, mbs in enumerate(data):
        mine = mbs[rank * G:(rank + 1) * G]
        if spec.get("fail_rank") == rank and spec.get("fail_step") == step:
            mine = [{"input_ids": mine[0]["input_ids"][:, :3], "labels": mine[0]["labels"]}] + mine[1:]  # bad batch
        if spec.get("api") == "deepspeed":    # engine(**b); backward(loss); step() per micro-batch
            total = 0.0
            for b in mine:
                out = engine(**b)
                engine.backward(out.loss)
                engine.step()
                total += float(out.loss)
            losses.append(total / len(mine))
        else:
            losses.append(engine.train_batch(mine))
    if spec.get("save"):
        engine.save_checkpoint(spec["save"], tag=spec.get("tag"))
    if spec.get("export"):
        engine.save_pretrained(spec["export"], dtype="fp32")
    engine.wait()
    state = {"losses": losses, "skipped": engine.skipped_steps,
             "threads": torch.get_num_threads(), "speculation": dict(engine.speculation_stats)}
    # the host state is in one shared mapping per arena (memfd), not copied per rank
    with open("/proc/self/maps") as f:
        state["shared_mappings"] = sum(1 for line in f if "memfd:zerofit-state" in line)
    state["shards"] = {u.name: (u.lo, u.hi, u.numel) for u in engine.units}
    state["streamed"] = sum(1 for u in engine.blocks if u.home.name == "STREAMED")
    master = engine.master_state_dict()     # a collective: every rank reads the weights together
    out = {"state": state}
    state["sharded_device_units"] = sum(u.shard_state for u in engine.units)
    with engine.sharding.full_state(engine.units, write_back=False):     # whole moments of GPU-sharded units (a collective)
        if rank == 0:
            moments = {}
            for u in engine.units:
                prefix = "" if u.index < 0 else engine.adapter.block_prefix(u.index) + "."
                for n, v in u.layout.views(u.exp_avg).items():
                    moments[prefix + n] = v.detach().to("cpu", copy=True)
            out.update(master=master, exp_avg=moments)
    torch.save(out, f"{spec['out']}.{rank}")
    engine.close()


if __name__ == "__main__":
    main()
