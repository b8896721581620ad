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

import torch

from zerofit.engine.disk.tier import ALIGN, tier_buffers, tier_chunk
from zerofit.engine.plan.activations import (
    CKPT_AHEAD,  # noqa: F401 (re-exported)
    CKPT_ON_DEVICE,  # noqa: F401 (re-exported)
    LOSS_BYTES,  # noqa: F401 (re-exported)
    LOSS_CHUNK_TOKENS,  # noqa: F401 (re-exported)
    SPARSE_EVERY,
    TILE_MIN,  # noqa: F401 (re-exported)
    activation_bytes,
    checkpoint_ahead,
    device_checkpoints,  # noqa: F401 (re-exported)
    loss_chunks_for,
    offloaded_blocks,  # noqa: F401 (re-exported)
    offloaded_checkpoints,
    padded_level,
    recomputed_blocks,  # noqa: F401 (re-exported)
    tiles_for,
)
from zerofit.engine.plan.plan import (
    BatchShape,
    GiB,
    MiB,
    ModelShape,
    Plan,
    PlanError,
    fmt_at_least,
    fmt_bytes,
    fmt_count,  # noqa: F401 (re-exported)
    placement_warnings,  # noqa: F401 (re-exported)
)

TIER_BUFFERS = 12  # disk.py: chunk buffers the disk tier streams through (reads ahead, writes behind)


ASSIST_CHUNKS = 8  # [Note: assisted updates]: a block's state goes up and down in this many chunks
ASSIST_SETS = 2  # chunk buffer sets: one chunk's download overlaps the next one's upload


CAST_SHARE = 1 / 3  # the CPU's fp32 -> 16-bit cast of a block, as a share of its AdamW (both bound by host memory
# traffic: 6 B/param against AdamW's ~28 B/param less cache effects), as the CPU's busy time per step of a 7B model
# on the benchmark machine gives it, and a timing on 2 cores (0.36). 0.5 (a device share of 0.58) made that model's
# step slower: the copy engines, then busier than the CPU in the backward, hold the gradient buffers longer
# (docs/benchmarks.md, the DeepSpeed-shaped loop)


SPLIT_FRACTION = 0.25  # [Note: moments after the forward] (update/split_adamw.py): deferred updates whose CPU share
# runs only its master pass on the forward's path leave the device a smaller share. With clipping at 1.0, a 3B
# model at a 24 GiB cap stepped faster at 0.25 than at 0.3 or 0.375, with the cast pass or without, and about as
# fast at 0.2 (docs/benchmarks.md, the 3B model with gradient clipping)


def copies_fraction(fraction: float) -> float:
    """[Note: 16-bit copies after the update] (copies16.py): the share of the streamed blocks the device
    updates when each CPU update is followed by a cast: the CPU keeps the busy time it had without the casts."""
    return 1.0 - (1.0 - fraction) / (1.0 + CAST_SHARE)


def assist_chunk(max_block: int) -> int:
    """Elements per assisted-update chunk (a multiple of 64: aligned slices)."""
    return -(-max(max_block, 1) // (ASSIST_CHUNKS * 64)) * 64


def assist_buffer_numel(max_block: int, grad: bool = True) -> int:
    """fp32 elements of the device buffers of assisted updates: per set, master, two moments and (deferred
    updates: it comes up from the host) gradient."""
    return ASSIST_SETS * (4 if grad else 3) * assist_chunk(max_block)


def assisted_choice(first_streamed: int, n_streamed: int, fraction: float) -> frozenset:
    """Which streamed blocks the device updates: ``fraction`` of them, spread evenly (0.5: every other
    one), so the CPU's and the copy engines' shares interleave in forward (and backward) order."""
    return frozenset(
        first_streamed + s
        for s in range(n_streamed)
        if math.floor((s + 1) * fraction + 1e-9) > math.floor(s * fraction + 1e-9)
    )


def make_plan(shape: ModelShape, batch: BatchShape | None, **kw) -> Plan:
    """Choose a placement (see :func:`_make_plan`); a refusal says what would fit, with the numbers
    (:func:`advice`)."""
    try:
        return _make_plan(shape, batch, **kw)
    except PlanError as e:
        tips = advice(shape, batch, kw, e.host_need)
        if tips:
            raise PlanError(f"{e}\nwhat would fit:\n" + "\n".join(f"  - {t}" for t in tips)) from None
        raise


def advice(shape: ModelShape, batch: BatchShape | None, kw: dict, host_need: int | None = None) -> list[str]:
    """What would make a refused plan fit, each with its numbers: a GPU cap, a host budget, an NVMe tier of
    N bytes, a smaller micro-batch. Each is checked by planning it, with the figure as written (rounded up:
    a budget rounded down to the figure shown would be refused again). ``host_need``: the refusal's (the least
    host memory of a placement the device holds), the host budget suggested when planning with it fits."""

    def tries(**changes) -> Plan | None:
        try:
            return _make_plan(shape, batch if "batch" not in changes else changes.pop("batch"), **(kw | changes))
        except PlanError:
            return None

    def shown(n: int, budget: str, **changes) -> str | None:
        """``n`` as the tip writes it, if planning with that budget (``budget``: the keyword) fits."""
        text = fmt_at_least(n)
        return text if tries(**(changes | {budget: _read_back(text)})) is not None else None

    tips = []
    if not kw.get("stream_params") and not kw.get("device_state"):
        # every block kept on the GPU with its optimizer state: offloading them is the cheapest fix there is
        streamed = tries(stream_params=True)
        host = tries(stream_params=True, host_budget=None, disk_budget=None) if streamed is None else None
        if streamed is not None or host is not None:
            fit = streamed or host
            assert fit is not None  # (one of them fits)
            tips.append(
                "the parameters offloaded too, with the optimizer (DeepSpeed: zero_optimization's "
                'offload_param {"device": "cpu"} beside offload_optimizer; zerofit: offload.param_device '
                f"'cpu'): the blocks streamed from host memory, {fmt_bytes(fit.device_total)} on the device"
                + (f", {fmt_bytes(fit.host_total)} of host memory" if streamed is None else "")
            )
    free = dict(device_budget=None, host_budget=None, disk_budget=None)
    unbounded = tries(**free)
    if unbounded is None:
        return tips
    dev_only = tries(host_budget=None, disk_budget=None)
    if dev_only is None and kw.get("on_cuda"):
        # the smallest device plan: every block streamed, the shell's optimizer on the host if need be
        smallest = dict(
            resident_blocks=0,
            shell_on_device=False,
            floor=(kw.get("chunkable_loss", True), True, True) if kw.get("checkpointing") else None,
        )
        low = tries(**free, **smallest)
        cap = low and shown(low.device_total, "device_budget", **free, **smallest)
        if cap:
            tips.append(f"a GPU cap (max_gpu_memory) of at least {cap}")
        if batch is not None:
            mb = batch.micro_batch // 2
            while mb >= 1:
                smaller = BatchShape(mb, batch.seq_len, batch.grad_accum * batch.micro_batch // mb)
                if tries(batch=smaller, host_budget=None, disk_budget=None) is not None:
                    tips.append(
                        f"micro_batch_size {mb} with gradient_accumulation_steps {smaller.grad_accum} (the "
                        "same tokens per step)"
                    )
                    break
                mb //= 2
    # host tips for the placement the device takes: the planned one if it fits, else the smallest one
    hb = (
        dict(device_budget=kw.get("device_budget"))
        if dev_only is not None
        else dict(device_budget=None, resident_blocks=0, shell_on_device=False)
    )
    host_only = tries(**hb, host_budget=None, disk=False)
    if host_only is not None and kw.get("host_budget") is not None and host_only.host_total > kw["host_budget"]:
        least = host_need if dev_only is not None and not kw.get("disk") else None
        budget = (least is not None and shown(least, "host_budget", **hb, disk=False)) or shown(
            host_only.host_total, "host_budget", **hb, disk=False
        )
        if budget:
            tips.append(f"a host budget (max_host_memory) of at least {budget}, all state in host memory")
    if kw.get("host_budget") is not None and kw.get("disk") and host_only is not None:
        # with the configured NVMe tier: the smallest host budget that fits beside it (the disk's free bytes
        # kept), to a MiB; the planner fills host memory first, so a larger budget fits too
        lo, hi = 0, host_only.host_total
        if tries(**hb, host_budget=hi) is not None and tries(**hb, host_budget=kw["host_budget"]) is None:
            while hi - lo > MiB:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if tries(**hb, host_budget=mid) is not None else (mid, hi)
            beside, budget = tries(**hb, host_budget=hi), shown(hi, "host_budget", **hb)
            if budget:
                assert beside is not None  # the search ends on a budget that fits (hi)
                tips.append(
                    f"a host budget (max_host_memory) of at least {budget} beside the NVMe tier "
                    f"({fmt_bytes(beside.disk_bytes)} on the disk)"
                )
    if batch is not None and batch.grad_accum > 1 and kw.get("host_budget") is not None:
        # every micro-batch of a step keeps its block checkpoints until the step's backward (block-major):
        # fewer micro-batches per step keep fewer
        g = batch.grad_accum // 2
        while g >= 1:
            if tries(batch=BatchShape(batch.micro_batch, batch.seq_len, g)) is not None:
                tips.append(
                    f"gradient_accumulation_steps {g} or fewer (each micro-batch of a step keeps its blocks' "
                    "checkpoints until the step's backward)"
                )
                break
            g //= 2
    if kw.get("host_budget") is not None:
        on_disk = tries(**hb, disk=True, disk_budget=None)
        if on_disk is not None and on_disk.disk_blocks:
            tips.append(
                f"an NVMe tier with at least {fmt_at_least(on_disk.disk_bytes)} free (offload.optimizer_device "
                "'nvme' and offload.nvme_path; DeepSpeed: offload_optimizer.device 'nvme') within the host "
                f"budget of {fmt_bytes(kw['host_budget'])}: {len(on_disk.disk_blocks)} blocks' state on the "
                "disk"
            )
    return tips


def _read_back(text: str) -> int:
    """A size as :func:`fmt_bytes` writes it, in bytes, as ``zerofit.config.parse_bytes`` reads it."""
    value, unit = text.split()
    return int(float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": GiB}[unit])


def _make_plan(
    shape: ModelShape,
    batch: BatchShape | None,
    *,
    compute_dtype: torch.dtype,
    on_cuda: bool,
    device_budget: int | None,
    host_budget: int | None,
    deferred_updates: bool,
    checkpointing: bool,
    stream_params: bool,
    resident_blocks: int | None,
    prefetch_depth: int | None,
    staging: int = 12,
    shell_on_device: bool | None = None,
    fixed_staging: int | None = None,
    assisted_updates: bool | None = None,
    assisted_fraction: float = 0.375,
    host16: bool = False,
    disk: bool = False,
    disk_budget: int | None = None,
    disk_blocks: int | None = None,
    disk_weights: bool | None = None,
    disk_placement: dict | None = None,
    disk_buffers: int = TIER_BUFFERS,
    floor: tuple | None = None,
    chunkable_loss: bool = True,
    loss_chunks: int | None = None,
    sequence_tile: int | None = None,
    shards: int = 1,
    ranks: int = 1,
    device_state: bool = False,
    disk_frozen_blocks: int | None = None,
    host_share: float = 1.0,
) -> Plan:
    """Choose a placement that fits ``device_budget`` and ``host_budget`` (bytes; None = unbounded).

    ``disk``: an NVMe tier may hold what host memory cannot (``disk_budget``: its free bytes). The planner
    then moves, from the last block down, first the Adam moments of streamed blocks to the disk, then their
    fp32 master weights too (keeping a 16-bit copy in host memory), until the host budget is met: the
    placement with the least disk traffic per step for the host memory given ([Note: disk placement]).
    ``disk_blocks``/``disk_weights`` force how many blocks and whether their master weights go there;
    ``disk_placement`` (block -> mode) keeps an existing placement (re-planning for a batch).

    [Note: a smaller GPU floor]
    When no placement fits the device, the planner tries again with, in turn: the head and loss computed over
    token chunks (the full-vocabulary logits never exist at once; only if ``chunkable_loss``: the model's
    loss takes ``shift_labels`` and ``num_items_in_batch``), then also the blocks' input checkpoints kept in
    pinned host memory between the forward and the backward (all but CKPT_ON_DEVICE blocks' worth), then also a
    lean pipeline: two weight slots (prefetch one block ahead), one gradient slot, and uploads staged through
    a quarter of a block. Each only when the one before does not fit: they cost time. ``floor`` = (chunked
    loss, offloaded checkpoints[, lean[, every[, tile]]]) fixes them (re-planning). Last, each of those levels
    again with the blocks' MLP over sequence tiles ([Note: MLP over sequence tiles], tiling.py): the largest
    power of two of at least TILE_MIN tokens below the micro-batch's that fits, halving (a forward of the MLP
    more per block). ``sequence_tile`` (the config's) fixes the tile at every level.

    ``ranks`` processes on this host ([Note: sharded units], ranks.py): the device bytes are one GPU's; the host
    bytes are the host's, the shared state once and each rank's private buffers (the host mirrors of its
    device-optimized units, its gradient staging for its shard, its offloaded checkpoints) ``ranks`` times.
    ``shards``: the ranks that share a GPU-resident unit's optimizer state. ``device_state`` (FULL_SHARD without
    offload, [Note: sharded device state] in sharding.py): every block streams, its weights gathered from the
    GPUs' shards of its state instead of uploaded from the host, which holds none of it. ``host_share``: the share
    of the host-optimized units' master, moments and waiting gradients this host holds (1/N: the full layout on N
    nodes, [Note: nodes hold a slice of the state] in node_slices.py)."""
    cb = torch.empty((), dtype=compute_dtype).element_size()
    fp32 = compute_dtype == torch.float32
    L = len(shape.block_numels)
    max_block = max(shape.block_numels, default=0)  # trained parameters: gradients, state, staging
    # [Note: frozen parameters] (store.py): a frozen parameter is only its weights, stored in the compute dtype
    # (2 B/param in bf16, 4 in fp32), in host memory once, and on the device where its unit's weights are
    frozen = [shape.frozen_of(i) for i in range(L)]
    weights_of = [n + f for n, f in zip(shape.block_numels, frozen)]  # a weight slot holds both
    # bytes/param of a resident unit with its optimizer on the device: weights, master, 2 moments, grad; with
    # ``shards`` ranks sharing its state ([Note: sharded device state], sharding.py): whole 16-bit weights (a
    # buffer of their own even in fp32) and gradient, 1/shards of master and moments and the gradient's shard
    res_opt = (0 if fp32 else cb) + 16 if shards <= 1 else cb + 4 + -(-16 // shards)
    chunks = loss_chunks or (loss_chunks_for(batch) if batch else 1)

    if device_state:
        candidates = [0]
    elif not checkpointing or not stream_params:
        candidates = [L]
    elif resident_blocks is not None:
        candidates = [min(resident_blocks, L)]
    elif not on_cuda and device_budget is None:
        candidates = [0]  # CPU: stream everything, so the CPU runs the same code paths as the GPU
    # [Note: a device budget on the CPU]: with max_gpu_memory the CPU's plan keeps resident what a GPU of that size
    # would (its "device" bytes are host memory, counted once as host), so the choice is testable without a GPU
    else:
        candidates = list(range(L, -1, -1))
    depth = prefetch_depth or 2

    def build(
        r: int,
        shell_dev: bool,
        disk_of: dict[int, str] | None = None,
        level: tuple = (False, False),
        assist_now: bool = False,
        frozen_k: int = 0,
    ) -> Plan:
        disk_of = disk_of or {}
        # [Note: a frozen base on the disk] (disk.py): the last frozen_k streamed blocks' frozen weights there
        fdisk = tuple(range(L - frozen_k, L)) if 0 < frozen_k <= L - r else ()
        fraw = {i: shape.frozen_host_bytes(cb, [i + 1]) for i in fdisk}  # each one's region, 4 KiB-aligned
        fbytes = {i: -(-n // ALIGN) * ALIGN for i, n in fraw.items()}
        chunked, offloaded = level[0], level[1]
        lean = len(level) > 2 and level[2]
        every = level[3] if len(level) > 3 else 1
        tile = level[4] if len(level) > 4 else None
        tile = tile if batch is not None and tile is not None and tile < batch.tokens else None
        streamed = shape.block_numels[r:]
        host_streamed = [] if device_state else streamed  # streamed blocks whose state is on the host
        n_cpu_units = len([n for n in host_streamed if n]) + (0 if shell_dev else 1)
        slots = (1 if lean else depth) + 1 if streamed else 0
        slots = min(slots, len(streamed))
        max_weights = max(weights_of[r:], default=0)  # a streamed block's trained and frozen weights
        # a block that trains nothing takes no gradient slot; none trains: no gradient pool (grads.py)
        gslots = min(1 if lean else 2, len(streamed)) if any(streamed) else 0
        up_stage = -(-max_block // (4 * 64)) * 64 if lean else 0
        # Gradient staging buffers let the CPU optimizer fall behind the backward by that many units
        # without stalling it; take up to ``staging`` while they fit in a quarter of the host budget.
        stage = min(2 if deferred_updates else staging, n_cpu_units)
        unit_bytes = max(list(streamed) + [shape.shell_numel], default=0) * 4
        if host_budget and unit_bytes and not deferred_updates:
            stage = max(min(stage, 2 * n_cpu_units), min(stage, max(2, host_budget // 4 // unit_bytes)))
        if fixed_staging is not None:  # re-planning around buffers that already exist
            stage = fixed_staging
        stage_numel = max(list(streamed) + ([shape.shell_numel] if not shell_dev else []), default=0)
        if disk_of:  # the disk tier binds: a deep gradient queue would only hold memory the state could use
            stage = min(stage, 3)
        chosen = assisted_choice(r, len(streamed), assisted_fraction) - set(disk_of)
        # deferred updates: always (they would wait for the norm); immediate ones: only when asked to (see
        # the end of _make_plan: when they fit beside the plan) [Note: assisted updates in the backward]
        assisted = (
            (deferred_updates or assist_now)
            and len(streamed) > 1
            and assisted_updates is not False
            and bool(chosen)
            and not device_state
        )
        if not assisted:
            chosen = frozenset()
        # [Note: one checkpoint ahead]: a block's checkpoints against the rest of its uploads in the backward (its
        # weights; with updates in the backward, a device-updated block's master and moments)
        ahead = CKPT_AHEAD
        if batch is not None and offloaded and every == 1:
            ckpt = batch.grad_accum * batch.tokens * shape.hidden * cb
            other = (max_weights * cb if streamed else 0) + (max_block * 12 if assisted and assist_now else 0)
            ahead = checkpoint_ahead(ckpt, other)
        act = (
            activation_bytes(shape, batch, L, cb, chunks if chunked else 1, offloaded, every, tile, ahead)
            if batch
            else {}
        )
        act_total = sum(act.values())
        uploaded = list(streamed) + ([] if shell_dev else [shape.shell_numel])
        # frozen weights on the device: a copy of their own on a GPU; on the CPU the device's tensor is the host
        # copy itself (materialize.py: the same dtype and device)
        frozen_dev = cb if on_cuda else 0
        # [Note: an NF4 base] (nf4.py): NF4 weights are dequantized into the device's tensor (on the CPU too)
        nf4n = shape.nf4_numels or (0,) * (L + 1)
        dev = {
            "shell": (
                shape.shell_numel * (res_opt if shell_dev else cb + 4)
                + shape.shell_frozen * frozen_dev
                + (0 if on_cuda else nf4n[0] * cb)
            ),
            "resident_blocks": (
                sum(shape.block_numels[:r]) * res_opt
                + sum(frozen[:r]) * frozen_dev
                + (0 if on_cuda else sum(nf4n[1 : r + 1]) * cb)
            ),
            # a streamed block's packed NF4 weights go up through one stage (streamer.py)
            "nf4_stage": max((shape.nf4_bytes_of(i) for i in range(r, L)), default=0) if on_cuda else 0,
            # device_state: each GPU's shard of every streamed block's master, moments and summed gradient
            "sharded_state": -(-sum(streamed) * 20 // shards) if device_state else 0,
            "weight_slots": slots * max_weights * cb,
            # [Note: fp32 uploads]; a unit larger than a block (the shell) goes up through it in pieces
            "upload_staging": (
                (up_stage or max(list(streamed) or uploaded, default=0)) * 4 if not fp32 and uploaded else 0
            ),
            "grad_slots": gslots * max_block * 4,
            "assist_buffers": (
                assist_buffer_numel(max_block, grad=deferred_updates) * 4
                # [Note: 16-bit copies after the update]: a set's new weights, cast, on their way down
                + (ASSIST_SETS * assist_chunk(max_block) * cb if host16 and not fp32 else 0)
            )
            if assisted
            else 0,
            **act,
        }
        # the caching allocator's slack: 8% of the activations and of the compute weights the device holds
        # (resident blocks and weight slots; a streamed block is on the device only in a slot), and 256 MiB.
        # (a 3B model with clipping at a 24 GiB cap: reserved exceeded allocated by more than the 5% first counted
        # gave, and the allocator then freed its cache and retried, each retry a device sync; docs/benchmarks.md,
        # the 3B model with gradient clipping)
        held16 = (sum(weights_of[:r]) + slots * max_weights) * cb
        dev["allocator_reserve"] = int(0.08 * (act_total + held16)) + (256 << 20 if on_cuda else 0)
        host_units = sum(host_streamed) + (0 if shell_dev else shape.shell_numel)
        device_opt_units = shape.shell_numel + sum(shape.block_numels) - host_units
        on_disk = {m: sum(shape.block_numels[i] for i, d in disk_of.items() if d == m) for m in ("moments", "all")}
        tier_max = max([max_block] + [-(-n // 4) for n in fraw.values()])
        chunk = tier_chunk(tier_max)  # (planning.open_tier sizes the tier so)
        host = {
            "master_and_moments": math.ceil((host_units - on_disk["moments"] - on_disk["all"]) * 12 * host_share),
            # [Note: frozen parameters]: the frozen weights, once (the host's ranks share them), no state
            "frozen_weights": shape.frozen_host_bytes(cb, [0] + [i + 1 for i in range(L) if i not in fbytes]),
            "host_mirrors": device_opt_units * 4 * ranks if on_cuda else 0,  # fp32 copies the params view
            "grad_staging": stage * -(-stage_numel // ranks) * 4 * ranks,  # each rank's, for its shard
            # deferred updates: each host unit's gradient waits for the norm here, or on the disk with its state
            "grad_buffers": (
                math.ceil((host_units - on_disk["moments"] - on_disk["all"]) * 4 * host_share)
                if deferred_updates
                else 0
            ),
            # DeepSpeed-style forwards: 16-bit copies of the streamed blocks (copies16.py)
            "host16_copies": (sum(streamed) - on_disk["all"]) * cb if host16 and not fp32 else 0,
            "disk_block_masters": on_disk["moments"] * 4,  # moments on the disk, master here
            "disk_block_weights16": on_disk["all"] * cb,  # master on the disk: 16-bit weights here
            "disk_buffers": (
                tier_buffers(tier_max, disk_buffers)
                * max(
                    (3 if on_disk["all"] else 2) + (1 if deferred_updates else 0) if disk_of else 0, 1 if fdisk else 0
                )
                * chunk
                * 4
                + ALIGN
            )
            if disk_of or fdisk
            else 0,
            "checkpoint_copies": (
                offloaded_checkpoints(L, every) * batch.grad_accum * batch.tokens * shape.hidden * cb * ranks
                if batch and offloaded
                else 0
            ),
        }
        if not on_cuda:  # device memory is host memory: count it once, as host
            for k, v in dev.items():
                host["device:" + k] = v
            dev = {}
        dbytes = sum(
            -(-shape.block_numels[i] * 4 // ALIGN)
            * ALIGN
            * ((2 if d == "moments" else 3) + (1 if deferred_updates else 0))
            for i, d in disk_of.items()
        )
        dbytes += sum(fbytes.values())
        return Plan(
            r,
            shell_dev,
            slots,
            gslots,
            stage,
            deferred_updates,
            assisted,
            dev,
            host,
            device_budget,
            host_budget,
            chosen,
            tuple(sorted(disk_of.items())),
            dbytes,
            disk_budget,
            loss_chunks=chunks if chunked else 1,
            offload_checkpoints=offloaded,
            stage_numel=up_stage,
            device_state=device_state,
            checkpoint_every=every,
            checkpoint_ahead=ahead,
            sequence_tile=tile,
            disk_frozen=fdisk,
            disk_frozen_bytes=sum(fbytes.values()),
            host_share=host_share,
        )

    def disk_choices(r: int):
        """[Note: disk placement]
        Per parameter, keeping the moments in host memory costs 8 B there and saves 16 B of disk traffic per
        step (read and write); keeping the master costs 4 B (2 B net of the 16-bit copy a disk master needs)
        and saves 8 B. Moments first, then, so the placements tried go: the moments of the last block, of the
        last two, ... of every streamed block; then also the master of the last block, the last two, ... .
        The last blocks go first: their gradients come first in the backward, so their disk updates start
        earliest, and the next forward needs them last."""
        n = L - r
        if disk_placement is not None:
            yield dict(disk_placement)
            return
        if disk_blocks is not None:
            k = min(disk_blocks, n)
            yield {i: ("all" if disk_weights else "moments") for i in range(L - k, L)}
            return
        for k in range(1, n + 1):
            if disk_weights is not True:
                yield {i: "moments" for i in range(L - k, L)}
        if disk_weights is not False and not fp32:
            for k in range(1, n + 1):
                yield {i: ("all" if i >= L - k else "moments") for i in range(r, L)}

    best = None
    least_host: int | None = None
    # Prefer the shell's optimizer on the device: its gradient is complete only at the very end of the
    # backward, so a host update of it would sit on the critical path of the next step.
    shell_choices: tuple[bool, ...] = (True, False)
    if shell_on_device is not None:
        shell_choices = (shell_on_device,)

    def fits(plan: Plan) -> tuple[bool, bool, bool]:
        on_device = (
            plan.device_total if on_cuda else sum(v for k, v in plan.host_bytes.items() if k.startswith("device:"))
        )
        return (
            device_budget is None or on_device <= device_budget,
            host_budget is None or plan.host_total <= host_budget,
            disk_budget is None or plan.disk_bytes <= disk_budget,
        )

    # [Note: a frozen base on the disk]: 16-bit frozen weights of streamed blocks (not NF4 ones) may go there
    frozen_ok = disk and any(shape.frozen_of(i) for i in range(L)) and not any(shape.nf4_numels)

    def options(r: int, shell_dev: bool, level: tuple):
        if disk_placement is not None:  # re-planning: the placement stays as it is
            yield build(r, shell_dev, dict(disk_placement), level, frozen_k=disk_frozen_blocks or 0)
            return
        base = build(r, shell_dev, None, level)
        forced = disk_blocks is not None or disk_frozen_blocks is not None
        if not (disk and forced):
            yield base
        if disk and r < L and fits(base)[0]:
            # the frozen weights first (per byte of host memory they save, the same disk traffic as the moments
            # and only reads), the last blocks' first; then the trained state beside all of them
            if disk_frozen_blocks is not None:
                ks = [min(disk_frozen_blocks, L - r)] if frozen_ok or disk_frozen_blocks == 0 else []
            else:
                ks = list(range(1, L - r + 1)) if frozen_ok else []
            if disk_blocks is None:
                for k in ks:
                    yield build(r, shell_dev, None, level, frozen_k=k)
            if disk_blocks is not None or disk_frozen_blocks is None:
                for d in disk_choices(r):
                    yield build(r, shell_dev, d, level, frozen_k=max(ks, default=0))

    # immediate updates: the device also updates a share of the streamed blocks during the backward, when its
    # buffers fit in what the chosen plan leaves of the budget (never at the cost of a resident block or of a
    # floor level); one GPU, real streams (on the CPU it would only copy), unless assisted_updates says
    assist_backward = (
        not deferred_updates
        and assisted_updates is not False
        and ranks == 1
        and not device_state
        and (on_cuda or assisted_updates is True)
    )
    # (chunked loss, offloaded checkpoints[, lean[, checkpoint every k blocks]]): Plan's floor level
    levels: list[tuple] = [(False, False)]
    if floor is not None:
        levels = [tuple(floor)]
    elif on_cuda and batch is not None and checkpointing and stream_params:
        levels += (
            [(True, False), (True, True), (True, True, True)]
            if chunkable_loss
            else [(False, True), (False, True, True)]
        )
        # [Note: checkpoints every k blocks]: last, for the host memory (or device) the kept inputs take
        levels += [(chunkable_loss, True, False, k) for k in SPARSE_EVERY]
    levels = [padded_level(lv) for lv in levels]
    if sequence_tile is not None:  # the config's tile, at every level
        levels = [lv[:4] + (sequence_tile,) for lv in levels]
    elif batch is not None and checkpointing and stream_params and (floor is None or len(floor) < 5):
        # [Note: MLP over sequence tiles]: last, each level again over tiles, the largest first
        levels += [lv[:4] + (t,) for t in tiles_for(batch) for lv in levels]
    for level in levels:
        for shell_dev in shell_choices:
            for r in candidates:
                for plan in options(r, shell_dev, level):
                    fit = fits(plan)
                    if all(fit):
                        if assist_backward:  # [Note: assisted updates in the backward]: only beside the plan
                            wider = build(r, shell_dev, plan.disk_of, level, assist_now=True)
                            if wider.assisted_updates and all(fits(wider)):
                                return wider
                        return plan
                    # keep the plan that comes closest, to show in the refusal: the smallest on the device
                    if best is None or (plan.device_total, plan.host_total) < (best.device_total, best.host_total):
                        best = plan
                    # and the least host memory of a plan the device holds: what the host needs (the refusal's
                    # figure, which the host budget it suggests covers)
                    if fit[0] and (least_host is None or plan.host_total < least_host):
                        least_host = plan.host_total
    assert best is not None
    need_dev = best.device_total
    need_host = best.host_total if least_host is None else least_host
    raise PlanError(
        "no placement fits: "
        + (
            f"device needs {fmt_bytes(need_dev)} > budget {fmt_bytes(device_budget)} "
            f"({need_dev} > {device_budget} bytes); "
            if device_budget is not None and on_cuda and need_dev > device_budget
            else ""
        )
        + (
            f"host needs {fmt_bytes(need_host)} > budget {fmt_bytes(host_budget)} ({need_host} > {host_budget} bytes); "
            if host_budget is not None and need_host > host_budget
            else ""
        )
        + (
            f"disk needs {fmt_bytes(best.disk_bytes)} > {fmt_bytes(disk_budget)} free; "
            if disk_budget is not None and best.disk_bytes > disk_budget
            else ""
        )
        + "smallest plan:\n"
        + best.describe(),
        host_need=least_host,
    )
