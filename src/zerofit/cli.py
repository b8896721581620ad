"""The ``zerofit`` command: a thin layer over the Python API.

    zerofit train                 # train the embedded demo model (see zerofit.demo)
    zerofit config show ds.json   # the resolved configuration, or the error
    zerofit doctor --disk /nvme   # this machine's limits, before choosing an offload plan
    zerofit export CKPT OUT       # a checkpoint's weights as a Hugging Face model directory

Each ``train`` option maps onto one config field (or describes the run); the
logic lives in :mod:`zerofit.demo`, :mod:`zerofit.doctor` and :mod:`zerofit.config`.
Exit codes: 0 done, 2 bad configuration or option.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from zerofit.demo.options import DemoOptions

_DEFAULT = DemoOptions()
app = typer.Typer(name="zerofit", no_args_is_help=True, add_completion=False,
                  help="Train language models whose training state is larger than GPU memory.")
config_app = typer.Typer(no_args_is_help=True, help="Read and check configurations.")
app.add_typer(config_app, name="config")

EXIT_BAD_CONFIG = 2


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


def _fail(console: Console, message: str) -> None:
    # Text: a message with [brackets] is not markup; soft_wrap: no line breaks inside names
    console.print(Text(message, style="bold red"), soft_wrap=True)
    raise typer.Exit(EXIT_BAD_CONFIG)


@app.command()
def train(
    config: Annotated[Path | None, typer.Option(
        help="DeepSpeed or zerofit JSON config; default: the demo's own.")] = None,
    steps: Annotated[int, typer.Option(
        min=1, help="Optimizer steps (scheduler.total_steps).")] = _DEFAULT.steps,
    micro_batch_size: Annotated[int | None, typer.Option(
        min=1, help="Sequences per micro-batch (micro_batch_size); demo default 8.")] = None,
    grad_accum: Annotated[int | None, typer.Option(
        min=1, help="Micro-batches per step (gradient_accumulation_steps); demo default 1.")] = None,
    seq_len: Annotated[int, typer.Option(
        min=8, help="Tokens (bytes) per sequence.")] = _DEFAULT.seq_len,
    lr: Annotated[float | None, typer.Option(
        help="Peak learning rate (optimizer.lr); demo default 4e-3.")] = None,
    precision: Annotated[Precision | None, typer.Option(
        help="Compute dtype (precision); demo default bf16 on a GPU, fp32 on the CPU.")] = None,
    max_gpu_memory: Annotated[str | None, typer.Option(
        help="GPU memory budget, e.g. 24GiB (max_gpu_memory).")] = None,
    device: Annotated[str, typer.Option(
        help="auto (the first GPU, else the CPU), cpu, cuda or cuda:N.")] = _DEFAULT.device,
    seed: Annotated[int | None, typer.Option(
        min=0, help="Random seed (seed); demo default 0.")] = None,
    time_budget: Annotated[float | None, typer.Option(
        min=0, help="No new step starts after this many seconds of training.")] = None,
    sample_tokens: Annotated[int, typer.Option(
        min=0, help="Bytes to generate after training; 0 skips the sample.")] = _DEFAULT.sample_tokens,
) -> None:
    """Train the embedded demo model (a tiny Llama on Python's own source) through zerofit's engine."""
    from zerofit.config import ConfigError
    from zerofit.demo.report import render_start, render_summary
    from zerofit.demo.run import run_demo

    console = Console()
    options = DemoOptions(
        config=config, steps=steps, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
        seq_len=seq_len, lr=lr, precision=precision.value if precision else None,
        max_gpu_memory=max_gpu_memory, device=device, seed=seed, time_budget=time_budget,
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
) -> None:
    """Measure GPU, host<->GPU bandwidth, CPU AdamW speed, RAM and disk (under 30 s)."""
    from zerofit.doctor import run_doctor

    if not disk.is_dir():
        _fail(Console(stderr=True), f"--disk {disk}: not a folder")
    report = run_doctor(disk)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    _render_doctor(report, Console())


@app.command("export")
def export(
    checkpoint: Annotated[Path, typer.Argument(
        help="A checkpoint folder (save_dir/<tag>) or a save folder (its 'latest' is used).")],
    out_dir: Annotated[Path, typer.Argument(help="Folder for the Hugging Face model (created).")],
    dtype: Annotated[str, typer.Option(help="Weights dtype: bf16, fp16 or fp32.")] = "bf16",
    max_shard_size: Annotated[str, typer.Option(help="Largest shard, e.g. 5GB or 2GiB.")] = "5GB",
) -> None:
    """Write a checkpoint's weights as a Hugging Face model (config.json, sharded safetensors, tokenizer)."""
    from zerofit.checkpoint import CheckpointError, export_checkpoint

    try:
        out = export_checkpoint(checkpoint, out_dir, dtype, max_shard_size)
    except (CheckpointError, ValueError) as e:
        _fail(Console(stderr=True), f"export failed: {e}")
    typer.echo(f"exported {checkpoint} -> {out} ({dtype})")


def _render_doctor(report, console: Console) -> None:
    gib = lambda n: f"{n / 2**30:,.1f} GiB"  # noqa: E731
    t = Table(title=f"zerofit doctor ({report.seconds:.1f} s)", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("torch", f"{report.torch_version} (Python {report.python_version})")
    g = report.gpu
    if g.available:
        t.add_row("GPU", f"{g.name} (x{g.count}), compute capability {g.capability}")
        t.add_row("driver / CUDA", f"{g.driver_version} / CUDA runtime {g.cuda_runtime}")
        t.add_row("GPU memory", f"{gib(g.memory_free_bytes)} free of {gib(g.memory_total_bytes)}")
        for c in report.copies:
            t.add_row(f"{c.direction}, {c.host_memory}",
                      f"{c.gb_per_s:,.1f} GB/s ({c.bytes_per_copy >> 20} MiB copies, best of {c.repeats})")
    else:
        t.add_row("GPU", Text(f"none: {g.reason}; host measurements only", style="yellow"))
    if report.optimizer:
        o = report.optimizer
        t.add_row("CPU AdamW", f"{o.params_per_s / 1e9:,.2f} G params/s ({o.implementation}, fp32, "
                               f"{o.params / 1e6:.0f} M params, {o.threads} torch threads)")
    if report.host:
        h = report.host
        t.add_row("host RAM", f"{gib(h.available_bytes)} available of {gib(h.total_bytes)}, {h.cpu_cores} CPUs")
    if report.disk:
        d = report.disk
        t.add_row("disk", f"{d.path}: {gib(d.free_bytes)} free of {gib(d.total_bytes)}")
        if d.bytes_tested:
            mode = "O_DIRECT" if d.direct_io else "buffered"
            t.add_row("disk speed", f"write {d.write_gb_per_s:,.2f} GB/s, read {d.read_gb_per_s:,.2f} GB/s "
                                    f"({d.bytes_tested >> 20} MiB, 1 MiB {mode})")
        if d.note:
            t.add_row("", Text(d.note, style="yellow"))
    for name, err in report.errors.items():
        t.add_row(f"{name} failed", Text(err, style="red"))
    console.print(t)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
