"""zerofit's own typed configuration.

Every component reads its settings from one frozen pydantic model, validated at
construction, before any process group or allocation. DeepSpeed JSON configs are
translated into this model by :mod:`zerofit.config.deepspeed`.

Every bad configuration raises :class:`ConfigError` (a ``ValueError``) whose message
names the field by its dotted path, what was expected and what was found::

    offload.prefetch_depth: expected greater than or equal to 1, found 0

Two rules span several fields and are written once here:

* the batch triple (:func:`resolve_batch`): ``train_batch_size ==
  micro_batch_size * gradient_accumulation_steps * world_size``; any two of the
  first three determine the third; an inconsistent or fractional triple is an
  error that shows the arithmetic;
* NVMe offload (:func:`check_nvme_path`): a device ``"nvme"`` needs an
  ``nvme_path`` that exists or can be created, is writable and has free space.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from zerofit.config.errors import (
    ConfigError,
    Problem,
    close_match,  # noqa: F401 (re-exported)
    config_error_from,
    show,
)

__all__ = [
    "ConfigError",
    "Problem",
    "NvmePathCheck",
    "parse_bytes",
    "resolve_batch",
    "check_nvme_path",
    "show",
    "OptimizerConfig",
    "SchedulerConfig",
    "OneCycleConfig",
    "LRRangeTestConfig",
    "LossScaleConfig",
    "OffloadConfig",
    "ZerofitConfig",
]


# ----------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | float | str | None, field: str = "size") -> int | None:
    """``"24GiB"`` -> 25769803776, ``"1.5GB"`` -> 1500000000; ints pass through; ``None`` stays ``None``.

    Raises :class:`ConfigError` naming ``field`` for anything else (negative, bool, nonsense).
    """
    expected = "a size in bytes such as 25769803776, '24GiB' or '1.5GB'"
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(field, "a size >= 0 (" + expected + ")", show(value))
        return int(value)
    m = _SIZE.match(value) if isinstance(value, str) else None
    if not m:
        raise ConfigError(field, expected, show(value))
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


# ----------------------------------------------------------------------------
# The batch triple
# ----------------------------------------------------------------------------

ZEROFIT_BATCH_NAMES = ("train_batch_size", "micro_batch_size", "gradient_accumulation_steps", "world_size")


def resolve_batch(
    train: int | None, micro: int | None, accum: int | None, world: int, names: Sequence[str] = ZEROFIT_BATCH_NAMES
) -> tuple[int, int, int]:
    """Complete ``(train_batch_size, micro_batch_size, gradient_accumulation_steps)``.

    ``train == micro * accum * world`` must hold. Any two of the three given
    determine the third (``None``, JSON null, counts as not given); with one
    given, ``gradient_accumulation_steps`` is 1
    (or ``micro_batch_size`` is 1 when only the accumulation is given); with
    none, both are 1 and ``train = world``. ``None`` means "not given".
    ``names`` are the four names the error messages use (zerofit's by default;
    :mod:`zerofit.config.deepspeed` passes DeepSpeed's).
    """
    n_train, n_micro, n_accum, n_world = names

    def divide(total: int, total_name: str, parts: list[tuple[str, int]], result_name: str) -> int:
        denom = math.prod(v for _, v in parts)
        if total % denom:
            shown = " * ".join(f"{n} ({v})" for n, v in parts)
            raise ConfigError(
                result_name,
                "a whole number",
                f"{total_name} ({total}) / ({shown}) = {total / denom:g}",
                f"make {total_name} a multiple of {denom}",
            )
        return total // denom

    if train is not None and micro is not None and accum is not None:
        expect = micro * accum * world
        if train != expect:
            raise ConfigError(
                n_train,
                f"{n_train} == {n_micro} * {n_accum} * {n_world}",
                f"{n_train} ({train}) != {n_micro} ({micro}) * {n_accum} ({accum}) * {n_world} ({world}) = {expect}",
                "give two of the three and the third is derived",
            )
        return train, micro, accum
    if train is not None and micro is not None:
        return train, micro, divide(train, n_train, [(n_micro, micro), (n_world, world)], n_accum)
    if train is not None and accum is not None:
        return train, divide(train, n_train, [(n_accum, accum), (n_world, world)], n_micro), accum
    if micro is not None and accum is not None:
        return micro * accum * world, micro, accum
    if train is not None:
        return train, divide(train, n_train, [(n_world, world)], n_micro), 1
    if micro is not None:
        return micro * world, micro, 1
    if accum is not None:
        return accum * world, 1, accum
    return world, 1, 1


# ----------------------------------------------------------------------------
# NVMe folder
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NvmePathCheck:
    """Result of :func:`check_nvme_path`."""

    path: Path
    """the folder, absolute"""
    exists: bool
    """False: it will be created on first use (its nearest existing parent is writable)"""
    free_bytes: int
    """free bytes on the file system that holds it"""

    def describe(self) -> str:
        state = "writable" if self.exists else "will be created (parent writable)"
        return f"{self.path}: {state}, {self.free_bytes / 2**30:.1f} GiB free"


def check_nvme_path(
    path: str | os.PathLike | None, *, field: str = "offload.nvme_path", required_bytes: int = 0
) -> NvmePathCheck:
    """Check that ``path`` can hold the NVMe tier: it exists (or can be created), is writable and has space.

    Nothing is created. ``required_bytes`` (from the planner, when known) must be
    free; otherwise any free space is accepted. Raises :class:`ConfigError`
    naming ``field``.
    """
    expected = "a writable folder with free space for NVMe offload"
    if path is None or str(path).strip() == "":
        raise ConfigError(
            field, expected, "nothing", "a device 'nvme' needs nvme_path set to a folder on a fast local disk"
        )
    p = Path(path).expanduser().absolute()
    existing = p
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        what = "a file" if existing == p else f"a path under the file {existing}"
        raise ConfigError(field, expected, f"{str(path)!r} ({what})", "point nvme_path at a folder")
    unwritable = _unwritable(existing)
    if unwritable:
        what = "not writable" if existing == p else f"missing, and its parent {existing} is not writable"
        raise ConfigError(
            field,
            expected,
            f"{str(path)!r} ({what}: {unwritable})",
            "choose a folder on a local disk this user can write to",
        )
    free = shutil.disk_usage(existing).free
    if free <= 0 or free < required_bytes:
        raise ConfigError(
            field,
            f"at least {max(required_bytes, 1)} bytes free",
            f"{free} bytes free at {p}",
            "free space on that disk or choose another folder",
        )
    return NvmePathCheck(path=p, exists=existing == p, free_bytes=free)


def _unwritable(folder: Path) -> str:
    """Why the disk tier cannot write files in ``folder`` (an existing folder), or "" when it can: the
    permissions (``os.access``, which root passes everywhere), a read-only mount, or a file system with no
    blocks at all (/proc, /sys: no file can be made there, whatever access says)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "this user may not create files there"
    try:
        st = os.statvfs(folder)
    except OSError as e:
        return f"its file system cannot be queried ({e.strerror})"
    if st.f_flag & os.ST_RDONLY:
        return "a read-only file system"
    if st.f_blocks == 0:
        return "a virtual file system with no disk blocks, such as /proc or /sys, not a disk"
    return ""


# ----------------------------------------------------------------------------
# The models
# ----------------------------------------------------------------------------


class _Frozen(BaseModel):
    # strict: a wrong JSON type is an error, never silently coerced ("4" is not 4).
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        validate_default=True,
        strict=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
    )


class OptimizerConfig(_Frozen):
    """AdamW, with the meaning of ``torch.optim.AdamW``."""

    type: Literal["adamw"] = "adamw"
    """the only optimizer zerofit implements (decoupled weight decay, bias-corrected)"""
    lr: float = Field(1e-3, gt=0)
    """peak learning rate; the schedule multiplies or replaces it per step"""
    betas: tuple[float, float] = Field((0.9, 0.999), strict=False)
    """Adam beta1, beta2, each in [0, 1) (a JSON list is accepted)"""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon, added to the root of the second moment"""
    weight_decay: float = Field(0.01, ge=0)
    """decoupled weight decay (``p -= lr * weight_decay * p``), applied to every parameter (unless parameter
    groups give some their own: ``zerofit.initialize(..., param_groups=...)``)"""

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, v):
        ok = (
            isinstance(v, (list, tuple))
            and len(v) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in v)
        )
        if not ok:
            raise ConfigError("betas", "two numbers, each in [0, 1)", show(v))
        return tuple(float(b) for b in v)


class OneCycleConfig(_Frozen):
    """DeepSpeed's ``OneCycle`` schedule (deepspeed/runtime/lr_schedules.py), its parameters by its names:
    the lr (and Adam's beta1) cycle between the bounds, then decay ([Note: OneCycle and LRRangeTest],
    zerofit/optim/schedules.py). Every parameter group gets the same lr, as DeepSpeed sets it."""

    cycle_min_lr: float = Field(ge=0)
    """lower lr bound of the cycle (the first step's lr)"""
    cycle_max_lr: float = Field(ge=0)
    """upper lr bound of the cycle"""
    decay_lr_rate: float = Field(0.0, ge=0)
    """after the cycle: lr = cycle_min_lr / (1 + decay_lr_rate * steps / decay_step_size)"""
    cycle_first_step_size: float = Field(2000.0, gt=0)
    """optimizer steps of the rising half of the cycle"""
    cycle_second_step_size: float | None = Field(None, ge=0)
    """optimizer steps of the falling half; None = cycle_first_step_size"""
    cycle_first_stair_count: int = Field(0, ge=0)
    """stairs in the rising half (the lr held flat between them); 0 = continuous"""
    cycle_second_stair_count: int | None = Field(None, ge=0)
    """stairs in the falling half; None = cycle_first_stair_count"""
    decay_step_size: float = Field(0.0, ge=0)
    """interval of the post-cycle decay; 0 = no decay (the lr stays at cycle_min_lr)"""
    cycle_momentum: bool = True
    """cycle Adam's beta1 inversely to the lr between cycle_max_mom and cycle_min_mom, with beta2 0.99 (what
    DeepSpeed writes into the optimizer's betas); False keeps the optimizer's betas"""
    cycle_min_mom: float = Field(0.8, ge=0, lt=1)
    """lower beta1 bound (the first step's beta1)"""
    cycle_max_mom: float = Field(0.9, ge=0, lt=1)
    """upper beta1 bound"""
    decay_mom_rate: float = Field(0.0, ge=0)
    """after the cycle: beta1 = cycle_max_mom * (1 + decay_mom_rate * steps / decay_step_size)"""


class LRRangeTestConfig(_Frozen):
    """DeepSpeed's ``LRRangeTest`` schedule: the lr grows from ``min_lr`` by ``step_rate`` per ``step_size``
    steps, ``min_lr * (1 + step_rate * steps / step_size)`` (floored to whole intervals when ``staircase``).
    Every parameter group gets the same lr, as DeepSpeed sets it."""

    min_lr: float = Field(1e-3, ge=0)
    """the first step's lr (DeepSpeed's lr_range_test_min_lr)"""
    step_size: int = Field(2000, ge=1)
    """optimizer steps per interval (lr_range_test_step_size)"""
    step_rate: float = Field(1.0, ge=0)
    """growth per interval, as a multiple of min_lr (lr_range_test_step_rate)"""
    staircase: bool = False
    """grow in whole intervals instead of continuously (lr_range_test_staircase)"""


class SchedulerConfig(_Frozen):
    """Learning-rate schedule; ``lr(step)`` is computed by :func:`zerofit.optim.schedules.lr_at`."""

    type: Literal[
        "constant",
        "linear",
        "cosine",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
        "OneCycle",
        "LRRangeTest",
        "hf_constant",
        "hf_constant_with_warmup",
        "hf_linear",
        "hf_cosine",
    ] = "constant"
    """constant/linear/cosine: zerofit's schedules; Warmup*, OneCycle, LRRangeTest: DeepSpeed's, with DeepSpeed's
    formulas (OneCycle's and LRRangeTest's parameters in ``one_cycle`` / ``lr_range_test``); hf_*:
    transformers' get_scheduler ("constant", "constant_with_warmup", "linear", "cosine"), with its formulas
    (zerofit.hf maps TrainingArguments.lr_scheduler_type onto them)"""
    warmup_steps: int = Field(0, ge=0)
    """optimizer steps of warm-up (DeepSpeed's ``warmup_num_steps``; DeepSpeed's schedules use at least 2)"""
    total_steps: int | None = Field(None, ge=1)
    """optimizer steps of the whole run; needed by linear, cosine, WarmupDecayLR, WarmupCosineLR.
    None: the engine supplies the run length (DeepSpeed's ``total_num_steps: "auto"``)"""
    warmup_min_lr: float = Field(0.0, ge=0)
    """lr at the start of warm-up (DeepSpeed WarmupLR/WarmupDecayLR)"""
    warmup_max_lr: float | None = Field(None, gt=0)
    """lr at the end of warm-up (DeepSpeed WarmupLR/WarmupDecayLR); None = optimizer.lr"""
    warmup_type: Literal["log", "linear"] = "log"
    """DeepSpeed's warm-up curve: log (DeepSpeed's default) or linear"""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """final lr / peak lr (linear, cosine; WarmupCosineLR's ``cos_min_ratio``)"""
    warmup_min_ratio: float = Field(0.0, ge=0, le=1)
    """WarmupCosineLR: lr at the start of warm-up / peak lr"""
    one_cycle: OneCycleConfig | None = None
    """OneCycle's parameters (required with type OneCycle, and only then)"""
    lr_range_test: LRRangeTestConfig | None = None
    """LRRangeTest's parameters (type LRRangeTest; None there = DeepSpeed's defaults)"""

    @model_validator(mode="after")
    def _parameters_of_the_type(self):
        if self.type == "OneCycle" and self.one_cycle is None:
            raise ConfigError(
                "one_cycle",
                "OneCycle's parameters (at least cycle_min_lr and cycle_max_lr)",
                "nothing",
                "DeepSpeed's OneCycle requires cycle_min_lr and cycle_max_lr",
            )
        for name, kind in (("one_cycle", "OneCycle"), ("lr_range_test", "LRRangeTest")):
            if getattr(self, name) is not None and self.type != kind:
                raise ConfigError(
                    name,
                    f"nothing unless scheduler.type is {kind!r}",
                    f"{name} with type {self.type!r}",
                    f"set type {kind!r} or remove {name}",
                )
        return self

    @model_serializer(mode="wrap")
    def _without_unused_parameters(self, handler: SerializerFunctionWrapHandler):
        """The dump leaves out the parameters of schedules not in use (as configs written before they existed)."""
        out = handler(self)
        for name in ("one_cycle", "lr_range_test"):
            if out.get(name) is None:
                out.pop(name, None)
        return out


class LossScaleConfig(_Frozen):
    """fp16 loss scaling, with DeepSpeed's semantics (see :mod:`zerofit.optim.loss_scaler`)."""

    loss_scale: float = Field(0.0, ge=0)
    """0 = dynamic loss scaling; otherwise this static scale"""
    initial_scale_power: int = Field(16, ge=0, le=64)
    """the dynamic scale starts at 2**initial_scale_power"""
    loss_scale_window: int = Field(1000, ge=1)
    """clean (non-overflowing) steps before the dynamic scale doubles"""
    hysteresis: int = Field(2, ge=1)
    """overflows tolerated before the scale halves (DeepSpeed's ``delayed_shift``)"""
    consecutive_hysteresis: bool = False
    """refill the hysteresis on every clean step instead of only when the scale grows"""
    min_loss_scale: float = Field(1.0, gt=0)
    """floor of the dynamic scale; another overflow there stops the run with LossScaleUnderflowError"""
    raise_at_min_scale: bool = True
    """False: an overflow at min_loss_scale skips the step and keeps the scale, as DeepSpeed's ZeRO stage 0 fp16
    optimizer does (a DeepSpeed config without ZeRO reads to False, with hysteresis 1)"""


class OffloadConfig(_Frozen):
    """Where training state lives. zerofit's planner places tensors within these bounds."""

    param_device: Literal["none", "cpu", "nvme"] = "cpu"
    """home of the weights: none = every block on the GPU; cpu = blocks stream from host memory (the planner
    keeps on the GPU those that fit, see resident_blocks); nvme = as cpu for the weights (the 16-bit weights a
    step reads stay in host memory), and it enables the disk tier for the optimizer state, as optimizer_device
    nvme does"""
    optimizer_device: Literal["none", "cpu", "nvme"] = "cpu"
    """home of the fp32 master weights and Adam moments, and where the optimizer step runs: none = the GPU;
    cpu = host memory (CPU AdamW) for the blocks that stream, while a block kept on the GPU keeps its state
    there (all of them when param_device is none); nvme = host memory first, and what max_host_memory cannot
    hold on the disk tier under nvme_path (streamed around each CPU update). The engine logs where the state
    is after planning."""
    nvme_path: str | None = None
    """folder of the disk tier's swap file; required (existing or creatable, writable) when a device is nvme.
    The file is reserved in full at initialize and removed at close"""
    disk_blocks: int | None = Field(None, ge=0)
    """with nvme: how many of the last blocks keep their optimizer state on the disk; None = the planner
    decides (only what host memory cannot hold)"""
    disk_weights: bool | None = None
    """with nvme: whether those blocks' fp32 master weights go to the disk too (else only their moments);
    None = the planner decides (moments first: they save twice the host memory per byte of disk traffic)"""
    disk_frozen_blocks: int | None = Field(None, ge=0)
    """with nvme and frozen parameters (LoRA): how many of the last streamed blocks keep their frozen 16-bit
    weights on the disk (read-only, read ahead of each upload); None = the planner decides (only what host memory
    cannot hold: a 70B bf16 base)"""
    nvme_block_size: int = Field(4 << 20, ge=4096)
    """bytes per disk request (DeepSpeed's aio.block_size); rounded up to 4 KiB"""
    nvme_queue_depth: int = Field(8, ge=1, le=256)
    """disk requests in flight (threads doing preadv/pwritev; DeepSpeed's aio.queue_depth x thread_count)"""
    pin_memory: bool = True
    """page-lock host buffers (much faster host-to-GPU copies, costs locked host memory)"""
    prefetch_depth: int | None = Field(None, ge=1, le=64)
    """blocks uploaded ahead of compute; None = the planner decides"""
    resident_blocks: int | None = Field(None, ge=0)
    """blocks kept on the GPU with a GPU optimizer; None = the planner decides"""
    shell_optimizer: Literal["auto", "device", "host"] = "auto"
    """where the optimizer of the shell (embeddings, final norm, head) runs; auto = the planner decides
    (the device when it fits: the shell's gradient is complete only at the end of the backward)"""
    assisted_fraction: float = Field(0.375, ge=0.0, le=1.0)
    """the share of the streamed blocks whose AdamW step the GPU runs (their state goes up and back down over
    PCIe) while the CPU updates the rest, spread evenly over the blocks. With deferred updates (clipping after a
    clipped step, fp16) both run during the next forward; with immediate ones during the backward (the GPU
    takes the block's gradient where it is), when their buffers fit beside the plan. 0 = the CPU updates all
    of them. The default balances the CPU's and the copy engines' busy time on the benchmark machine (a 3B model
    with deferred updates stepped faster at 0.375 than at 0.5 or 0.625: docs/benchmarks.md, the 3B model with
    gradient clipping); left unset, deferred updates in two passes (``split_updates``) take 0.25, faster there
    than 0.375"""
    assisted_updates: bool | None = None
    """None = the planner decides (deferred updates: always; immediate ones: on one GPU, when the buffers fit
    beside the plan); False = never (the CPU updates every streamed block); True = also with immediate updates
    on the CPU, where the copies only cost time (tests)"""
    loss_chunks: int | None = Field(None, ge=1)
    """the head and loss over this many token chunks of each micro-batch, so that the full-vocabulary logits
    never exist at once (1: off); None = the planner decides (only when the device budget needs it; models whose
    loss takes shift_labels and num_items_in_batch, as Hugging Face causal LMs' does)"""
    sequence_tile: int | None = Field(None, ge=1)
    """tokens per sequence tile of the blocks: a micro-batch of more tokens runs each block's per-token work (norms,
    projections, RoPE, LoRA paths, the MLP) over tiles of this many, recomputed tile by tile in the backward, and
    attention's core once over the whole sequence, so all but q, k, v and the attention's output exist for one tile
    at a time ([Note: a block over sequence tiles], engine/model/tiling.py; layers other than Llama's, Mistral's and
    Qwen's kin tile their MLP alone);
    None = the planner decides (off, the whole sequence, unless the device budget needs it: then the largest
    power of two of at least 1024 tokens that fits, after loss chunks and offloaded checkpoints)"""
    offload_checkpoints: bool | None = None
    """keep the blocks' input checkpoints in pinned host memory between the forward and the backward (all but
    three blocks'); None = the planner decides (only when the device budget needs it)"""
    checkpoint_every: int | None = Field(None, ge=1)
    """keep the inputs of every k-th block only (blocks 0, k, 2k, ...) and recompute the others' in the backward,
    one segment of k blocks at a time: a forward more for k - 1 of every k blocks, for the memory of 1/k of the
    checkpoints (every micro-batch of a step keeps them until the step's backward). 1: every
    block's; None = the planner decides (only when the checkpoints do not fit otherwise)"""
    copies_after_update: bool = True
    """the DeepSpeed-shaped loop (one forward per call), updates without clipping: after a streamed block's
    update, its new weights are cast into its 16-bit host copy (by the CPU worker, or on the GPU for a block the
    GPU updates), so the next window's first forward uploads 2 B/param instead of the fp32 master's 4 (costs the
    CPU a cast pass per update; docs/engine.md)"""
    split_updates: bool | None = None
    """deferred updates (clipping, fp16) on the CPU in two passes: the new master weights on the next forward's
    critical path, the moments after it (20 B of host memory each instead of the fused kernel's 32 at once;
    [Note: moments after the forward], engine/update/split_adamw.py). A C++ kernel built at first use (a compiler
    needed; without one the fused kernel is used, with a notice). None = on a GPU (where the host's memory
    binds the forward), off on the CPU; the fused kernel's results bitwise (the kernel finds how this torch build
    rounds at load). In bf16 the first pass writes only the weights cast for the upload, the second the master
    and the moments ([Note: the master behind its cast])"""
    rest_pass_threads: int | None = Field(None, ge=1)
    """threads of the second pass of a split update (off the critical path, while the post pass and the backward
    run): fewer than the first pass's leave cores to the main thread, which launches the GPU's work. None =
    torch's intra-op threads less a quarter ([Note: threads for the rest pass], engine/update/split_adamw.py)"""
    window_keep_blocks: bool = True
    """the DeepSpeed-shaped loop: keep some streamed blocks on the GPU from a window's first forward to its
    boundary, in the memory of the gradient buffers (idle until the blocks' backward), so the window's later
    forwards do not upload them again"""
    speculative_updates: bool = True
    """with gradient clipping (bf16/fp32): update host blocks during the backward as if unclipped, and roll
    them back and update again in the rare step that the global norm then clips (zerofit/engine/update/speculation.py);
    after a clipped step the next one waits for the norm instead. The user's own loop: its steps update in their
    backward where nothing clips, and in bf16 cast the streamed blocks' 16-bit copies in it where something does"""

    @field_validator("nvme_path")
    @classmethod
    def _nvme_usable(cls, v, info):
        devices = (info.data.get("param_device"), info.data.get("optimizer_device"))
        if "nvme" in devices and not _read(info, "nvme_path"):
            check_nvme_path(v, field="nvme_path")
        return v


class ZerofitConfig(_Frozen):
    """The resolved configuration of one training run.

    Construction validates everything (raising :class:`ConfigError`); the batch
    triple is completed by :func:`resolve_batch`, so ``ZerofitConfig(micro_batch_size=4,
    gradient_accumulation_steps=8)`` has ``train_batch_size == 32``.
    """

    train_batch_size: int = Field(1, ge=1)
    """sequences per optimizer step, summed over all ranks"""
    micro_batch_size: int = Field(1, ge=1)
    """sequences in one forward/backward on one GPU"""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """micro-batches whose gradients are summed per optimizer step, per rank"""
    world_size: int = Field(1, ge=1)
    """number of data-parallel ranks"""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """compute dtype of forward/backward; master weights and optimizer state are always fp32"""
    fp16: LossScaleConfig = Field(default_factory=LossScaleConfig)
    """loss scaling, used when precision is fp16"""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """the optimizer (AdamW)"""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """the learning-rate schedule"""
    gradient_clipping: float = Field(0.0, ge=0)
    """max L2 norm of all gradients together; 0 = off"""
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    """where weights and optimizer state live"""
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description="compute device: auto (the GPU if there is one), cpu, cuda or cuda:N",
    )
    adapter: Literal["auto", "blocks", "generic", "hooked"] = Field(
        "auto",
        description="how the model is run: auto (stream its repeated blocks when it has them), blocks "
        "(require it), generic (the whole model as one resident unit, any nn.Module), hooked (any nn.Module, "
        "streamed by its submodules' calls as DeepSpeed ZeRO-3 and FSDP stream it: hooked_units)",
    )
    hooked_units: list[str] = Field(
        default_factory=list,
        description="adapter hooked: the class names of the submodules that stream, one unit each (FSDP's "
        "transformer_layer_cls_to_wrap); empty: chosen by size (hooked_share)",
    )
    hooked_share: float = Field(
        0.02,
        gt=0,
        le=1,
        description="adapter hooked without hooked_units: a submodule becomes a unit when its parameters not in a "
        "unit below it are at least this share of the model's",
    )
    kernels: Literal["auto", "exact", "fast"] = Field(
        "auto",
        description="the code that computes: exact (the model's own modules, op by op: bitwise plain PyTorch), "
        "fast (each block through one torch.compile'd graph, train_batch's head and loss as a fused linear "
        "cross-entropy: the same math rounded differently), auto (fast on a GPU, exact on the CPU)",
    )
    attention_backend: Literal["auto", "timed", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        description="the kernel of torch's scaled_dot_product_attention the blocks' attention runs on first: "
        "auto (torch's own choice), timed (the fastest of cudnn, flash and efficient at each shape, timed at its "
        "first call and checked against flash's results), or a kernel's name (each exact attention, rounded its "
        "own way)",
    )
    seq_len: int | None = Field(
        None,
        ge=1,
        description="tokens per sequence, for the memory plan made at start-up; "
        "None: planned for min(max_position_embeddings, 2048) and checked at the first batch",
    )
    activation_checkpointing: bool = True
    """keep only block inputs in forward and recompute each block in backward"""
    quantize_base: Literal["none", "nf4"] = "none"
    """QLoRA: hold the frozen nn.Linear weights of the blocks in NF4 with double quantization (bitsandbytes'
    format, ~0.52 B/param in host memory), dequantized on the GPU once per residency; a model loaded with
    BitsAndBytesConfig(load_in_4bit=True) is held so whatever the value (docs/lora.md)"""
    max_gpu_memory: int | None = Field(None, ge=0)
    """bytes of GPU memory the engine may use (accepts '24GiB', '1.5GB'); None = what the device has; on the CPU
    it bounds the device's buffers as a GPU's would (which units stay resident), where by default every one streams"""
    max_host_memory: int | None = Field(None, ge=0)
    """bytes of host memory the engine may use (accepts '64GiB'); None = what the machine has"""
    seed: int = Field(0, ge=0)
    """random seed for initialisation, dropout and data order"""
    steps_per_print: int | None = Field(10, ge=1)
    """log every N optimizer steps (engine.steps_per_print()); None: never (a DeepSpeed config without the key)"""
    managed_gradient_accumulation: bool = True
    """the DeepSpeed-shaped loop (DeepSpeed's key): True, engine.step() steps at every
    gradient_accumulation_steps-th micro-batch; False, every engine.step() after a backward() is the
    accumulation boundary, whatever the count so far (at most gradient_accumulation_steps micro-batches)"""
    wall_clock_breakdown: bool = False
    """print where the step's time went every steps_per_print steps"""
    sharding: Literal["auto", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] = "auto"
    """with several ranks (FSDP's words; DeepSpeed's zero stage maps here): how the training state is divided
    (docs/ranks.md). Offloaded state is held once per host whatever the value. The optimizer state of units kept
    on the GPUs is sharded across them unless NO_SHARD (stage 0/1: replicated); without offload, FULL_SHARD
    (stage 3) also shards the 16-bit weights (each block gathered for each use), SHARD_GRAD_OP (stage 2) and
    auto keep them whole on every GPU"""
    nodes_layout: Literal["auto", "hybrid", "full"] = "auto"
    """on several nodes (docs/ranks.md): hybrid, each node holds the whole training state (FSDP's HYBRID_SHARD);
    full, the host state sharded across the nodes too, each holding 1/N (FSDP's FULL_SHARD, DeepSpeed's ZeRO
    across nodes); auto, hybrid where the state fits a node's host memory, else full"""
    distributed_timeout_s: float = Field(600.0, gt=0)
    """with several ranks: how long a collective may wait for the others before the process group fails"""

    # Raise ConfigError, never pydantic's ValidationError, from every way of building one. ``_read``: what the
    # source read already and the validators do not read again ("batch", "nvme_path": a DeepSpeed translation)
    def __init__(self, /, _read: tuple = (), **data: Any) -> None:
        try:  # BaseModel.__init__'s own call, with the context the validators read
            self.__pydantic_validator__.validate_python(
                data, self_instance=self, context={"read": _read} if _read else None
            )
        except ValidationError as exc:
            raise config_error_from(exc, type(self)) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> ZerofitConfig:  # type: ignore[override]
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise config_error_from(exc, cls) from None

    @field_validator("max_gpu_memory", "max_host_memory", mode="before")
    @classmethod
    def _sizes(cls, v, info):
        return parse_bytes(v, info.field_name)

    @model_validator(mode="before")
    @classmethod
    def _derive_batch(cls, data: Any, info) -> Any:
        """Fill in the batch triple (see :func:`resolve_batch`) before the fields are checked (once: a source
        that resolved it already, a DeepSpeed translation, says so)."""
        if not isinstance(data, dict) or _read(info, "batch"):
            return data
        world = data.get("world_size", 1)
        given = [data.get(k) for k in ZEROFIT_BATCH_NAMES[:3]]
        if not (_positive_int(world) and all(v is None or _positive_int(v) for v in given)):
            return data  # field validation reports the bad value by name
        train, micro, accum = resolve_batch(*given, world)
        return {**data, "train_batch_size": train, "micro_batch_size": micro, "gradient_accumulation_steps": accum}

    @model_validator(mode="after")
    def _checkpoint_every(self):
        every = self.offload.checkpoint_every
        if every is not None and every > 1 and not self.activation_checkpointing:
            raise ConfigError(
                "offload.checkpoint_every",
                "1 or unset with activation_checkpointing false",
                str(every),
                "keeping every k-th block's checkpoints needs activation_checkpointing "
                "(without it the forward keeps every block's activations, not checkpoints)",
            )
        return self


def _read(info, what: str) -> bool:
    """Whether the source already read ``what`` ("batch": the batch triple resolved; "nvme_path": the folder
    checked), as ``ZerofitConfig(_read=(...), **fields)`` says: the config is read once."""
    return what in ((info.context or {}).get("read") or ())


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
