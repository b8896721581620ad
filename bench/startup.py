"""python bench/startup.py --workload W6c --layers 8 --source meta --result /tmp/startup.json
python bench/startup.py --workload W1 --layers 2 --source folder --device cpu

How fast zerofit materializes a model ([Note: start-up progress], src/zerofit/engine/model/startup.py): the
workload's shape cut to ``--layers`` blocks, LoRA over its frozen base (``--qlora``: the blocks' linears in
4 bits), from

- ``meta``: a model on the meta device, initialized by the engine (a benchmark's model; ``zerofit.initialize``);
- ``folder``: a bf16 model folder this script writes first, read as ``zerofit train --model DIR --lora`` (with
  ``--qlora``: quantized as it is read);
- ``folder4``: the model saved in 4 bits by transformers' ``save_pretrained`` (``BitsAndBytesConfig(load_in_4bit=
  True)``, NF4, double quantization; quantized on the GPU one block at a time), read as stored.

It reports the seconds of ``initialize`` and of its materialization (and of each phase), parameters/s and GB/s over the
materialization (the folder's bytes, or the model's bf16 bytes for a meta model), the time to read the folder's bytes
alone (the page cache's speed, and the disk's with ``--direct``; with ``--cold`` the folder's pages are then dropped
from the page cache, so that the engine reads the disk), and with ``--step`` the time to the end of the first training
step (``--steps N``: each of N steps, the peak GPU memory and the peak host RSS). Run it under ``taskset -c 0`` for one
core against all (the readers follow the process's CPU affinity).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))  # the working tree's zerofit

T0 = time.time()

import common  # noqa: E402


def _cut(name: str, layers: int):
    w = common.WORKLOADS[name]
    return dataclasses.replace(w, layers=layers or w.layers)


def _write_folder(w, path: str, device: str) -> None:
    """The workload's model in bf16, initialized on ``device`` by its own init, saved by save_pretrained."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM(common.llama_config(w)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="2GB")
    del model


def _write_folder4(w, path: str, device: str) -> None:
    """The workload's model with its blocks' linears in NF4 (common.build_nf4_model: quantized on ``device`` one
    block at a time, the bf16 model never whole), written by transformers' ``save_pretrained`` with its
    ``BitsAndBytesConfig``: the folder transformers writes for a model loaded in 4 bits, without the bf16
    folder (137 GB for W6c) that loading one would need first."""
    import torch

    model = common.build_nf4_model(w, device)
    model.config.quantization_config = common.nf4_config()
    model.save_pretrained(path, max_shard_size="2GB")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _evict(path: str) -> None:
    """The folder's pages out of the page cache (written back first), so that the next read comes from the disk."""
    for f in os.listdir(path):
        fd = os.open(os.path.join(path, f), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_speed(path: str, direct: bool) -> dict:
    """Seconds to read every weight file's bytes once (O_DIRECT: from the disk, past the page cache)."""
    import mmap

    files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    total, t = 0, time.perf_counter()
    buf = mmap.mmap(-1, 64 << 20)
    for f in files:
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            while True:
                n = os.readv(fd, [buf])
                total += n
                if n < len(buf):
                    break
        finally:
            os.close(fd)
    s = time.perf_counter() - t
    return {"bytes": total, "seconds": round(s, 3), "gb_per_s": round(total / s / 1e9, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="W6c", choices=sorted(common.WORKLOADS))
    p.add_argument("--layers", type=int, default=8, help="blocks kept of the workload's (0: all)")
    p.add_argument("--source", default="meta", choices=["meta", "folder", "folder4"])
    p.add_argument("--qlora", action="store_true", help="the blocks' linears in 4 bits (implied by W6c)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cap", default=None, help="max_gpu_memory (default: the workload's)")
    p.add_argument("--dir", default=None, help="where the folders are written (default: a temporary folder)")
    p.add_argument("--direct", action="store_true", help="also time a read of the folder past the page cache")
    p.add_argument(
        "--write-only",
        action="store_true",
        help="write the folder and stop (its writing then stays out of the run's peak memory)",
    )
    p.add_argument("--cold", action="store_true", help="drop the folder's pages from the page cache before the run")
    p.add_argument("--step", action="store_true", help="also time the first training step")
    p.add_argument("--steps", type=int, default=0, help="time this many training steps (implies --step)")
    p.add_argument("--profile", default=None, help="write cProfile's 40 costliest calls of initialize here")
    p.add_argument("--result", default=None)
    args = p.parse_args(argv)

    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    w = _cut(args.workload, args.layers)
    qlora = args.qlora or w.qlora
    cuda = args.device.startswith("cuda")
    cfg = {
        "device": args.device,
        "precision": "bf16" if cuda else "fp32",
        "micro_batch_size": w.micro_batch,
        "gradient_accumulation_steps": w.grad_accum,
        "seq_len": w.seq if cuda else 128,
        "optimizer": {"lr": common.LORA.lr},
    }
    if cuda:
        cfg["max_gpu_memory"] = args.cap or w.cap
    if qlora and args.source != "folder4":
        cfg["quantize_base"] = "nf4"
    out = {
        "workload": w.name,
        "layers": w.layers,
        "source": args.source,
        "qlora": qlora,
        "device": args.device,
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
    }
    if cuda:
        out["gpu"] = torch.cuda.get_device_name()
    root = args.dir or tempfile.mkdtemp(prefix="zerofit-startup-")
    folder = os.path.join(root, f"{w.name}-{w.layers}")
    if args.source == "folder" and not os.path.isfile(os.path.join(folder, "config.json")):
        t = time.perf_counter()
        _write_folder(w, folder, "cuda" if cuda else "cpu")
        out["write_seconds"] = round(time.perf_counter() - t, 1)
    if args.source == "folder4":
        folder = folder + "-nf4"
        if not os.path.isfile(os.path.join(folder, "config.json")):
            t = time.perf_counter()
            _write_folder4(w, folder, "cuda" if cuda else "cpu")
            out["write_seconds"] = round(time.perf_counter() - t, 1)
    if args.write_only:
        print(json.dumps(out, indent=1))
        return 0
    if args.source != "meta":
        out["folder_read"] = _read_speed(folder, direct=False)
        if args.direct:
            out["folder_read_direct"] = _read_speed(folder, direct=True)
        if args.cold:
            _evict(folder)
            out["cold"] = True

    from zerofit.config import load_config
    from zerofit.engine.engine import Engine

    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    if args.source == "meta":
        import engine_zerofit

        model = engine_zerofit.build(w, lora=True)
        engine = Engine(model, load_config(cfg).config)
        stored = sum(q.numel() for q in model.parameters()) * 2  # the model's bf16 bytes
    else:
        from zerofit.lora.model import LoraOptions, from_model_dir

        L = common.LORA
        model, source = from_model_dir(folder, LoraOptions(r=L.r, alpha=L.alpha, targets=",".join(L.targets)))
        engine = Engine(model, load_config(cfg).config, source=source)
        stored = out["folder_read"]["bytes"]
    secs = time.perf_counter() - t
    if prof is not None:
        import io
        import pstats

        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        with open(args.profile, "w") as f:
            f.write(text.getvalue())
    startup = getattr(engine, "startup", None)  # (an engine from before [Note: start-up progress]: none)
    mat = startup.elapsed() if startup is not None else secs
    params = sum(q.numel() for q in {id(q): q for q in engine.module.parameters()}.values())
    out.update(
        initialize_seconds=round(secs, 2),
        materialize_seconds=round(mat, 2),
        phases={k: round(v, 2) for k, v in startup.seconds.items()} if startup is not None else None,
        parameters=params,
        params_per_s=round(params / mat),
        gb_per_s=round(stored / mat / 1e9, 3),
        stored_bytes=stored,
        process_to_engine_seconds=round(time.time() - T0, 1),
    )
    steps = max(args.steps, 1 if args.step else 0)
    if steps:
        seconds, losses = [], []
        for i, micro in enumerate(common.make_batches(w, steps)):
            batch = [{"input_ids": ids[:, : cfg["seq_len"]], "labels": ids[:, : cfg["seq_len"]]} for ids in micro]
            t = time.perf_counter()
            losses.append(round(engine.train_batch(batch), 4))
            seconds.append(round(time.perf_counter() - t, 2))
            if i == 0:
                out["process_to_first_step_seconds"] = round(time.time() - T0, 1)
        out.update(
            first_step_seconds=seconds[0],
            first_loss=losses[0],
            step_seconds=seconds,
            losses=losses,
            peak_rss_gib=round(common.peak_rss_gib(), 2),
        )
        if cuda:
            out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    engine.close()
    text = json.dumps(out, indent=1)
    print(text)
    if args.result:
        with open(args.result, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
