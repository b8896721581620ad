"""What ``zerofit train --model DIR --data PATH...`` (and :func:`zerofit.train.run_training`) can set.

Each field maps onto one config field (named beside it) or describes the run (data, run folder, checkpoints,
evaluation, export). ``None`` means: the config file's value, else the fine-tuning default of
:func:`zerofit.train.run.finetune_defaults`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zerofit.lora.options import LoraOptions


@dataclass
class TrainOptions:
    model: Path  # Hugging Face model directory (config.json, *.safetensors, tokenizer)
    data: list[Path] = field(default_factory=list)  # files or folders: .txt, .jsonl/.json, .parquet
    output: Path = Path("runs/zerofit")  # run folder: metrics, TensorBoard, checkpoints/, model/ (export)
    config: Path | None = None  # DeepSpeed or zerofit JSON
    steps: int | None = None  # optimizer steps (scheduler.total_steps); None: one epoch
    epochs: float | None = None  # or this many passes over the training windows
    seq_len: int | None = None  # tokens per packed window (seq_len); None: the model's, <= 2048
    micro_batch_size: int | None = None  # micro_batch_size
    grad_accum: int | None = None  # gradient_accumulation_steps
    lr: float | None = None  # optimizer.lr
    warmup_steps: int | None = None  # scheduler.warmup_steps
    precision: str | None = None  # precision
    kernels: str | None = None  # kernels
    max_gpu_memory: str | None = None  # max_gpu_memory
    max_host_memory: str | None = None  # max_host_memory
    nvme: str | None = None  # offload.optimizer_device "nvme" with this offload.nvme_path
    device: str = "auto"  # device
    seed: int | None = None  # seed (also the data order and split)
    eval_size: float = 0.02  # held-out documents: a fraction (< 1) or a count (>= 1)
    eval_every: int = 0  # evaluate every N steps (and at the end); 0: only at the end
    eval_windows: int | None = None  # cap on the held-out windows evaluated each time
    save_every: int = 0  # checkpoint every N steps (and at the end); 0: only at the end
    keep: int = 2  # checkpoints kept (the newest; `latest` is never removed)
    save_at_end: bool = True  # a checkpoint after the last step
    resume: bool = False  # continue from output/checkpoints/latest
    save_on_interrupt: bool = True  # Ctrl-C: finish the step, save a checkpoint, exit 130
    export: bool = True  # write a Hugging Face model to output/model at the end
    export_dtype: str | None = None  # bf16, fp16, fp32; None: the dtype of the model directory
    tensorboard: bool = True  # TensorBoard event files in output/tensorboard
    progress: bool = True  # the progress bar (off in logs and tests)
    deterministic: bool = False  # deterministic kernels: runs and resumes repeat bitwise on a GPU
    lora: LoraOptions | None = None  # train LoRA adapters (PEFT) over the frozen model; docs/lora.md
