"""A real fine-tuning run: a model directory and the user's data in; checkpoints, metrics and a model out.

    zerofit train --model path/to/Llama-2-7b-hf --data notes/ chats.jsonl --output runs/notes \\
                  --max-gpu-memory 24GiB --save-every 200 --eval-every 100
    zerofit train --model path/to/Llama-2-7b-hf --data notes/ chats.jsonl --output runs/notes --resume

:func:`run_training` does what the command does, from Python: read and pack the data with the model's own
tokenizer (:mod:`zerofit.data`), build the engine from the model directory (weights streamed into its
buffers), train with a progress bar, log metrics (``metrics.jsonl``, TensorBoard), evaluate on held-out
documents, save resumable checkpoints (``checkpoints/``, the newest ``keep``), and export a Hugging Face model
(``model/``). ``--resume`` continues from ``checkpoints/latest`` exactly where it stopped, data order
included (without ``latest``, from the newest complete checkpoint: [Note: where a run starts], resume.py).
One run holds the folder at a time ([Note: one writer per folder], checkpoint/lock.py). The first Ctrl-C or
SIGTERM finishes the current step, saves a checkpoint and stops (exit 130 or 143); a second one stops at
once ([Note: signals of a run], signals.py).

Run folder::

    OUTPUT/.zerofit-run.lock      held by the run (who: pid, host, start time, command)
    OUTPUT/metrics.jsonl          one JSON object per training step and per evaluation
    OUTPUT/tensorboard/           TensorBoard event files
    OUTPUT/checkpoints/latest     the tag of the newest complete checkpoint
    OUTPUT/checkpoints/global_stepN/
    OUTPUT/model/                 the exported Hugging Face model (config.json, *.safetensors, tokenizer)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from zerofit.config import LoadedConfig, load_config, load_with_defaults
from zerofit.data.pairs import PairDataset
from zerofit.engine.plan.search import fmt_bytes, fmt_count
from zerofit.train.metrics import Metrics
from zerofit.train.options import TrainOptions
from zerofit.train.progress import first_step_note, kernel_build_note
from zerofit.train.resume import hold_run_folder, plan_start
from zerofit.train.signals import RunSignals, StopNow, reached

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
    for name, value in (
        ("micro_batch_size", opts.micro_batch_size),
        ("gradient_accumulation_steps", opts.grad_accum),
        ("optimizer.lr", opts.lr),
        ("scheduler.warmup_steps", opts.warmup_steps),
        ("precision", opts.precision),
        ("kernels", opts.kernels),
        ("max_gpu_memory", opts.max_gpu_memory),
        ("max_host_memory", opts.max_host_memory),
        ("seed", opts.seed),
    ):
        if value is not None:
            overrides[name] = value
    if opts.nvme is not None:
        overrides["offload.optimizer_device"] = overrides["offload.param_device"] = "nvme"  # streamed, tier on
        overrides["offload.nvme_path"] = str(opts.nvme)
    overrides["seq_len"] = opts.seq_len
    return load_with_defaults(opts.config, finetune_defaults(device), **overrides)


@dataclass
class TrainResult:
    """What a run did (this process: a resumed run counts from where it resumed)."""

    run_dir: Path
    steps_total: int  # steps the run is planned for
    start_step: int = 0  # steps done before this process (resume)
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "eval_loss", "eval_perplexity"}
    checkpoints: list[Path] = field(default_factory=list)
    export_dir: Path | None = None
    seq2seq: bool = False  # an encoder-decoder trained on pairs ([Note: pairs for an encoder-decoder])
    interrupted: bool = False
    stop_signal: int = 0  # the signal that interrupted it (SIGINT, SIGTERM); 0: none
    tokens_per_step: int = 0
    memory: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)  # load (and resume) seconds and memory, as logged

    @property
    def steps_done(self) -> int:
        return self.start_step + len(self.losses)

    @property
    def tokens_per_s(self) -> float:
        timed = self.step_seconds[1:] or self.step_seconds
        return len(timed) * self.tokens_per_step / sum(timed) if timed and sum(timed) > 0 else 0.0


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


def run_training(opts: TrainOptions, console: Console | None = None, *, run_lock=None) -> TrainResult:
    """Fine-tune ``opts.model`` on ``opts.data``; see the module docstring. The run folder is held for the
    run (``run_lock``: the caller holds it already, as ``zerofit train`` does before torch loads); a folder
    another run holds raises :class:`~zerofit.checkpoint.lock.FolderInUseError` before anything is read or
    written. A signal that stops the run at once raises :class:`~zerofit.train.signals.StopNow` (a
    KeyboardInterrupt); one that lets the step finish returns the result, ``interrupted``."""
    console = console or Console()
    # several ranks: rank 0 holds the folder for all of them (the others write only below it, ranks/rankN/)
    from zerofit.engine.distributed import slurm

    slurm.adopt()  # under srun: SLURM's variables as torchrun's ([Note: srun is a launcher too])
    rank = int(os.environ.get("RANK", "0"))
    own = run_lock is None and rank == 0
    lock = hold_run_folder(opts.output) if own else run_lock
    try:
        with RunSignals((console if rank == 0 else Console(quiet=True)).print) as signals:
            return _run(opts, console, signals)
    finally:
        if own:
            lock.release()


def _run(opts: TrainOptions, console: Console, signals: RunSignals) -> TrainResult:
    from zerofit.data import StepLoader, build_datasets, load_tokenizer, small_held_out
    from zerofit.demo.run import resolve_device
    from zerofit.models import ModelDir
    from zerofit.models.directory import window_length

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
    model_dir = ModelDir.open(opts.model)  # a wrong path fails here, naming it, before the data is read
    seq_len, note = window_length(opts.seq_len, model_dir.config)
    if note:
        console.print(Text(f"zerofit: {note}", style="yellow"), soft_wrap=True)
    opts = dataclasses.replace(opts, seq_len=seq_len)
    loaded = resolve_config(opts, device, world)
    cfg = loaded.config
    run_dir = Path(opts.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = run_dir / "checkpoints"
    start = plan_start(ckpt_dir, opts.resume)  # [Note: where a run starts]: refused before anything loads

    tokenizer = load_tokenizer(opts.model)
    reached("data")
    # rank 0 fills the datasets cache before the others read it: each rank passes one barrier, before or after
    if rank:
        torch.distributed.barrier()
    data = build_datasets(
        opts.data,
        tokenizer,
        opts.seq_len,
        eval_size=opts.eval_size,
        seed=cfg.seed,
        cache_dir=run_dir / ".datasets-cache",
        seq2seq=bool(getattr(model_dir.config, "is_encoder_decoder", False)),  # [Note: pairs for an encoder-decoder]
    )
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
    engine = _load_with_progress(console, opts, loaded)
    result = TrainResult(run_dir, total, tokens_per_step=cfg.micro_batch_size * G * world * opts.seq_len)
    result.seq2seq = isinstance(data.train, PairDataset)
    metrics = None
    try:
        reached("engine")
        setup = {
            "load_seconds": round(time.perf_counter() - t_load, 3),
            "load_phases": {k: round(v, 3) for k, v in engine.startup.seconds.items()},
            "load_rss_growth_bytes": _rss("VmHWM:") - rss0,
            "host_planned_bytes": engine.plan.host_total,
        }
        elapsed = 0.0
        if start.note:
            console.print(Text(start.note, style="yellow"), soft_wrap=True)
        if start.resume:
            t_resume = time.perf_counter()
            path, client = engine.load_checkpoint(ckpt_dir, tag=start.tag)
            setup["resume_seconds"] = round(time.perf_counter() - t_resume, 3)
            loader.load_state_dict(client["loader"])
            result.start_step = int(client["iterations"])
            elapsed = float(client.get("elapsed", 0.0))
            console.print(f"resumed from {path} at step {result.start_step} of {total}")
        _print_start(console, opts, loaded, data, engine, total, result)
        tiny = small_held_out(data.eval, opts.eval_windows) if data.eval is not None else None
        if tiny:
            console.print(Text("warning: " + tiny, style="yellow"))
        # the records of steps after the start are dropped: they are trained again (metrics.py)
        metrics = (
            Metrics(run_dir, tensorboard=opts.tensorboard, elapsed=elapsed, start_step=result.start_step)
            if rank == 0
            else Metrics(
                run_dir / "ranks" / f"rank{rank}", tensorboard=False, elapsed=elapsed, start_step=result.start_step
            )
        )
        result.setup = metrics.log(result.start_step, **setup)
        signals.training = True
        return _loop(opts, console, signals, engine, loader, data, metrics, result, start.protect, ckpt_dir)
    except StopNow as e:
        result.interrupted, result.stop_signal = True, e.signum
        engine = None  # at once: no orderly close; the engine's finalizer releases it ([Note: signals of a run])
        raise
    finally:
        if metrics is not None:
            metrics.close()
        if engine is not None:
            result.memory = dict(engine.memory_stats())
            engine.close()
        if world > 1 and _made_group:
            torch.distributed.destroy_process_group()


def _nf4_bytes(engine) -> int:
    return sum(u.nf4.nbytes for u in engine.units if u.nf4 is not None)


def _load_with_progress(console: Console, opts: TrainOptions, loaded: LoadedConfig):
    """The engine (:func:`_build_engine`), a progress bar on screen while its model is read, built or quantized
    ([Note: start-up progress], engine/model/startup.py)."""
    from zerofit.engine.model.startup import listen

    what = "quantize" if opts.lora is not None and opts.lora.qlora else "load"
    bar = Progress(
        TextColumn(f"[bold]{what}"),
        BarColumn(),
        TextColumn("{task.fields[done]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=not opts.progress,
        transient=True,
    )

    def tell(done: int, total: int, seconds: float) -> None:
        rate = done / seconds / 1e6 if seconds > 0 else 0.0
        bar.update(
            task,
            total=total,
            completed=done,
            done=f"{fmt_count(done)} of {fmt_count(total)} parameters, {fmt_count(rate * 1e6)}/s",
        )

    with bar, listen(tell):
        task = bar.add_task(what, total=None, done="reading the model's files")
        return _build_engine(opts, loaded)


def _build_engine(opts: TrainOptions, loaded: LoadedConfig):
    """The engine over the model directory; with ``opts.lora``, over the PEFT model that wraps it (the base
    read from the files into the engine's buffers, frozen; the adapters PEFT's, seeded: zerofit/lora/model.py)."""
    import zerofit

    if opts.lora is None:
        return zerofit.initialize(str(opts.model), loaded)
    from zerofit.engine.engine import Engine
    from zerofit.lora.model import from_model_dir

    model, source = from_model_dir(opts.model, opts.lora, seed=loaded.config.seed)
    config = loaded.config
    if opts.lora.qlora:  # [Note: an NF4 base] (engine/model/nf4.py): quantized as the files are read
        config = config.model_copy(update={"quantize_base": "nf4"})
    return Engine(model, config, report=loaded.report, source=source)


def _loop(
    opts: TrainOptions,
    console: Console,
    signals: RunSignals,
    engine,
    loader,
    data,
    metrics: Metrics,
    result: TrainResult,
    protect: frozenset[str],
    ckpt_dir: Path,
) -> TrainResult:
    """The steps, evaluations and checkpoints, then the end of the run: evaluation, checkpoint, export. The
    first signal ends it after the step in progress, with a checkpoint ([Note: signals of a run])."""
    from zerofit.checkpoint import prune
    from zerofit.data import evaluate

    cfg = engine.config
    world, rank = engine.ranks.world, engine.ranks.rank
    G, total = cfg.gradient_accumulation_steps, result.steps_total

    def save(step: int) -> None:
        client = {"loader": loader.state_dict(), "iterations": step, "elapsed": metrics.elapsed}
        t = time.perf_counter()
        engine.save_checkpoint(ckpt_dir, tag=f"global_step{step}", client_state=client)
        result.checkpoints.append(ckpt_dir / f"global_step{step}")
        if rank == 0:  # never the checkpoint the run started from, nor a newer one that was there before it
            prune(ckpt_dir, opts.keep, protect=protect)
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
        console.print(
            f"step {step}: held-out loss {res.loss:.4f}, perplexity {res.perplexity:,.2f} ({res.tokens:,} tokens)"
        )

    bar = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[stats]}"),
        console=console,
        disable=not opts.progress,
    )

    def stop_requested() -> int:
        """The signal that asked the run to stop, or 0; the same on every rank (else one would wait forever
        for the others)."""
        return max(engine.ranks.objects(signals.signum)) if world > 1 else signals.signum

    step = result.start_step
    with bar:
        task = bar.add_task("train", total=total, completed=step, stats=first_step_note(engine.device))
        bar.refresh()  # the note shows now, not at the next tick: step 1 may take seconds
        while step < total and not stop_requested():
            batch = next(loader)[rank * G : (rank + 1) * G]
            lr = engine.hypers.reported()[0].lr  # the lr this step applies (group 0), as every view reports it
            t0 = time.perf_counter()
            loss = engine.train_batch(batch)
            dt = time.perf_counter() - t0
            step += 1
            result.losses.append(loss)
            result.step_seconds.append(dt)
            mem = engine.memory_stats()
            rec = metrics.log(
                step,
                loss=loss,
                lr=lr,
                grad_norm=engine.last_grad_norm,
                tokens_per_s=round(result.tokens_per_step / dt, 1),
                step_seconds=round(dt, 4),
                gpu_peak_bytes=mem["gpu_peak_bytes"],
                host_rss_bytes=mem["host_bytes"],
                skipped_steps=engine.skipped_steps,
            )
            gpu = f" gpu {_gib(mem['gpu_peak_bytes'])}" if mem["gpu_peak_bytes"] else ""
            bar.update(
                task,
                completed=step,
                stats=f"loss {loss:.4f} {rec['tokens_per_s']:,.0f} tok/s{gpu} host {_gib(mem['host_bytes'])}",
            )
            if opts.eval_every and step % opts.eval_every == 0 and step < total:
                run_eval(step)
            if opts.save_every and step % opts.save_every == 0 and step < total:
                save(step)
    # the end: a signal during the last step skips the evaluation; one up to the export skips the export
    result.stop_signal = stop_requested()
    if not result.stop_signal:
        run_eval(step)
        result.stop_signal = stop_requested()
    saved = bool(result.checkpoints) and result.checkpoints[-1].name == f"global_step{step}"
    if result.stop_signal:
        result.interrupted = True
        if opts.save_on_interrupt and step > result.start_step and not saved:
            save(step)
        return result
    if opts.save_at_end and not saved:
        save(step)
    result.stop_signal = stop_requested()
    if result.stop_signal:
        result.interrupted = True
    elif opts.export:
        out = result.run_dir / ("adapter" if opts.lora is not None else "model")
        t = time.perf_counter()
        engine.save_pretrained(out, dtype=opts.export_dtype)  # None: the model directory's dtype; LoRA: PEFT's
        result.export_dir = out
        what = "the trained adapter (PEFT's adapter folder)" if opts.lora is not None else "the trained model"
        console.print(f"exported {what} to {out} in {time.perf_counter() - t:.1f} s")
    return result


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


def _print_start(
    console: Console, opts: TrainOptions, loaded: LoadedConfig, data, engine, total: int, result: TrainResult
) -> None:
    from zerofit.config import format_report

    cfg = loaded.config
    s = data.stats
    params = sum(u.numel for u in engine.units)
    frozen = sum(u.frozen_numel for u in engine.units)  # [Note: frozen parameters] (engine/memory/store.py)
    counts = (
        f"{fmt_count(params + frozen)} parameters, {fmt_count(params)} trained, {fmt_count(frozen)} frozen in "
        f"{cfg.precision}"
        if frozen
        else f"{fmt_count(params)} parameters"
    )
    console.print(f"[bold]zerofit train[/]: {opts.model} ({counts}) on {engine.device}")
    if opts.lora is not None:
        lo = opts.lora
        console.print(
            f"  lora      r {lo.r}, alpha {lo.alpha:g}, targets {lo.targets}, dropout {lo.dropout:g}: "
            f"trainable {params:,} of {params + frozen:,} parameters "
            f"({100 * params / max(1, params + frozen):.2f}%); the base is frozen"
            + (f", its linears in NF4 ({fmt_bytes(_nf4_bytes(engine))} in host memory)" if engine.nf4 else "")
        )
    kinds = ", ".join(f"{n:,} {k}" for k, n in s.documents)
    if isinstance(data.train, PairDataset):  # [Note: pairs for an encoder-decoder]
        shape = (
            f"{len(data.train):,} training pairs, inputs padded to {data.train.seq_len} and targets to "
            f"{data.train.target_len} tokens"
        )
    else:
        shape = (
            f"{len(data.train):,} training windows of {opts.seq_len} (documents packed, each attending to itself "
            "only: position ids restart per document)"
        )
    console.print(
        f"  data      {s.files} files, {kinds}; {s.tokens:,} tokens ({s.target_tokens:,} with a loss); {shape}"
        + (f", {len(data.eval):,} held out" if data.eval is not None else ", none held out")
    )
    ranks = f" x {cfg.world_size} ranks" if cfg.world_size > 1 else ""
    console.print(
        f"  batch     {cfg.micro_batch_size} x {opts.seq_len} x {cfg.gradient_accumulation_steps}{ranks} = "
        f"{result.tokens_per_step:,} tokens per step; {total} steps"
    )
    console.print(
        f"  optimizer AdamW lr {cfg.optimizer.lr:g}, weight decay {cfg.optimizer.weight_decay:g}; "
        f"schedule {cfg.scheduler.type}, warm-up {cfg.scheduler.warmup_steps}; "
        f"clipping {cfg.gradient_clipping:g}; precision {cfg.precision}"
    )
    console.print("  " + engine.plan.describe().replace("\n", "\n  "))
    console.print(f"  {engine.kernels.describe()}")  # [Note: fast kernels]: what computes, and why
    when = (
        f"every {opts.save_every} steps" + (" and at the end" if opts.save_at_end else "")
        if opts.save_every
        else "at the end"
        if opts.save_at_end
        else "none"
    )
    console.print(f"  run       {opts.output} (checkpoints: {when}; keep {opts.keep})")
    notices = format_report(loaded.notices)
    if notices:
        console.print("  DeepSpeed keys zerofit maps or decides itself:\n" + notices)
