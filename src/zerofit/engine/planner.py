"""The planner: where each unit lives, what that costs, and whether it fits.

From the unit sizes, the batch shape and the budgets it chooses, before
anything is allocated:

* which blocks stay RESIDENT on the device with a device optimizer (from block
  0 upward: those are needed first in the next forward, so updating them on the
  device keeps the CPU optimizer's last updates off the critical path);
* whether the shell's optimizer runs on the device or the host;
* how many device slots streamed blocks rotate through (prefetch depth + 1);
* how many pinned host gradient buffers the CPU optimizer consumes from.

It predicts device and host bytes for that placement and refuses a plan that
does not fit with :class:`PlanError`, naming the bytes needed and available.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

GiB = 2**30


class PlanError(RuntimeError):
    """No placement fits the memory budgets; raised before anything is allocated."""


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1, e.g. '1.50 GiB', '812.0 KiB'."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of the model."""

    shell_numel: int
    block_numels: tuple[int, ...]
    hidden: int            # width of the residual stream
    intermediate: int      # MLP width (for the activation estimate)
    vocab: int             # 0 if unknown


@dataclass(frozen=True)
class BatchShape:
    micro_batch: int
    seq_len: int
    grad_accum: int

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass(frozen=True)
class Plan:
    """A placement and its predicted memory. Byte counts are per kind of buffer."""

    resident_blocks: int           # blocks 0..resident_blocks-1 are RESIDENT (device optimizer)
    shell_optimizer_on_device: bool
    weight_slots: int              # device slots for streamed blocks (0 when none stream)
    grad_slots: int
    staging_buffers: int           # pinned host fp32 gradient staging buffers the CPU optimizer consumes from
    deferred_updates: bool         # clipping/fp16: CPU updates wait for the global norm / overflow check
    assisted_updates: bool         # deferred: the device updates some streamed blocks (engine.py)
    device_bytes: dict[str, int]
    host_bytes: dict[str, int]
    device_budget: int | None
    host_budget: int | None
    assisted_blocks: frozenset = frozenset()   # indices of the blocks the device updates ([Note: assisted updates])

    @property
    def device_total(self) -> int:
        return sum(self.device_bytes.values())

    @property
    def host_total(self) -> int:
        return sum(self.host_bytes.values())

    def describe(self) -> str:
        lines = [f"plan: {self.resident_blocks} resident blocks (device optimizer), "
                 f"shell optimizer on {'device' if self.shell_optimizer_on_device else 'host'}, "
                 f"{self.weight_slots} weight slots, {self.staging_buffers} pinned gradient buffers"
                 f"{', deferred updates' if self.deferred_updates else ''}"
                 + (f" ({len(self.assisted_blocks)} of the streamed blocks updated on the device)"
                    if self.assisted_updates else ""),
                 f"  device {fmt_bytes(self.device_total)}"
                 + (f" of {fmt_bytes(self.device_budget)}" if self.device_budget else "") + ": "
                 + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.device_bytes.items() if v),
                 f"  host {fmt_bytes(self.host_total)}"
                 + (f" of {fmt_bytes(self.host_budget)}" if self.host_budget else "") + ": "
                 + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.host_bytes.items() if v)]
        return "\n".join(lines)

    def optimizer_homes(self, num_blocks: int, device: str = "the GPU") -> str:
        """Where the optimizer state (fp32 master weights and Adam moments) of the shell and of the blocks
        is under this plan, in words: what the engine logs after planning."""
        def where(on_device: bool) -> str:
            return f"on {device}" if on_device else "in host memory (CPU AdamW)"

        def blocks(lo: int, hi: int) -> str:
            return f"block {lo}" if hi - lo == 1 else f"blocks {lo}-{hi - 1}"

        r = min(self.resident_blocks, num_blocks)
        parts = [f"shell {where(self.shell_optimizer_on_device)}"]
        if r:
            parts.append(f"{blocks(0, r)} {where(True)}")
        if r < num_blocks:
            parts.append(f"{blocks(r, num_blocks)} {where(False)}")
        return "optimizer state: " + "; ".join(parts)

    def optimizer_on_host(self, num_blocks: int) -> bool:
        """Whether any optimizer state lives in host memory under this plan."""
        return not self.shell_optimizer_on_device or self.resident_blocks < num_blocks


def placement_warnings(plan: Plan, num_blocks: int, *, optimizer_device: str, param_device: str,
                       on_cuda: bool) -> list[str]:
    """Where the plan does not do what the offload settings say in DeepSpeed's words (the engine logs them).

    ``optimizer_device``/``param_device``: the config's ``offload`` fields ('none', 'cpu', 'nvme')."""
    homes = plan.optimizer_homes(num_blocks)
    if "nvme" in (optimizer_device, param_device):
        return [f"offload to 'nvme' was asked for, but zerofit has no NVMe tier yet: that state is kept in host "
                f"memory (planned against max_host_memory); nvme_path is checked, not written. {homes}"]
    if on_cuda and param_device != "none" and optimizer_device == "none":
        return ["offload.param_device is 'cpu' but offload.optimizer_device is 'none': zerofit keeps every block "
                "on the GPU with its optimizer state (it offloads whole blocks, weights and optimizer state "
                f"together); set offload.optimizer_device 'cpu' to stream them. {homes}"]
    if on_cuda and optimizer_device != "none" and not plan.optimizer_on_host(num_blocks):
        why = ("offload.param_device is 'none' (DeepSpeed: no offload_param), so every block's weights stay on the "
               "GPU, and zerofit updates a block where its weights live; set offload.param_device 'cpu' (DeepSpeed: "
               "zero_optimization.offload_param.device 'cpu', stage 3) to move it to host memory"
               if param_device == "none" else
               "it all fits there (the planner keeps blocks on the GPU while they fit); set "
               "offload.resident_blocks to bound that")
        return [f"offload.optimizer_device is {optimizer_device!r}, but the plan keeps all optimizer state on the "
                f"GPU: {why}"]
    return []


def activation_bytes(shape: ModelShape, batch: BatchShape, n_blocks: int, dtype_bytes: int) -> dict[str, int]:
    """Predicted activation memory of a block-major step with per-block recompute.

    checkpoints: every block's input for every micro-batch (block-major order keeps them all);
    boundary: the gradient flowing between blocks, one per micro-batch;
    block: one block's recomputed activations and their gradients (transient);
    logits: the fp32 upcast of the head's output for the loss, its gradient, the 16-bit gradient
    (the 16-bit logits themselves are dropped before the backward)."""
    tok = batch.tokens
    return {
        "checkpoints": n_blocks * batch.grad_accum * tok * shape.hidden * dtype_bytes,
        "boundary_grads": 2 * batch.grad_accum * tok * shape.hidden * dtype_bytes,
        "block_working_set": tok * (48 * shape.hidden + 16 * shape.intermediate) * dtype_bytes // 2,
        "logits": tok * shape.vocab * (dtype_bytes + 8),
    }


ASSIST_CHUNKS = 4    # [Note: assisted updates]: a block's state goes up and down in this many chunks
ASSIST_SETS = 2      # chunk buffer sets: one chunk's download overlaps the next one's upload


def assist_chunk(max_block: int) -> int:
    """Elements per assisted-update chunk (a multiple of 64: aligned slices)."""
    return -(-max(max_block, 1) // (ASSIST_CHUNKS * 64)) * 64


def assist_buffer_numel(max_block: int) -> int:
    """fp32 elements of the device buffers of assisted updates: per set, master, two moments and gradient."""
    return ASSIST_SETS * 4 * assist_chunk(max_block)


def assisted_choice(first_streamed: int, n_streamed: int, fraction: float) -> frozenset:
    """Which streamed blocks the device updates under deferred updates: ``fraction`` of them, spread
    evenly (0.5: every other one), so the CPU's and the copy engines' shares interleave in forward order."""
    return frozenset(first_streamed + s for s in range(n_streamed)
                     if math.floor((s + 1) * fraction + 1e-9) > math.floor(s * fraction + 1e-9))


def make_plan(shape: ModelShape, batch: BatchShape | None, *, compute_dtype: torch.dtype, on_cuda: bool,
              device_budget: int | None, host_budget: int | None, deferred_updates: bool,
              checkpointing: bool, stream_params: bool,
              resident_blocks: int | None, prefetch_depth: int | None, staging: int = 12,
              shell_on_device: bool | None = None, fixed_staging: int | None = None,
              assisted_updates: bool | None = None, assisted_fraction: float = 0.375,
              host16: bool = False) -> Plan:
    """Choose a placement that fits ``device_budget`` and ``host_budget`` (bytes; None = unbounded)."""
    cb = torch.empty((), dtype=compute_dtype).element_size()
    fp32 = compute_dtype == torch.float32
    L = len(shape.block_numels)
    max_block = max(shape.block_numels, default=0)
    # bytes/param of a resident unit with its optimizer on the device: weights, master, 2 moments, grad
    res_opt = (0 if fp32 else cb) + 16
    act = activation_bytes(shape, batch, L, cb) if batch else {}
    act_total = sum(act.values())

    if not checkpointing or not stream_params:
        candidates = [L]
    elif resident_blocks is not None:
        candidates = [min(resident_blocks, L)]
    elif not on_cuda:
        candidates = [0]   # CPU: stream everything, so the CPU runs the same code paths as the GPU
    else:
        candidates = list(range(L, -1, -1))
    depth = prefetch_depth or 2

    def build(r: int, shell_dev: bool) -> Plan:
        streamed = shape.block_numels[r:]
        n_cpu_units = len(streamed) + (0 if shell_dev else 1)
        slots = depth + 1 if streamed else 0
        slots = min(slots, len(streamed))
        gslots = min(2, len(streamed))
        # Gradient staging buffers let the CPU optimizer fall behind the backward by that many units
        # without stalling it; take up to ``staging`` while they fit in a quarter of the host budget.
        stage = min(2 if deferred_updates else staging, n_cpu_units)
        unit_bytes = max(list(streamed) + [shape.shell_numel], default=0) * 4
        if host_budget and unit_bytes and not deferred_updates:
            stage = max(min(stage, 2 * n_cpu_units), min(stage, max(2, host_budget // 4 // unit_bytes)))
        if fixed_staging is not None:    # re-planning around buffers that already exist
            stage = fixed_staging
        stage_numel = max(list(streamed) + ([shape.shell_numel] if not shell_dev else []), default=0)
        chosen = assisted_choice(r, len(streamed), assisted_fraction)
        assisted = deferred_updates and len(streamed) > 1 and assisted_updates is not False and bool(chosen)
        if not assisted:
            chosen = frozenset()
        uploaded = list(streamed) + ([] if shell_dev else [shape.shell_numel])
        dev = {
            "shell": shape.shell_numel * (res_opt if shell_dev else cb + 4),
            "resident_blocks": sum(shape.block_numels[:r]) * res_opt,
            "weight_slots": slots * max_block * cb,
            "upload_staging": (max(uploaded, default=0) * 4) if not fp32 else 0,   # [Note: fp32 uploads]
            "grad_slots": gslots * max_block * 4,
            "assist_buffers": assist_buffer_numel(max_block) * 4 if assisted else 0,
            **act,
            "allocator_reserve": int(0.05 * (act_total + sum(shape.block_numels) * cb)) + (256 << 20 if on_cuda else 0),
        }
        host_units = sum(streamed) + (0 if shell_dev else shape.shell_numel)
        device_opt_units = shape.shell_numel + sum(shape.block_numels) - host_units
        host = {
            "master_and_moments": host_units * 12,                      # master pinned: it is uploaded
            "host_mirrors": device_opt_units * 4 if on_cuda else 0,     # fp32 copies the module's params view
            "grad_staging": stage * stage_numel * 4,
            "grad_buffers": host_units * 4 if deferred_updates else 0,
            # DeepSpeed-style forwards: 16-bit copies of the streamed blocks (engine/deepspeed_api.py)
            "host16_copies": sum(streamed) * cb if host16 and not fp32 else 0,
        }
        if not on_cuda:  # device memory is host memory: count it once, as host
            for k, v in dev.items():
                host["device:" + k] = v
            dev = {}
        return Plan(r, shell_dev, slots, gslots, stage, deferred_updates, assisted, dev, host, device_budget,
                    host_budget, chosen)

    best = None
    # Prefer the shell's optimizer on the device: its gradient is complete only at the very end of the
    # backward, so a host update of it would sit on the critical path of the next step.
    shell_choices = (True, False)
    if shell_on_device is not None:
        shell_choices = (shell_on_device,)
    for shell_dev in shell_choices:
        for r in candidates:
            plan = build(r, shell_dev)
            dev_ok = device_budget is None or not on_cuda or plan.device_total <= device_budget
            host_ok = host_budget is None or plan.host_total <= host_budget
            if dev_ok and host_ok:
                return plan
            # keep the plan that comes closest, to show in the refusal: the smallest on the device
            if best is None or (plan.device_total, plan.host_total) < (best.device_total, best.host_total):
                best = plan
    assert best is not None
    need_dev = best.device_total
    raise PlanError(
        "no placement fits: "
        + (f"device needs {fmt_bytes(need_dev)} > budget {fmt_bytes(device_budget)} "
           f"({need_dev} > {device_budget} bytes); "
           if device_budget is not None and on_cuda and need_dev > device_budget else "")
        + (f"host needs {fmt_bytes(best.host_total)} > budget {fmt_bytes(host_budget)} "
           f"({best.host_total} > {host_budget} bytes); "
           if host_budget is not None and best.host_total > host_budget else "")
        + "smallest plan:\n" + best.describe()
        + "\nlower micro_batch_size or seq_len, or raise max_gpu_memory / max_host_memory")
