"""The hooked mode's units: which submodules of any model stream, one unit each (the model room).

[Note: the hooked mode]
A model that is not one chain of blocks (residuals around its blocks, a U-Net's skip connections, several towers, a
module called twice) streams the way DeepSpeed ZeRO-3 and FSDP stream every model: by its modules. Some submodules are
*units* (FSDP's groups): each unit's parameters are one flat unit of the store (its master in host memory, planned as a
block is), and everything outside every unit is the shell, on the device for the whole step. The model's own forward
runs; each unit module's call goes through an autograd function (engine/step/hooked.py) that uploads the unit's weights
into a slot, computes the module's own forward with them without keeping a graph, and lets the slot go; its backward
uploads them again, recomputes the call from the inputs it kept, and hands the unit's gradient to the optimizer step as
a block's is. So a unit's weights are on the device only while it computes, in the forward and again in its backward,
as FSDP's unshard/reshard and ZeRO-3's fetch/release do.

Which submodules: those whose class is named (``hooked_units``: FSDP's ``transformer_layer_cls_to_wrap``), else a
transformers model's own layer classes (its ``_no_split_modules``, as accelerate's and FSDP's auto-wrap read them), else
by size (FSDP's size-based auto-wrap): bottom up, a module whose parameters not already in a unit below it are at least
``share`` of the model's becomes a unit. A unit never nests in another (its parent's own parameters stay in the shell),
a module one of whose parameters is also used outside it (a tied embedding, a shared projection) is never one (the
parameter stays in the shell, on the device, as FSDP2 keeps such parameters in its root), nor is a container that is
never called itself (``nn.ModuleList``: its members are).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from zerofit.errors import InputError


class UnknownUnitClass(InputError, ValueError):
    """A unit class named in the config that no module of the model is."""


def _owners(model: nn.Module) -> dict[int, set[str]]:
    """Each parameter (by id) -> every module path that holds it directly."""
    out: dict[int, set[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            out.setdefault(id(p), set()).add(path)
    return out


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def _called(module: nn.Module) -> bool:
    """Whether the module computes when called (a container such as ``nn.ModuleList`` does not: its members are)."""
    return type(module).forward is not nn.Module.forward


def _own(module: nn.Module, path: str, owners: dict[int, set[str]]) -> bool:
    """Whether every parameter of ``module`` is held only inside it (no tied use outside)."""
    return all(all(_inside(o, path) for o in owners[id(p)]) for p in module.parameters())


def _own_layers(model: nn.Module) -> list[str]:
    """The layer classes a transformers model names as never to be split across devices (``_no_split_modules``: its
    blocks, ``T5Block``, ``BartEncoderLayer``...), of the model or of the one a PEFT model wraps."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # type: ignore[operator]
    return list(getattr(base, "_no_split_modules", None) or [])


def hooked_units(model: nn.Module, classes: Sequence[str] = (), share: float = 0.02) -> list[tuple[str, nn.Module]]:
    """The model's units for the hooked mode, in the model's module order: (path, module). See [Note: the hooked
    mode]."""
    owners = _owners(model)
    total = sum(p.numel() for p in model.parameters())
    named = [(path, m) for path, m in model.named_modules() if path]
    if not classes:  # a transformers model's own layers, where it has them
        present = {type(m).__name__ for _, m in named}
        classes = [c for c in _own_layers(model) if c in present]
    if classes:
        present = {type(m).__name__ for _, m in named}
        missing = [c for c in classes if c not in present]
        if missing:
            kinds = ", ".join(sorted(present))
            raise UnknownUnitClass(
                f"hooked_units: no module of the model is a {', '.join(missing)} (its module classes: {kinds})"
            )
        chosen: list[tuple[str, nn.Module]] = []
        for path, m in named:
            if (
                type(m).__name__ in classes
                and _called(m)
                and not any(_inside(path, c) for c, _ in chosen)
                and _own(m, path, owners)
            ):
                chosen.append((path, m))
        return chosen
    threshold = max(1, int(share * total))
    picked: dict[str, nn.Module] = {}
    covered: dict[str, int] = {}  # path -> parameters of units below it

    for path, m in reversed(named):  # children before their parents
        below = sum(n for p, n in covered.items() if p.startswith(path + "."))
        numel = sum(p.numel() for p in m.parameters())
        if below:  # a unit is below: this module is never one (units do not nest)
            covered[path] = 0
            continue
        if numel >= threshold and _called(m) and _own(m, path, owners):
            picked[path] = m
            covered[path] = numel
    order = [p for p, _ in named]
    return sorted(picked.items(), key=lambda kv: order.index(kv[0]))
