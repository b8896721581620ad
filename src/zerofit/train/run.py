"""A real fine-tuning run: a model directory and the user's data in; checkpoints, metrics and a model out.

    zerofit train --model path/to/Llama-2-7b-hf --data notes/ chats.jsonl --output runs/notes \\
                  --max-gpu-memory 24GiB --save-every 200 --eval-every 100
    zerofit train --model path/to/Llama-2-7b-hf --data notes/ chats.jsonl --output runs/notes --resume

:func:`run_training` does what the command does, from Python: read and pack the data with the model's own
tokenizer (:mod:`zerofit.data`), build the engine from the model directory (weights streamed into its
buffers), train with a progress bar, log metrics (``metrics.jsonl``, TensorBoard), evaluate on held-out
documents, save resumable checkpoints (``checkpoints/``, the newest ``keep``), and export a Hugging Face model
(``model/``). ``--resume`` continues from ``checkpoints/latest`` exactly where it stopped, data order
included. The first Ctrl-C finishes the current step, saves a checkpoint and stops (exit 130); a second
one stops at once.

Run folder::

    OUTPUT/metrics.jsonl          one JSON object per training step and per evaluation
    OUTPUT/tensorboard/           TensorBoard event files
    OUTPUT/checkpoints/latest     the tag of the newest complete checkpoint
    OUTPUT/checkpoints/global_stepN/
    OUTPUT/model/                 the exported Hugging Face model (config.json, *.safetensors, tokenizer)
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.text import Text
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from zerofit.config import LoadedConfig, load_config, load_with_defaults
from zerofit.engine.planner import fmt_count
from zerofit.train.metrics import Metrics
from zerofit.train.progress import first_step_note, kernel_build_note
from zerofit.train.options import TrainOptions

log = logging.getLogger("zerofit")


def finetune_defaults(device: torch.device) -> dict[str, Any]:
    """zerofit's config for fine-tuning when the user gives none: what the Hugging Face Trainer does
    (AdamW, lr 2e-5, no weight decay, gradient clipping at 1.0), with a short warm-up and cosine decay."""
    return {
        "precision": "bf16" if device.type == "cuda" else "fp32",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 8,
        "optimizer": {"lr": 2e-5, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8},
        "scheduler": {"type": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.1},
        "gradient_clipping": 1.0,
    }


def resolve_config(opts: TrainOptions, device: torch.device, world: int = 1) -> LoadedConfig:
    """The config file (or the fine-tuning defaults) with the options the user set applied on top, for
    ``world`` ranks (the batch options are per rank)."""
    overrides: dict[str, Any] = {"device": str(device)}
    if world > 1:
        overrides["world_size"] = world
    for name, value in (("micro_batch_size", opts.micro_batch_size), ("gradient_accumulation_steps", opts.grad_accum),
                        ("optimizer.lr", opts.lr), ("scheduler.warmup_steps", opts.warmup_steps),
                        ("precision", opts.precision), ("max_gpu_memory", opts.max_gpu_memory),
                        ("max_host_memory", opts.max_host_memory), ("seed", opts.seed)):
        if value is not None:
            overrides[name] = value
    if opts.nvme is not None:
        overrides["offload.optimizer_device"] = overrides["offload.param_device"] = "nvme"   # streamed, tier on
        overrides["offload.nvme_path"] = str(opts.nvme)
    overrides["seq_len"] = opts.seq_len
    return load_with_defaults(opts.config, finetune_defaults(device), **overrides)


@dataclass
class TrainResult:
    """What a run did (this process: a resumed run counts from where it resumed)."""

    run_dir: Path
    steps_total: int                       # steps the run is planned for
    start_step: int = 0                    # steps done before this process (resume)
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)   # {"step", "eval_loss", "eval_perplexity"}
    checkpoints: list[Path] = field(default_factory=list)
    export_dir: Path | None = None
    interrupted: bool = False
    tokens_per_step: int = 0
    memory: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)     # load (and resume) seconds and memory, as logged

    @property
    def steps_done(self) -> int:
        return self.start_step + len(self.losses)

    @property
    def tokens_per_s(self) -> float:
        timed = self.step_seconds[1:] or self.step_seconds
        return len(timed) * self.tokens_per_step / sum(timed) if timed and sum(timed) > 0 else 0.0


class _StopRequest:
    """[Note: Ctrl-C between steps]
    While training, the first SIGINT only asks the loop to stop after the current step (which then completes,
    so the engine's state is a whole step and can be saved); a second SIGINT raises KeyboardInterrupt at
    once (the engine then leaves the step unapplied or fails, see docs/engine.md). Installed only from the
    main thread; the previous handler comes back afterwards."""

    def __init__(self, console: Console):
        self.requested = False
        self._console = console
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._console.print("[yellow]interrupt: finishing this step, then saving a checkpoint "
                            "(Ctrl-C again to stop now)[/]")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _reset_peak_rss() -> None:
    """Make the kernel's peak RSS (VmHWM) start again from now (Linux), so the load's own peak is measured."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss(key: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process in bytes; 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    except (OSError, StopIteration):
        return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}G"


def run_training(opts: TrainOptions, console: Console | None = None) -> TrainResult:
    """Fine-tune ``opts.model`` on ``opts.data``; see the module docstring."""
    import zerofit
    from zerofit.checkpoint import prune
    from zerofit.data import StepLoader, build_datasets, evaluate, load_tokenizer, small_held_out
    from zerofit.models import ModelDir
    from zerofit.demo.run import resolve_device
    from zerofit.optim.schedules import lr_at

    console = console or Console()
    if opts.deterministic:
        # [Note: bitwise runs on a GPU] Some CUDA kernels accumulate with atomics (the embedding's backward, some
        # attention backwards) and cuBLAS picks workspaces per stream: two runs (or a run and its resume) then
        # differ in the last bits. Deterministic algorithms (and a fixed cuBLAS workspace, which must be set
        # before cuBLAS starts) make them repeat bitwise, at some speed. On the CPU runs repeat without it.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = resolve_device(opts.device)
    # several ranks (torchrun, zerofit train --gpus N): rank r trains micro-batches r*G .. r*G+G-1 of each step's
    # N*G (every rank draws the same order, so the loader's position resumes anywhere); rank 0 alone prints,
    # logs to OUTPUT/metrics.jsonl and prunes checkpoints (the engine has rank 0 write them)
    world, rank, _made_group = _init_ranks(device)
    if rank:
        console = Console(quiet=True)
    loaded = resolve_config(opts, device, world)
    cfg = loaded.config
    run_dir = Path(opts.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = run_dir / "checkpoints"

    ModelDir.open(opts.model)          # a wrong path fails here, naming it, before the data is read
    tokenizer = load_tokenizer(opts.model)
    # rank 0 fills the datasets cache before the others read it: each rank passes one barrier, before or after
    if rank:
        torch.distributed.barrier()
    data = build_datasets(opts.data, tokenizer, opts.seq_len, eval_size=opts.eval_size, seed=cfg.seed,
                          cache_dir=run_dir / ".datasets-cache")
    if world > 1 and rank == 0:
        torch.distributed.barrier()
    G = cfg.gradient_accumulation_steps
    loader = StepLoader(data.train, cfg.micro_batch_size, G * world, seed=cfg.seed)
    total = opts.steps if opts.steps is not None else max(1, math.ceil((opts.epochs or 1.0) * loader.steps_per_epoch))
    loaded = load_config(loaded, **{"scheduler.total_steps": total})

    lcfg = loaded.config
    _reset_peak_rss()
    rss0, t_load = _rss("VmRSS:"), time.perf_counter()
    build = kernel_build_note(lcfg, device)
    if build:
        console.print(build)
    engine = zerofit.initialize(str(opts.model), loaded)
    setup = {"load_seconds": round(time.perf_counter() - t_load, 3), "load_rss_growth_bytes": _rss("VmHWM:") - rss0,
             "host_planned_bytes": engine.plan.host_total}
    result = TrainResult(run_dir, total, tokens_per_step=cfg.micro_batch_size * G * world * opts.seq_len)
    elapsed = 0.0
    if opts.resume:
        t_resume = time.perf_counter()
        path, client = engine.load_checkpoint(ckpt_dir)
        setup["resume_seconds"] = round(time.perf_counter() - t_resume, 3)
        if path is None:
            console.print(f"[yellow]--resume: no checkpoint in {ckpt_dir}; starting from the model directory[/]")
        else:
            loader.load_state_dict(client["loader"])
            result.start_step = int(client["iterations"])
            elapsed = float(client.get("elapsed", 0.0))
            console.print(f"resumed from {path} at step {result.start_step} of {total}")
    _print_start(console, opts, loaded, data, engine, total, result)
    tiny = small_held_out(data.eval, opts.eval_windows) if data.eval is not None else None
    if tiny:
        console.print(Text("warning: " + tiny, style="yellow"))

    metrics = (Metrics(run_dir, tensorboard=opts.tensorboard, elapsed=elapsed) if rank == 0 else
               Metrics(run_dir / "ranks" / f"rank{rank}", tensorboard=False, elapsed=elapsed))
    result.setup = metrics.log(result.start_step, **setup)

    def save(step: int) -> None:
        client = {"loader": loader.state_dict(), "iterations": step, "elapsed": metrics.elapsed}
        t = time.perf_counter()
        engine.save_checkpoint(ckpt_dir, tag=f"global_step{step}", client_state=client)
        result.checkpoints.append(ckpt_dir / f"global_step{step}")
        if rank == 0:
            prune(ckpt_dir, opts.keep)
        metrics.log(step, checkpoint_seconds=round(time.perf_counter() - t, 3))

    def run_eval(step: int) -> None:
        if data.eval is None:
            return
        engine.eval()
        try:
            res = evaluate(data.eval, lambda b: engine(**b).loss, cfg.micro_batch_size, max_windows=opts.eval_windows)
        finally:
            engine.train()
        rec = metrics.log(step, eval_loss=res.loss, eval_perplexity=res.perplexity, eval_tokens=res.tokens)
        result.evals.append(rec)
        console.print(f"step {step}: held-out loss {res.loss:.4f}, perplexity {res.perplexity:,.2f} "
                      f"({res.tokens:,} tokens)")

    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[stats]}"), console=console,
                   disable=not opts.progress)
    step = result.start_step
    try:
        with _StopRequest(console) as stop, bar:
            task = bar.add_task("train", total=total, completed=step, stats=first_step_note(device))
            bar.refresh()      # the note shows now, not at the next tick: step 1 may take seconds
            while step < total:
                requested = stop.requested
                if world > 1:     # every rank stops at the same step, or one would wait for the others forever
                    requested = any(engine.ranks.objects(requested))
                if requested:
                    result.interrupted = True
                    break
                batch = next(loader)[rank * G:(rank + 1) * G]
                t0 = time.perf_counter()
                loss = engine.train_batch(batch)
                dt = time.perf_counter() - t0
                step += 1
                result.losses.append(loss)
                result.step_seconds.append(dt)
                mem = engine.memory_stats()
                rec = metrics.log(step, loss=loss, lr=lr_at(engine.global_step - 1, lcfg.optimizer.lr, lcfg.scheduler),
                                  grad_norm=getattr(engine, "last_grad_norm", None),
                                  tokens_per_s=round(result.tokens_per_step / dt, 1), step_seconds=round(dt, 4),
                                  gpu_peak_bytes=mem["gpu_peak_bytes"], host_rss_bytes=mem["host_bytes"],
                                  skipped_steps=engine.skipped_steps)
                gpu = f" gpu {_gib(mem['gpu_peak_bytes'])}" if mem["gpu_peak_bytes"] else ""
                bar.update(task, completed=step, stats=f"loss {loss:.4f} {rec['tokens_per_s']:,.0f} tok/s"
                                                        f"{gpu} host {_gib(mem['host_bytes'])}")
                if opts.eval_every and step % opts.eval_every == 0 and step < total:
                    run_eval(step)
                if opts.save_every and step % opts.save_every == 0 and step < total:
                    save(step)
            if result.interrupted:
                if opts.save_on_interrupt and step > result.start_step:
                    save(step)
                return result
        run_eval(step)
        if opts.save_at_end and (not result.checkpoints or result.checkpoints[-1].name != f"global_step{step}"):
            save(step)
        if opts.export:
            out = run_dir / "model"
            t = time.perf_counter()
            engine.save_pretrained(out, dtype=opts.export_dtype)     # None: the model directory's dtype
            result.export_dir = out
            console.print(f"exported the trained model to {out} in {time.perf_counter() - t:.1f} s")
        return result
    finally:
        result.memory = dict(engine.memory_stats())
        metrics.close()
        engine.close()
        if world > 1 and _made_group:
            torch.distributed.destroy_process_group()


def _init_ranks(device: torch.device) -> tuple[int, int, bool]:
    """(world size, rank, made): the process group torchrun describes, made now (NCCL on GPUs, gloo on the CPU)
    so that the ranks can take turns before the engine exists; the engine then uses it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 1, 0, False
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_world_size(), dist.get_rank(), made


def _print_start(console: Console, opts: TrainOptions, loaded: LoadedConfig, data, engine, total: int,
                 result: TrainResult) -> None:
    from zerofit.config import format_report

    cfg = loaded.config
    s = data.stats
    params = sum(u.numel for u in engine.units)
    console.print(f"[bold]zerofit train[/]: {opts.model} ({fmt_count(params)} parameters) on {engine.device}")
    kinds = ", ".join(f"{n:,} {k}" for k, n in s.documents)
    console.print(f"  data      {s.files} files, {kinds}; {s.tokens:,} tokens ({s.target_tokens:,} with a loss); "
                  f"{len(data.train):,} training windows of {opts.seq_len}"
                  + (f", {len(data.eval):,} held out" if data.eval is not None else ", none held out"))
    ranks = f" x {cfg.world_size} ranks" if cfg.world_size > 1 else ""
    console.print(f"  batch     {cfg.micro_batch_size} x {opts.seq_len} x {cfg.gradient_accumulation_steps}{ranks} = "
                  f"{result.tokens_per_step:,} tokens per step; {total} steps")
    console.print(f"  optimizer AdamW lr {cfg.optimizer.lr:g}, weight decay {cfg.optimizer.weight_decay:g}; "
                  f"schedule {cfg.scheduler.type}, warm-up {cfg.scheduler.warmup_steps}; "
                  f"clipping {cfg.gradient_clipping:g}; precision {cfg.precision}")
    console.print("  " + engine.plan.describe().replace("\n", "\n  "))
    when = (f"every {opts.save_every} steps" + (" and at the end" if opts.save_at_end else "") if opts.save_every
            else "at the end" if opts.save_at_end else "none")
    console.print(f"  run       {opts.output} (checkpoints: {when}; keep {opts.keep})")
    notices = format_report(loaded.notices)
    if notices:
        console.print("  DeepSpeed keys zerofit maps or decides itself:\n" + notices)
