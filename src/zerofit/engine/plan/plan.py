"""A plan and what it is made from: the model's and the batch's shapes, the placement the planner chose
(:class:`Plan`: where each unit lives, its predicted bytes, in words with :meth:`Plan.describe`), and the
refusal when none fits (:class:`PlanError`). The planner itself is plan/search.py; the config and the device it
plans for, plan/engine_plan.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerofit.errors import InputError

GiB = 2**30
MiB = 2**20


class PlanError(InputError, RuntimeError):
    """No placement fits the memory budgets; raised before anything is allocated. ``host_need``: the least host
    memory of a placement the device holds (None: none does), the figure the refusal gives."""

    def __init__(self, message: str, host_need: int | None = None):
        super().__init__(message)
        self.host_need = host_need


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1, e.g. '1.50 GiB', '812.0 KiB'."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_at_least(n: float) -> str:
    """``n`` bytes as :func:`fmt_bytes` writes them, rounded up, so that the figure (read back as a size:
    ``1.46MiB``) is never less than ``n``: what a refusal's "at least" says."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = math.ceil(n * 100 / size) / 100
            while int(float(f"{v:.2f}") * size) < n:  # as zerofit.config.parse_bytes reads it back
                v += 0.01
            return f"{v:.2f} {unit}"
    return f"{math.ceil(n)} B"


def fmt_count(n: float) -> str:
    """A count in the largest of K, M, B that keeps it >= 1, three significant digits: '203 K', '3.03 M',
    '13 B' (a 0.2 M-parameter model is not '0.00 B')."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)}"


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of the model."""

    shell_numel: int  # the shell's trained parameters
    block_numels: tuple[int, ...]  # each block's trained parameters (master, moments, gradient)
    hidden: int  # width of the residual stream
    intermediate: int  # MLP width (for the activation estimate)
    vocab: int  # 0 if unknown
    shell_frozen: int = 0  # the shell's frozen parameters: weights only, in the compute dtype ([Note: frozen
    # parameters], store.py)
    block_frozen: tuple[int, ...] = ()  # each block's frozen parameters (empty: none)
    # [Note: an NF4 base] (nf4.py): of those, per unit (the shell first), the ones held in NF4 and their host
    # bytes (empty: none)
    nf4_numels: tuple[int, ...] = ()
    nf4_bytes: tuple[int, ...] = ()
    # [Note: a block over sequence tiles] (tiling.py): per token, the elements of q, k, v and the attention's output
    # when the blocks run over sequence tiles whole (0: only their MLP does, or nothing)
    attention: int = 0

    def frozen_of(self, i: int) -> int:
        """Block ``i``'s frozen parameters."""
        return self.block_frozen[i] if self.block_frozen else 0

    def nf4_bytes_of(self, i: int) -> int:
        """Block ``i``'s NF4 weights' host bytes (its packed upload)."""
        return self.nf4_bytes[i + 1] if self.nf4_bytes else 0

    def frozen_host_bytes(self, cb: int, units=None) -> int:
        """Host bytes of the frozen weights (of ``units``: indices, the shell 0; None: all): the 16-bit ones
        at ``cb`` bytes each, the NF4 ones packed."""
        frozen = (self.shell_frozen,) + (tuple(self.block_frozen) or (0,) * len(self.block_numels))
        nf4n = self.nf4_numels or (0,) * len(frozen)
        nf4b = self.nf4_bytes or (0,) * len(frozen)
        idx = range(len(frozen)) if units is None else units
        return sum((frozen[i] - nf4n[i]) * cb + nf4b[i] for i in idx)

    @property
    def frozen_numel(self) -> int:
        return self.shell_frozen + sum(self.block_frozen)

    @property
    def parameters(self) -> int:
        """Every parameter, trained and frozen."""
        return self.shell_numel + sum(self.block_numels) + self.frozen_numel


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

    resident_blocks: int  # blocks 0..resident_blocks-1 are RESIDENT (device optimizer)
    shell_optimizer_on_device: bool
    weight_slots: int  # device slots for streamed blocks (0 when none stream)
    grad_slots: int
    staging_buffers: int  # pinned host fp32 gradient staging buffers the CPU optimizer consumes from
    deferred_updates: bool  # clipping/fp16: CPU updates wait for the global norm / overflow check
    assisted_updates: bool  # the device updates some streamed blocks (engine.py): during the next forward
    # (deferred updates), or during the backward (immediate ones)
    device_bytes: dict[str, int]
    host_bytes: dict[str, int]
    device_budget: int | None
    host_budget: int | None
    assisted_blocks: frozenset = frozenset()  # indices of the blocks the device updates ([Note: assisted updates])
    disk_blocks: tuple = ()  # ((block index, "moments" | "all"), ...): optimizer state on the disk (disk.py)
    disk_bytes: int = 0  # the swap file's size
    disk_budget: int | None = None
    disk_speed: tuple | None = None  # (write, read) GB/s measured on the swap file at initialize
    stage_numel: int = 0  # fp32 upload staging elements (0: the largest uploaded unit); larger ones go up
    # in pieces
    loss_chunks: int = 1  # [Note: a smaller GPU floor]: the head and loss run over this many token chunks
    sequence_tile: int | None = None  # [Note: a block over sequence tiles] (tiling.py): the blocks' per-token work
    # over tiles of this many tokens (None: the whole sequence)
    offload_checkpoints: bool = False  # block inputs kept in pinned host memory between forward and backward
    checkpoint_every: int = 1  # [Note: checkpoints every k blocks]: only blocks 0, k, 2k, ... keep their inputs
    checkpoint_ahead: int = 2  # offloaded checkpoints come back this many blocks ahead ([Note: one checkpoint ahead])
    device_state: bool = False  # several ranks, FULL_SHARD without offload: streamed blocks keep their optimizer
    # state on the GPUs, sharded; their weights are gathered from it for each use
    disk_frozen: tuple = ()  # block indices whose frozen 16-bit weights are on the disk, read-only
    # ([Note: a frozen base on the disk], disk.py)
    disk_frozen_bytes: int = 0  # their bytes there
    host_share: float = 1.0  # the share of the host-optimized units' state this node holds: 1/N in the full
    # layout on N nodes ([Note: nodes hold a slice of the state], node_slices.py)

    @property
    def disk_of(self) -> dict[int, str]:
        """Block index -> what of its state is on the disk: "moments" (exp_avg, exp_avg_sq) or "all" (the
        fp32 master too; its 16-bit weights stay in host memory)."""
        return dict(self.disk_blocks)

    @property
    def assisted_shell(self) -> bool:
        """The device also updates the shell, from its gradient, at the end of the backward: immediate updates
        with the assisted updates' buffers and the shell's optimizer on the host ([Note: assisted updates in the
        backward], update/assisted.py)."""
        return self.assisted_updates and not self.deferred_updates and not self.shell_optimizer_on_device

    @property
    def device_total(self) -> int:
        return sum(self.device_bytes.values())

    @property
    def host_total(self) -> int:
        return sum(self.host_bytes.values())

    @property
    def device_peak(self) -> int:
        """The predicted peak of *allocated* device memory (``torch.cuda.max_memory_allocated``): the plan's
        device bytes less the allocator's slack (reserved, never allocated) and less the smaller of the
        logits and a block's working set, which never coexist (the head runs between the blocks' forward and
        backward). ``device_total`` is what the plan is checked against the cap with."""
        d = self.device_bytes
        return (
            self.device_total - d.get("allocator_reserve", 0) - min(d.get("logits", 0), d.get("block_working_set", 0))
        )

    def describe(self) -> str:
        """The placement and its bytes in a few lines (``zerofit train`` and ``zerofit estimate`` print it)."""
        extras = (
            (
                f" ({len(self.assisted_blocks)} of the streamed blocks updated on the device)"
                if self.assisted_updates
                else ""
            )
            + (f", loss in {self.loss_chunks} token chunks" if self.loss_chunks > 1 else "")
            + (", block checkpoints in host memory" if self.offload_checkpoints else "")
            + (" (back one block ahead)" if self.offload_checkpoints and self.checkpoint_ahead == 1 else "")
            + (f", sequence tiles of {self.sequence_tile} tokens" if self.sequence_tile else "")
            + (
                f", checkpoints every {self.checkpoint_every} blocks (the rest recomputed in the backward)"
                if self.checkpoint_every > 1
                else ""
            )
            + (f", uploads staged in pieces of {fmt_bytes(self.stage_numel * 4)}" if self.stage_numel else "")
        )
        if self.on_cpu:
            lines = self._describe_cpu(extras)
        else:
            lines = [
                f"plan: {self.resident_blocks} resident blocks (device optimizer), "
                f"shell optimizer on {'device' if self.shell_optimizer_on_device else 'host'}, "
                f"{self.weight_slots} weight slots, {self.staging_buffers} pinned gradient buffers"
                f"{', deferred updates' if self.deferred_updates else ''}" + extras,
                f"  device {fmt_bytes(self.device_total)}"
                + (f" of {fmt_bytes(self.device_budget)}" if self.device_budget else "")
                + ": "
                + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.device_bytes.items() if v),
                f"  host {fmt_bytes(self.host_total)}"
                + (f" of {fmt_bytes(self.host_budget)}" if self.host_budget else "")
                + ": "
                + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.host_bytes.items() if v),
            ]
        if self.disk_blocks or self.disk_frozen:
            d = self.disk_of
            moments = [i for i, m in d.items() if m == "moments"]
            full = [i for i, m in d.items() if m == "all"]
            lines.append(
                f"  disk {fmt_bytes(self.disk_bytes)}"
                + (f" of {fmt_bytes(self.disk_budget)} free" if self.disk_budget else "")
                + ": "
                + "; ".join(
                    p
                    for p in (
                        f"moments of {_ranges(moments)}" if moments else "",
                        f"master and moments of {_ranges(full)}" if full else "",
                        f"frozen weights of {_ranges(list(self.disk_frozen))} (read-only)" if self.disk_frozen else "",
                    )
                    if p
                )
                + (
                    f"; measured write {self.disk_speed[0]:.2f} GB/s, read {self.disk_speed[1]:.2f} GB/s"
                    if self.disk_speed
                    else ""
                )
            )
        return "\n".join(lines)

    @property
    def on_cpu(self) -> bool:
        """A plan for training on the CPU: the planner counts the device's buffers as host memory there
        (``device:<kind>``) and leaves ``device_bytes`` empty."""
        return not self.device_bytes and any(k.startswith("device:") for k in self.host_bytes)

    def _describe_cpu(self, extras: str) -> list[str]:
        """On the CPU there is no GPU: no GPU memory cap, nothing crosses PCIe. The engine still runs its
        streaming path (the code a GPU runs), its "device" buffers in host memory: say that, in those words."""
        kept = (
            f"{self.resident_blocks} blocks kept whole, the others stream"
            if self.resident_blocks
            else "every block streams"
        )
        shell = "in the step" if self.shell_optimizer_on_device else "on the optimizer thread"
        own = {k: v for k, v in self.host_bytes.items() if not k.startswith("device:") and v}
        work = {k[len("device:") :]: v for k, v in self.host_bytes.items() if k.startswith("device:") and v}
        cap = (
            f"max_gpu_memory {fmt_bytes(self.device_budget)} bounds its device buffers as a GPU's"
            if self.device_budget
            else "no GPU memory cap"
        )  # [Note: a device budget on the CPU] (search.py)
        return [
            f"plan: on the CPU (no GPU: {cap}, nothing streams over PCIe); {kept} through "
            f"{self.weight_slots} weight slots in host memory (the GPU's code path), {self.staging_buffers} "
            f"gradient buffers; the shell's AdamW {shell}, the streamed blocks' on the optimizer thread"
            + (", deferred updates" if self.deferred_updates else "")
            + extras,
            f"  host {fmt_bytes(self.host_total)}"
            + (f" of {fmt_bytes(self.host_budget)}" if self.host_budget else "")
            + ": "
            + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in own.items())
            + (("; compute " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in work.items())) if work else ""),
        ]

    def disk_traffic(self, shape: ModelShape) -> tuple[int, int]:
        """(bytes read, bytes written) on the disk per optimizer step: every swapped field once each way (the
        gradient too with deferred updates: [Note: gradients on the disk], step/optimizer_step.py)."""
        per = {"moments": 8 + 4 * self.deferred_updates, "all": 12 + 4 * self.deferred_updates}
        n = sum(shape.block_numels[i] * per[m] for i, m in self.disk_blocks)
        # frozen weights on the disk: read for each upload, the forward's and the backward's ([Note: a frozen
        # base on the disk]); never written
        return n + 2 * self.disk_frozen_bytes, n

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
        disk = self.disk_of
        mem = [i for i in range(r, num_blocks) if i not in disk]
        if mem:
            parts.append(f"{_ranges(mem)} {where(False)}")
        moments = [i for i, m in disk.items() if m == "moments"]
        full = [i for i, m in disk.items() if m == "all"]
        if moments:
            parts.append(f"{_ranges(moments)}: master in host memory, moments on the disk (CPU AdamW)")
        if full:
            parts.append(f"{_ranges(full)}: master and moments on the disk, 16-bit weights in host memory (CPU AdamW)")
        return "optimizer state: " + "; ".join(parts)

    def optimizer_on_host(self, num_blocks: int) -> bool:
        """Whether any optimizer state lives in host memory under this plan."""
        return not self.shell_optimizer_on_device or self.resident_blocks < num_blocks


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> 'blocks 0-2, 5'."""
    idx = sorted(idx)
    runs, start = [], None
    for j, i in enumerate(idx):
        if start is None:
            start = i
        if j + 1 == len(idx) or idx[j + 1] != i + 1:
            runs.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return ("block " if len(idx) == 1 else "blocks ") + ", ".join(runs)


def placement_warnings(
    plan: Plan, num_blocks: int, *, optimizer_device: str, param_device: str, on_cuda: bool
) -> list[str]:
    """Where the plan does not do what the offload settings say in DeepSpeed's words (the engine logs them).

    ``optimizer_device``/``param_device``: the config's ``offload`` fields ('none', 'cpu', 'nvme')."""
    homes = plan.optimizer_homes(num_blocks)
    if "nvme" in (optimizer_device, param_device) and not plan.disk_blocks and not plan.disk_frozen:
        return [
            f"offload to 'nvme' was asked for, but host memory holds all the optimizer state under "
            f"max_host_memory ({fmt_bytes(plan.host_budget) if plan.host_budget else 'no limit'}): "
            f"zerofit puts on the disk only what host "
            f"memory cannot hold, so the disk is not used. {homes}"
        ]
    if on_cuda and param_device != "none" and optimizer_device == "none":
        return [
            "offload.param_device is 'cpu' but offload.optimizer_device is 'none': zerofit keeps every block "
            "on the GPU with its optimizer state (it offloads whole blocks, weights and optimizer state "
            f"together); set offload.optimizer_device 'cpu' to stream them. {homes}"
        ]
    if on_cuda and optimizer_device != "none" and not plan.optimizer_on_host(num_blocks):
        why = (
            "offload.param_device is 'none' (DeepSpeed: no offload_param), so every block's weights stay on the "
            "GPU, and zerofit updates a block where its weights live; set offload.param_device 'cpu' (DeepSpeed: "
            "zero_optimization.offload_param.device 'cpu', stage 3) to move it to host memory"
            if param_device == "none"
            else "it all fits there (the planner keeps blocks on the GPU while they fit); set "
            "offload.resident_blocks to bound that"
        )
        return [
            f"offload.optimizer_device is {optimizer_device!r}, but the plan keeps all optimizer state on the "
            f"GPU: {why}"
        ]
    return []
