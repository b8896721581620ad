"""zerofit serve under load: streaming requests at concurrency 1, 8 and 32 against the real server (uvicorn, in this
process, on a free port); tokens/s and time to the first token, and ``generate`` at batch 1 beside it.

    python3 bench/serve.py --out /tmp/DATE_serve_COMMIT_cpu_tiny.json                       # CPU: a tiny Llama
    python3 bench/serve.py --shape llama-2-13b --max-gpu-memory 24GiB --out serve13b.json    # CUDA: the 13B shape
    python3 bench/serve.py --shape llama-2-13b --max-gpu-memory 24GiB --peer accelerate --concurrency 1,16

The model is built from a config with deterministic weights (bench/infer.py's fill by tensor name; nothing
downloads) and served under ``--max-gpu-memory`` with zerofit's offloaded engine, or with ``--peer accelerate``
through accelerate's ``device_map`` offload (the blocks that do not fit on the GPU kept on the CPU and moved in by
accelerate's hooks at each forward) behind the same server and batcher, so the two differ only in how the weights
reach the GPU. Prompts are random token ids (seed 0) sent as ``prompt: [ids]`` to ``/v1/completions``, greedy,
with no end-of-sequence token: every request decodes ``--new-tokens``. Per concurrency ``c``: ``c`` requests at once
(``--waves`` times), the tokens of all over the wall time (tokens/s), each request's time to its first streamed
token (TTFT: mean, p50, max) and its own decode rate; the server's mean batch per forward.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GiB = 2**30


class IdTokenizer:
    """Token ids as text (``"17 4 99"``): the server needs a tokenizer to stream text, the bench sends ids."""

    eos_token_id = None
    pad_token_id = 0
    chat_template = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f" {i}" for i in ids)

    def __call__(self, text: str) -> dict:
        return {"input_ids": [int(t) for t in text.split()]}


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, attn_implementation="sdpa",
    )  # fmt: skip


def meta_model(args):
    import torch
    from transformers import AutoModelForCausalLM

    from zerofit.estimate.shapes import shape_config

    cfg = tiny_config() if args.shape == "tiny" else shape_config(args.shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # decode every new token
    model.generation_config.pad_token_id = 0
    return model


def zerofit_engine(args):
    import torch

    from infer import Filler
    from zerofit.infer import InferenceEngine

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return InferenceEngine(meta_model(args), dtype=dtype, max_gpu_memory=args.max_gpu_memory, fill=Filler(),
                           tokenizer=IdTokenizer())  # fmt: skip


class AccelerateEngine:
    """accelerate's ``device_map`` offload of the same model, with the face the scheduler calls (``model``,
    ``prepare``, ``shape``, ``dtype``, ``device``, a forward): the peer behind the same server."""

    def __init__(self, args):
        import torch
        from accelerate import dispatch_model, infer_auto_device_map

        from infer import Filler
        from zerofit.config.schema import parse_bytes
        from zerofit.estimate.serve import serve_shape

        cuda = torch.cuda.is_available()
        self.dtype = torch.bfloat16 if cuda else torch.float32
        model = meta_model(args)
        self.shape = serve_shape(model, self.dtype)
        model.to_empty(device="cpu")
        model.tie_weights()
        fill = Filler()
        for name, p in model.named_parameters():
            p.data = p.data.to(self.dtype)
            fill([name], p.data)
        for m in model.modules():
            if "RotaryEmbedding" in type(m).__name__:
                model._init_weights(m)
        cap = parse_bytes(args.max_gpu_memory, "max_gpu_memory")
        budget = (cap - args.accelerate_headroom) if cap else 200 * GiB
        if cuda:
            blocks = [type(model.model.layers[0]).__name__]
            dm = infer_auto_device_map(model, max_memory={0: budget, "cpu": 400 * GiB},
                                       no_split_module_classes=blocks, dtype=self.dtype)  # fmt: skip
            model = dispatch_model(model, device_map=dm)
            self.device = torch.device("cuda", 0)
            self.device_map = {"gpu_modules": sum(v == 0 for v in dm.values()),
                               "cpu_modules": sum(v == "cpu" for v in dm.values())}  # fmt: skip
        else:
            self.device, self.device_map = torch.device("cpu"), None
        self.model = model.eval()
        self.tokenizer = IdTokenizer()
        self.plan = None

    def prepare(self, batch, context, prefill=None, grow_only=True):
        from zerofit.infer.plan import InferPlan

        self.plan = InferPlan(self.shape, batch, context, prefill or context, None)
        return self.plan

    def __call__(self, **kw):
        import torch

        with torch.no_grad():
            return self.model(**kw)

    def summary(self) -> str:
        return f"accelerate device_map {self.device_map}"

    def close(self):
        pass


def serve_in_thread(engine, slots: int, context: int):
    """uvicorn in a thread of this process, on a free port; (server, scheduler, url)."""
    import socket

    import uvicorn

    from zerofit.serve.app import Served, create_app
    from zerofit.serve.scheduler import Scheduler

    sched = Scheduler(engine, slots=slots, context=context, max_waiting=4096)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(Served(sched, "bench")), port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, sched, f"http://127.0.0.1:{port}"


async def one_request(client, url: str, prompt: list[int], new_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=None) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    t1 = time.perf_counter()
    return {"ttft_s": first - t0, "seconds": t1 - t0, "tokens": tokens,
            "decode_tokens_per_s": (tokens - 1) / (t1 - first) if tokens > 1 and t1 > first else None}  # fmt: skip


async def load(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[dict]]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_request(client, url, p, new_tokens) for p in prompts))
        return time.perf_counter() - t0, list(res)


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def generate_batch1(engine, prompt: list[int], new_tokens: int) -> float:
    """``generate``'s tokens/s at batch 1 on the same prompt (zerofit generate's path)."""
    import torch

    ids = torch.tensor([prompt])
    engine.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)  # warm: the same shapes
    t0 = time.perf_counter()
    engine.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return new_tokens / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny", help="tiny (CPU) or a named shape: llama-2-13b, llama-3.1-8b ...")
    p.add_argument("--max-gpu-memory", default=None)
    p.add_argument("--peer", choices=["accelerate"], default=None, help="serve through accelerate's offload instead")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--waves", type=int, default=1, help="rounds of `concurrency` requests at each level")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--slots", type=int, default=None, help="the server's --max-batch (default: the top concurrency)")
    p.add_argument("--accelerate-headroom", type=int, default=4 * GiB)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import torch

    levels = [int(x) for x in args.concurrency.split(",")]
    slots = args.slots or max(levels)
    context = args.prompt_len + args.new_tokens
    t = time.perf_counter()
    engine = AccelerateEngine(args) if args.peer else zerofit_engine(args)
    load_s = time.perf_counter() - t
    gen1 = None
    if not args.peer:  # before the server starts: generate alone in the process
        gen1 = round(generate_batch1(engine, prompts(engine.shape.vocab, 1, args.prompt_len)[0], args.new_tokens), 2)
        print(json.dumps({"generate_batch1_tokens_per_s": gen1}), flush=True)
    server, sched, url = serve_in_thread(engine, slots, context)
    vocab = engine.shape.vocab
    asyncio.run(load(url, prompts(vocab, 1, args.prompt_len, seed=99), 4))  # warm the server's path
    result = {
        "bench": "serve",
        "engine": args.peer or "zerofit",
        "shape": args.shape,
        "max_gpu_memory": args.max_gpu_memory,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor()})",
        "torch_threads": torch.get_num_threads(),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["python3", "bench/serve.py", *sys.argv[1:]]),
        "slots": slots,
        "context": context,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "load_s": round(load_s, 1),
        "plan": engine.summary(),
        "levels": [],
    }
    for c in levels:
        forwards0, rows0 = sched.forwards, sched.rows
        walls, reqs = 0.0, []
        for w in range(args.waves):
            wall, res = asyncio.run(load(url, prompts(vocab, c, args.prompt_len, seed=w), args.new_tokens))
            walls += wall
            reqs += res
        ttft = [r["ttft_s"] for r in reqs]
        tokens = sum(r["tokens"] for r in reqs)
        rates = [r["decode_tokens_per_s"] for r in reqs if r["decode_tokens_per_s"]]
        level = {
            "concurrency": c,
            "requests": len(reqs),
            "tokens": tokens,
            "wall_s": round(walls, 3),
            "tokens_per_s": round(tokens / walls, 2),
            "ttft_mean_s": round(statistics.mean(ttft), 4),
            "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_max_s": round(max(ttft), 4),
            "per_request_decode_tokens_per_s": round(statistics.mean(rates), 2) if rates else None,
            "mean_batch": round((sched.rows - rows0) / max(1, sched.forwards - forwards0), 2),
            # the KV cache's rows at the level's end and the placements made so far ([Note: a plan that follows
            # the batch]): at one request, the placement generate's own plan has
            "cache_rows": sched.stats().get("rows"),
            "resizes": sched.stats().get("resizes"),
        }
        result["levels"].append(level)
        print(json.dumps(level), flush=True)
    server.should_exit = True
    sched.close()
    result["generate_batch1_tokens_per_s"] = gen1
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
