"""python3 bench/convergence.py run --kernels fast --seed 1 --steps 300 --out /tmp/conv/fast-1.json
python3 bench/convergence.py summary /tmp/conv/*.json

The convergence check of the fast kernels ([Note: fast kernels], src/zerofit/engine/model/kernels.py): a 0.6 B
Llama (hidden 1536, 24 layers, the demo's byte-level tokens) trained by ``train_batch`` on Python's standard
library source (the demo's corpus), the same steps with ``kernels: exact`` and ``kernels: fast``, over several
seeds (the seed sets the initial weights and the order of the windows). ``summary`` compares the curves: the
exact runs' spread over seeds at each point, against the distance of the fast runs' mean from the exact runs'
mean (both smoothed over windows of 20 steps).

Each ``run`` is one process; several fit one 80 GB card at once (about 12 GB each, no cap).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def config(seq: int, hidden: int = 1536, layers: int = 24):
    from transformers import LlamaConfig

    from zerofit.demo.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 384),
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )


def run(args) -> int:
    import torch
    from transformers import LlamaForCausalLM

    import zerofit
    from zerofit.demo.corpus import load_corpus, micro_batches

    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = LlamaForCausalLM(config(args.seq, args.hidden, args.layers))
    model.to_empty(device="cpu")
    with torch.no_grad():
        torch.manual_seed(args.seed)
        model.init_weights()
    params = sum(p.numel() for p in model.parameters())
    engine = zerofit.initialize(
        model,
        {
            "micro_batch_size": args.micro_batch,
            "gradient_accumulation_steps": args.grad_accum,
            "seq_len": args.seq,
            "precision": "bf16",
            "kernels": args.kernels,
            "gradient_clipping": 1.0,
            "optimizer": {"lr": args.lr, "weight_decay": 0.01},
            "scheduler": {"type": "WarmupCosineLR", "warmup_steps": 20, "total_steps": args.steps},
        },
    )
    corpus = load_corpus()
    stream = micro_batches(corpus.train, args.micro_batch, args.seq, args.grad_accum, seed=args.seed)
    losses, t0 = [], time.perf_counter()
    for _ in range(args.steps):
        losses.append(float(engine.train_batch(next(stream))))
    wall = time.perf_counter() - t0
    doc = {
        "kernels": args.kernels,
        "describe": engine.kernels.describe(),
        "seed": args.seed,
        "params": params,
        "steps": args.steps,
        "tokens_per_step": args.micro_batch * args.grad_accum * args.seq,
        "wall_s": round(wall, 1),
        "compile_seconds": engine.kernels.compile_seconds,
        "losses": losses,
    }
    engine.close()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f)
    print(f"{args.kernels} seed {args.seed}: last loss {losses[-1]:.4f}, {wall:.1f} s", flush=True)
    return 0


def smooth(xs: list[float], k: int) -> list[float]:
    return [sum(xs[i : i + k]) / k for i in range(0, len(xs) - k + 1, k)]


def summary(paths: list[str], k: int = 20) -> dict:
    """Per window of ``k`` steps: the exact runs' spread over seeds (max - min of their means) and the distance
    between the fast runs' mean and the exact runs' mean."""
    runs: dict[str, list[dict]] = {}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        runs.setdefault(d["kernels"], []).append(d)
    exact = [smooth(r["losses"], k) for r in runs.get("exact", [])]
    fast = [smooth(r["losses"], k) for r in runs.get("fast", [])]
    if not exact or not fast:
        raise SystemExit("summary needs runs of both kernels")
    n = min(min(map(len, exact)), min(map(len, fast)))
    rows = []
    for i in range(n):
        e = [c[i] for c in exact]
        f_ = [c[i] for c in fast]
        me, mf = sum(e) / len(e), sum(f_) / len(f_)
        spread = max(e) - min(e)
        rows.append({"steps": f"{i * k + 1}-{(i + 1) * k}", "exact": me, "fast": mf, "gap": mf - me, "spread": spread})
    within = sum(abs(r["gap"]) <= r["spread"] for r in rows)
    out = {
        "seeds": {kind: sorted(r["seed"] for r in rs) for kind, rs in runs.items()},
        "windows": rows,
        "within_spread": f"{within}/{len(rows)}",
        "last": {kind: [r["losses"][-1] for r in rs] for kind, rs in runs.items()},
        "wall_s": {kind: [r["wall_s"] for r in rs] for kind, rs in runs.items()},
        "describe": {kind: rs[0]["describe"] for kind, rs in runs.items()},
    }
    print("| steps | exact (mean) | fast (mean) | fast - exact | exact's spread over seeds |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['steps']} | {r['exact']:.4f} | {r['fast']:.4f} | {r['gap']:+.4f} | {r['spread']:.4f} |")
    print(f"\nfast's mean within the exact runs' spread in {out['within_spread']} windows of {k} steps")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--kernels", choices=["exact", "fast"], required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int, default=300)
    r.add_argument("--seq", type=int, default=1024)
    r.add_argument("--micro-batch", type=int, default=8)
    r.add_argument("--grad-accum", type=int, default=1)
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--hidden", type=int, default=1536, help="the model's width (a smaller one for a dry run)")
    r.add_argument("--layers", type=int, default=24)
    r.add_argument("--out", required=True)
    s = sub.add_parser("summary")
    s.add_argument("paths", nargs="+")
    s.add_argument("--window", type=int, default=20)
    s.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    out = summary(args.paths, args.window)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
