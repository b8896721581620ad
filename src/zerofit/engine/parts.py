"""The parts the engine builds over its units (``build_parts``): the same code at initialize and for the fallback."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from zerofit.engine.distributed.sharding import Sharding
from zerofit.engine.memory.activations import Activations
from zerofit.engine.memory.copies16 import Copies16
from zerofit.engine.memory.grads import Grads
from zerofit.engine.memory.store import Home
from zerofit.engine.memory.streamer import Streamer
from zerofit.engine.model import tiling
from zerofit.engine.model.kernels import Kernels
from zerofit.engine.model.materialize import build_units, release_originals
from zerofit.engine.model.startup import Startup
from zerofit.engine.step.compute import Compute
from zerofit.engine.step.optimizer_step import Step
from zerofit.engine.step.schedule import Schedule
from zerofit.engine.step.step_end import StepEnd
from zerofit.engine.step.window import Window
from zerofit.engine.update.assisted import DeviceUpdates
from zerofit.engine.update.host import HostUpdates

if TYPE_CHECKING:
    from zerofit.engine.engine import Engine


def build_parts(engine: Engine, carry: Window | None) -> None:
    """Materialize the units (materialize.py) where the plan puts them, then the parts built over them: the
    same code at initialize and for the generic fallback ([Note: generic fallback], recovery.py). ``carry``:
    the window the new one takes over (the fallback's), None at initialize."""
    plan, cfg, dev, ranks = engine.plan, engine.config, engine.dev, engine.ranks
    pinned = dev.is_cuda and cfg.offload.pin_memory
    engine.sharding = Sharding(dev, ranks, engine.dtype, cfg.sharding)
    # [Note: start-up progress] (startup.py): the parameters materialized, the seconds of each phase
    engine.startup = Startup(sum(p.numel() for p in engine._table.canonical.values()))
    engine.units, arenas = build_units(
        engine._model,
        engine.adapter,
        engine._table,
        plan,
        dev.device,
        engine.dtype,
        pinned,
        source=engine._source,
        group_of=engine._group_of,
        tier=engine.tier,
        ranks=ranks,
        on_device_unit=engine.sharding.share_device_unit if ranks.many else None,
        frozen=engine.frozen,
        nf4=engine.nf4,
        startup=engine.startup,
    )
    engine._source = None  # the files are read: keep only their folder (source_dir)
    engine._table = release_originals(engine._model, engine._table)  # the user's tensors are copied: let go
    engine._arenas.extend(arenas)
    if ranks.full and pinned:  # [Note: nodes hold a slice of the state]: the node's slices only
        engine._arenas.append(engine.sharding.slices)
        engine.sharding.slices.pin(engine.units)
    engine.shell, engine.blocks = engine.units[0], engine.units[1:]  # each unit's shard [lo, hi): build_units
    if ranks.many:
        engine.sharding.share_units(engine.units)
    streamed = [u for u in engine.blocks if u.home is Home.STREAMED]
    engine.grads = Grads(
        dev,
        ranks,
        engine.worker,
        engine.clock,
        plan,
        engine.units,
        deferred=engine.deferred,
        pinned=pinned,
        speculating=engine.speculator.can or engine.speculator.known,
        arenas=engine._arenas,
    )
    engine.copies16 = Copies16(
        cfg, engine.dtype, dev, ranks, engine.planning, engine.blocks, engine._arenas, engine.deferred
    )
    engine.device_updates = DeviceUpdates(
        dev,
        engine.lifecycle,
        engine.planning,
        engine.grads,
        engine.copies16,
        deferred=engine.deferred,
        dtype=engine.dtype,
        streamed=bool(streamed),
        cap=max((ranks.padded(u.numel) for u in streamed), default=0),
        pinned=pinned,
        worker=engine.worker,
        clock=engine.clock,
        arenas=engine._arenas,
    )
    engine.host_updates = HostUpdates(
        engine.worker,
        engine.grads,
        engine.tier,
        engine.clock,
        deferred=engine.deferred,
        split=engine._split,
        rest_threads=cfg.offload.rest_pass_threads,
    )
    engine.streamer = Streamer(
        dev,
        ranks,
        engine.planning,
        engine.units,
        dtype=engine.dtype,
        host_updates=engine.host_updates,
        device_updates=engine.device_updates,
        copies16=engine.copies16,
        sharding=engine.sharding,
        keep_blocks=cfg.offload.window_keep_blocks,
    )
    engine.activations = Activations(dev, len(engine.blocks), cfg.gradient_accumulation_steps, pinned, engine._arenas)
    # [Note: fast kernels] (model/kernels.py): the compiled blocks and the fused loss, or the model's own code
    engine.kernels = Kernels(
        engine._model, engine.adapter, cfg.kernels, dev.is_cuda, tiling.tile_of(weakref.ref(engine))
    )
    engine.compute = Compute(engine._model, engine.adapter, dev, engine.shell, engine.kernels)
    engine.stepper = Step(
        config=cfg,
        dev=dev,
        ranks=ranks,
        lifecycle=engine.lifecycle,
        worker=engine.worker,
        tier=engine.tier,
        units=engine.units,
        grads=engine.grads,
        sharding=engine.sharding,
        host_updates=engine.host_updates,
        device_updates=engine.device_updates,
        copies16=engine.copies16,
        speculator=engine.speculator,
        hypers=engine.hypers,
        scaler=engine.scaler,
        deferred=engine.deferred,
        cast_first=engine._cast_first,
    )
    engine.schedule = Schedule(
        config=cfg,
        dev=dev,
        adapter=engine.adapter,
        units=engine.units,
        compute=engine.compute,
        streamer=engine.streamer,
        activations=engine.activations,
        grads=engine.grads,
        step=engine.stepper,
        host_updates=engine.host_updates,
        lifecycle=engine.lifecycle,
    )
    engine.window = Window(
        config=cfg,
        dev=dev,
        ranks=ranks,
        adapter=engine.adapter,
        model=engine._model,
        planning=engine.planning,
        schedule=engine.schedule,
        streamer=engine.streamer,
        grads=engine.grads,
        copies16=engine.copies16,
        device_updates=engine.device_updates,
        compute=engine.compute,
        speculator=engine.speculator,
        clock=engine.clock,
        lifecycle=engine.lifecycle,
        batch_spec=engine.batch_spec,
        carry=carry,
    )
    engine.step_end = StepEnd(engine.stepper, engine.window, engine.end_step)  # [Note: one end of a step]
    engine.clock.note_host()
