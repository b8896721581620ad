"""Materialization: the model's parameters become the store's flat buffers, one unit at a time.

The model may be real (its tensors are copied once, then released), built on
the meta device (each unit is created and initialized on the compute device,
copied to its home, and released before the next), or built on the meta device
with its weights in a model directory (each tensor is read from its safetensors
file straight into the unit's buffer: [Note: one tensor's worth] in
zerofit/models/safetensors.py): host memory never holds the model twice. Afterwards the module's own parameters are
views of the units' fp32 host weights (the frozen ones views of their host copy, in the compute dtype: [Note: frozen
parameters] in store.py), so ``engine.module`` is the model with its current weights.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from zerofit.engine.disk.tier import frozen_key
from zerofit.engine.distributed.node_slices import free_outside, sliced
from zerofit.engine.memory.store import FlatLayout, Home, HostArena, Shard, Unit
from zerofit.engine.model import tiling
from zerofit.engine.model.adapter import Adapter
from zerofit.engine.model.startup import Startup
from zerofit.engine.plan.search import ModelShape, Plan


@dataclass
class ParamTable:
    """The model's distinct parameters, their aliases (tied weights) and how they split into units."""

    canonical: dict[str, nn.Parameter]  # first name -> parameter
    aliases: dict[str, list[str]]  # first name -> every name of the same parameter
    unit_names: list[list[str]]  # [shell, block 0, block 1, ...] -> first names, in order


def _canonical(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, list[str]]]:
    seen: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[seen[id(p)]].append(name)
            continue
        seen[id(p)] = name
        aliases[name] = [name]
        out[name] = p
    return out, aliases


def param_table(model: nn.Module, adapter: Adapter) -> ParamTable:
    canonical, aliases = _canonical(model)
    prefixes = [adapter.block_prefix(i) + "." for i in range(adapter.num_blocks)]

    def unit_of(name: str) -> int:
        return next((i + 1 for i, pre in enumerate(prefixes) if name.startswith(pre)), 0)

    unit_names: list[list[str]] = [[] for _ in range(len(prefixes) + 1)]
    for name in canonical:
        unit_names[unit_of(name)].append(name)
    for names in aliases.values():
        if len({unit_of(a) for a in names}) > 1:
            raise ValueError(f"parameters {names} are shared between blocks; zerofit cannot stream them")
    return ParamTable(canonical, aliases, unit_names)


def model_shape(
    model: nn.Module, adapter: Adapter, table: ParamTable, frozen: frozenset | None = None, nf4=None
) -> ModelShape:
    """The planner's view of the model: each unit's trained and frozen parameter counts and the widths.
    ``frozen``: the canonical names not trained (None: those with ``requires_grad=False``); ``nf4``: the
    :class:`~zerofit.engine.model.nf4.BaseNF4` of the ones held in 4 bits ([Note: an NF4 base])."""
    if frozen is None:
        frozen = frozenset(n for n, p in table.canonical.items() if not p.requires_grad)
    numels = [sum(table.canonical[n].numel() for n in names if n not in frozen) for names in table.unit_names]
    still = [sum(table.canonical[n].numel() for n in names if n in frozen) for names in table.unit_names]
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or 0
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    vocab = getattr(cfg, "vocab_size", 0) or 0
    if not hidden and adapter.streaming:  # not a Hugging Face model: the block's widest weight
        hidden = max((p.shape[-1] for p in adapter.blocks[0].parameters() if p.dim() == 2), default=0)
        inter = 4 * hidden
    nf4_numels: tuple[int, ...] = ()
    nf4_bytes: tuple[int, ...] = ()
    if nf4:
        nf4_numels = tuple(sum(table.canonical[n].numel() for n in names if n in nf4) for names in table.unit_names)
        nf4_bytes = tuple(
            nf4.unit_bytes([(table.canonical[n].shape, n) for n in names if n in nf4]) for names in table.unit_names
        )
    return ModelShape(
        numels[0],
        tuple(numels[1:]),
        hidden,
        inter,
        vocab,
        still[0],
        tuple(still[1:]) if any(still[1:]) else (),
        nf4_numels,
        nf4_bytes,
        attention_width(cfg, adapter),
    )


def attention_width(cfg, adapter: Adapter) -> int:
    """Per token, the elements of q, k, v and the attention's output where every block runs over sequence tiles
    whole ([Note: a block over sequence tiles], tiling.py), else 0."""
    if not adapter.streaming or any(tiling.block_tileable(b) is not None for b in adapter.blocks):
        return 0
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) or 0) // max(1, heads)
    return (2 * heads + 2 * kv) * head_dim


def warn_low_precision_trained(table: ParamTable, frozen: frozenset) -> None:
    """Trained parameters that are 16-bit in the model (TRL's QLoRA adapters, a bf16 model): the engine keeps fp32
    masters of them, which an optimizer over the 16-bit tensors would not: say so once, at start-up."""
    low = [p for n, p in table.canonical.items() if n not in frozen and p.dtype in (torch.bfloat16, torch.float16)]
    if low:
        names = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in low}))
        logging.getLogger("zerofit").warning(
            "zerofit: %s trained parameters are %s in the model: the engine keeps fp32 master weights of them and "
            "updates those (docs/lora.md); their updates are not rounded to %s at every step as an optimizer over "
            "the 16-bit tensors themselves would round them",
            f"{sum(p.numel() for p in low):,}",
            names,
            names,
        )


def build_units(
    model: nn.Module,
    adapter: Adapter,
    table: ParamTable,
    plan: Plan,
    dev: torch.device,
    compute_dtype: torch.dtype,
    pinned: bool,
    source=None,
    group_of: dict[str, int] | None = None,
    tier=None,
    ranks=None,
    on_device_unit=None,
    frozen: frozenset = frozenset(),
    nf4=None,
    startup: Startup | None = None,
) -> tuple[list[Unit], list[HostArena]]:
    """Create every unit's buffers where ``plan`` puts them and point the module's parameters at them.

    ``source``: a :class:`zerofit.models.ModelDir` whose files hold the weights of a meta model.
    ``group_of``: canonical name -> parameter group; each unit's layout places its parameters group by
    group ([Note: segments per unit] in store.py). None: one group, the model's order.
    ``ranks`` with several ranks: the host state is in arenas the host's ranks share, written by local rank 0
    only (the others' values, maybe initialized differently, never reach it); [Note: sharded units], ranks.py.
    ``on_device_unit(unit)``: called as soon as a device-optimized unit is built (the engine broadcasts and
    shards it there, so that one unit's whole state at most exists at a time).
    ``frozen``: canonical names of the parameters that are not trained; each unit keeps them apart, in its
    ``frozen`` layout and ``frozen_host`` buffer ([Note: frozen parameters], store.py); of those, the ones in
    ``nf4`` (a :class:`~zerofit.engine.model.nf4.BaseNF4`) are held in 4 bits, after the 16-bit ones in the layout, in
    the unit's ``nf4`` buffer ([Note: an NF4 base], nf4.py). ``startup``: counts the parameters done and the
    seconds of each phase as they go ([Note: start-up progress], startup.py)."""
    canon = table.canonical
    if startup is None:
        startup = Startup(sum(p.numel() for p in canon.values()))
    quant = nf4 if nf4 else ()
    meta = any(p.is_meta for n, p in canon.items() if n not in quant)
    init_device = dev if meta else None
    fds: dict = {}
    L = adapter.num_blocks
    homes = [Home.RESIDENT] + [Home.RESIDENT if i < plan.resident_blocks else Home.STREAMED for i in range(L)]
    # [Note: sharded device state]: with plan.device_state the streamed blocks' optimizer state is on the GPUs
    opt_on_dev = [plan.shell_optimizer_on_device] + [i < plan.resident_blocks or plan.device_state for i in range(L)]
    fp32 = compute_dtype == torch.float32
    # [Note: fp32 uploads]
    # Host-optimized units upload their fp32 master itself (pinned, one arena) and the device casts it
    # into the compute dtype: the CPU's only work per step is the AdamW update, no 16-bit copy-out.
    # The PCIe bytes double (4 B/param each way up), which the measured budget affords; the CPU was
    # the binding resource. The module's parameters are fp32 views of the same.
    trained = [[n for n in names if n not in frozen] for names in table.unit_names]
    still = [
        [n for n in names if n in frozen and n not in quant] + [n for n in names if n in quant]
        for names in table.unit_names
    ]
    sizes = [sum(canon[n].numel() for n in names) for names in trained]
    disk_of = {i + 1: m for i, m in plan.disk_of.items()}  # unit index -> "moments" | "all"
    need = sum(n for i, (n, on_dev) in enumerate(zip(sizes, opt_on_dev)) if not on_dev and disk_of.get(i) != "all")
    need16 = sum(sizes[i] for i, m in disk_of.items() if m == "all")
    with startup.phase("allocate"):
        arena16 = HostArena(need16, compute_dtype, pinned) if need16 else None
    # With assisted updates the moments of the device-updated blocks are copied too: pin them as well
    # (a pageable copy runs at a seventh of the speed and blocks the host).
    assisted = [i - 1 in plan.assisted_blocks for i in range(len(sizes))]
    assisted[0] = plan.assisted_shell  # the shell too ([Note: assisted updates in the backward], update/assisted.py)
    many = ranks is not None and ranks.many
    writer = not many or ranks.local_rank == 0
    if many:  # every host unit's moments in the shared arena (zeros as mapped): the state is held once
        need += 2 * sum(n for n, on_dev in zip(sizes, opt_on_dev) if not on_dev)
    else:
        need += 2 * sum(n for n, a in zip(sizes, assisted) if a)
    sliced_nodes = ranks is not None and ranks.full  # [Note: nodes hold a slice of the state] (node_slices.py)
    # the full layout page-locks only the node's slices (NodeSlices.pin): locking the arena would back all of it
    with startup.phase("allocate"):
        arena = HostArena(need, torch.float32, pinned and not sliced_nodes, ranks) if need else None
    on_disk_f = set(plan.disk_frozen)  # [Note: a frozen base on the disk] (disk.py): in the swap file instead
    need_f = sum(
        canon[n].numel() for i, names in enumerate(still) for n in names if n not in quant and i - 1 not in on_disk_f
    )
    # [Note: frozen parameters]: the frozen weights in the compute dtype, read into it from the files or the user's
    # tensors (a bf16 file's tensors as they are); shared by the host's ranks
    with startup.phase("allocate"):
        arena_f = HostArena(need_f, compute_dtype, pinned, ranks) if need_f else None
    units: list[Unit] = []
    for idx, (all_names, names, frozen_names) in enumerate(zip(table.unit_names, trained, still)):
        layout = FlatLayout.of(
            [(n, canon[n].shape) for n in names], [group_of[n] for n in names] if group_of is not None else None
        )
        flayout = FlatLayout.of([(n, canon[n].shape) for n in frozen_names]) if frozen_names else None
        plain = [n for n in frozen_names if n not in quant]  # the 16-bit ones, first ([Note: an NF4 base])
        qnames = frozen_names[len(plain) :]
        n16 = sum(canon[n].numel() for n in plain)
        if idx - 1 in on_disk_f:  # a view of the swap file's mapping, written once below
            fhost = tier.view(frozen_key(idx - 1), "w16").view(compute_dtype)[:n16]
        elif flayout is not None and n16:  # compute dtype, host: (16-bit frozen numel,)
            assert arena_f is not None  # sized by need_f, which counts these
            fhost = arena_f.take(n16)
        elif flayout is not None:
            fhost = torch.empty(0, dtype=compute_dtype)
        else:
            fhost = None
        fviews = FlatLayout.of([(n, canon[n].shape) for n in plain]).views(fhost) if flayout is not None else {}
        home, on_dev = homes[idx], opt_on_dev[idx]
        opt_dev = dev if on_dev else torch.device("cpu")
        prefix = "" if idx == 0 else adapter.block_prefix(idx - 1) + "."
        rel = dataclasses.replace(layout, names=tuple(n[len(prefix) :] for n in layout.names))
        unit = Unit("shell" if idx == 0 else prefix[:-1], idx - 1, rel, home, on_dev)
        if flayout is not None:
            unit.frozen = dataclasses.replace(flayout, names=tuple(n[len(prefix) :] for n in flayout.names))
        if qnames:
            assert flayout is not None and nf4 is not None  # NF4 names are frozen ones, of the NF4 base
            at = dict(zip(flayout.names, flayout.offsets))
            with startup.phase("allocate"):
                unit.nf4 = nf4.unit(
                    qnames,
                    [n[len(prefix) :] for n in qnames],
                    [canon[n].shape for n in qnames],
                    [at[n] for n in qnames],
                    pinned,
                )
        swap = disk_of.get(idx)
        if on_dev:
            master = torch.empty(layout.numel, dtype=torch.float32, device=opt_dev)
        elif swap == "all":
            master = tier.view(idx - 1, "master")  # (numel,) fp32, the swap file's mapping
        elif not layout.numel:  # nothing of the unit trains ([Note: frozen parameters], store.py)
            master = torch.empty(0, dtype=torch.float32)
        else:
            assert arena is not None  # sized by need, which counts every host unit's master off the disk
            master = arena.take(layout.numel)  # (numel,) fp32, pinned host: the upload source
        fill = writer or on_dev
        frozen_fill = writer  # frozen weights live on the host only, in memory the host's ranks share
        if source is not None:
            init_buffers(model, adapter, idx, init_device)
            with startup.phase("read"):
                if fill:
                    _read_unit(source, table, names, layout.views(master), fds)
                if frozen_fill and flayout is not None:
                    _read_unit(source, table, plain, fviews, fds)
            for j, n in enumerate(qnames):  # one tensor at a time, quantized as it is read (or read packed)
                assert unit.nf4 is not None  # made above for its NF4 names
                if n in nf4.from_folder:  # [Note: a 4-bit folder]: as stored
                    with startup.phase("read"):
                        unit.nf4.put(j, nf4.pack_of(n, None))
                    continue
                with startup.phase("read"):
                    w = _read_one(source, table, n, compute_dtype, fds)
                with startup.phase("quantize"):
                    unit.nf4.put(j, nf4.pack_of(n, lambda w=w: w))
                del w
        else:
            real = [n for n in all_names if n not in quant]
            with startup.phase("init"):
                values = dict(zip(real, _unit_values(model, adapter, idx, real, init_device)))
            with startup.phase("copy"):
                if fill:
                    _fill(layout.views(master), names, [values[n] for n in names])
                if frozen_fill and flayout is not None:
                    _fill(fviews, plain, [values[n] for n in plain])
            del values
            with startup.phase("quantize"):
                for j, n in enumerate(qnames):
                    assert unit.nf4 is not None  # made above for its NF4 names
                    unit.nf4.put(j, nf4.pack_of(n, None))
        for j, n in enumerate(qnames):
            nf4.held(n, unit.nf4, j)
        if idx - 1 in on_disk_f:
            unit.frozen_disk = True
            r = tier.regions[frozen_key(idx - 1)]
            tier.file.drop_pages(r.offsets["w16"], r.numel * 4)  # written: out of host memory
        unit.master = master
        if swap:
            unit.swap = swap
            unit.exp_avg, unit.exp_avg_sq = tier.view(idx - 1, "exp_avg"), tier.view(idx - 1, "exp_avg_sq")
            if swap == "all":
                assert arena16 is not None  # sized by need16
                unit.host16 = arena16.take(layout.numel)
                unit.host16.copy_(master)
                r = tier.regions[idx - 1]
                tier.file.drop_pages(r.offsets["master"], layout.numel * 4)  # one unit's pages in memory at a time
        elif many and not on_dev and layout.numel:
            assert arena is not None  # sized by need, which counts these moments
            unit.exp_avg, unit.exp_avg_sq = arena.take(layout.numel), arena.take(layout.numel)
        elif assisted[idx] and layout.numel:
            assert arena is not None  # as above
            unit.exp_avg, unit.exp_avg_sq = arena.take(layout.numel).zero_(), arena.take(layout.numel).zero_()
        else:
            unit.exp_avg, unit.exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        if sliced_nodes and fill and sliced(unit):  # written whole: the other nodes' slices out
            free_outside(ranks, master)
        unit.step = torch.zeros((), dtype=torch.float32, device=opt_dev)
        if on_dev:
            if home is Home.RESIDENT:
                unit.dev16 = master if fp32 else master.to(compute_dtype)
            unit.host = master.to("cpu") if dev.type != "cpu" else master  # host mirror, fp32
        else:
            unit.host = master
            if home is Home.RESIDENT:
                unit.dev16 = master.to(dev, compute_dtype)
        if home is Home.RESIDENT:
            unit.grads.own(torch.zeros(layout.numel, dtype=torch.float32, device=dev))
        if flayout is not None:  # [Note: frozen parameters]
            unit.frozen_host = fhost
            if unit.nf4 is not None:  # dequantized once, for the whole run ([Note: an NF4 base])
                if home is Home.RESIDENT:
                    unit.frozen_dev = torch.empty(flayout.numel, dtype=compute_dtype, device=dev)
                    unit.frozen_dev[:n16].copy_(fhost)
                    unit.nf4.dequantize(unit.nf4.host.to(dev), unit.frozen_dev)
                else:
                    unit.frozen_at = ranks.padded(layout.numel) if ranks is not None else layout.numel
            elif home is Home.RESIDENT:  # on the CPU the host copy itself (same dtype and device)
                unit.frozen_dev = fhost.to(dev)
            else:
                unit.frozen_at = ranks.padded(layout.numel) if ranks is not None else layout.numel
        # the module's own parameters become views of the host weights (fp32, current after engine.wait()); the
        # frozen ones views of their host copy, in the compute dtype ([Note: frozen parameters], store.py)
        views = layout.views(unit.host)
        if flayout is not None:
            views.update(fviews)
        for n in qnames:  # no 16-bit copy to view outside a step: on the meta device ([Note: an NF4 base])
            views[n] = torch.empty(canon[n].shape, dtype=compute_dtype, device="meta")
        for n in all_names:
            shared = as_parameter(canon[n], views[n])
            for alias in table.aliases[n]:
                mod_path, _, leaf = alias.rpartition(".")
                (model.get_submodule(mod_path) if mod_path else model)._parameters[leaf] = shared
        root = model if idx == 0 else adapter.blocks[idx - 1]
        unit.buffers = _unit_buffers(adapter, root, idx == 0, dev)
        if ranks is not None:
            unit.shard = Shard(*ranks.bounds(unit.numel))
        if on_dev and on_device_unit is not None:
            on_device_unit(unit)
        units.append(unit)
        startup.advance(sum(canon[n].numel() for n in all_names))
    for fd in fds.values():
        os.close(fd)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # the packed 4-bit pieces copied from the device without waiting are in
    startup.finish()
    if tier is not None:
        tier.file.flush_mapping()  # the masters written through the mapping reach the disk, and leave memory
    return units, [a for a in (arena, arena16, arena_f) if a is not None]


def release_originals(model: nn.Module, table: ParamTable) -> ParamTable:
    """The table with the module's parameters as they are now (views of the units' buffers), so that it holds
    none of the user's original tensors: a real model's weights are not kept a second time in host memory."""
    return dataclasses.replace(table, canonical={n: model.get_parameter(n) for n in table.canonical})


def as_parameter(old: torch.Tensor, view: torch.Tensor) -> nn.Parameter:
    """[Note: the model's parameter objects]
    The module's parameter ``old`` made to view ``view`` (the engine's buffer): the same ``nn.Parameter`` object,
    its ``data`` swapped, so that what the user holds (an optimizer built over ``model.parameters()`` after
    wrapping, a list kept for clipping) stays the model's parameters through every build of the units: the first,
    a rebuild on the generic path ([Note: generic fallback], recovery.py), a load. A new object only where there
    is none to keep: a parameter on the meta device (no storage to swap), or a view on it (an NF4 weight)."""
    if isinstance(old, nn.Parameter) and not old.is_meta and not view.is_meta:
        old.data = view
        return old
    return nn.Parameter(view, requires_grad=old.requires_grad)


def rebind_params(model: nn.Module, adapter: Adapter, table: ParamTable, unit: Unit, host: torch.Tensor) -> None:
    """Point the module's trained parameters of ``unit`` at views of ``host`` (fp32, the unit's flat layout)."""
    prefix = "" if unit.index < 0 else adapter.block_prefix(unit.index) + "."
    views = unit.layout.views(host)
    for n in (prefix + rel for rel in unit.layout.names):
        shared = as_parameter(table.canonical[n], views[n[len(prefix) :]])
        for alias in table.aliases[n]:
            mod_path, _, leaf = alias.rpartition(".")
            (model.get_submodule(mod_path) if mod_path else model)._parameters[leaf] = shared
    unit.host = host


def _read_one(source, table: ParamTable, name: str, dtype: torch.dtype, fds: dict) -> torch.Tensor:
    """One tensor of the model directory, in ``dtype`` (to be quantized: [Note: an NF4 base])."""
    from zerofit.models.directory import load_tensor

    out = torch.empty(table.canonical[name].shape, dtype=dtype)
    load_tensor(source, table.aliases[name], out, fds)
    return out


def _read_unit(source, table: ParamTable, names: list[str], views: dict[str, torch.Tensor], fds: dict) -> None:
    """Fill the unit's master from the model directory, one tensor at a time (any alias of a tied weight)."""
    from zerofit.models.directory import load_tensor

    for n in names:
        load_tensor(source, table.aliases[n], views[n], fds)


def init_buffers(model: nn.Module, adapter: Adapter, idx: int, init_device: torch.device | None) -> None:
    """Weights come from files: only the unit's meta *buffers* (rotary tables...) need creating and
    initializing, by the model's own ``_init_weights`` on the modules that own them (on still-meta
    parameters that init is a no-op)."""
    root = model if idx == 0 else adapter.blocks[idx - 1]
    mods = list(root.modules()) if idx > 0 else _shell_modules(model, adapter)
    init = getattr(model, "_init_weights", None)
    for m in mods:
        meta_bufs = [bn for bn, b in m._buffers.items() if b is not None and b.is_meta]
        for bn in meta_bufs:
            b = m._buffers[bn]
            assert b is not None  # (meta_bufs)
            m._buffers[bn] = torch.empty(b.shape, dtype=b.dtype, device=init_device)
        if meta_bufs:
            if init is not None:
                init(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()  # type: ignore[operator]  # the module's own, found by name


def _unit_values(
    model: nn.Module, adapter: Adapter, idx: int, names: list[str], init_device: torch.device | None
) -> list[torch.Tensor]:
    """The unit's parameter values: those of a real model, or freshly initialized ones of a meta model
    (the model's own ``_init_weights`` for Hugging Face models, else each module's ``reset_parameters``)."""
    canon, _ = _canonical(model)
    if init_device is None:
        return [canon[n].detach() for n in names]
    root = model if idx == 0 else adapter.blocks[idx - 1]
    mods = list(root.modules()) if idx > 0 else _shell_modules(model, adapter)
    # only what is still on meta is initialized: real weights beside it (PEFT's adapters made real over a meta
    # base, say) keep their values
    on_meta = {
        id(m) for m in mods if any(t is not None and t.is_meta for t in [*m._parameters.values(), *m._buffers.values()])
    }
    for m in mods:
        for p in list(m._parameters.values()):
            if p is not None and p.is_meta:
                real = nn.Parameter(
                    torch.empty(p.shape, dtype=torch.float32, device=init_device), requires_grad=p.requires_grad
                )
                for other in model.modules():  # tied weights stay one object
                    for on, op in other._parameters.items():
                        if op is p:
                            other._parameters[on] = real
        for bn, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[bn] = torch.empty(b.shape, dtype=b.dtype, device=init_device)
    init = getattr(model, "_init_weights", None)
    for m in reversed(mods):  # children before parents, as HF's own init
        if id(m) not in on_meta:
            continue
        if init is not None:
            init(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()  # type: ignore[operator]  # the module's own, found by name
    _init_lora(model, mods, on_meta)
    canon, _ = _canonical(model)
    missing = [n for n in names if canon[n].is_meta]
    if missing:
        raise ValueError(f"cannot initialize {missing} on the meta device: no _init_weights or reset_parameters")
    return [canon[n].detach() for n in names]


def _init_lora(model: nn.Module, mods: list[nn.Module], on_meta: set) -> None:
    """PEFT's LoRA layers whose adapters were on meta get PEFT's own initialization (``reset_lora_parameters``
    with the adapter's ``init_lora_weights``: lora_B zero, so the model starts as its base), not the model's
    ``_init_weights``, which would draw lora_B at random."""
    configs = getattr(model, "peft_config", None) or {}
    for m in mods:
        lora_a = getattr(m, "lora_A", None)
        if not hasattr(m, "reset_lora_parameters") or not isinstance(lora_a, nn.ModuleDict):
            continue
        for name, sub in lora_a.items():
            if id(sub) in on_meta:
                cfg = configs.get(name)
                # PEFT's own method, found by name (torch types a module attribute as Tensor | Module)
                m.reset_lora_parameters(name, cfg.init_lora_weights if cfg is not None else True)  # type: ignore[operator]


def _shell_modules(model: nn.Module, adapter: Adapter) -> list[nn.Module]:
    inside = {id(m) for b in adapter.blocks for m in b.modules()}
    inside.add(id(adapter.blocks))
    return [m for m in model.modules() if id(m) not in inside]


def _fill(views: dict[str, torch.Tensor], names: list[str], values: list[torch.Tensor]) -> None:
    for n, v in zip(names, values):
        dst = views[n]
        if v.device != dst.device and v.dtype != dst.dtype:  # cast where the value is (a copy across devices that
            v = v.to(dst.dtype)  # also casts goes through a temporary on the host)
        dst.copy_(v)


def _unit_buffers(adapter: Adapter, root: nn.Module, is_shell: bool, dev: torch.device) -> dict[str, torch.Tensor]:
    """Device copies of the unit's module buffers (passed to functional_call); the module keeps host copies."""
    inside = {id(b) for b in adapter.blocks.buffers()} if is_shell else set()
    out = {}
    for name, b in root.named_buffers():
        if id(b) in inside:
            continue
        if b.is_meta:
            raise ValueError(f"buffer {name} is still on the meta device after initialization")
        out[name] = b.to(dev)
    for name, b in out.items():
        if b.device.type != "cpu":
            mod_path, _, leaf = name.rpartition(".")
            mod = root.get_submodule(mod_path) if mod_path else root
            mod._buffers[leaf] = b.to("cpu")
    return out
