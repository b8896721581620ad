"""torch's ``clip_grad_norm_`` over the engine's gradients, for the user's own loop (a part).

[Note: the user's clip on the device]
The user's loop ([Note: the user's loop drives the engine], userloop) clips as torch does: each trained
parameter's fp32 norm (``_foreach_norm``), the norm of those norms, ``clamp(max_norm / (norm + 1e-6), max=1)``
and every gradient multiplied by it in place, so its clipped gradients are bitwise the plain loop's. Done at the
``clip_grad_norm_`` call over the host gradients of the streamed blocks, that was two passes over every host
gradient between the backward and ``optimizer.step()``, with the GPU idle: almost half the step of a 3B model
in the user's own loop with 4 micro-batches (bench/engine_userloop.py --window 4; docs/benchmarks.md, the user's
own loop). So:

- a streamed unit whose whole gradient of the step comes down at once (deferred updates, the unit's host buffer
  filled fresh: the window holds every micro-batch) has its parameters' norms taken on the device as it is
  handed over, by the same ``_foreach_norm`` over the same fp32 values (``note``); a gradient that another
  micro-step then adds to on the host loses them (``forget``) and is read at the clip as before;
- the norms are stacked on the compute device (where plain torch on that device stacks them);
- the multiply of a host unit's gradient is left to the worker's update task of that unit, just before its
  AdamW (``pending``): the same ``mul_`` by the same fp32 factor, later, off the path between the backward and
  the step. Anything that reads the gradients before (a second clip, a GradScaler's unscale, ``grad_views``)
  has the multiplies done first (``settle``); a step not applied drops them (``discard``).

Several ranks (each holds its shard of every host-optimized unit's gradient; the replicated device units' whole,
averaged): FSDP's ``clip_grad_norm_`` arithmetic instead, as FSDP itself has no per-parameter norms to stack: each
rank's fp32 sum of the squares of its shards (the replicated units' counted on rank 0 only), summed over the ranks,
its square root the norm; every rank multiplies its shards (now: ``clip_sharded``). A unit whose device state is
sharded across the GPUs contributes its shard of the averaged gradient (the step's ``dev_grads``), as FSDP's.

State: ``order`` ((unit, name) of every trained parameter in the model's order, set by the user's loop),
``names`` (id(unit) -> its names in that order), ``norms`` (id(unit) -> its parameters' norms, device, this
step's), ``coef`` and ``waiting`` (the clip factor, host fp32, and id(unit) -> the views it is still to
multiply).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from zerofit.engine.memory.store import Unit

if TYPE_CHECKING:
    from zerofit.engine.device import Device
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.memory.grads import Grads


def module_order(units: list[Unit], adapter, model) -> list[tuple[Unit, str]]:
    """(unit, its name in the unit) of every trained parameter, in the module's order: what torch's clip sums over
    in the user's loop (:meth:`TorchClip.follow`)."""
    where: dict[str, tuple[Unit, str]] = {}
    for u in units:
        prefix = "" if u.index < 0 else adapter.block_prefix(u.index) + "."
        where.update({prefix + n: (u, n) for n in u.layout.names})
    return [where[n] for n, p in model.named_parameters() if p.requires_grad and n in where]


class TorchClip:
    def __init__(self, dev: Device, grads: Grads, ranks: Ranks) -> None:
        self.dev, self.grads, self.ranks = dev, grads, ranks
        self.order: list[tuple[Unit, str]] | None = None  # follow(): the user's loop clips
        self.names: dict[int, list[str]] = {}
        self.norms: dict[int, Sequence[torch.Tensor]] = {}
        self.coef: torch.Tensor | None = None
        self.waiting: dict[int, list[torch.Tensor]] = {}

    def follow(self, order: list[tuple[Unit, str]]) -> None:
        """The user's loop clips over ``order`` ((unit, name) of every trained parameter, the model's order)."""
        self.order = order
        self.names = {}
        for u, name in order:
            self.names.setdefault(id(u), []).append(name)

    # ------------------------------------------------------------------ as the backward hands gradients over

    def note(self, unit: Unit, grad: torch.Tensor) -> None:
        """``grad`` (on the device, fp32) is the unit's whole gradient of the step: its parameters' norms now."""
        names = self.names.get(id(unit))
        if names and not self.ranks.many:  # several ranks: each holds a shard; the clip reads them as before
            views = unit.layout.views(grad)
            self.norms[id(unit)] = torch._foreach_norm([views[n] for n in names], 2.0)

    def forget(self, unit: Unit) -> None:
        """The unit's gradient is summed on the host from here: its norms are taken at the clip."""
        self.norms.pop(id(unit), None)

    # ------------------------------------------------------------------ the clip

    def views(self, dev_grads: dict | None = None) -> list[torch.Tensor]:
        """The step's gradient of every trained parameter (views of the engine's gradient buffers), in the
        model's order, every clip multiply done. Several ranks: each unit's flat gradient this rank holds (its
        shard, or a replicated unit's whole), for elementwise readers (a GradScaler's unscale)."""
        self.settle()
        if self.ranks.many:
            return self._flats(dev_grads or {})
        return self._views()

    def _flats(self, dev_grads: dict) -> list[torch.Tensor]:
        """Several ranks: (unit, its flat gradient on this rank), each unit once, in the model's order."""
        assert self.order is not None  # the user's loop: follow() ran
        self.dev.record(self.dev.download).synchronize()
        out, seen = [], set()
        for u, _name in self.order:
            if id(u) in seen:
                continue
            seen.add(id(u))
            if u.shard.state:
                out.append(dev_grads[id(u)].narrow(0, 0, u.shard.hi - u.shard.lo))
            elif u.optimizer_on_device:
                out.append(u.grads.tensor)
            else:
                flat = self.grads.host_grads.get(id(u))
                if flat is None:
                    raise RuntimeError(
                        f"{u.name}: its gradient is not in memory (the disk tier's): clipping or "
                        "unscaling under the user's loop needs it there"
                    )
                out.append(flat.narrow(0, 0, u.shard.hi - u.shard.lo))
        return out

    def _views(self) -> list[torch.Tensor]:
        # the host gradients came down on the download stream: the main thread reads them after it
        self.dev.record(self.dev.download).synchronize()
        assert self.order is not None  # the user's loop: follow() ran
        out = []
        for u, name in self.order:
            flat = u.grads.tensor if u.optimizer_on_device else self.grads.host_grads.get(id(u))
            if flat is None:
                raise RuntimeError(
                    f"{u.name}: its gradient is not in memory (the disk tier's): clipping or "
                    "unscaling under the user's loop needs it there"
                )
            out.append(u.layout.views(flat)[name])
        return out

    def clip(self, max_norm: float, dev_grads: dict | None = None) -> float:
        """torch's ``clip_grad_norm_`` over the step's gradients (the Note); returns the norm. ``dev_grads``: the
        prepared step's shards of the device units whose state is sharded (several ranks)."""
        if self.ranks.many:
            return self.clip_sharded(max_norm, dev_grads or {})
        self.settle()
        grads = self._views()
        assert self.order is not None  # (_views)
        norms: list = [None] * len(grads)
        at = {id(u): 0 for u, _ in self.order}
        rest = []
        for i, (u, _name) in enumerate(self.order):
            kept = self.norms.get(id(u))
            if kept is not None and not u.optimizer_on_device:
                norms[i] = kept[at[id(u)]]
                at[id(u)] += 1
            else:
                rest.append(i)
        for i, n in zip(rest, torch._foreach_norm([grads[i] for i in rest], 2.0) if rest else []):
            norms[i] = n
        self.norms.clear()  # a second clip reads the clipped gradients themselves
        device = self.dev.device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if float(coef) < 1.0:
            host = torch.device("cpu")
            self.coef = coef.to(host)
            for (u, _name), g in zip(self.order, grads):
                if u.optimizer_on_device or g.device != host:
                    g.mul_(coef.to(g.device))
                else:
                    self.waiting.setdefault(id(u), []).append(g)
        return float(total)

    def clip_sharded(self, max_norm: float, dev_grads: dict) -> float:
        """FSDP's ``clip_grad_norm_`` over the ranks' shards (the Note's several ranks); returns the norm."""
        flats = self._flats(dev_grads)
        assert self.order is not None  # (_flats)
        units, seen = [], set()
        for u, _name in self.order:
            if id(u) not in seen:
                seen.add(id(u))
                units.append(u)
        device = self.dev.device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for u, flat in zip(units, flats):
            # a replicated unit (whole and averaged on every rank) counted once; a shard by the rank holding it
            if u.shard.state or not u.optimizer_on_device or self.ranks.local_rank == 0:
                sq += torch.linalg.vector_norm(flat, 2.0).to(device) ** 2
        total = self.ranks.all_reduce(sq.reshape(1)).reshape(()).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if float(coef) < 1.0:
            for g in flats:
                g.mul_(coef.to(g.device))
        self.norms.clear()
        return float(total)

    # ------------------------------------------------------------------ the multiplies left to the updates

    def pending(self, unit: Unit):
        """The multiply the unit's gradient still waits for, as a function for its update task to run first
        (None: nothing waits)."""
        views = self.waiting.pop(id(unit), None)
        if not views:
            return None
        coef = self.coef
        assert coef is not None  # set by the clip that left multiplies waiting

        def multiply():
            for g in views:
                g.mul_(coef)

        return multiply

    def settle(self) -> None:
        """Every multiply still waiting, done now (a reader of the gradients comes before the updates)."""
        for views in self.waiting.values():
            assert self.coef is not None  # set by the clip that left multiplies waiting
            for g in views:
                g.mul_(self.coef)
        self.waiting.clear()

    def discard(self) -> None:
        """The step is not applied (or its gradients forgotten): nothing of it waits."""
        self.norms.clear()
        self.waiting.clear()
        self.coef = None
