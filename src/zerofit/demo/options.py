"""What ``zerofit train`` can set: kept free of heavy imports so that the CLI's help stays fast."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DemoOptions:
    """What ``zerofit train`` can set. ``None`` means "the demo's default" (or the ``config`` file's value).

    Each option maps onto one field of the resolved :class:`~zerofit.config.ZerofitConfig`
    (named beside it), except those that describe the run rather than the engine.
    """

    config: str | Path | None = None  # a DeepSpeed or zerofit JSON file; None = the demo's defaults
    steps: int = 250  # optimizer steps (and scheduler.total_steps)
    micro_batch_size: int | None = None  # micro_batch_size
    grad_accum: int | None = None  # gradient_accumulation_steps
    seq_len: int = 64  # tokens per sequence (run)
    lr: float | None = None  # optimizer.lr
    precision: str | None = None  # precision; None: bf16 on a GPU, fp32 on the CPU
    kernels: str | None = None  # kernels; None: auto (fast on a GPU, exact on the CPU)
    max_gpu_memory: str | int | None = None  # max_gpu_memory
    device: str = "auto"  # auto | cpu | cuda | cuda:N (run)
    seed: int | None = None  # seed
    time_budget: float | None = None  # seconds of training after which no new step starts (run); step 1 always runs
    sample_tokens: int = 160  # bytes generated after training (run)
