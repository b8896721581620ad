"""python3 bench/checkpoint_speed.py --dir /nvme/tmp --mb 400 [--engine] [--workers 1,2,4]

Checkpoint write speed against the disk's own sequential write speed, on the same disk.

* ``dd``: ``dd if=/dev/zero bs=64M count=N conv=fsync`` of the same size (the disk's speed with one
  large sequential writer and an fsync at the end, the same durability as a checkpoint);
* ``save``: ``write_checkpoint`` of synthetic fp32 tensors of that size, 1/3 weights and 2/3 moments as
  a real state, sharded at ``--shard-mb``, with 1, 2, 4 files in flight (CRC32 of every byte,
  every file fsynced, commit record, rename, ``latest``);
* ``--engine``: ``engine.save_checkpoint`` of a Llama whose training state has that size (CPU);
* ``load``: verifying (CRC pass) and reading the synthetic checkpoint back into its buffers. Reads
  right after the writes come largely from the page cache, unless ``--drop-caches`` (root) drops it.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from zerofit.checkpoint.commit import verify  # noqa: E402
from zerofit.checkpoint.format import Entry  # noqa: E402
from zerofit.checkpoint.load import copy_into, locate, open_checkpoint, shard_files  # noqa: E402
from zerofit.checkpoint.save import Content, write_checkpoint  # noqa: E402


def _emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _drop(enabled: bool) -> None:
    if enabled:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def dd(path: Path, mb: int) -> float:
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={max(1, mb // 64)}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    s = time.perf_counter() - t
    path.unlink()
    return max(1, mb // 64) * 64 / s


def synthetic(mb: int) -> tuple[Content, dict]:
    n = mb * (1 << 20) // 4 // 3  # fp32 elements per kind
    bufs = {k: torch.rand(n) for k in ("master", "exp_avg", "exp_avg_sq")}
    sizes = [n // 64] * 64

    def entries(kind, suffix=""):
        out, o = [], 0
        for i, s in enumerate(sizes):
            out.append(Entry(f"layers.{i}.w{suffix}", (s,), torch.float32, bufs[kind], o))
            o += s
        return out

    return Content(
        "bench", entries("master"), entries("exp_avg", ".exp_avg") + entries("exp_avg_sq", ".exp_avg_sq"), state={}
    ), bufs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("."))
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--drop-caches", action="store_true")
    args = ap.parse_args()
    root = args.dir / f"zerofit-ckpt-bench-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        _emit(what="dd", mb=args.mb, mb_per_s=round(dd(root / "dd.bin", args.mb), 1))
        content, bufs = synthetic(args.mb)
        total = sum(e.nbytes for e in content.weights + content.optimizer) / 2**20
        for w in [int(x) for x in args.workers.split(",")]:
            _drop(args.drop_caches)
            t = time.perf_counter()
            write_checkpoint(root / f"w{w}", content, max_shard_bytes=args.shard_mb << 20, workers=w)
            s = time.perf_counter() - t
            _emit(what="save", workers=w, mb=round(total), seconds=round(s, 3), mb_per_s=round(total / s, 1))
            _emit(what="dd", mb=args.mb, mb_per_s=round(dd(root / "dd.bin", args.mb), 1))
        folder, record = open_checkpoint(root / "w1", None)
        _drop(args.drop_caches)
        t = time.perf_counter()
        verify(folder, record)
        tv = time.perf_counter() - t
        found = {}
        for ix in ("weights.safetensors.index.json", "optimizer.safetensors.index.json"):
            found.update(locate(folder, shard_files(folder, record, ix), ix))
        targets = {e.name: e.base[e.offset : e.offset + e.numel] for e in content.weights + content.optimizer}
        t = time.perf_counter()
        copy_into(folder, record, found, targets)
        tc = time.perf_counter() - t
        _emit(
            what="load",
            mb=round(total),
            verify_s=round(tv, 3),
            copy_s=round(tc, 3),
            mb_per_s=round(total / (tv + tc), 1),
            page_cache_dropped=args.drop_caches,
        )
        del content, bufs
        if args.engine:
            from transformers import LlamaConfig, LlamaForCausalLM

            import zerofit

            params = args.mb * (1 << 20) // 12
            layers, h = 8, 512
            inter = max(64, int((params / layers - 4 * h * h) / (3 * h)))
            model = LlamaForCausalLM(
                LlamaConfig(
                    hidden_size=h,
                    intermediate_size=inter,
                    num_hidden_layers=layers,
                    num_attention_heads=8,
                    vocab_size=32000,
                    tie_word_embeddings=True,
                )
            )
            engine = zerofit.initialize(
                model, {"device": "cpu", "precision": "fp32", "micro_batch_size": 1, "seq_len": 16}
            )
            n = sum(p.numel() for p in model.parameters())
            _drop(args.drop_caches)
            t = time.perf_counter()
            engine.save_checkpoint(root / "engine")
            s = time.perf_counter() - t
            _emit(
                what="engine-save",
                params=n,
                mb=round(n * 12 / 2**20),
                seconds=round(s, 3),
                mb_per_s=round(n * 12 / 2**20 / s, 1),
            )
            t = time.perf_counter()
            engine.load_checkpoint(root / "engine")
            s = time.perf_counter() - t
            mb = n * 12 / 2**20
            _emit(what="engine-load", mb=round(mb), seconds=round(s, 3), mb_per_s=round(mb / s, 1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
