"""The parts the engine builds over its units (:func:`build_parts`): the same code at initialize and for the fallback.

[Note: the parts as a value]
``build_parts`` reads what it needs from :class:`PartsInputs` (the engine's settings and the parts that outlive a
rebuild: the worker, the clock, the lifecycle, the planning...) and returns the new parts as one :class:`Parts`;
the engine alone assigns them (``Engine._build_parts``), at initialize and again for the generic fallback
([Note: generic fallback], recovery.py). No part is built by reaching into the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerofit.engine.distributed.sharding import Sharding
from zerofit.engine.memory.activations import Activations
from zerofit.engine.memory.copies16 import Copies16
from zerofit.engine.memory.grads import Grads
from zerofit.engine.memory.store import Home, Unit
from zerofit.engine.memory.streamer import Streamer
from zerofit.engine.model.attention import Attention
from zerofit.engine.model.kernels import Kernels
from zerofit.engine.model.materialize import ParamTable, build_units, release_originals
from zerofit.engine.model.startup import Startup
from zerofit.engine.step.compute import Compute
from zerofit.engine.step.hooked import Hooked
from zerofit.engine.step.optimizer_step import Step
from zerofit.engine.step.schedule import Schedule
from zerofit.engine.step.step_end import StepEnd
from zerofit.engine.step.window import Window
from zerofit.engine.update.assisted import DeviceUpdates
from zerofit.engine.update.host import HostUpdates

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.engine.device import Device
    from zerofit.engine.disk.tier import DiskTier
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.lifecycle import Lifecycle
    from zerofit.engine.model.adapter import Adapter
    from zerofit.engine.plan.engine_plan import Planning
    from zerofit.engine.step.batch import BatchSpec
    from zerofit.engine.step.hypers import Hypers
    from zerofit.engine.step.timeline import Timeline
    from zerofit.engine.update.speculation import Speculator
    from zerofit.engine.update.worker import HostWorker


@dataclass(frozen=True)
class PartsInputs:
    """What the parts are built from ([Note: the parts as a value])."""

    config: ZerofitConfig
    dev: Device
    ranks: Ranks
    dtype: torch.dtype  # the compute dtype
    model: nn.Module
    adapter: Adapter
    table: ParamTable
    source: Any  # a WeightSource whose files hold a meta model's weights, or None
    group_of: dict[str, int]
    frozen: frozenset
    nf4: Any  # BaseNF4
    tier: DiskTier | None
    planning: Planning
    lifecycle: Lifecycle
    worker: HostWorker
    clock: Timeline
    speculator: Speculator
    hypers: Hypers
    scaler: Any
    batch_spec: BatchSpec
    deferred: bool
    split: bool
    cast_first: bool
    arenas: list  # the engine's arenas, released at close: the parts add theirs
    tile_of: Callable[[], int | None]  # the plan's sequence tile ([Note: MLP over sequence tiles])
    end_step: Callable[[bool, float | None], None]  # the engine's end of a step ([Note: one end of a step])
    carry: Window | None  # the window the new one takes over (the fallback's), None at initialize


@dataclass
class Parts:
    """The units and the parts over them ([Note: the parts as a value])."""

    startup: Startup
    sharding: Sharding
    units: list[Unit]  # the shell first, then the blocks in execution order
    table: ParamTable  # the parameter table without the user's original tensors (release_originals)
    grads: Grads
    copies16: Copies16
    device_updates: DeviceUpdates
    host_updates: HostUpdates
    streamer: Streamer
    activations: Activations
    kernels: Kernels
    compute: Compute
    stepper: Step
    schedule: Schedule
    window: Window
    step_end: StepEnd


def build_parts(i: PartsInputs) -> Parts:
    """Materialize the units (materialize.py) where the plan puts them, then the parts built over them: the
    same code at initialize and for the generic fallback ([Note: generic fallback], recovery.py)."""
    plan, cfg, dev, ranks = i.planning.plan, i.config, i.dev, i.ranks
    pinned = dev.is_cuda and cfg.offload.pin_memory
    sharding = Sharding(dev, ranks, i.dtype, cfg.sharding)
    # [Note: start-up progress] (startup.py): the parameters materialized, the seconds of each phase
    startup = Startup(sum(p.numel() for p in i.table.canonical.values()))
    units, arenas = build_units(
        i.model,
        i.adapter,
        i.table,
        plan,
        dev.device,
        i.dtype,
        pinned,
        source=i.source,
        group_of=i.group_of,
        tier=i.tier,
        ranks=ranks,
        on_device_unit=sharding.share_device_unit if ranks.many else None,
        frozen=i.frozen,
        nf4=i.nf4,
        startup=startup,
    )
    table = release_originals(i.model, i.table)  # the user's tensors are copied: let go
    i.arenas.extend(arenas)
    if ranks.full and pinned:  # [Note: nodes hold a slice of the state]: the node's slices only
        i.arenas.append(sharding.slices)
        sharding.slices.pin(units)
    shell, blocks = units[0], units[1:]  # each unit's shard [lo, hi): build_units
    if ranks.many:
        sharding.share_units(units)
    streamed = [u for u in blocks if u.home is Home.STREAMED]
    grads = Grads(
        dev,
        ranks,
        i.worker,
        i.clock,
        plan,
        units,
        deferred=i.deferred,
        pinned=pinned,
        speculating=i.speculator.can or i.speculator.known,
        arenas=i.arenas,
    )
    copies16 = Copies16(cfg, i.dtype, dev, ranks, i.planning, blocks, i.arenas, i.deferred)
    device_updates = DeviceUpdates(
        dev,
        i.lifecycle,
        i.planning,
        grads,
        copies16,
        deferred=i.deferred,
        dtype=i.dtype,
        streamed=bool(streamed),
        cap=max((ranks.padded(u.numel) for u in streamed), default=0),
        pinned=pinned,
        worker=i.worker,
        clock=i.clock,
        arenas=i.arenas,
    )
    host_updates = HostUpdates(
        i.worker,
        grads,
        i.tier,
        i.clock,
        deferred=i.deferred,
        split=i.split,
        rest_threads=cfg.offload.rest_pass_threads,
    )
    streamer = Streamer(
        dev,
        ranks,
        i.planning,
        units,
        dtype=i.dtype,
        host_updates=host_updates,
        device_updates=device_updates,
        copies16=copies16,
        sharding=sharding,
        keep_blocks=cfg.offload.window_keep_blocks,
    )
    activations = Activations(dev, len(blocks), cfg.gradient_accumulation_steps, pinned, i.arenas)
    # [Note: fast kernels] (model/kernels.py): the compiled blocks and the fused loss, or the model's own code
    kernels = Kernels(i.model, i.adapter, cfg.kernels, dev.is_cuda, i.tile_of)
    # [Note: attention's backend] (model/attention.py): SDPA's kernel first around each block's call
    attention = Attention(i.model, cfg.attention_backend, dev.device)
    compute = Compute(i.model, i.adapter, dev, shell, kernels, attention)
    stepper = Step(
        config=cfg,
        dev=dev,
        ranks=ranks,
        lifecycle=i.lifecycle,
        worker=i.worker,
        tier=i.tier,
        units=units,
        grads=grads,
        sharding=sharding,
        host_updates=host_updates,
        device_updates=device_updates,
        copies16=copies16,
        streamer=streamer,
        speculator=i.speculator,
        hypers=i.hypers,
        scaler=i.scaler,
        deferred=i.deferred,
        cast_first=i.cast_first,
    )
    # [Note: the hooked mode] (model/hooked.py): the units streamed by their modules' calls
    hooked = (
        Hooked(blocks, list(i.adapter.blocks), compute=compute, streamer=streamer, grads=grads, stepper=stepper)
        if i.adapter.hooked
        else None
    )
    # [Note: generation over the engine's weights] (step/hooked.py): a chain's blocks streamed by their calls
    generation = (
        None
        if i.adapter.hooked
        else Hooked(
            blocks,
            list(i.adapter.blocks),
            compute=compute,
            streamer=streamer,
            grads=grads,
            stepper=stepper,
            cyclic=True,
        )
    )
    schedule = Schedule(
        config=cfg,
        dev=dev,
        adapter=i.adapter,
        units=units,
        compute=compute,
        streamer=streamer,
        activations=activations,
        grads=grads,
        step=stepper,
        host_updates=host_updates,
        lifecycle=i.lifecycle,
        hooked=hooked,
        generation=generation,
    )
    window = Window(
        config=cfg,
        dev=dev,
        ranks=ranks,
        adapter=i.adapter,
        model=i.model,
        planning=i.planning,
        schedule=schedule,
        streamer=streamer,
        grads=grads,
        copies16=copies16,
        device_updates=device_updates,
        compute=compute,
        speculator=i.speculator,
        clock=i.clock,
        lifecycle=i.lifecycle,
        batch_spec=i.batch_spec,
        carry=i.carry,
    )
    step_end = StepEnd(stepper, window, i.end_step)  # [Note: one end of a step]
    i.clock.note_host()
    return Parts(
        startup=startup,
        sharding=sharding,
        units=units,
        table=table,
        grads=grads,
        copies16=copies16,
        device_updates=device_updates,
        host_updates=host_updates,
        streamer=streamer,
        activations=activations,
        kernels=kernels,
        compute=compute,
        stepper=stepper,
        schedule=schedule,
        window=window,
        step_end=step_end,
    )


def end_step_of(engine_ref):
    """``Engine.end_step`` through a weak reference: the parts hold no reference to the engine, so an engine no one
    holds is freed at once (its worker thread with it), not at the next garbage collection."""

    def end_step(applied: bool, norm: float | None) -> None:
        engine = engine_ref()
        assert engine is not None  # a part of a live engine ends its steps
        engine.end_step(applied, norm)

    return end_step
