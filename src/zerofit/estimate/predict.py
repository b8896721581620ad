"""``zerofit estimate``: the plan the engine would choose, what it needs, and how long a step takes.

Nothing of the model is allocated: it is built on the meta device (from a model directory's
``config.json`` or a named shape), split into units as the engine splits it, and planned by the engine's
own planner with the engine's own arguments (``engine.plan_args``), so the GPU, host and disk bytes are
the ones ``zerofit.initialize`` would plan, and a refusal is the same text.

The step time is predicted from this machine's measured speeds, each resource on its own:

* compute: plain PyTorch models of the same shape with n and 2n blocks (8 and 16 where the model and the GPU
  allow) are trained on the GPU (bf16, activation checkpointing, the micro-batch of the config); the
  difference is n blocks' forward + recompute + backward, the rest the shell's (embeddings, head, loss);
  times blocks and G;
* PCIe: the bytes the plan moves per step (each streamed block up twice, its gradient down once; the state
  of the blocks the device updates up and back down) over the pinned copy bandwidth ``zerofit doctor``
  measures;
* CPU optimizer: the host-updated parameters (less those the device updates) over the fused CPU AdamW speed
  ``zerofit doctor`` measures;
* disk: the tier's bytes read and written per step over the disk speeds measured under ``nvme_path``
  (DISK_TESTS tests: the median's, with the step at the fastest and the slowest shown).

The engine overlaps them within each phase of the step (the forward, the post pass, the backward, a
host-optimized shell's update: [Note: the step's phases]), so the predicted step is the sum of the phases, each
as long as its busiest resource, or the disk's time where that is longer; each resource's total is shown with
it. The host peak is the plan's host bytes plus this process's own resident memory (interpreter,
libraries, CUDA context), which a training process has as well.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

import zerofit.estimate.nodes as estimate_nodes
from zerofit.engine.model.adapter import Adapter
from zerofit.engine.plan.search import BatchShape, ModelShape, Plan, fmt_bytes, fmt_count, recomputed_blocks
from zerofit.estimate.probes import (
    ComputeProbe,  # noqa: F401 (re-exported)
    EngineProbe,  # noqa: F401 (re-exported)
    block_seconds,  # noqa: F401 (re-exported)
    compute_dtype,
    engine_block_seconds,
)
from zerofit.estimate.shapes import LORA_DEFAULTS, meta_model, with_lora  # noqa: F401 (re-exported)


@dataclass
class StepPrediction:
    """Seconds per optimizer step, per resource; ``step`` from the phases they run in, or the disk's time."""

    compute: float | None = None
    upload: float | None = None
    download: float | None = None
    cpu_optimizer: float | None = None
    disk: float | None = None
    inter_node: float | None = None  # the bytes across the nodes per step, in seconds ([Note: what crosses the nodes])
    disk_range: tuple | None = None  # (fastest, slowest) disk seconds over the DISK_TESTS tests of the disk
    step: float | None = None
    step_range: tuple | None = None  # the step at those, where the disk binds
    binds: str = ""
    phases: dict = field(default_factory=dict)  # phase -> (seconds, what binds it): [Note: the step's phases]
    speeds: dict = field(default_factory=dict)
    note: str = ""


@dataclass
class Estimate:
    plan: Plan | None
    shape: ModelShape
    batch: BatchShape
    parameters: int
    gpu_bytes: int = 0
    host_bytes: int = 0
    host_baseline_bytes: int = 0
    ranks: int = 1  # processes (one GPU each) on the host
    nnodes: int = 1  # hosts ([Note: the nodes' layout], engine/plan/engine_plan.py)
    inter_node_bytes: int = 0  # per node and step, across the nodes, in the chosen layout
    inter_node_gb_per_s: float | None = None
    layout: str = "hybrid"  # the layout the engine would run on the nodes
    layouts: dict = field(default_factory=dict)  # name -> LayoutEstimate (estimate/nodes.py), several nodes
    asked: str = "auto"  # the config's nodes_layout
    disk_bytes: int = 0
    disk_traffic: tuple = (0, 0)
    step: StepPrediction = field(default_factory=StepPrediction)
    refusal: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        if not self.step.step:
            return None
        return self.batch.tokens * self.batch.grad_accum * self.ranks * self.nnodes / self.step.step

    @property
    def inter_node_seconds(self) -> float | None:
        """The inter-node bytes' seconds at the given bandwidth, were none of it overlapped with the step."""
        if not self.inter_node_bytes or not self.inter_node_gb_per_s:
            return None
        return self.inter_node_bytes / (self.inter_node_gb_per_s * 1e9)

    def to_dict(self) -> dict:
        d = {
            "parameters": self.parameters,
            "frozen_parameters": self.shape.frozen_numel,
            "batch": asdict(self.batch),
            "refusal": self.refusal,
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "host_baseline_bytes": self.host_baseline_bytes,
            "disk_bytes": self.disk_bytes,
            "disk_traffic_bytes": list(self.disk_traffic),
            "step": asdict(self.step),
            "tokens_per_s": self.tokens_per_s,
            "ranks": self.ranks,
            "nnodes": self.nnodes,
            "inter_node_bytes": self.inter_node_bytes,
            "inter_node_seconds": self.inter_node_seconds,
            "layout": self.layout,
            "layouts": {k: v.to_dict() for k, v in self.layouts.items()},
        }
        if self.plan is not None:
            d["plan"] = self.plan.describe()
            d["device_bytes"] = dict(self.plan.device_bytes)
            d["host_plan_bytes"] = dict(self.plan.host_bytes)
            d["disk_blocks"] = [list(x) for x in self.plan.disk_blocks]
        return d

    def render(self) -> str:
        b = self.batch
        ranks = (
            f" per rank, {self.ranks} ranks (GPU bytes: each GPU's; host bytes: the host's)" if self.ranks > 1 else ""
        )
        sh = self.shape
        q = sum(sh.nf4_numels)
        held = (
            f"{fmt_count(q)} of them in NF4 ({fmt_bytes(sum(sh.nf4_bytes))}), the rest in the compute dtype"
            if q
            else "in the compute dtype"
        )
        frozen = (
            f" ({fmt_count(sh.shell_numel + sum(sh.block_numels))} trained; {fmt_count(sh.frozen_numel)} frozen:"
            f" their weights only, {held})"
            if sh.frozen_numel
            else ""
        )
        lines = [
            f"model: {fmt_count(self.parameters)} parameters{frozen}, {len(self.shape.block_numels)} blocks; "
            f"batch {b.micro_batch} x {b.seq_len} tokens, {b.grad_accum} micro-batches per step{ranks}"
        ]
        if self.refusal is not None:
            return "\n".join(lines + ["", self.refusal])
        lines += [self.plan.describe(), ""]
        if not self.plan.on_cpu:  # on the CPU there is no GPU memory to speak of: the host's line holds it all
            lines.append(
                f"GPU peak     {fmt_bytes(self.gpu_bytes)} allocated (planned against the cap with the "
                f"allocator's slack: {fmt_bytes(self.plan.device_total)})"
            )
        lines += [
            f"host peak    {fmt_bytes(self.host_bytes)} (plan {fmt_bytes(self.plan.host_total)} + this process "
            f"{fmt_bytes(self.host_baseline_bytes)})",
            f"disk         {fmt_bytes(self.disk_bytes)}"
            + (
                f", {fmt_bytes(self.disk_traffic[0])} read and {fmt_bytes(self.disk_traffic[1])} written per step"
                if self.disk_bytes
                else ""
            ),
        ]
        s = self.step
        if s.step:
            parts = [
                f"{k} {v:.2f} s"
                for k, v in (
                    ("compute", s.compute),
                    ("upload", s.upload),
                    ("download", s.download),
                    ("cpu optimizer", s.cpu_optimizer),
                    ("disk", s.disk),
                    ("inter-node", s.inter_node),
                )
                if v is not None
            ]
            lines.append(
                f"step time    {s.step:.2f} s ({self.tokens_per_s:,.0f} tokens/s), bound by {s.binds}: "
                + ", ".join(parts)
            )
            if s.disk_range is not None:
                tests = s.speeds.get("disk_tests_gb_per_s", [])
                lines.append(
                    f"disk tests   {len(tests)}: read "
                    + ", ".join(f"{r:.2f}" for r, _ in tests)
                    + " GB/s, write "
                    + ", ".join(f"{w:.2f}" for _, w in tests)
                    + " GB/s"
                    + (
                        f"; the step {s.step_range[0]:.2f}-{s.step_range[1]:.2f} s at the fastest and slowest"
                        if s.step_range
                        else ""
                    )
                )
        else:
            lines.append(f"step time    not predicted: {s.note}")
        if self.nnodes > 1:
            lines += estimate_nodes.render(
                self.nnodes, self.ranks, self.layout, self.asked, self.layouts, self.inter_node_gb_per_s
            )
        return "\n".join(lines)


def estimate(
    model,
    config=None,
    *,
    measure: bool = True,
    gpu: bool | None = None,
    lora: dict | bool | None = None,
    nnodes: int = 1,
    inter_node_gb_per_s: float | None = None,
    **overrides,
) -> Estimate:
    """Plan ``model`` (an ``nn.Module`` on the meta device, or a model directory) under ``config`` (any form
    ``zerofit.initialize`` takes, with the same keyword overrides) without allocating it.

    ``lora``: plan LoRA over a frozen base (True: LORA_DEFAULTS; a dict: :func:`with_lora`'s settings). A model
    whose parameters have ``requires_grad=False`` (a PEFT model) is planned with them frozen anyway.

    ``gpu``: plan for a GPU (True) or the CPU (False); None: the config's device (``auto``: a GPU if this
    machine has one or ``max_gpu_memory`` is set). Without a GPU here, ``max_gpu_memory`` is its size.

    ``nnodes``: hosts of the run, each with the config's ranks (its ``world_size``): the plan is each node's, in
    the layout the engine would choose ([Note: the nodes' layout], engine/plan/engine_plan.py); both layouts are planned
    beside it (``layouts``), with the bytes that cross the nodes per step ([Note: what crosses the nodes],
    estimate/nodes.py); ``inter_node_gb_per_s`` gives their time, and where the step is predicted, which layout
    is faster."""
    from zerofit.config import load_config
    from zerofit.engine.model.materialize import model_shape, param_table
    from zerofit.engine.plan.engine_plan import (
        DTYPES,
        cast_copies,
        default_host_budget,
        gpu_budget,
        needs_norm,
        nodes_plan,
        placement_kept,
        plan_batch,
        planner_inputs,
    )
    from zerofit.engine.plan.search import PlanError, make_plan

    cfg = load_config(config, **overrides).config
    source = None
    if isinstance(model, (str, Path)):  # config.json alone: a 4-bit folder's form comes from it too
        from zerofit.models import ModelDir

        source = ModelDir.open(model, config_only=True)
        model = source.build_meta()
    if lora:
        model = with_lora(model, **(LORA_DEFAULTS | (lora if isinstance(lora, dict) else {})))
    if gpu is None:
        gpu = (
            cfg.device.startswith("cuda")
            if cfg.device != "auto"
            else torch.cuda.is_available() or cfg.max_gpu_memory is not None
        )
    on_cuda = gpu
    if on_cuda and not torch.cuda.is_available() and cfg.max_gpu_memory is None:
        raise ValueError("no GPU here to read its memory from: give max_gpu_memory (--max-gpu-memory), the GPU's size")
    adapter = Adapter(model, cfg.adapter, cfg.hooked_units, cfg.hooked_share)
    from zerofit.engine.model.nf4 import BaseNF4

    # [Note: an NF4 base] (engine/model/nf4.py): quantize_base (--qlora), or a model of bitsandbytes' 4-bit layers
    nf4 = BaseNF4.prepare(model, adapter, DTYPES[cfg.precision], cfg.quantize_base == "nf4", check=False, source=source)
    table = param_table(model, adapter)
    shape = model_shape(model, adapter, table, nf4=nf4)
    batch = plan_batch(cfg, model, None)
    dtype = DTYPES[cfg.precision]
    deferred = needs_norm(cfg)
    dev_budget = gpu_budget(cfg) if on_cuda and torch.cuda.is_available() else cfg.max_gpu_memory
    host_budget = cfg.max_host_memory or default_host_budget()
    params = shape.parameters
    baseline = psutil.Process().memory_info().rss * cfg.world_size  # one process per rank
    est = Estimate(
        None,
        shape,
        batch,
        params,
        host_baseline_bytes=baseline,
        ranks=cfg.world_size,
        nnodes=nnodes,
        inter_node_gb_per_s=inter_node_gb_per_s,
        asked=cfg.nodes_layout,
    )
    args = planner_inputs(cfg, adapter, on_cuda=on_cuda, device_budget=dev_budget, host_budget=host_budget)

    def plan_for(share: float) -> Plan:
        return make_plan(shape, batch, **(args | dict(host_share=share)))

    try:
        est.layout, plan = nodes_plan(cfg, nnodes, plan_for)  # [Note: the nodes' layout]
    except PlanError as e:
        est.refusal = str(e)
        return est
    streamed = range(plan.resident_blocks, len(shape.block_numels))
    if cast_copies(cfg, dtype, on_cuda, deferred) and any(plan.disk_of.get(i) is None for i in streamed):
        # [Note: the master behind its cast]: the engine adds 16-bit host copies at its first update, where
        # they fit beside its plan (Copies16.enable, copies16.py)
        try:
            plan = make_plan(shape, batch, **(args | placement_kept(plan) | dict(host16=True)))
        except PlanError:
            pass
    est.plan = plan
    est.gpu_bytes = plan.device_peak if on_cuda else 0
    est.host_bytes = plan.host_total + baseline
    est.disk_bytes = plan.disk_bytes
    est.disk_traffic = plan.disk_traffic(shape)
    cache: dict = {}  # the measured speeds, shared by the layouts' predictions
    if nnodes > 1:
        again = recomputed_blocks(len(shape.block_numels), plan.checkpoint_every)
        cb = torch.empty((), dtype=dtype).element_size()
        for name, share in (("hybrid", 1.0), ("full", 1.0 / nnodes)):
            try:
                p = plan if name == est.layout else plan_for(share)
            except PlanError as e:
                est.layouts[name] = estimate_nodes.LayoutEstimate(
                    name, None, 0, estimate_nodes.NodeTraffic(), refusal=str(e)
                )
                continue
            est.layouts[name] = estimate_nodes.LayoutEstimate(
                name, p, p.host_total + baseline, estimate_nodes.traffic(name, shape, p, nnodes, cb, again)
            )
        est.inter_node_bytes = est.layouts[est.layout].traffic.total
    if measure:
        est.step = predict_step(
            model,
            cfg,
            plan,
            shape,
            batch,
            on_cuda,
            nodes=nnodes,
            layout=est.layout,
            gb_per_s=inter_node_gb_per_s,
            cache=cache,
            hooked=adapter.hooked,
        )
        for name, le in est.layouts.items():
            if le.plan is None:
                continue
            le.step = (
                est.step
                if name == est.layout
                else predict_step(
                    model,
                    cfg,
                    le.plan,
                    shape,
                    batch,
                    on_cuda,
                    nodes=nnodes,
                    layout=name,
                    gb_per_s=inter_node_gb_per_s,
                    cache=cache,
                )
            ).step
    else:
        est.step.note = "not measured (measure=False)"
    return est


# [Note: when the disk works]
# With immediate updates the disk tier reads a block's state when the backward hands over its gradient, and
# writes it back after its update: its traffic starts with the backward. Where the backward's last host update
# (its lowest streamed, host-updated block) is in host memory, the step's disk work ends within the step and
# the disk idles through the next forward and post pass: the step is those phases plus the disk's time. Where
# that block is on the disk, the updates still pending when the backward ends (as many as the gradient staging
# buffers hold) run on into the next forward, which waits for them block by block: the disk works through the
# whole step. With deferred updates (clipping, fp16) the gradients go to the disk in the backward and the
# updates run in the next forward: the disk works through the whole step as well. A 3B model with 32 micro-batches
# per step on the disk tier showed both (docs/benchmarks.md, the 3B model on the NVMe tier): with the moments of its
# upper blocks on the disk, the forward and post pass, then a backward paced by the disk, as predicted; with every
# streamed block on the disk, the next forward waited on the lowest one's update.

# [Note: the disk's speed moves]
# The benchmark machine's disk moved up to a third less from one 1 GiB test (written, then read) to the next within
# a minute, and its runs' steps moved bytes at speeds as spread (bench/probes/disk_probe.py; docs/benchmarks.md, the
# disk's speed): one test predicted disk-bound steps up to a fifth short or long. So the disk is tested DISK_TESTS
# times: the prediction takes the median test, and the estimate shows the step at the fastest and the slowest.
DISK_TESTS = 3

# [Note: the step's phases]
# The engine overlaps its resources within a phase of the step, not across all of it (engine.trace(),
# bench/trace.py): the forward (a quarter of the blocks' compute: forward, recompute and backward run about
# 1:1:2) against the streamed blocks' uploads and, with deferred updates, the CPU's updates and the assisted
# blocks' state; the post pass (the shell's compute: embeddings, head, loss); the backward (the other three
# quarters) against the uploads, the gradients and the assisted blocks' state going down, and, with immediate
# updates, the CPU's AdamW as the gradients come; then a host-optimized shell's update, which needs the whole
# gradient and which the next forward waits for. The step is their sum, or the disk tier's time when that is
# longer (its reads and writes span the whole step). The phases measured on 3B and 7B models put the forward at just
# under a quarter of the blocks' compute (docs/benchmarks.md, the DeepSpeed-shaped loop's phases).
FORWARD_SHARE = 0.25


def copy_seconds(up: float, down: float, h2d: float, d2h: float, both: float) -> tuple[float, float]:
    """Seconds of ``up`` and ``down`` bytes in one phase: while both ways carry bytes each goes at ``both``
    (doctor's rate each way with the other busy), the rest at its own one-way rate (bytes per second)."""
    together = min(up, down)
    return together / both + (up - together) / h2d, together / both + (down - together) / d2h


def phase_seconds(
    *,
    blocks: float,
    post: float,
    up_fwd: float,
    up_bwd: float,
    down_fwd: float,
    down_bwd: float,
    cpu_fwd: float,
    cpu_bwd: float,
    tail: float,
    pre: float = 0.0,
    forward_share: float = FORWARD_SHARE,
    again: float = 0.0,
    device_updates: float = 0.0,
    assisted: float = 0.0,
    assisted_in_forward: bool = False,
    net=None,
) -> dict[str, tuple[float, str]]:
    """Each phase's seconds and what binds it ([Note: the step's phases]); ``blocks`` is the blocks' compute,
    ``pre`` the shell's before the first block (embeddings), ``post`` the engine's post pass, ``again`` the
    backward's forwards for recomputed inputs ([Note: checkpoints every k blocks], engine/step/schedule.py),
    ``device_updates`` the device's AdamW of the resident blocks and the shell after the backward, ``assisted`` the
    assisted blocks' beside the backward's compute (the forward's if ``assisted_in_forward``: deferred updates)."""

    def phase(**parts):
        k = max(parts, key=lambda n: parts[n])
        return parts[k], k.replace("_", " ")

    fwd_assist, bwd_assist = (assisted, 0.0) if assisted_in_forward else (0.0, assisted)
    net_fwd, net_bwd, net_grads = (net.gather_fwd, net.gather_bwd, net.grads) if net is not None else (0.0, 0.0, 0.0)
    # [Note: what crosses the nodes] (estimate/nodes.py): the weight gathers after the uploads on their stream, the
    # gradients' reductions on the compute stream
    bwd_compute = "compute_and_inter_node" if net_grads else "compute"
    phases = {
        "forward": phase(
            compute=blocks * forward_share + pre + fwd_assist,
            upload=up_fwd + net_fwd,
            download=down_fwd,
            cpu_optimizer=cpu_fwd,
        ),
        "post": (post, "compute"),
        "backward": phase(
            **{bwd_compute: blocks * (1 - forward_share) + again + bwd_assist + net_grads},
            upload=up_bwd + net_bwd,
            download=down_bwd,
            cpu_optimizer=cpu_bwd,
        ),
    }
    if device_updates:
        phases["device updates"] = (device_updates, "compute")
    phases["shell update"] = (tail, "the shell's update")
    return phases


def hooked_transfers(G: int, up_fwd: int, up_bwd: int, down_bwd: int) -> tuple[int, int, int]:
    """[Note: the hooked mode's transfers]
    A chain of blocks runs each block over every micro-batch of the step at once: its weights cross once in the
    forward and once in the backward, its gradient once. The hooked mode runs the model's own forward one micro-batch
    at a time ([Note: a unit's call as an autograd function], engine/step/hooked.py): each streamed unit's weights
    cross in every micro-batch's forward and again in its backward, and its gradient goes down after every
    micro-batch's backward (the host sums them), so each of those is G times a chain's: (up in the forwards, up in
    the backwards, down in the backwards)."""
    return G * up_fwd, G * up_bwd, G * down_bwd


def predict_step(
    model,
    cfg,
    plan: Plan,
    shape: ModelShape,
    batch: BatchShape,
    on_cuda: bool,
    *,
    nodes: int = 1,
    layout: str = "hybrid",
    gb_per_s: float | None = None,
    cache: dict | None = None,
    hooked: bool = False,
) -> StepPrediction:
    """Each resource's seconds per step from this machine's measured speeds, and the step from the phases they
    run in ([Note: the step's phases]; see also the module docstring). ``nodes`` and ``layout``: one node's step
    of a run on several ([Note: what crosses the nodes], estimate/nodes.py), the bytes across them at
    ``gb_per_s``. ``cache``: the measured speeds, kept for the next call (the other layout's)."""
    cache = {} if cache is None else cache

    def once(key, fn):
        if key not in cache:
            cache[key] = fn()
        return cache[key]

    from zerofit.cli import doctor
    from zerofit.engine.plan.engine_plan import cast_copies, split_updates

    pred = StepPrediction()
    if not on_cuda or not torch.cuda.is_available():
        pred.note = "no CUDA GPU here to measure the compute on; run it on the training machine"
        return pred
    L, G = len(shape.block_numels), batch.grad_accum
    chunks = plan.loss_chunks if plan.loss_chunks > 1 and Adapter(model).chunkable_loss else 1
    probe = once(
        ("block", plan.sequence_tile), lambda: block_seconds(model, batch, cfg, chunks, tile=plan.sequence_tile)
    )
    # [Note: a block over sequence tiles]: the probe's blocks over the plan's tiles, their recompute in its time
    engine_probe = once(
        ("engine", plan.sequence_tile, chunks),
        lambda: engine_block_seconds(
            model, batch, cfg, nf4=any(shape.nf4_numels), tile=plan.sequence_tile, chunks=chunks
        ),
    )
    if engine_probe is not None:  # the engine's own block compute and pre pass
        probe = dataclasses.replace(
            probe,
            per_block=engine_probe.per_block,
            forward_share=engine_probe.forward_share,
            pre=engine_probe.pre,
            source="the engine on a 2-block model",
        )
    per_block, shell = probe.per_block, probe.shell
    update = engine_probe.update if engine_probe is not None else 0.0  # device AdamW, seconds per parameter
    # [Note: checkpoints every k blocks] (engine/step/schedule.py): the backward runs these blocks' forward again, their
    # weights uploaded once more
    again = recomputed_blocks(L, plan.checkpoint_every)
    regen = len(again) * per_block * probe.forward_share
    pred.compute = G * (probe.pre + probe.post + L * per_block + regen)
    copies = once(
        "copies", lambda: {(c.direction, c.host_memory): c.gb_per_s for c in doctor.copy_bandwidth(256 << 20, 3)}
    )
    h2d, d2h = copies[("host->gpu", "pinned")], copies[("gpu->host", "pinned")]
    both = copies.get(("both", "pinned"), min(h2d, d2h))
    # the CPU's AdamW runs while the copies do, sharing the host's memory bandwidth with them
    opt = once("adamw", lambda: doctor.optimizer_speed(64 << 20, 5.0, while_copying=True))
    rate = opt.params_per_s
    cb = torch.empty((), dtype=compute_dtype(cfg)).element_size()
    n = shape.block_numels
    disk_of = plan.disk_of
    streamed = range(plan.resident_blocks, L)
    # assisted updates (engine/update/assisted.py): the device updates these blocks, their state up and back down;
    # deferred, with the host gradient going up too; in the backward, from the gradient where it is (not sent down)
    assisted = set(plan.assisted_blocks) if plan.assisted_updates else set()
    a = sum(n[i] for i in assisted)

    def up_bytes(i: int) -> int:
        """Block i's weights going up: fp32, or its 16-bit host copy where master and moments are on the disk; its
        frozen weights as they are stored, in the compute dtype ([Note: frozen parameters], engine/memory/store.py)."""
        return n[i] * (cb if disk_of.get(i) == "all" else 4) + shape.frozen_host_bytes(cb, [i + 1])

    weights = sum(up_bytes(i) for i in streamed)  # one pass over the blocks
    host_params = sum(n[i] for i in streamed) - a
    if plan.deferred_updates:  # the updates wait for the norm and run during the next forward
        # in two passes, the forward waits for the first pass only ([Note: moments after the forward]); with
        # 16-bit host copies it writes the cast alone, and every upload after it reads the copy ([Note: the
        # master behind its cast])
        cast = plan.host_bytes.get("host16_copies", 0) > 0 and cast_copies(cfg, compute_dtype(cfg), on_cuda, True)
        fwd_rate = (
            once(("pass", cast), lambda: doctor.master_pass_speed(cast=compute_dtype(cfg) if cast else None))
            if split_updates(cfg, on_cuda, True)
            else rate
        )
        w16 = sum(n[i] * cb + shape.frozen_host_bytes(cb, [i + 1]) for i in streamed)
        up_fwd = (w16 - a * cb + a * 16) if cast else weights + a * 12
        down_fwd = a * (12 + cb) if cast else a * 12
        cpu_fwd = host_params / fwd_rate
        pred.speeds["cpu_forward_params_per_s"] = fwd_rate
        up_bwd, down_bwd, cpu_bwd = (w16 if cast else weights), sum(n[i] for i in streamed) * 4, 0.0
    else:
        up_fwd, down_fwd, cpu_fwd = weights, 0, 0.0
        up_bwd, down_bwd, cpu_bwd = weights + a * 12, (host_params * 4) + a * 12, host_params / rate
    up_bwd += sum(up_bytes(i) for i in again if i >= plan.resident_blocks)
    if hooked:  # [Note: the hooked mode's transfers]
        up_fwd, up_bwd, down_bwd = hooked_transfers(G, up_fwd, up_bwd, down_bwd)
    s = shape.shell_numel
    shell_bytes = (0, 0)
    if plan.assisted_shell:  # updated on the device: its state up and back down
        shell_bytes = (s * 12, s * 12)
    elif not plan.shell_optimizer_on_device:  # its gradient down, the CPU's update, its master up
        shell_bytes = (s * 4, s * 4)
        host_params += s
    # several ranks: each uploads and downloads its shard over its own link (the GPUs exchange the rest); each
    # CPU worker updates its shard with its share of the cores, against one host memory: as one rank's time. The
    # full layout on several nodes: the shards are the world's, each node's CPU updates 1/n of the host state
    full = layout == "full" and nodes > 1
    r = cfg.world_size * (nodes if full else 1)
    share = 1.0 / nodes if full else 1.0
    cpu_fwd, cpu_bwd = cpu_fwd * share, cpu_bwd * share
    rates = (h2d * r * 1e9, d2h * r * 1e9, both * r * 1e9)
    t_up_fwd, t_down_fwd = copy_seconds(up_fwd, down_fwd, *rates)
    t_up_bwd, t_down_bwd = copy_seconds(up_bwd, down_bwd, *rates)
    if plan.assisted_shell:  # both ways at once, in chunks
        tail = max(copy_seconds(*shell_bytes, h2d * 1e9, d2h * 1e9, both * 1e9))
    elif not plan.shell_optimizer_on_device:  # one after the other
        tail = s * 4 / d2h / 1e9 + s / rate + s * 4 / h2d / 1e9
    else:
        tail = 0.0
    tail *= share
    net = estimate_nodes.traffic(layout, shape, plan, nodes, cb, again).seconds(gb_per_s) if nodes > 1 else None
    pred.inter_node = net.total if net is not None else None
    # the device's own updates (Step.finish, engine/step/optimizer_step.py): the resident blocks' and the shell's
    # after the backward; the assisted blocks' beside the backward's compute, or the next forward's with deferred
    # updates; each rank its shard of them
    dev_params = (
        sum(n[: plan.resident_blocks]) + (s if plan.shell_optimizer_on_device or plan.assisted_shell else 0)
    ) / r
    dev_update, assist_update = dev_params * update, a * update / r
    pred.compute += dev_update + assist_update
    pred.upload = t_up_fwd + t_up_bwd + shell_bytes[0] / rates[0]
    pred.download = t_down_fwd + t_down_bwd + shell_bytes[1] / rates[1]
    pred.cpu_optimizer = host_params / rate * share
    pred.phases = phase_seconds(
        blocks=G * L * per_block,
        pre=G * probe.pre,
        post=G * probe.post,
        again=G * regen,
        forward_share=probe.forward_share,
        up_fwd=t_up_fwd,
        up_bwd=t_up_bwd,
        down_fwd=t_down_fwd,
        down_bwd=t_down_bwd,
        cpu_fwd=cpu_fwd,
        cpu_bwd=cpu_bwd,
        tail=tail,
        device_updates=dev_update,
        assisted=assist_update,
        assisted_in_forward=plan.deferred_updates,
        net=net,
    )
    pred.speeds |= {
        "h2d_gb_per_s": h2d,
        "d2h_gb_per_s": d2h,
        "both_ways_gb_per_s_each": both,
        "cpu_adamw_params_per_s": rate,
        "block_seconds": per_block,
        "shell_seconds": shell,
        "pre_seconds": probe.pre,
        "post_seconds": probe.post,
        "loss_chunks": chunks,
        "forward_share": probe.forward_share,
        "block_seconds_from": probe.source,
        "device_adamw_seconds_per_param": update,
    }
    if plan.disk_blocks:  # the tier's own I/O path: direct, parallel requests of its block size
        from zerofit.engine.disk.tier import measure_folder

        off = cfg.offload
        read, written = plan.disk_traffic(shape)
        tests = []  # [Note: the disk's speed moves]
        for _ in range(DISK_TESTS):
            wr, rd = measure_folder(
                off.nvme_path, 1 << 30, threads=off.nvme_queue_depth, block_bytes=off.nvme_block_size
            )
            tests.append((read / (rd * 1e9) + written / (wr * 1e9), rd, wr))
        tests.sort()
        pred.disk, rd, wr = tests[len(tests) // 2]
        pred.disk_range = (tests[0][0], tests[-1][0])
        pred.speeds |= {
            "disk_read_gb_per_s": rd,
            "disk_write_gb_per_s": wr,
            "disk_tests_gb_per_s": [(r, w) for _, r, w in tests],
        }
    phased = sum(t for t, _ in pred.phases.values())
    # [Note: when the disk works]
    disk_step = None
    if pred.disk is not None:
        host_updated = [i for i in streamed if i not in assisted]
        spills = bool(host_updated) and disk_of.get(min(host_updated)) is not None
        idle = 0.0 if plan.deferred_updates or spills else pred.phases["forward"][0] + pred.phases["post"][0]
        disk_step = pred.disk + idle
    if disk_step is not None and disk_step > phased:
        pred.step, pred.binds = disk_step, "disk"
        pred.step_range = tuple(max(phased, t + idle) for t in pred.disk_range)
    else:
        pred.step = phased
        pred.binds = (
            "its phases in turn ("
            + ", ".join(f"{k} {t:.2f} s: {why}" for k, (t, why) in pred.phases.items() if t > 0)
            + ")"
        )
    return pred
