"""The ``zerofit`` command: a thin layer over the Python API.

    zerofit train                 # train the embedded demo model (see zerofit.demo)
    zerofit config show ds.json   # the resolved configuration, or the error
    zerofit doctor --disk /nvme   # this machine's limits, before choosing an offload plan
    zerofit export CKPT OUT       # a checkpoint's weights as a Hugging Face model directory
    zerofit estimate --shape llama-2-13b --max-gpu-memory 24GiB --nvme /nvme   # the plan, before launch
    zerofit generate --model DIR --prompt "Hello" --max-gpu-memory 24GiB       # offloaded generation
    zerofit chat --model runs/x/export                                          # chat in the terminal
    zerofit deepspeed train.py --deepspeed_config ds.json                       # a DeepSpeed script, unchanged

Each ``train`` option maps onto one config field (or describes the run); the
logic lives in :mod:`zerofit.demo`, :mod:`zerofit.cli.doctor` and :mod:`zerofit.config`.
Exit codes: 0 done, 1 the run failed (or its folder is in use, its checkpoints refused), 2 bad configuration,
option or path, 130 / 143 a run stopped by Ctrl-C / SIGTERM (docs/cli.md); every error is one line ([Note: one
line per error], zerofit.cli.errors), its traceback only with ``--debug`` or ZEROFIT_DEBUG=1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup
from typer.exceptions import TyperException

from zerofit.cli import errors as cli_errors
from zerofit.demo.options import DemoOptions

_DEFAULT = DemoOptions()


class _Commands(TyperGroup):
    """The command group: an error a command did not handle is one line and an exit status ([Note: one line per
    error]), not a traceback."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, TyperException):  # exits, and usage errors typer prints itself
            raise
        except Exception as e:  # noqa: BLE001 - each is described, see cli_errors
            if cli_errors.debug_requested():
                raise
            _fail_on(e)


app = typer.Typer(
    name="zerofit",
    no_args_is_help=True,
    add_completion=False,
    cls=_Commands,
    help="Train language models whose training state is larger than GPU memory.",
)
config_app = typer.Typer(no_args_is_help=True, help="Read and check configurations.")
app.add_typer(config_app, name="config")

EXIT_FAILED = 1  # a run that cannot go on: its folder in use, its checkpoints refused
EXIT_BAD_CONFIG = 2
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT (143: SIGTERM, 128 + its number)


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


def _fail(console: Console, message: str, status: int = EXIT_BAD_CONFIG) -> None:
    handled = sys.exc_info()[1]
    if handled is not None and cli_errors.debug_requested():
        raise handled  # --debug: the error being reported, with its traceback
    # Text: a message with [brackets] is not markup; soft_wrap: no line breaks inside names; one line
    console.print(Text(cli_errors.one_line(message), style="bold red"), soft_wrap=True)
    raise typer.Exit(status)


def _fail_on(err: Exception, *, output: Path | None = None, resume: bool = False) -> None:
    """``err`` as one line on stderr, and its exit status ([Note: one line per error])."""
    code, message = cli_errors.describe(err, output=output, resume=resume)
    Console(stderr=True).print(Text(message, style="bold red"), soft_wrap=True)
    raise typer.Exit(code) from None


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show an error's full traceback (also ZEROFIT_DEBUG=1).")
    ] = False,
) -> None:
    cli_errors.debug_flag(debug)


@app.command()
def estimate(
    model: Annotated[
        Path | None,
        typer.Option(help="Hugging Face model directory (only config.json is read: a 4-bit folder's form too)."),
    ] = None,
    shape: Annotated[
        str | None,
        typer.Option(
            help=(
                "A named shape instead of --model: llama-3.2-3b, llama-2-7b, llama-3.1-8b, llama-2-13b, llama-3-70b, "
                "qwen3-8b, qwen3-32b, qwen2.5-72b (or 3b, 7b, 13b, 70b)."
            )
        ),
    ] = None,
    config: Annotated[Path | None, typer.Option(help="DeepSpeed or zerofit JSON config.")] = None,
    max_gpu_memory: Annotated[str | None, typer.Option(help="GPU memory budget, e.g. 24GiB.")] = None,
    max_host_memory: Annotated[str | None, typer.Option(help="Host memory budget, e.g. 64GiB.")] = None,
    nvme: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the disk tier (offload.optimizer_device and param_device nvme, offload.nvme_path)."
        ),
    ] = None,
    micro_batch_size: Annotated[int | None, typer.Option(min=1, help="Sequences per micro-batch.")] = None,
    grad_accum: Annotated[int | None, typer.Option(min=1, help="Micro-batches per step.")] = None,
    seq_len: Annotated[
        int | None, typer.Option(min=8, help="Tokens per sequence (default: the model's, <= 2048).")
    ] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Plan for training on the CPU instead of a GPU.")] = False,
    gpus: Annotated[
        int,
        typer.Option(
            min=1, help="Ranks on one host, one GPU each: GPU bytes per GPU, host bytes for the host (docs/ranks.md)."
        ),
    ] = 1,
    nnodes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Hosts, each with --gpus ranks: both layouts across them (hybrid, full), their host bytes per node, "
            "the bytes that cross the nodes per step, and which is faster (docs/ranks.md).",
        ),
    ] = 1,
    inter_node_gbps: Annotated[
        float | None,
        typer.Option(min=0.0, help="The bandwidth between the hosts, GB/s (with --nnodes): the time of those bytes."),
    ] = None,
    measure: Annotated[bool, typer.Option(help="Measure this machine's speeds to predict the step time.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON.")] = False,
    lora: Annotated[
        bool, typer.Option("--lora", help="Plan LoRA (r 16, alpha 32, all linears) over a frozen base.")
    ] = False,
    qlora: Annotated[bool, typer.Option("--qlora", help="Plan QLoRA: --lora with the base's linears in NF4.")] = False,
) -> None:
    """The plan zerofit would choose, the GPU, host and disk bytes it needs and the predicted step time,
    without allocating the model. When nothing fits: what would, with the numbers (exit 2)."""
    from zerofit.config import ConfigError, load_config
    from zerofit.estimate import estimate as run_estimate
    from zerofit.models import WeightFileError

    console = Console()
    if (model is None) == (shape is None):
        _fail(console, "give --model DIR or --shape NAME (one of them)")
    overrides: dict = {}
    for key, value in (
        ("max_gpu_memory", max_gpu_memory),
        ("max_host_memory", max_host_memory),
        ("micro_batch_size", micro_batch_size),
        ("gradient_accumulation_steps", grad_accum),
        ("seq_len", seq_len),
    ):
        if value is not None:
            overrides[key] = value
    try:
        base = load_config(str(config) if config else {}, world_size=gpus if gpus > 1 else None).config.model_dump(
            mode="json"
        )
        if nvme is not None:
            base["offload"] = {
                **base.get("offload", {}),
                "optimizer_device": "nvme",
                "param_device": "nvme",
                "nvme_path": str(nvme),
            }
        if cpu:
            base["device"] = "cpu"
        if "micro_batch_size" in overrides or "gradient_accumulation_steps" in overrides:
            base.pop("train_batch_size", None)
        from zerofit.estimate import meta_model

        meta = model if model is not None else meta_model(shape=shape)  # a folder: its config.json alone
        if qlora:
            base["quantize_base"] = "nf4"
        est = run_estimate(
            meta,
            base,
            measure=measure,
            gpu=not cpu,
            lora=lora or qlora or None,
            nnodes=nnodes,
            inter_node_gb_per_s=inter_node_gbps,
            **overrides,
        )
    except (ConfigError, WeightFileError, ValueError) as e:
        _fail(console, f"{type(e).__name__}: {e}")
    if as_json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        console.print(Text(est.render()), soft_wrap=True)
    if est.refusal is not None:
        raise typer.Exit(EXIT_BAD_CONFIG)


@app.command()
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
    ] = _DEFAULT.device,
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
    ] = _DEFAULT.sample_tokens,
) -> None:
    """Fine-tune a Hugging Face model directory on your data (--model, --data), or train the embedded demo."""
    console = Console()
    paths = list(data or []) + list(more_data or [])
    if (gpus > 1 or nnodes > 1) and model is None:
        _fail(console, "--gpus and --nnodes need --model (the demo trains on one device)")
    if node_rank >= nnodes:
        _fail(console, f"--node-rank {node_rank}: the nodes are 0 .. {nnodes - 1} (--nnodes {nnodes})")
    from zerofit.engine.distributed import slurm

    slurm.adopt()  # under srun: its tasks are the ranks ([Note: srun is a launcher too])
    if (gpus > 1 or nnodes > 1) and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        from zerofit.cli.launch import relaunch

        raise typer.Exit(relaunch(gpus, nnodes, node_rank, master_addr, master_port))
    if model is None:
        if paths:
            _fail(console, "--data needs --model (the model directory whose tokenizer reads it)")
        if lora or qlora:
            _fail(console, "--lora needs --model DIR: the model whose adapters to train (the demo trains everything)")
        _train_demo(
            console,
            config,
            steps,
            micro_batch_size,
            grad_accum,
            seq_len,
            lr,
            precision,
            max_gpu_memory,
            device,
            seed,
            time_budget,
            sample_tokens,
        )
        return
    if not paths:
        _fail(console, "--model needs --data PATH [PATH...]: the files or folders to train on")
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
                _fail(console, str(e), EXIT_FAILED)
            except OSError as e:  # a folder that cannot be written (exit 2), or locks it does not take
                _fail_on(e, output=output)
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
        _fail(console, str(e), e.exit_status)
    except FolderInUseError as e:
        _fail(console, str(e), EXIT_FAILED)
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
            _fail(console, str(e))
        _fail_on(e, output=opts.output, resume=opts.resume)
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
        t.add_row("model", f"{result.export_dir} (AutoModelForCausalLM.from_pretrained works on it)")
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
        steps=steps or _DEFAULT.steps,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        seq_len=seq_len or _DEFAULT.seq_len,
        lr=lr,
        precision=precision.value if precision else None,
        max_gpu_memory=max_gpu_memory,
        device=device,
        seed=seed,
        time_budget=time_budget,
        sample_tokens=sample_tokens,
    )
    try:
        result = run_demo(options, console=console, on_start=lambda r: render_start(r, console))
    except ConfigError as e:
        _fail(console, f"configuration error: {e}")
    except ValueError as e:
        if "--device" not in str(e):
            raise
        _fail(console, str(e))
    render_summary(result, console)


@config_app.command("show")
def config_show(
    file: Annotated[Path, typer.Argument(help="DeepSpeed or zerofit JSON config.")],
) -> None:
    """Print the resolved configuration (and how each DeepSpeed key was read), or the error."""
    from zerofit.config import ConfigError, load_config, render_config

    try:
        loaded = load_config(file)
    except ConfigError as e:
        _fail(Console(stderr=True), f"{file}: {e}")
    typer.echo(render_config(loaded))


@config_app.command("keys")
def config_keys(
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown table.")] = False,
) -> None:
    """List every DeepSpeed key zerofit knows and how it reads it (honoured, mapped, not-applicable)."""
    from zerofit.config.deepspeed_keys import key_table

    rows = key_table()
    if markdown:
        typer.echo("| key | status | how zerofit reads it |\n| --- | --- | --- |")
        for path, status, note in rows:
            typer.echo(f"| `{path}` | {status} | {note.replace('|', '/')} |")
        return
    width = max(len(p) for p, _, _ in rows)
    for path, status, note in rows:
        typer.echo(f"{path:<{width}}  {status:<14}  {note}".rstrip())


@app.command()
def doctor(
    disk: Annotated[Path, typer.Option(help="Folder whose disk to measure (the would-be NVMe tier).")] = Path("."),
    as_json: Annotated[bool, typer.Option("--json", help="Print the measurements as JSON.")] = False,
    inter_node: Annotated[
        bool,
        typer.Option(
            "--inter-node",
            help="Only the bandwidth between the nodes, launched on each node like training (torchrun "
            "--nnodes N --node-rank i ... -m zerofit.cli doctor --inter-node, or srun): rank 0 "
            "prints it.",
        ),
    ] = False,
) -> None:
    """Measure GPU, host<->GPU bandwidth, CPU AdamW speed, RAM and disk (under 30 s)."""
    from zerofit.cli.doctor import run_doctor

    if inter_node:
        from zerofit.cli.doctor import inter_node_bandwidth, inter_node_text

        try:
            r = inter_node_bandwidth()
        except ValueError as e:
            _fail(Console(stderr=True), str(e))
        if int(os.environ.get("RANK", "0")) == 0:
            typer.echo(json.dumps(r, indent=2) if as_json else inter_node_text(r))
        return
    if not disk.is_dir():
        _fail(Console(stderr=True), f"--disk {disk}: not a folder")
    report = run_doctor(disk)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    from zerofit.cli.doctor import render

    render(report, Console())


@app.command("export")
def export(
    checkpoint: Annotated[
        Path, typer.Argument(help="A checkpoint folder (save_dir/<tag>) or a save folder (its 'latest' is used).")
    ],
    out_dir: Annotated[Path, typer.Argument(help="Folder for the Hugging Face model (created).")],
    dtype: Annotated[
        str | None, typer.Option(help="Weights dtype: bf16, fp16 or fp32 (default: the trained model's own dtype).")
    ] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest shard, e.g. 5GB or 2GiB.")] = "5GB",
    merge: Annotated[
        bool,
        typer.Option(
            "--merge",
            help="A LoRA run's checkpoint: merge the adapter into its base "
            "and write a Hugging Face model (default: the adapter).",
        ),
    ] = False,
    base: Annotated[
        Path | None,
        typer.Option(help="With --merge: the base model directory (default: the one the checkpoint was trained over)."),
    ] = None,
) -> None:
    """Write a checkpoint's weights as a Hugging Face model (config.json, sharded safetensors, tokenizer); a LoRA
    run's checkpoint as PEFT's adapter folder, or merged (--merge)."""
    from zerofit.checkpoint import CheckpointError, export_checkpoint

    said: list[str] = []
    try:
        out = export_checkpoint(checkpoint, out_dir, dtype, max_shard_size, merge=merge, base=base, said=said)
    except (CheckpointError, ValueError) as e:
        _fail(Console(stderr=True), f"export failed: {e}")
    for line in said:
        typer.echo(line)
    if (out / "adapter_config.json").is_file():
        typer.echo(f"exported {checkpoint} -> {out} (a PEFT adapter: PeftModel.from_pretrained(base, {out}))")
        return
    written = json.loads((out / "config.json").read_text())["dtype"]
    how = "as asked" if dtype else "the model's own dtype; --dtype to change it"
    typer.echo(f"exported {checkpoint} -> {out} ({written}: {how})")


_GEN_MODEL = typer.Option(
    help="A Hugging Face model directory or a zerofit checkpoint (a tag folder, or a save "
    "folder whose 'latest' is used)."
)


@app.command(
    "deepspeed", add_help_option=False, context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def deepspeed_launch(ctx: typer.Context) -> None:
    """Run a DeepSpeed training script unchanged, in one process, its `import deepspeed` zerofit's:
    `zerofit deepspeed train.py --deepspeed_config ds.json` (DeepSpeed's launcher options; --help)."""
    from zerofit.deepspeed.launcher import main as launch
    from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported

    # the command line itself where it is this command's (click drops a `--` the script may want)
    argv = sys.argv[2:] if sys.argv[1:2] == ["deepspeed"] else list(ctx.args)
    try:
        code = launch(argv)
    except (DeepSpeedUnsupported, FileNotFoundError, ValueError) as e:  # the launch itself; not the script's
        _fail(Console(stderr=True), str(e))
    raise typer.Exit(code)


def _sampling_options(temperature, top_k, top_p, repetition_penalty, stop, seed, greedy) -> dict:
    return {
        "do_sample": False if greedy else None,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "repetition_penalty": repetition_penalty,
        "stop": stop or None,
        "seed": seed,
    }


def _inference_engine(
    console: Console, model: Path, max_gpu_memory, dtype, device, max_host_memory=None, nvme=None, adapter=None
):
    from zerofit.engine.disk.tier import DiskTierError
    from zerofit.infer.engine import InferenceEngine
    from zerofit.models import WeightFileError

    try:
        return InferenceEngine.from_pretrained(
            model,
            adapter=adapter,
            max_gpu_memory=max_gpu_memory,
            dtype=dtype,
            device=device,
            max_host_memory=max_host_memory,
            nvme_path=nvme,
        )
    except (WeightFileError, ValueError, OSError, DiskTierError) as e:
        _fail(console, f"cannot load {model}: {e}")


_HOST_OPT = typer.Option(help="Host memory budget for the blocks' 16-bit weights, e.g. 16GiB: the rest go to --nvme.")
_NVME_OPT = typer.Option(
    help="Folder for the blocks that do not fit --max-host-memory (a swap file, removed at the end)."
)


@app.command()
def generate(
    model: Annotated[Path, _GEN_MODEL],
    prompt: Annotated[list[str] | None, typer.Option(help="A prompt (repeat for several).")] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(help="JSON-lines file: each line a string or an object with prompt, text or messages (a chat)."),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 128,
    batch_size: Annotated[int, typer.Option(min=1, help="Prompts decoded together.")] = 8,
    max_gpu_memory: Annotated[
        str | None,
        typer.Option(help="GPU memory budget, e.g. 24GiB: the blocks that do not fit stream through the GPU."),
    ] = None,
    max_host_memory: Annotated[str | None, _HOST_OPT] = None,
    nvme: Annotated[Path | None, _NVME_OPT] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Weights dtype: bf16 or fp16 (default: the model's 16-bit dtype, else bf16); fp32 on the CPU."
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cuda, cuda:1 or cpu (default: the GPU if there is one).")] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap each text prompt as a user message in the model's chat template.")
    ] = False,
    system: Annotated[str | None, typer.Option(help="System message for chat prompts.")] = None,
    greedy: Annotated[
        bool, typer.Option("--greedy", help="Greedy decoding even if the model's generation config samples.")
    ] = False,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature (sets sampling on).")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sample from the k most likely tokens.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling threshold.")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(help="Penalty > 1 for repeated tokens.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop at this text (repeat for several).")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed (sampling is reproducible with it).")] = None,
    output: Annotated[
        Path | None, typer.Option(help="Write one JSON line per prompt (prompt, text, tokens, finish) to this file.")
    ] = None,
    adapter: Annotated[
        Path | None,
        typer.Option(
            help="A PEFT adapter folder (zerofit train --lora's OUTPUT/adapter) over --model, the base directory."
        ),
    ] = None,
) -> None:
    """Generate text with a model or checkpoint larger than the GPU: as many blocks as fit stay resident, the
    others stream from pinned host memory. One prompt streams its tokens to the terminal."""
    from zerofit.infer import InferencePlanError
    from zerofit.infer.text import complete, read_prompts

    err = Console(stderr=True)
    if (prompt is None) == (prompts is None):
        _fail(err, "give --prompt TEXT (repeatable) or --prompts FILE.jsonl (one of them)")
    try:
        items = list(prompt) if prompt else read_prompts(prompts)
    except (OSError, ValueError) as e:
        _fail(err, f"--prompts: {e}")
    engine = _inference_engine(err, model, max_gpu_memory, dtype, device, max_host_memory, nvme, adapter)
    sampling = _sampling_options(temperature, top_k, top_p, repetition_penalty, stop, seed, greedy)
    one = len(items) == 1
    stream = (lambda piece: (sys.stdout.write(piece), sys.stdout.flush())) if one and output is None else None
    t0 = time.perf_counter()
    try:
        done = complete(
            engine,
            items,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            chat=chat,
            system=system,
            stream=stream,
            **sampling,
        )
    except InferencePlanError as e:
        engine.close()
        _fail(err, f"refused before the first token: {e}")
    except ValueError as e:
        engine.close()
        _fail(err, str(e))
    if stream is not None:
        sys.stdout.write("\n")
    elif output is None:
        for i, c in enumerate(done):
            typer.echo(f"--- {i}: {c.new_tokens} tokens ({c.finish})")
            typer.echo(c.text)
    if output is not None:
        with open(output, "w") as f:
            for item, c in zip(items, done):
                f.write(
                    json.dumps(
                        {
                            "prompt": item,
                            "text": c.text,
                            "prompt_tokens": c.prompt_tokens,
                            "new_tokens": c.new_tokens,
                            "finish": c.finish,
                        }
                    )
                    + "\n"
                )
    new = sum(c.new_tokens for c in done)
    wall = time.perf_counter() - t0
    err.print(
        Text(
            f"{len(done)} prompts, {new} new tokens in {wall:.2f} s ({new / max(wall, 1e-9):.1f} tokens/s); "
            f"{engine.summary()}",
            style="dim",
        ),
        soft_wrap=True,
    )
    engine.close()


@app.command()
def chat(
    model: Annotated[Path, _GEN_MODEL],
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per answer.")] = 512,
    max_gpu_memory: Annotated[str | None, typer.Option(help="GPU memory budget, e.g. 24GiB.")] = None,
    max_host_memory: Annotated[str | None, _HOST_OPT] = None,
    nvme: Annotated[Path | None, _NVME_OPT] = None,
    dtype: Annotated[str | None, typer.Option(help="Weights dtype: bf16 or fp16.")] = None,
    device: Annotated[str | None, typer.Option(help="cuda, cuda:1 or cpu.")] = None,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature (default: greedy).")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling threshold.")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    adapter: Annotated[
        Path | None,
        typer.Option(
            help="A PEFT adapter folder (zerofit train --lora's OUTPUT/adapter) over --model, the base directory."
        ),
    ] = None,
) -> None:
    """Chat with a model or checkpoint in the terminal (its chat template; the conversation is kept).
    /help lists the commands; /reset starts over; /quit, /exit or Ctrl-D (end of input) ends it."""
    from zerofit.infer import InferencePlanError
    from zerofit.infer.chat import HINT, Chat, run_chat
    from zerofit.infer.text import complete, prompt_ids
    from zerofit.models.directory import positions

    err = Console(stderr=True)
    err.print(Text(f"loading {model} ...", style="dim"), soft_wrap=True)
    t0 = time.perf_counter()
    engine = _inference_engine(err, model, max_gpu_memory, dtype, device, max_host_memory, nvme, adapter)
    if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
        engine.close()
        _fail(err, f"{model}: its tokenizer has no chat template: use zerofit generate with plain prompts")
    err.print(Text(f"loaded in {time.perf_counter() - t0:.1f} s; {engine.summary()}", style="dim"), soft_wrap=True)
    err.print(Text(HINT), soft_wrap=True)
    sampling = _sampling_options(temperature, None, top_p, None, None, seed, temperature is None)
    context, _ = positions(engine.model.config)

    def prompt_length(messages: list[dict]) -> int:
        return len(prompt_ids(engine.tokenizer, messages, chat=True))

    def fits(messages: list[dict]) -> bool:  # the history with a whole answer within the model's context
        return context is None or prompt_length(messages) + max_new_tokens <= context

    def answer(messages: list[dict], stream) -> str | None:
        room = max_new_tokens if context is None else min(max_new_tokens, context - prompt_length(messages))
        if room < 1:
            return None
        try:
            (c,) = complete(engine, [messages], max_new_tokens=room, stream=stream, **sampling)
        except InferencePlanError as e:
            engine.close()
            _fail(err, f"refused: {e}")
        return c.text

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        run_chat(Chat(system=system), answer, input, write, fits)
    except KeyboardInterrupt:  # Ctrl-C: the chat ends, the engine's memory is given back
        write("\n")
        engine.close()
        raise typer.Exit(EXIT_INTERRUPTED) from None
    engine.close()


def main() -> None:
    # DeepSpeed, when installed, is imported by transformers and warns on a machine without a GPU that it chose
    # the CPU: zerofit's commands use its config format, not its accelerator; on a GPU machine it finds CUDA
    # itself, and a DS_ACCELERATOR the user set is kept
    if "DS_ACCELERATOR" not in os.environ and not _has_cuda():
        os.environ["DS_ACCELERATOR"] = "cpu"
    app()


def _has_cuda() -> bool:
    """Whether a CUDA device is visible, without importing torch (``zerofit --help`` stays fast): the driver's
    device files."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


if __name__ == "__main__":
    main()
