"""How a demo run reads on the terminal: the start-up summary and the final summary."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from zerofit.config import format_report
from zerofit.demo.run import DemoResult

# Phases of engine.timeline(), in the order a reader wants them, with what each one is.
PHASES = {
    "compute": "forward + backward on the device",
    "upload": "weights host -> device",
    "download": "gradients device -> host",
    "optimizer": "CPU optimizer worker working",
    "optimizer_wait": "CPU optimizer tasks waiting for a gradient or the disk",
    "wait": "host blocked waiting for the optimizer or buffers",
}


def _mib(n: int | float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def render_start(result: DemoResult, console: Console) -> None:
    """The resolved run in a few lines (``zerofit config show`` prints the whole config)."""
    cfg = result.loaded.config
    source = "the demo's defaults" if result.loaded.source == "<dict>" else result.loaded.source
    sched = cfg.scheduler
    console.print(
        f"[bold]zerofit train[/]: tiny Llama, {result.params / 1e6:.2f} M parameters, "
        f"byte-level tokens, on {result.device}"
    )
    console.print(
        f"  data      {result.corpus_bytes / 2**20:.1f} MiB of Python's standard library source "
        f"({result.corpus_files} files), 5% held out"
    )
    console.print(f"  config    {source} ({result.loaded.flavour})")
    console.print(
        f"  batch     {cfg.micro_batch_size} x {result.seq_len} tokens x {cfg.gradient_accumulation_steps}"
        f" micro-batches = {result.tokens_per_step:,} tokens per step, {result.steps_planned} steps"
    )
    console.print(
        f"  optimizer AdamW lr {cfg.optimizer.lr:g}, betas {tuple(cfg.optimizer.betas)}, "
        f"weight decay {cfg.optimizer.weight_decay:g}; schedule {sched.type}, "
        f"warm-up {sched.warmup_steps}; clipping {cfg.gradient_clipping:g}"
    )
    if result.device.startswith("cuda"):
        cap = f"max GPU memory {_mib(cfg.max_gpu_memory) if cfg.max_gpu_memory else 'all free'}"
    else:  # no GPU: every buffer is in host memory, nothing is capped or streamed over PCIe
        cap = "on the CPU: no GPU memory cap, all in host memory"
    console.print(f"  precision {cfg.precision}; {cap}")
    notices = format_report(result.loaded.notices)
    if notices:
        console.print("  DeepSpeed keys zerofit maps or decides itself:")
        console.print(Text(notices))


def render_summary(result: DemoResult, console: Console) -> None:
    """First and last loss, throughput, peak memory, where the time went, a sample."""
    t = Table(title="summary", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    steps = f"{result.steps} of {result.steps_planned}"
    if result.stopped_early:
        steps += " (time budget reached)"
    t.add_row("steps", f"{steps} in {result.train_seconds:.1f} s")
    last = f"{result.last_loss:.3f} (step {result.steps})"
    if result.steps > 10:
        last = f"{result.final_loss:.3f} (mean of the last 10 steps; step {result.steps}: {result.last_loss:.3f})"
    t.add_row("training loss", f"{result.first_loss:.3f} (step 1) -> {last}")
    t.add_row("held-out loss", f"{result.eval_loss_before:.3f} -> {result.eval_loss_after:.3f}")
    if result.steps > 1:
        rate = (
            f"{result.tokens_per_s:,.0f} tokens/s over steps 2..{result.steps} "
            f"({result.tokens_per_s_overall:,.0f} with step 1's set-up)"
        )
    else:
        rate = f"{result.tokens_per_s:,.0f} tokens/s (step 1, set-up included)"
    t.add_row("throughput", f"{rate}; {result.tokens_per_step:,} tokens per step")
    mem = result.memory
    if mem.get("gpu_peak_bytes"):
        t.add_row("GPU memory peak", _mib(mem["gpu_peak_bytes"]))
    host = mem.get("host_peak_bytes") or mem.get("host_bytes")
    if host:
        t.add_row("host memory peak", f"{_mib(host)} (process RSS)")
    console.print(t)

    step = result.timeline.get("step", 0.0)
    if step > 0:
        which = f"mean of steps 2..{result.steps}" if result.steps > 1 else "step 1"
        tl = Table(title=f"where the time of one step went ({which}; phases overlap)", title_justify="left")
        tl.add_column("phase")
        tl.add_column("ms", justify="right")
        tl.add_column("% of step", justify="right")
        tl.add_column("what")
        tl.add_row("step", f"{step * 1e3:.1f}", "100%", "wall time of train_batch")
        names = list(PHASES) + sorted(k for k in result.timeline if k not in PHASES and k != "step")
        for name in names:
            v = result.timeline.get(name, 0.0)
            tl.add_row(name, f"{v * 1e3:.1f}", f"{100 * v / step:.0f}%", PHASES.get(name, ""))
        console.print(tl)
    if result.sample:
        console.print("[bold]sample[/] (top-k from the trained model, prompt 'def '):")
        console.print(Text(result.sample))
