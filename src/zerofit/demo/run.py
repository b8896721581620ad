"""The embedded demo that ``zerofit train`` (and ``make demo``) runs, end to end, through the engine.

    zerofit train --steps 100 --time-budget 60

Builds the tiny Llama of :mod:`zerofit.demo.model`, resolves the configuration
(the demo's defaults, or the user's ``--config`` file, with the command-line
options applied on top), trains it with ``zerofit.initialize(...).train_batch``
on random windows of the standard library's source, and returns a
:class:`DemoResult`: losses, throughput, memory, where the time went and a
generated sample. Nothing is downloaded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import zerofit
from zerofit.config import LoadedConfig, load_with_defaults
from zerofit.demo.corpus import Corpus, load_corpus, micro_batches, random_windows
from zerofit.demo.model import build_model, eval_loss, sample
from zerofit.demo.options import DemoOptions
from zerofit.demo.tokenizer import ByteTokenizer
from zerofit.train.progress import first_step_note, kernel_build_note

SAMPLE_PROMPT = "def "
EVAL_BATCHES = 4  # held-out micro-batches of 8 windows for the evaluation loss


def demo_defaults(device: torch.device) -> dict[str, Any]:
    """The demo's own zerofit config: AdamW with a short warm-up and cosine decay, clipping at 1."""
    on_gpu = device.type == "cuda"
    return {
        "precision": "bf16" if on_gpu else "fp32",  # the CPU has no fast bf16 matmul here
        "micro_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"lr": 4e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8},
        "scheduler": {"type": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1},
        "gradient_clipping": 1.0,
        "seed": 0,
    }


def resolve_device(name: str) -> torch.device:
    """``auto`` is the first GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; use auto or cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_config(options: DemoOptions, device: torch.device) -> LoadedConfig:
    """The demo's defaults (or ``options.config``) with every option the user set applied on top."""
    overrides: dict[str, Any] = {}
    if options.micro_batch_size is not None:
        overrides["micro_batch_size"] = options.micro_batch_size
    if options.grad_accum is not None:
        overrides["gradient_accumulation_steps"] = options.grad_accum
    if options.lr is not None:
        overrides["optimizer.lr"] = options.lr
    if options.precision is not None:
        overrides["precision"] = options.precision
    if options.kernels is not None:
        overrides["kernels"] = options.kernels
    if options.max_gpu_memory is not None:
        overrides["max_gpu_memory"] = options.max_gpu_memory
    if options.seed is not None:
        overrides["seed"] = options.seed
    overrides["scheduler.total_steps"] = options.steps
    # a file's batch triple is kept where the options leave it; the demo's defaults have no train_batch_size
    return load_with_defaults(options.config, demo_defaults(device), **overrides)


@dataclass
class DemoResult:
    """What one demo run did; :func:`zerofit.demo.report.render_summary` prints it."""

    loaded: LoadedConfig
    device: str
    params: int
    seq_len: int
    tokens_per_step: int
    steps_planned: int
    losses: list[float] = field(default_factory=list)  # training loss of each step
    step_seconds: list[float] = field(default_factory=list)  # wall time of each train_batch call
    eval_loss_before: float = math.nan  # held-out loss of the initial weights
    eval_loss_after: float = math.nan  # held-out loss after training
    train_seconds: float = 0.0  # wall time of the training steps
    timeline: dict[str, float] = field(default_factory=dict)  # seconds per phase, mean over steps 2..N
    memory: dict[str, int] = field(default_factory=dict)  # engine.memory_stats() after training
    sample: str = ""
    stopped_early: bool = False  # the time budget ran out before ``steps_planned``
    corpus_bytes: int = 0
    corpus_files: int = 0

    @property
    def steps(self) -> int:
        return len(self.losses)

    @property
    def first_loss(self) -> float:
        return self.losses[0] if self.losses else math.nan

    @property
    def last_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan

    @property
    def final_loss(self) -> float:
        """Mean training loss of the last (up to) 10 steps: one small step's loss is noisy."""
        tail = self.losses[-10:]
        return sum(tail) / len(tail) if tail else math.nan

    @property
    def tokens_per_s(self) -> float:
        """Steady-state throughput: steps 2..N (step 1 includes the engine's one-time set-up)."""
        timed = self.step_seconds[1:] or self.step_seconds
        return len(timed) * self.tokens_per_step / sum(timed) if timed and sum(timed) > 0 else 0.0

    @property
    def tokens_per_s_overall(self) -> float:
        """All training tokens over the whole training wall time, set-up included."""
        return self.steps * self.tokens_per_step / self.train_seconds if self.train_seconds > 0 else 0.0


def run_demo(
    options: DemoOptions | None = None,
    console: Console | None = None,
    progress: bool = True,
    on_start: Callable[[DemoResult], None] | None = None,
) -> DemoResult:
    """Train the demo model as ``options`` say.

    ``on_start(result)`` is called once the configuration is resolved and the model
    built, before the engine starts (the CLI prints the run's summary there).
    """
    options = options or DemoOptions()
    console = console or Console()
    device = resolve_device(options.device)
    loaded = resolve_config(options, device)
    cfg = loaded.config
    corpus: Corpus = load_corpus()
    tok = ByteTokenizer()
    model = build_model(max_seq_len=max(options.seq_len, 1024), seed=cfg.seed)
    eval_gen = torch.Generator().manual_seed(1234)  # the same held-out windows every run
    eval_set = [random_windows(corpus.eval, 8, options.seq_len, eval_gen) for _ in range(EVAL_BATCHES)]

    result = DemoResult(
        loaded=loaded,
        device=str(device),
        params=sum(p.numel() for p in model.parameters()),
        seq_len=options.seq_len,
        tokens_per_step=cfg.micro_batch_size * cfg.gradient_accumulation_steps * options.seq_len,
        steps_planned=options.steps,
        corpus_bytes=len(corpus),
        corpus_files=corpus.files,
    )
    result.eval_loss_before = eval_loss(model, eval_set)
    if on_start is not None:
        on_start(result)

    build = kernel_build_note(cfg, device)
    if build:
        console.print(build)
    engine = zerofit.initialize(model, loaded, device=str(device))
    data = micro_batches(
        corpus.train, cfg.micro_batch_size, options.seq_len, cfg.gradient_accumulation_steps, seed=cfg.seed
    )
    timelines: list[dict[str, float]] = []  # engine.timeline() of each step
    bar = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
        console=console,
        disable=not progress,
        transient=False,
    )
    t_start = time.perf_counter()
    with bar:
        task = bar.add_task("train", total=options.steps, stats=first_step_note(device))
        bar.refresh()  # the note shows now, not at the next tick: step 1 may take seconds
        for step in range(options.steps):
            if step > 0 and options.time_budget is not None and time.perf_counter() - t_start >= options.time_budget:
                result.stopped_early = True
                break
            t0 = time.perf_counter()
            loss = engine.train_batch(next(data))
            dt = time.perf_counter() - t0
            result.losses.append(float(loss))
            result.step_seconds.append(dt)
            timelines.append(engine.timeline())
            bar.update(task, advance=1, stats=_stats(loss, result.tokens_per_step / dt, engine.memory_stats()))
    result.train_seconds = time.perf_counter() - t_start
    counted = timelines[1:] or timelines  # step 1 includes one-time set-up: left out of the means
    result.timeline = {k: sum(t.get(k, 0.0) for t in counted) / len(counted) for k in counted[0]}
    result.memory = dict(engine.memory_stats())

    module = engine.module  # current weights, on the host
    result.eval_loss_after = eval_loss(module, eval_set)
    result.sample = sample(module, tok, SAMPLE_PROMPT, max_new_tokens=options.sample_tokens, seed=cfg.seed)
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    return result


def _stats(loss: float, tokens_per_s: float, mem: dict[str, int]) -> str:
    gpu = mem.get("gpu_peak_bytes", 0)
    where = f"gpu peak {gpu / 2**20:,.0f} MiB" if gpu else f"host {mem.get('host_bytes', 0) / 2**20:,.0f} MiB"
    return f"loss {loss:6.3f}  {tokens_per_s:8,.0f} tok/s  {where}"
