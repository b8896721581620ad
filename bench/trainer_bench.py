"""A workload trained through ``zerofit.hf.Trainer`` (the Hugging Face Trainer on zerofit), timed per step.

    python3 bench/trainer_bench.py --workload W2 --steps 5 --cap 24GiB --out RESULT.json [--device cuda]

The model is built on the meta device (zerofit materializes it, as `bench/engine_zerofit.py` does), the data
are uniform random tokens, the batch is the workload's (micro-batch, accumulation, sequence length), bf16,
AdamW lr 1e-4 and weight decay 0.01 (the Trainer's rule: none on biases and norm weights), constant
schedule, no clipping (`max_grad_norm=0`, as the `zerofit` train_batch runs of bench/run.py). Each optimizer
step's wall time comes from a callback; tokens/s is the median of the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cap", default="24GiB")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch
    from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments

    import zerofit.hf
    from zerofit.hf import Trainer

    w = common.WORKLOADS[a.workload]
    with torch.device("meta"):
        model = LlamaForCausalLM(common.llama_config(w))
    n = w.micro_batch * w.grad_accum * (a.steps + 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, w.vocab, (n, w.seq), generator=g)
    train = [{"input_ids": r, "labels": r} for r in ids]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if a.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    out_dir = tempfile.mkdtemp(prefix="zf-trainer-")
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=w.grad_accum,
        max_steps=a.steps,
        learning_rate=1e-4,
        weight_decay=0.01,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=a.device == "cpu",
        dataloader_drop_last=True,
    )
    cfg = {"seq_len": w.seq}
    if a.cap and a.device == "cuda":
        cfg["max_gpu_memory"] = a.cap
    t0 = time.perf_counter()
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[Clock()], zerofit_config=cfg)
    result = trainer.train()
    wall = time.perf_counter() - t0
    tokens = w.micro_batch * w.grad_accum * w.seq
    steady = times[1:] or times
    s = statistics.median(steady)
    engine = trainer.zerofit_engine
    res = {
        "engine": "zerofit-trainer",
        "workload": a.workload,
        "step_s": times,
        "s_per_step": s,
        "tokens_per_s": tokens / s,
        "tokens_per_step": tokens,
        "wall_s": wall,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "train_loss": result.training_loss,
        "plan": engine.plan.describe(),
        "timeline": engine.timeline(),
        "zerofit_hf": zerofit.hf.__name__,
        "window_stats": engine.window_stats,
        "trace": engine.trace(),
        "peak_gpu_gib": (torch.cuda.max_memory_allocated() / 2**30) if a.device == "cuda" else None,
        "peak_rss_gib": common.peak_rss_gib() if hasattr(common, "peak_rss_gib") else None,
    }
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"[trainer] {a.workload}: {res['tokens_per_s']:,.0f} tokens/s, {s:.2f} s/step, steps {times}", flush=True)
    trainer.zerofit_engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
