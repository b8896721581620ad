"""W4: offloaded generation of the 13B shape (bf16) under a GPU cap: zerofit against accelerate's
``device_map`` offload, each engine in its own process, in one run (``bench/WORKLOADS.md``).

    python3 bench/infer.py --out results/w4 [--caps 24GiB,8GiB] [--batches 1,16] [--new-tokens 128]

Both engines get the same weights (a deterministic fill, by tensor name: no 26 GB random init), the same
prompts (random tokens, seed 0), greedy decoding with the end-of-sequence token off (every run decodes all
``--new-tokens``). Per run: prefill seconds (to the first new token), decode tokens/s (the batch's tokens
after the first, over the time after the first), peak GPU (allocated and reserved), the exit status. zerofit
also runs a 2,048-token prefill at each cap, and reports the PCIe bound: the streamed bytes per token over
the pinned host-to-device bandwidth measured in the same process. The first batch-1 tokens of both engines
are compared (same weights, same math: they must agree).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GiB = 2**30


# --------------------------------------------------------------------------- the model and the weights


def meta_model(w, dtype=None):
    import torch
    from transformers import LlamaForCausalLM

    cfg = common.llama_config(w)
    cfg.use_cache = True
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype or torch.float32)
    model.generation_config.eos_token_id = None  # decode every new token
    model.generation_config.pad_token_id = 0
    return model


class Filler:
    """Deterministic weights by name: a 64M-value random base, tiled from an offset the name's CRC picks;
    1-D tensors (norms) are ones."""

    def __init__(self):
        import torch

        g = torch.Generator().manual_seed(0)
        self.base = (torch.randn(1 << 26, generator=g) * 0.02).to(torch.bfloat16)

    def __call__(self, names, dst):

        if dst.dim() == 1:
            dst.fill_(1.0)
            return
        flat = dst.view(-1)
        n, N = flat.numel(), self.base.numel()
        off = zlib.crc32(names[0].encode()) % N
        at = 0
        while at < n:
            k = min(n - at, N - off)
            flat[at : at + k].copy_(self.base[off : off + k])
            at, off = at + k, 0


def prompts(w, batch: int, length: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, w.vocab, (batch, length), generator=g)
    return ids, torch.ones_like(ids)


class Clock:
    """A streamer that records when each step's tokens arrive (generate syncs every step anyway)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(gen, ids, mask, new_tokens: int) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock = Clock()
    t0 = time.perf_counter()
    out = gen(ids, mask, new_tokens, clock)
    _sync()
    t1 = time.perf_counter()
    first = clock.times[1] if len(clock.times) > 1 else t1  # times[0]: the prompt
    B = ids.shape[0]
    decoded = out.shape[1] - ids.shape[1]
    return {
        "batch": B,
        "prompt_tokens": ids.shape[1],
        "new_tokens": decoded,
        "seconds": round(t1 - t0, 4),
        "prefill_s": round(first - t0, 4),
        "decode_tokens_per_s": round(B * (decoded - 1) / (t1 - first), 3) if decoded > 1 else None,
        "tokens_per_s": round(B * decoded / (t1 - t0), 3),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 3) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 3) if cuda else None,
        "first_tokens": out[0, ids.shape[1] : ids.shape[1] + 16].tolist(),
    }


def pinned_bandwidth(nbytes: int = 1 << 30) -> float:
    """Host-to-device GB/s from page-locked memory, best of 5 copies of ``nbytes`` (``zerofit doctor``'s
    measurement)."""
    from zerofit.cli.doctor import copy_bandwidth

    return round(
        next(
            c.gb_per_s
            for c in copy_bandwidth(nbytes, repeats=5)
            if c.direction == "host->gpu" and c.host_memory == "pinned"
        ),
        2,
    )


# --------------------------------------------------------------------------- the engines (child processes)


def run_zerofit(args, w) -> dict:
    import torch

    from zerofit.infer import InferenceEngine

    res = {"engine": "zerofit", "cap": args.cap, "runs": []}
    res["pinned_h2d_gb_per_s"] = pinned_bandwidth() if torch.cuda.is_available() else None
    if args.nvme:
        from zerofit.engine.disk.tier import measure_folder

        res["disk_write_gb_per_s"], res["disk_read_gb_per_s"] = (round(x, 2) for x in measure_folder(args.nvme))
        res["max_host_memory"] = args.max_host_memory
    common.set_gpu_cap(args.cap, "cuda" if torch.cuda.is_available() else "cpu")
    t = time.perf_counter()
    eng = InferenceEngine(
        meta_model(w),
        dtype=torch.bfloat16,
        max_gpu_memory=args.cap,
        fill=Filler(),
        max_host_memory=args.max_host_memory,
        nvme_path=args.nvme,
    )
    res["load_s"] = round(time.perf_counter() - t, 1)

    def gen(ids, mask, n, clock):
        return eng.generate(ids, mask, max_new_tokens=n, do_sample=False, streamer=clock)

    for b in args.batches:
        ids, mask = prompts(w, b, args.prompt_len)
        eng.prepare(b, args.prompt_len + args.new_tokens, args.prompt_len, grow_only=False)  # this batch's plan
        r = timed(gen, ids, mask, args.new_tokens)
        r.update(
            plan=eng.summary(),
            resident=len(eng.plan.resident),
            streamed=len(eng.plan.streamed),
            streamed_gb_per_token=round(eng.plan.streamed_bytes / 1e9, 3),
            stats=eng.stats(),
        )
        if eng.disk_blocks and res.get("disk_read_gb_per_s"):
            disk = sum(eng.shape.block_bytes[x] for x in eng.plan.streamed if x in eng.disk_blocks)
            r["disk_gb_per_token"] = round(disk / 1e9, 3)
            r["disk_bound_tokens_per_s"] = round(res["disk_read_gb_per_s"] * 1e9 / disk * b, 3) if disk else None
        if r["decode_tokens_per_s"] and eng.plan.streamed_bytes and res["pinned_h2d_gb_per_s"]:
            bound = res["pinned_h2d_gb_per_s"] * 1e9 / eng.plan.streamed_bytes * b
            r["pcie_bound_tokens_per_s"] = round(bound, 2)
            r["of_bound"] = round(r["decode_tokens_per_s"] / bound, 3)
        res["runs"].append(r)
        print(json.dumps(r), flush=True)
    if args.probe:  # what binds at batch 1: the copy stream's busy time, restarts, and the uncapped floor
        ids, mask = prompts(w, 1, args.prompt_len)
        probes = []
        for label, cap, slots in (("cap", eng.cap, 2), ("cap, 4 slots", eng.cap, 4), ("uncapped", None, 2)):
            if cap is None:
                torch.cuda.set_per_process_memory_fraction(1.0, 0)
            eng.cap, eng.slots_wanted = cap, slots
            eng.prepare(1, args.prompt_len + 64, args.prompt_len, grow_only=False)
            before = eng.stats()
            r = timed(gen, ids, mask, 64)
            after = eng.stats()
            r.update(
                probe=label,
                plan=eng.plan.summary(),
                upload_s=round(after["upload_seconds"] - before["upload_seconds"], 4),
                primes=after["primes"] - before["primes"],
                uploads=after["uploads"] - before["uploads"],
            )
            probes.append(r)
            print(json.dumps(r), flush=True)
        res["probes"] = probes
        common.set_gpu_cap(args.cap, "cuda")
        eng.cap, eng.slots_wanted = common.parse_bytes(args.cap), 2
    if args.prefill_len:
        ids, mask = prompts(w, 1, args.prefill_len)
        eng.prepare(1, args.prefill_len + 2, args.prefill_len, grow_only=False)
        r = timed(gen, ids, mask, 2)
        r.update(kind="prefill", plan=eng.plan.summary())
        res["prefill"] = r
        print(json.dumps(r), flush=True)
    return res


def run_accelerate(args, w) -> dict:
    import accelerate
    import torch
    from accelerate import dispatch_model, infer_auto_device_map

    res = {"engine": "accelerate", "version": accelerate.__version__, "cap": args.cap, "runs": []}
    cap = common.set_gpu_cap(args.cap, "cuda" if torch.cuda.is_available() else "cpu") or common.parse_bytes(args.cap)
    t = time.perf_counter()
    model = meta_model(w, torch.bfloat16)  # bf16 parameters, fp32 rotary tables (as from_pretrained)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty makes new parameters: tie them again
    fill = Filler()
    for name, p in model.named_parameters():
        fill([name], p.data)
    for m in model.modules():
        if "RotaryEmbedding" in type(m).__name__:
            model._init_weights(m)
    gpu_budget = cap - args.accelerate_headroom if cap else 200 * GiB
    dm = infer_auto_device_map(
        model,
        max_memory={0: gpu_budget, "cpu": 400 * GiB},
        no_split_module_classes=["LlamaDecoderLayer"],
        dtype=torch.bfloat16,
    )
    model = dispatch_model(model.eval(), device_map=dm) if torch.cuda.is_available() else model.eval()
    res["load_s"] = round(time.perf_counter() - t, 1)
    res["device_map"] = {
        "gpu_modules": sum(1 for v in dm.values() if v == 0),
        "cpu_modules": sum(1 for v in dm.values() if v == "cpu"),
        "gpu_budget_gib": round(gpu_budget / GiB, 2) if gpu_budget else None,
    }

    def gen(ids, mask, n, clock):
        with torch.no_grad():
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            return model.generate(
                input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n, do_sample=False, streamer=clock
            )

    for b in args.batches:
        ids, mask = prompts(w, b, args.prompt_len)
        r = timed(gen, ids, mask, args.new_tokens)
        res["runs"].append(r)
        print(json.dumps(r), flush=True)
    return res


# --------------------------------------------------------------------------- the driver


def child(args) -> int:
    w = common.WORKLOADS[args.workload]
    res = run_zerofit(args, w) if args.engine == "zerofit" else run_accelerate(args, w)
    Path(args.result).write_text(json.dumps(res, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W3")
    p.add_argument("--engines", default="zerofit,accelerate")
    p.add_argument("--caps", default="24GiB,8GiB", help="zerofit runs at each; accelerate at the first only")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--accelerate-new-tokens", type=int, default=None, help="accelerate's new tokens (default: --new-tokens)"
    )
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument(
        "--accelerate-headroom",
        type=int,
        default=int(4.5 * GiB),
        help="bytes of the cap left out of accelerate's max_memory for the KV cache and activations",
    )
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--max-host-memory", default=None, help="zerofit: host budget for the blocks' weights")
    p.add_argument("--nvme", default=None, help="zerofit: folder for the blocks beyond --max-host-memory")
    p.add_argument("--probe", action="store_true", help="zerofit: batch-1 probes of what binds (see run_zerofit)")
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--cap", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.engine:
        return child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    caps = args.caps.split(",")
    jobs = [("zerofit", c) for c in caps if "zerofit" in args.engines]
    if "accelerate" in args.engines:
        jobs.append(("accelerate", caps[0]))
    summary = {
        "workload": args.workload,
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "results": [],
    }
    for engine, cap in jobs:
        result = out / f"{engine}_{cap}.json"
        cmd = (
            [
                sys.executable,
                __file__,
                "--engine",
                engine,
                "--cap",
                cap,
                "--result",
                str(result),
                "--workload",
                args.workload,
                "--batches",
                ",".join(map(str, args.batches)),
                "--prompt-len",
                str(args.prompt_len),
                "--accelerate-headroom",
                str(args.accelerate_headroom),
                "--new-tokens",
                str(
                    args.accelerate_new_tokens
                    if engine == "accelerate" and args.accelerate_new_tokens
                    else args.new_tokens
                ),
                "--prefill-len",
                str(args.prefill_len),
                "--out",
                str(out),
            ]
            + (["--probe"] if args.probe else [])
            + (["--max-host-memory", args.max_host_memory, "--nvme", args.nvme] if args.nvme else [])
        )
        t = time.perf_counter()
        print(f"== {engine} at {cap}: {' '.join(cmd)}", flush=True)
        try:
            rc = subprocess.run(cmd, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        entry = {"engine": engine, "cap": cap, "rc": rc, "wall_s": round(time.perf_counter() - t, 1)}
        if result.is_file():
            entry.update(json.loads(result.read_text()))
        summary["results"].append(entry)
        print(f"== {engine} at {cap}: rc={rc}", flush=True)
    z = next((r for r in summary["results"] if r["engine"] == "zerofit" and r.get("runs")), None)
    a = next((r for r in summary["results"] if r["engine"] == "accelerate" and r.get("runs")), None)
    if z and a:
        summary["same_first_tokens_batch1"] = z["runs"][0]["first_tokens"] == a["runs"][0]["first_tokens"]
        summary["speedup"] = {
            str(zr["batch"]): round(zr["decode_tokens_per_s"] / ar["decode_tokens_per_s"], 2)
            for zr, ar in zip(z["runs"], a["runs"])
            if zr.get("decode_tokens_per_s") and ar.get("decode_tokens_per_s")
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=1))
    ok = all(r["rc"] == 0 for r in summary["results"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
