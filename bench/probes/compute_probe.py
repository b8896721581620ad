"""Why does ``zerofit estimate``'s compute come out short? (W1 in host memory: 11% short, docs/benchmarks.md)

Times forward + recompute + backward per micro-batch of plain PyTorch models of a workload's shape
(activation checkpointing, bf16, no optimizer) on the GPU: the 4- and 8-block pair the estimate uses, held
for 2 s and for 8 s (clocks under sustained load), an 8/16 pair, and the whole model; prints the per-block
and shell figures each implies and the whole model's time against each prediction. One JSON line per
measurement, then a summary.

    python3 bench/probes/compute_probe.py --shape w1 --micro-batch 2 --seq-len 2048 --accum 4
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # the working tree's zerofit


def timed(model_cls, cfg, layers, mb, seq, accum, seconds):
    small = cfg.__class__.from_dict({**cfg.to_dict(), "num_hidden_layers": layers})
    small._attn_implementation = "sdpa"
    dev = torch.device("cuda")
    with dev:
        m = model_cls._from_config(small, dtype=torch.bfloat16)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    ids = torch.randint(0, small.vocab_size, (mb, seq), device=dev)
    runs = []
    start = time.perf_counter()
    while len(runs) < 4 or time.perf_counter() - start < seconds:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(accum):
            m(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / accum)
        m.zero_grad(set_to_none=True)
    late = sorted(runs[len(runs) // 2 :])
    del m, ids
    gc.collect()
    torch.cuda.empty_cache()
    return late[len(late) // 2], len(runs)


def main():
    from zerofit.estimate import meta_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="w1")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--accum", type=int, default=4)
    a = ap.parse_args()
    model = meta_model(shape=a.shape)
    cfg, cls = model.config, type(model)
    L = cfg.num_hidden_layers
    out = {}
    for name, layers, secs in [
        ("4@2s", 4, 2.0),
        ("8@2s", 8, 2.0),
        ("4@8s", 4, 8.0),
        ("8@8s", 8, 8.0),
        ("16@2s", 16, 2.0),
        (f"{L}@4s", L, 4.0),
    ]:
        t, n = timed(cls, cfg, layers, a.micro_batch, a.seq_len, a.accum, secs)
        out[name] = t
        print(json.dumps({"run": name, "s_per_micro": t, "runs": n}), flush=True)

    def predict(lo, hi, nlo, nhi):
        per = (out[hi] - out[lo]) / (nhi - nlo)
        return per, out[lo] - nlo * per, (out[lo] - nlo * per) + L * per

    full = out[f"{L}@4s"]
    for lo, hi, nlo, nhi in [("4@2s", "8@2s", 4, 8), ("4@8s", "8@8s", 4, 8), ("8@2s", "16@2s", 8, 16)]:
        per, shell, pred = predict(lo, hi, nlo, nhi)
        print(
            json.dumps(
                {
                    "pair": f"{lo}/{hi}",
                    "per_block": per,
                    "shell": shell,
                    "predicted_full": pred,
                    "measured_full": full,
                    "error": pred / full - 1,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
