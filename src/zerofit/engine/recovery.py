"""The generic fallback, and the weights a closing engine takes off the disk tier (functions, no state).

[Note: generic fallback]
Whether a model chains its blocks output-to-input shows only when its forward runs (the pre and post
passes check it, see [Note: sequential blocks]), and a probe at initialize would need an input the engine
cannot make up. So with adapter="auto" the first forward decides: if it raises NonSequentialModel
(before anything of its step was applied), the step's transient state is dropped (each part's reset()), the
units and the parts over them are rebuilt as one generic unit (the whole model) from the module's current
weights by the same code that built them (``Engine._build_parts``), with the optimizer state they hold (a
checkpoint loaded into a fresh engine: moments by name, the common step count), the RNG state the aborted
forward consumed is restored, and the same call runs again, with a logged notice. What outlives the rebuild:
the parts not built over the units (lifecycle, clock, step count and settings, speculation record) and the
window's override and counters. Memory: the old host weights and moments live until the new unit has copied
them. Where the device cannot hold the model as one unit, the rebuild is in the hooked mode instead ([Note: the hooked
mode], model/hooked.py), its updates deferred. adapter="blocks" refuses instead; adapter="generic" skips it.
"""

from __future__ import annotations

import logging

import torch

from zerofit.engine.model.adapter import Adapter, NonSequentialModel
from zerofit.engine.model.materialize import model_shape, param_table, rebind_params
from zerofit.engine.plan.engine_plan import Planning
from zerofit.engine.plan.search import PlanError

log = logging.getLogger("zerofit")


def run_with_fallback(run, possible: bool, dev, discard, become_generic):
    """``run()``, and once more on the generic path if it finds the model not block-sequential (``possible``:
    adapter="auto", streaming, no window open): ``discard()`` drops the step, ``become_generic(err)`` rebuilds."""
    if not possible:
        return run()
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev.device) if dev.is_cuda else None)
    try:
        return run()
    except NonSequentialModel as err:
        discard()
        become_generic(err)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], dev.device)
        return run()


def _planned(model, adapter: Adapter, *, config, dev, ranks, frozen, nf4=None):
    """``adapter``'s parameter table, shape and planning; PlanError where its plan does not fit."""
    table = param_table(model, adapter)
    shape = model_shape(model, adapter, table, frozen, nf4)
    planning = Planning(
        config, adapter, shape, on_cuda=dev.is_cuda, device=dev.device, ranks=ranks, seq_len=config.seq_len
    )
    return table, shape, planning


def _hooked(model, config) -> Adapter:
    """The hooked mode's adapter ([Note: the hooked mode]); PlanError where no module of the model can be a unit."""
    hooked = Adapter(model, "hooked", config.hooked_units, config.hooked_share)
    if not hooked.blocks:
        raise PlanError("no module of the model can be a unit")
    return hooked


def generic_plan(err: NonSequentialModel, *, model, config, dev, ranks, frozen: frozenset | None = None):
    """The generic path's adapter, parameter table, shape and planning; where the device has no room for the whole
    model, the hooked mode's; NonSequentialModel (the engine intact) where neither fits."""
    kw = dict(config=config, dev=dev, ranks=ranks, frozen=frozen)
    generic = Adapter(model, "generic")
    try:  # refused here, the streaming engine is intact
        planned = _planned(model, generic, **kw)
    except PlanError as e:
        try:  # streamed by its modules' calls where the device cannot hold it whole
            hooked = _hooked(model, config)
            planned = _planned(model, hooked, **kw)
        except PlanError as again:
            raise NonSequentialModel(
                f"{err.reason}; and neither the generic path (the whole model resident on the device: {e}) nor the "
                f"hooked mode (its modules streamed by their calls: {again}) fits"
            ) from err
        log.warning(
            "zerofit: %s, so this model cannot stream block by block, and the device cannot hold it whole (%s): it "
            "streams in the hooked mode instead, by its modules' calls (%d units). Pass adapter='hooked' to skip "
            "this check, or adapter='blocks' to refuse.",
            err.reason,
            e,
            hooked.num_blocks,
        )
        return (hooked, *planned)
    log.warning(
        "zerofit: %s, so this model cannot stream block by block: it trains on the generic path "
        "instead (the whole model as one unit). Pass adapter='generic' to skip this check, or "
        "adapter='blocks' to refuse.",
        err.reason,
    )
    return (generic, *planned)


def resident_or_hooked(model, adapter: Adapter, *, config, dev, ranks, frozen: frozenset, nf4=None) -> Adapter:
    """[Note: the hooked mode] chosen by the engine: a model with no chain of blocks (``adapter`` found none) trains
    as one resident unit where the device holds it whole, else in the hooked mode, when it has units."""
    try:
        _planned(model, adapter, config=config, dev=dev, ranks=ranks, frozen=frozen, nf4=nf4)
        return adapter
    except PlanError as e:
        try:
            hooked = _hooked(model, config)
        except PlanError:
            raise e from None
        log.warning(
            "zerofit: the model has no chain of blocks and the device cannot hold it whole (%s): it streams in the "
            "hooked mode, by its modules' calls (%d units). Pass adapter='hooked' to choose it yourself.",
            e,
            hooked.num_blocks,
        )
        return hooked


def optimizer_state_by_name(units, adapter, sharding) -> tuple[float, dict] | None:
    """(the step count, {canonical name: (exp_avg, exp_avg_sq) host copies}) of a unit set that took optimizer
    state (a loaded checkpoint), for the generic fallback; None before any."""
    trained = [u for u in units if u.trains]
    steps = {float(u.step) for u in trained}
    if steps == {0.0}:
        return None
    if len(steps) != 1:
        raise RuntimeError(
            f"the units took different numbers of optimizer steps ({sorted(steps)}): cannot "
            "fall back to the generic path with their state"
        )
    moments = {}
    with sharding.full_state(units, write_back=False):  # [Note: sharded device state]
        for u in trained:
            prefix = "" if u.index < 0 else adapter.block_prefix(u.index) + "."
            m, v = u.layout.views(u.exp_avg), u.layout.views(u.exp_avg_sq)
            for n in u.layout.names:
                moments[prefix + n] = (m[n].detach().to("cpu", copy=True), v[n].detach().to("cpu", copy=True))
    return steps.pop(), moments


def restore_optimizer_state(units, carried: tuple[float, dict] | None) -> None:
    """The moments and step count optimizer_state_by_name took, into the rebuilt units, by name."""
    if carried is None:
        return
    step, moments = carried
    for u in units:
        if not u.trains:
            continue
        m, v = u.layout.views(u.exp_avg), u.layout.views(u.exp_avg_sq)
        for n in u.layout.names:
            m[n].copy_(moments[n][0])
            v[n].copy_(moments[n][1])
        u.step.fill_(step)


def leave_disk(tier, blocks, model, adapter, table) -> None:
    """Before close removes the swap file: the master weights kept there are copied into host memory and
    the module's parameters pointed at them, so ``engine.module`` keeps the final weights (as fp32 host
    tensors, like every other unit's)."""
    if tier is None:
        return
    for u in blocks:
        if u.swap == "all":
            host = torch.empty(u.numel, dtype=torch.float32)
            host.copy_(u.master)
            rebind_params(model, adapter, table, u, host)
            u.master = host
    tier.file.flush_mapping()


def generic_inputs(err: NonSequentialModel, *, model, config, dev, ranks, frozen, tier, units, adapter, sharding):
    """[Note: generic fallback]: what the engine rebuilds itself from as one generic unit: (adapter, parameter
    table, shape, planning, the optimizer state its ``units`` hold by name); NonSequentialModel, the engine intact,
    where that cannot be (the disk tier, a device without room for the whole model)."""
    if tier is not None:
        raise NonSequentialModel(
            f"{err.reason}; the generic path (the whole model as one unit) cannot use the disk tier this plan needs"
        ) from err
    carried = optimizer_state_by_name(units, adapter, sharding)
    generic, table, shape, planning = generic_plan(err, model=model, config=config, dev=dev, ranks=ranks, frozen=frozen)
    return generic, table, shape, planning, carried
