"""``zerofit train``: the embedded demo model, or a model folder with data files (its options, its run, its summary)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from zerofit.cli import errors as cli_errors
from zerofit.cli.common import (
    DEFAULT,
    EXIT_FAILED,
    KernelsChoice,
    Precision,
    fail,
    fail_on,
)
from zerofit.demo.options import DemoOptions


def train(
    model: Annotated[
        Path | None,
        typer.Option(
            help="Hugging Face model directory (config.json, *.safetensors, tokenizer) to fine-tune; "
            "without it, the embedded demo model trains."
        ),
    ] = None,
    data: Annotated[
        list[Path] | None,
        typer.Option(help="Training data: .txt, .jsonl/.json, .parquet files or folders (--data a.jsonl b/ c.txt)."),
    ] = None,
    more_data: Annotated[
        list[Path] | None,
        typer.Argument(show_default=False, metavar="[PATH...]", help="More data paths (after --data)."),
    ] = None,
    output: Annotated[
        Path, typer.Option(help="Run folder: metrics.jsonl, tensorboard/, checkpoints/, model/ (with --model).")
    ] = Path("runs/zerofit"),
    config: Annotated[
        Path | None, typer.Option(help="DeepSpeed or zerofit JSON config; default: the fine-tuning (or demo) defaults.")
    ] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, help="Optimizer steps (scheduler.total_steps); default: one epoch (demo: 250).")
    ] = None,
    epochs: Annotated[
        float | None,
        typer.Option(min=0.0, help="Passes over the training windows, when --steps is not given (with --model)."),
    ] = None,
    micro_batch_size: Annotated[
        int | None, typer.Option(min=1, help="Sequences per micro-batch (micro_batch_size).")
    ] = None,
    grad_accum: Annotated[
        int | None, typer.Option(min=1, help="Micro-batches per step (gradient_accumulation_steps).")
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            min=8, help="Tokens per sequence (seq_len); default the model's context, at most 2048 (demo: 64 bytes)."
        ),
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (optimizer.lr).")] = None,
    warmup_steps: Annotated[int | None, typer.Option(min=0, help="Warm-up steps (scheduler.warmup_steps).")] = None,
    precision: Annotated[
        Precision | None, typer.Option(help="Compute dtype (precision); default bf16 on a GPU, fp32 on the CPU.")
    ] = None,
    kernels: Annotated[
        KernelsChoice | None,
        typer.Option(
            help="The code that computes (kernels): fast compiles the blocks and fuses the head and loss (the same "
            "math, rounded differently), exact runs the model's own ops; default auto, fast on a GPU."
        ),
    ] = None,
    max_gpu_memory: Annotated[str | None, typer.Option(help="GPU memory budget, e.g. 24GiB (max_gpu_memory).")] = None,
    max_host_memory: Annotated[
        str | None, typer.Option(help="Host memory budget, e.g. 64GiB (max_host_memory).")
    ] = None,
    nvme: Annotated[
        Path | None,
        typer.Option(help="Folder on a fast disk for the optimizer state host memory cannot hold (the NVMe tier)."),
    ] = None,
    device: Annotated[
        str, typer.Option(help="auto (the first GPU, else the CPU), cpu, cuda or cuda:N.")
    ] = DEFAULT.device,
    gpus: Annotated[
        int,
        typer.Option(
            min=1,
            help="Ranks on this host, one GPU each (launched with torchrun; with --device cpu, gloo "
            "processes); the batch is per rank (with --model).",
        ),
    ] = 1,
    nnodes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Nodes of the run, each running this command with its --node-rank (torchrun's --nnodes; "
            "docs/ranks.md).",
        ),
    ] = 1,
    node_rank: Annotated[int, typer.Option(min=0, help="This node's index, 0 .. --nnodes - 1.")] = 0,
    master_addr: Annotated[str, typer.Option(help="Node 0's address, where the ranks meet.")] = "127.0.0.1",
    master_port: Annotated[int, typer.Option(help="Node 0's port for the rendezvous.")] = 29500,
    seed: Annotated[
        int | None, typer.Option(min=0, help="Random seed (seed): initialisation, dropout, data order and split.")
    ] = None,
    eval_size: Annotated[
        float, typer.Option(min=0.0, help="Held-out documents: a fraction (< 1) or a count (with --model).")
    ] = 0.02,
    eval_every: Annotated[
        int, typer.Option(min=0, help="Evaluate on the held-out documents every N steps and at the end (with --model).")
    ] = 0,
    eval_windows: Annotated[
        int | None, typer.Option(min=1, help="Evaluate at most this many held-out windows each time.")
    ] = None,
    save_every: Annotated[
        int, typer.Option(min=0, help="Save a checkpoint every N steps and at the end (with --model).")
    ] = 0,
    keep: Annotated[int, typer.Option(min=1, help="Checkpoints kept (the newest).")] = 2,
    save_at_end: Annotated[bool, typer.Option(help="Save a checkpoint after the last step.")] = True,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from OUTPUT/checkpoints/latest, data order included.")
    ] = False,
    save_on_interrupt: Annotated[
        bool, typer.Option(help="On Ctrl-C: finish the step, save a checkpoint, exit 130.")
    ] = True,
    export: Annotated[bool, typer.Option(help="Export a Hugging Face model to OUTPUT/model at the end.")] = True,
    export_dtype: Annotated[
        Precision | None, typer.Option(help="dtype of the exported weights; default: the model directory's.")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
    deterministic: Annotated[
        bool,
        typer.Option("--deterministic", help="Deterministic GPU kernels: runs and resumes repeat bitwise (slower)."),
    ] = False,
    lora: Annotated[
        bool,
        typer.Option(
            "--lora",
            help="Train LoRA adapters (PEFT) over the frozen model; the run exports OUTPUT/adapter (docs/lora.md).",
        ),
    ] = False,
    lora_r: Annotated[int, typer.Option(min=1, help="LoRA rank (LoraConfig.r).")] = 16,
    lora_alpha: Annotated[float, typer.Option(help="LoRA alpha (LoraConfig.lora_alpha).")] = 32.0,
    lora_targets: Annotated[
        str, typer.Option(help="Modules to adapt: all-linear, or names, comma-separated (q_proj,v_proj).")
    ] = "all-linear",
    lora_dropout: Annotated[float, typer.Option(min=0.0, max=1.0, help="LoRA dropout.")] = 0.0,
    qlora: Annotated[
        bool,
        typer.Option(
            "--qlora",
            help="QLoRA: --lora over the base's linear layers held in 4 bits (NF4 with double quantization, "
            "bitsandbytes' format), quantized as they are read (docs/lora.md).",
        ),
    ] = False,
    time_budget: Annotated[
        float | None, typer.Option(min=0, help="Demo only: no new step starts after this many seconds of training.")
    ] = None,
    sample_tokens: Annotated[
        int, typer.Option(min=0, help="Demo only: bytes to generate after training; 0 skips the sample.")
    ] = DEFAULT.sample_tokens,
) -> None:
    """Fine-tune a Hugging Face model directory on your data (--model, --data), or train the embedded demo."""
    console = Console()
    paths = list(data or []) + list(more_data or [])
    if (gpus > 1 or nnodes > 1) and model is None:
        fail(console, "--gpus and --nnodes need --model (the demo trains on one device)")
    if node_rank >= nnodes:
        fail(console, f"--node-rank {node_rank}: the nodes are 0 .. {nnodes - 1} (--nnodes {nnodes})")
    from zerofit.engine.distributed import slurm

    slurm.adopt()  # under srun: its tasks are the ranks ([Note: srun is a launcher too])
    if (gpus > 1 or nnodes > 1) and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from zerofit.cli.launch import relaunch

        raise typer.Exit(relaunch(gpus, nnodes, node_rank, master_addr, master_port))
    if model is None:
        if paths:
            fail(console, "--data needs --model (the model directory whose tokenizer reads it)")
        if lora or qlora:
            fail(console, "--lora needs --model DIR: the model whose adapters to train (the demo trains everything)")
        _train_demo(
            console,
            config,
            steps,
            micro_batch_size,
            grad_accum,
            seq_len,
            lr,
            precision,
            kernels,
            max_gpu_memory,
            device,
            seed,
            time_budget,
            sample_tokens,
        )
        return
    if not paths:
        fail(console, "--model needs --data PATH [PATH...]: the files or folders to train on")
    from zerofit.checkpoint.lock import FolderInUseError
    from zerofit.lora.options import LoraOptions
    from zerofit.train.options import TrainOptions
    from zerofit.train.resume import hold_run_folder
    from zerofit.train.signals import exit_at_once, exit_on_signal

    opts = TrainOptions(
        model=model,
        data=paths,
        output=output,
        config=config,
        steps=steps,
        epochs=epochs,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        lr=lr,
        warmup_steps=warmup_steps,
        precision=precision.value if precision else None,
        kernels=kernels.value if kernels else None,
        max_gpu_memory=max_gpu_memory,
        max_host_memory=max_host_memory,
        nvme=str(nvme) if nvme else None,
        device=device,
        seed=seed,
        eval_size=int(eval_size) if eval_size >= 1 else eval_size,
        eval_every=eval_every,
        eval_windows=eval_windows,
        save_every=save_every,
        keep=keep,
        save_at_end=save_at_end,
        resume=resume,
        save_on_interrupt=save_on_interrupt,
        export=export,
        export_dtype=export_dtype.value if export_dtype else None,
        progress=progress,
        deterministic=deterministic,
        lora=(
            LoraOptions(r=lora_r, alpha=lora_alpha, targets=lora_targets, dropout=lora_dropout, qlora=qlora)
            if lora or qlora
            else None
        ),
    )
    status = 0
    with exit_on_signal():  # until the run's own handling: a signal ends the command with 130 / 143
        # [Note: one writer per folder]: the run folder is held before torch loads, so a second run is refused
        # in a moment; with --gpus, rank 0 holds it for all ranks
        lock = None
        if int(os.environ.get("RANK", "0")) == 0:
            try:
                lock = hold_run_folder(output)
            except FolderInUseError as e:
                fail(console, str(e), EXIT_FAILED)
            except OSError as e:  # a folder that cannot be written (exit 2), or locks it does not take
                fail_on(e, output=output)
        try:
            status = _train_model(console, opts, lock)
        finally:
            if lock is not None:
                lock.release()
    if status:
        exit_at_once()  # the run is over: a signal from here to the process's end exits with 130 / 143
        raise typer.Exit(status)


def _train_model(console: Console, opts, lock) -> int:
    """``zerofit train --model``: the run; returns the exit status (0, or 130 / 143 after a signal)."""
    from zerofit.checkpoint.lock import FolderInUseError
    from zerofit.train import run_training
    from zerofit.train.resume import RunFolderError
    from zerofit.train.signals import StopNow, exit_status

    try:
        result = run_training(opts, console, run_lock=lock)
    except RunFolderError as e:
        fail(console, str(e), e.exit_status)
    except FolderInUseError as e:
        fail(console, str(e), EXIT_FAILED)
    except StopNow as e:  # [Note: signals of a run]: a second signal, or one during start-up
        console.print(
            Text(f"{e}. {opts.output}: `--resume` continues from the last checkpoint (if any)", style="yellow"),
            soft_wrap=True,
        )
        return exit_status(e.signum)
    except Exception as e:  # noqa: BLE001 - [Note: one line per error]; the run folder's paths name --output
        if cli_errors.debug_requested():
            raise
        if isinstance(e, ValueError) and "--device" in str(e):
            fail(console, str(e))
        fail_on(e, output=opts.output, resume=opts.resume)
    _render_train_summary(result, console)
    return exit_status(result.stop_signal) if result.interrupted else 0


def _render_train_summary(result, console: Console) -> None:
    from zerofit.engine.plan.search import fmt_bytes

    t = Table(title="summary", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    done = f"{result.steps_done} of {result.steps_total}" + (" (interrupted)" if result.interrupted else "")
    t.add_row("steps", done + (f", resumed at {result.start_step}" if result.start_step else ""))
    if result.losses:
        t.add_row("training loss", f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
        t.add_row("throughput", f"{result.tokens_per_s:,.0f} tokens/s ({result.tokens_per_step:,} tokens per step)")
    if result.evals:
        e = result.evals[-1]
        t.add_row("held-out", f"loss {e['eval_loss']:.4f}, perplexity {e['eval_perplexity']:,.2f}")
    s = result.setup
    if s.get("load_seconds") is not None:
        phases = ", ".join(
            f"{k} {v:.1f} s"
            for k, v in sorted((s.get("load_phases") or {}).items(), key=lambda kv: -kv[1])
            if v >= 0.05
        )
        t.add_row(
            "model load",
            f"{s['load_seconds']:.1f} s"
            + (f" ({phases})" if phases else "")
            + f", host memory grew {fmt_bytes(s['load_rss_growth_bytes'])} "
            f"(plan {fmt_bytes(s['host_planned_bytes'])})"
            + (f"; resume {s['resume_seconds']:.1f} s" if "resume_seconds" in s else ""),
        )
    if result.memory.get("gpu_peak_bytes"):
        t.add_row("GPU memory peak", fmt_bytes(result.memory["gpu_peak_bytes"]))
    t.add_row("host memory peak", f"{fmt_bytes(result.memory.get('host_peak_bytes', 0))} (process RSS)")
    if result.checkpoints:
        t.add_row("checkpoint", str(result.checkpoints[-1]))
    if result.export_dir and result.export_dir.name == "adapter":
        t.add_row(
            "adapter",
            f"{result.export_dir} (PeftModel.from_pretrained(base, it); zerofit generate --model BASE --adapter it)",
        )
    elif result.export_dir:
        auto = "AutoModelForSeq2SeqLM" if result.seq2seq else "AutoModelForCausalLM"
        t.add_row("model", f"{result.export_dir} ({auto}.from_pretrained works on it)")
    console.print(t)


def _train_demo(
    console,
    config,
    steps,
    micro_batch_size,
    grad_accum,
    seq_len,
    lr,
    precision,
    kernels,
    max_gpu_memory,
    device,
    seed,
    time_budget,
    sample_tokens,
) -> None:
    from zerofit.config import ConfigError
    from zerofit.demo.report import render_start, render_summary
    from zerofit.demo.run import run_demo

    options = DemoOptions(
        config=config,
        steps=steps or DEFAULT.steps,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        seq_len=seq_len or DEFAULT.seq_len,
        lr=lr,
        precision=precision.value if precision else None,
        kernels=kernels.value if kernels else None,
        max_gpu_memory=max_gpu_memory,
        device=device,
        seed=seed,
        time_budget=time_budget,
        sample_tokens=sample_tokens,
    )
    try:
        result = run_demo(options, console=console, on_start=lambda r: render_start(r, console))
    except ConfigError as e:
        fail(console, f"configuration error: {e}")
    except ValueError as e:
        if "--device" not in str(e):
            raise
        fail(console, str(e))
    render_summary(result, console)
