"""Real DeepSpeed on the CPU, for tests/integration/test_deepspeed_checkpoints.py: each run trains a tiny Llama, saves a
DeepSpeed checkpoint and goes on training, and writes what DeepSpeed itself had and did.

Run in a subprocess of its own (DeepSpeed sets up its accelerator, logging and torch.distributed in the
process): ``python tests/support/deepspeed_script.py SPEC_JSON`` with ``DS_ACCELERATOR=cpu``. The spec:
``{"out": dir, "runs": [run, ...]}``, a run ``{"name", "config" (DeepSpeed's), "steps", "more"}`` and optionally
``"model"`` (LlamaConfig keywords; else ``tiny_models.llama()``), ``"groups"``, ``"freeze"`` (parameter
names), ``"mid"``, ``"universal"``:

- trains ``steps`` optimizer steps (G = ``gradient_accumulation_steps`` micro-batches each, DeepSpeed's loop:
  ``engine(**b)``, ``backward``, ``step`` per micro-batch) of ``tiny_models.batches(steps + more, G)``, then
  ``save_checkpoint(out/name, client_state=...)``; with ``"mid": k`` it runs ``k`` more micro-batches of
  the next step first and saves in the middle of that accumulation window, as a script may;
- writes ``out/name.pt``: per parameter (DeepSpeed's own accessors, ``safe_get_full_fp32_param`` and
  ``safe_get_full_optimizer_state``) the fp32 master and moments after the last optimizer step before the
  save, the losses of ``more`` further steps DeepSpeed takes itself (the micro-batches before a mid-window
  save included) and the fp32 masters after them, its step counters and loss scale;
- with ``"args"`` (TrainingArguments keywords), it is transformers' Trainer with ``deepspeed=config`` that
  trains and saves its ``checkpoint-N`` folders (:func:`hf`);
- with ``"universal": true``, converts the checkpoint with DeepSpeed's ds_to_universal into
  ``out/name/<tag>_universal``.

Several data-parallel ranks (``"world": 2``): the test starts one process per rank (RANK, WORLD_SIZE and a
``file://`` store in ``ZF_DS_STORE``); rank r trains on its half of each step's 2G micro-batches.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402,F401
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tests.support import tiny_models as tm  # noqa: E402

# world size 1 needs no shared-memory all-reduce; DeepSpeed would compile its C++ op (a minute) to get one
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # (deepspeed.comm.torch is torch, as an attribute)


def state_of(engine) -> dict | None:
    """Each parameter's fp32 master and moments, by DeepSpeed's accessors; None where they fail (DeepSpeed
    0.19.8 under ZeRO 1-2 with two parameter groups: "exp_avg not found in optimizer state fragment")."""
    try:
        return _state_of(engine)
    except ValueError as e:
        if "not found in optimizer state fragment" not in str(e):
            raise
        return None


def _state_of(engine) -> dict:
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:  # frozen: no optimizer state, its own value
            out[name] = (p.detach().float().clone(), None, None)
            continue
        out[name] = (
            safe_get_full_fp32_param(p).clone(),
            safe_get_full_optimizer_state(p, "exp_avg").clone(),
            safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
        )
    return out


def masters(engine) -> dict:
    return {
        name: (safe_get_full_fp32_param(p) if p.requires_grad else p.detach().float()).clone()
        for name, p in engine.module.named_parameters()
    }


def parameters(model, run: dict):
    """The model's parameters, or with ``"groups"`` two AdamW groups: matrices, and vectors without weight decay."""
    if not run.get("groups"):
        return [p for p in model.parameters() if p.requires_grad]
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim > 1]},
        {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0},
    ]


def adam_step(engine) -> list[float]:
    """The AdamW step count of each of DeepSpeed's flat groups (its base optimizer's state)."""
    return [float(s["step"]) for s in engine.optimizer.optimizer.state.values()]


def micro(engine, b) -> float:
    out = engine(**b)
    engine.backward(out.loss)
    engine.step()
    return out.loss.item()


def one(run: dict, out_dir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if run["config"].get("fp16", {}).get("enabled"):
        # DeepSpeed's CPU accelerator offers fp16 only where oneDNN has fp16 kernels; torch computes fp16 on any CPU
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(0)
    model = tm.llama() if "model" not in run else LlamaForCausalLM(LlamaConfig(**run["model"]))
    for name in run.get("freeze", ()):
        model.get_parameter(name).requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters(model, run), config=run["config"])
    G = run["config"]["gradient_accumulation_steps"]
    data = tm.batches(run["steps"] + run["more"], G * world)
    mine = [mbs[rank * G : (rank + 1) * G] for mbs in data]
    for mbs in mine[: run["steps"]]:
        for b in mbs:
            micro(engine, b)
    rest = [b for mbs in mine[run["steps"] :] for b in mbs]
    mid = run.get("mid", 0)
    state = state_of(engine)
    scaler = {
        k: getattr(engine.optimizer.loss_scaler, k, None)
        for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "dynamic")
    }
    at_save = {
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "scaler": scaler,
        "adam_step": adam_step(engine),
    }
    done = [micro(engine, b) for b in rest[:mid]]
    save_dir = os.path.join(out_dir, run["name"])
    engine.save_checkpoint(save_dir, client_state={"epoch": 3, "seen": torch.arange(4), "note": run["name"]})
    if state is None:  # DeepSpeed's own consolidation of the masters instead (no moments)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = {
            n: (t.clone(), None, None)
            for n, t in get_fp32_state_dict_from_zero_checkpoint(save_dir).items()
            if n in dict(engine.module.named_parameters())
        }
    losses = done + [micro(engine, b) for b in rest[mid:]]
    every = [None] * world
    dist.all_gather_object(every, losses)
    result = {
        "state": state,
        "losses": every[0],
        "rank_losses": every,
        "at_save": at_save,
        "final": masters(engine),
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "lr": engine.get_lr(),
        "scale": float(engine.optimizer.loss_scaler.cur_scale),
    }
    if run.get("reload"):  # what DeepSpeed's own load_checkpoint gives back, in a fresh engine
        torch.manual_seed(1)
        fresh = LlamaForCausalLM(LlamaConfig(**run["model"])) if "model" in run else tm.llama()
        again, *_ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=run["config"])
        path, client_state = again.load_checkpoint(save_dir)
        result["reload"] = {
            "path": path,
            "client_state": client_state,
            "global_steps": again.global_steps,
            "lr": again.get_lr(),
        }
        del again
    if rank == 0:
        torch.save(result, os.path.join(out_dir, run["name"] + ".pt"))
        if run.get("universal"):
            universal(save_dir)
    del engine


def universal(save_dir: str) -> None:
    """DeepSpeed's own conversion of the checkpoint to its universal layout, beside it (tag + "_universal")."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    tag = open(os.path.join(save_dir, "latest")).read().strip()
    args = argparse.Namespace(
        input_folder=os.path.join(save_dir, tag),
        output_folder=os.path.join(save_dir, tag + "_universal"),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds_to_universal.main(args)


def hf_data() -> list[dict]:
    """The Hugging Face run's 12 sequences (tests/integration/test_deepspeed_checkpoints.py builds the same)."""
    return [{"input_ids": r, "labels": r} for mbs in tm.batches(6, 1) for r in mbs[0]["input_ids"]]


def hf(run: dict, out_dir: str) -> None:
    """transformers' Trainer with ``deepspeed=`` (its own DeepSpeed integration), saving checkpoint-N folders:
    writes its log history and the final fp32 masters."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(output_dir=os.path.join(out_dir, run["name"]), deepspeed=run["config"], **run["args"])
    torch.manual_seed(0)
    trainer = Trainer(model=tm.llama(), args=args, train_dataset=hf_data(), data_collator=default_data_collator)
    trainer.train()
    torch.save(
        {"log_history": trainer.state.log_history, "final": masters(trainer.model_wrapped)},
        os.path.join(out_dir, run["name"] + ".pt"),
    )


def main() -> None:
    spec = json.loads(sys.argv[1])
    store = os.environ.get("ZF_DS_STORE")
    if store:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    else:  # one process: no rendezvous, no port
        os.environ.update(RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # DeepSpeed asks for it (one host)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in spec["runs"]:
        (hf if "args" in run else one)(run, spec["out"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
