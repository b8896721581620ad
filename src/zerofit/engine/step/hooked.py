"""The hooked mode's calls: each unit module's call in the model's own forward streamed through an autograd function
(a part). See [Note: the hooked mode] (model/hooked.py).

[Note: a unit's call as an autograd function]
While the model's forward runs (Schedule.post, on the hooked path), every unit module's ``forward`` is this part's
for the duration of the call (:meth:`Hooked.installed`). A call becomes :class:`_UnitCall`: its forward acquires the
unit's weights (the streamer uploads them into a slot), runs the module's own forward with them under ``no_grad`` and
lets the slot go, keeping only the call's tensor inputs (as a block keeps its checkpoint) and the RNG state; its
backward acquires the weights again, recomputes the call with autograd from those inputs under that RNG state, and
takes the gradients of the inputs (returned to autograd) and of the unit's trained weights (added into the unit's
gradient: Grads.accumulate). The weights are never saved in a graph, so a slot is free for the next unit as soon as
a call returns. Each call also takes the unit's *anchor*, a scalar leaf that requires a gradient: the engine asks
autograd for the anchors' gradients too, so every unit's backward runs even where nothing before it takes a
gradient (the first unit's inputs are the batch's); its gradient is None.

A unit may be called several times in one micro-batch (a shared module, a tower applied twice): its gradient buffer is
taken at its first backward of the micro-batch and its gradient handed to the optimizer step (Step.unit_done) when its
last call's backward ran (the calls are counted in the forward). The step then sums the micro-batches' gradients on
the host, as for the DeepSpeed-shaped loop's micro-steps: the hooked mode runs with deferred updates.

[Note: a unit's parameters outside its call]
A unit's weights are on the device only inside its module's call. A model that reads a unit's parameter elsewhere (a
weight used directly by its parent's code, FSDP's and ZeRO-3's known break: ZeRO-3 asks for
``register_external_parameter``, FSDP2 keeps such parameters in its root) would otherwise compute with the module's
own parameter, the host master, and its gradient would never reach the engine. So while the model's forward runs,
each unit module's own parameters are tensors on the meta device: such a read fails at once, and the engine says
which units and what to do (:class:`UnitParameterOutside`). Inside its call the module's parameters are the
device weights.

[Note: prefetch by the recorded order]
As ZeRO-3 traces its modules' order in the first step and prefetches by it, each training forward records the order
its units are called in. While a unit computes, the next forward's calls start the uploads of the units that order
calls next (as many as the weight slots hold beside the one computing), as long as the forward has followed the
recorded order so far (a forward that takes another path, data-dependent control flow, prefetches nothing until the
next one records its own). Each call's backward prefetches the units called before it, in reverse: the backward's
order. A unit's own upload is always waited for where it is called (Streamer.acquire), so a wrong guess costs a slot,
never a wrong weight.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from zerofit.errors import InputError

if TYPE_CHECKING:
    from torch import nn

    from zerofit.engine.memory.grads import Grads
    from zerofit.engine.memory.store import Unit
    from zerofit.engine.memory.streamer import Streamer
    from zerofit.engine.step.compute import Compute
    from zerofit.engine.step.optimizer_step import Step


class UnitParameterOutside(InputError, RuntimeError):
    """A unit's parameter was read outside its module's call: [Note: a unit's parameters outside its call]."""

    def __init__(self, units: list[str]):
        shown = ", ".join(units[:6]) + (", ..." if len(units) > 6 else "")
        super().__init__(
            f"the hooked mode: the model reads a parameter of one of its units ({shown}) outside that unit's own call "
            "(a weight used directly, as in x @ self.proj.weight.T): name in hooked_units the module whose forward "
            "uses it (or its parent), or raise hooked_share so that it is one unit with its user"
        )


class _UnitCall(torch.autograd.Function):
    """One call of a unit module: [Note: a unit's call as an autograd function]."""

    @staticmethod
    def forward(ctx, hooked: Hooked, index: int, flat: list, spec, holder: list, anchor, *tensors):
        args = _filled(flat, tensors)
        ctx.hooked, ctx.index, ctx.flat, ctx.spec = hooked, index, flat, spec
        ctx.rng = hooked.compute.rng_state()
        ctx.position = len(hooked.calls)  # this call's place in the forward ([Note: prefetch by the recorded order])
        ctx.save_for_backward(*tensors)
        out = hooked.run(index, tree_unflatten(args, spec), grad=False, record=True)
        out_flat, out_spec = tree_flatten(out)
        holder.append((out_flat, out_spec))
        outs = tuple(t for t in out_flat if isinstance(t, torch.Tensor))
        ctx.mark_non_differentiable(*(t for t in outs if not (t.is_floating_point() or t.is_complex())))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        hooked: Hooked = ctx.hooked
        wanted = ctx.needs_input_grad[6:]
        inputs = [t.detach().requires_grad_(w) for t, w in zip(ctx.saved_tensors, wanted)]
        grad_in = hooked.backward(ctx.index, ctx.flat, ctx.spec, inputs, list(grads), ctx.rng, ctx.position)
        return (None, None, None, None, None, None, *grad_in)


_TENSOR = object()  # where a call's flattened arguments had a tensor (None is an argument like any other)


def _filled(flat: list, tensors) -> list:
    """``flat`` with its tensors' places (``_TENSOR``) filled by ``tensors``, in order."""
    it = iter(tensors)
    return [next(it) if v is _TENSOR else v for v in flat]


class Hooked:
    """State: the units in the model's module order and their modules; per micro-batch the calls not yet through their
    backward (``pending``) and the units' anchors."""

    def __init__(
        self,
        units: list[Unit],
        modules: list[nn.Module],
        *,
        compute: Compute,
        streamer: Streamer,
        grads: Grads,
        stepper: Step,
        cyclic: bool = False,
    ) -> None:
        self.units, self.modules = units, modules
        self.cyclic = cyclic  # [Note: generation over the engine's weights]: a chain's blocks, in order, each forward
        self.compute, self.streamer, self.grads, self.stepper = compute, streamer, grads, stepper
        self.pending = [0] * len(units)  # per unit: its calls of this micro-batch whose backward has not run
        self.anchors: list[torch.Tensor] = []
        self.backwards = 0  # calls whose backward ran (the engine's check that a loss reached its forward)
        # [Note: prefetch by the recorded order]: the units' calls in the last training forward, and this one's so far
        self.order: list[int] = []
        self.calls: list[int] = []

    # ------------------------------------------------------------------ a forward with the units hooked

    @contextlib.contextmanager
    def installed(self, grad: bool):
        """Every unit module's ``forward`` is this part's for the block; with ``grad``, through :class:`_UnitCall`
        (a training forward), else computed at once (an evaluation). [Note: a unit's parameters outside its call]"""
        dev = self.compute.dev.device
        self.anchors = [torch.zeros((), device=dev, requires_grad=True) for _ in self.units] if grad else []
        if grad:
            self.calls = []
        originals = []
        with contextlib.ExitStack() as stack:
            for i, module in enumerate(self.modules):
                meta = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in module.named_parameters()}
                stack.enter_context(_reparametrize_module(module, meta, strict=False))
                originals.append(module.__dict__.get("forward"))
                module.forward = self._hook(i, grad)
            try:
                yield self.anchors
                if grad:
                    self.order = self.calls
            except (RuntimeError, NotImplementedError) as e:
                if "meta" in str(e):
                    raise UnitParameterOutside(self.paths()) from e
                raise
            finally:
                for module, before in zip(self.modules, originals):
                    del module.forward
                    if before is not None:
                        module.forward = before

    def generate(self, model: nn.Module, *args: Any, **kwargs: Any):
        """[Note: generation over the engine's weights]
        A chain's engine generates the same way (the engine's ``generate``, TRL's trainers' completions): its blocks
        are this part's units with ``cyclic`` on, each block's call uploading its weights from the engine's own host
        state (the current step's, the last updates applied first) into a slot, and prefetching the blocks after it
        in the chain's order, wrapping to the next token's forward. No second copy of the weights exists, on the host
        or the device; the key/value cache is the model's own.

        [Note: generation in the hooked mode]
        The model's own ``generate`` (an encoder-decoder's too) with its units streamed as in an evaluation forward:
        each unit's call uploads its weights, computes (with the model's own key/value cache: generation keeps it)
        and lets the slot go; the caller holds the shell's device weights in the model for the call. Its tensors
        go to the device; nothing of a step is touched."""
        dev = self.compute.dev.device
        args, kwargs = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        with torch.no_grad(), self.installed(grad=False):
            return model.generate(*args, **kwargs)  # type: ignore[operator]  # (a transformers model's method)

    def paths(self) -> list[str]:
        return [u.name for u in self.units]

    def _hook(self, i: int, grad: bool):
        def call(*args: Any, **kwargs: Any):
            if not (grad and torch.is_grad_enabled()):
                return self.run(i, (args, kwargs), grad=False)
            flat, spec = tree_flatten((args, kwargs))
            tensors = [v for v in flat if isinstance(v, torch.Tensor)]
            bare = [_TENSOR if isinstance(v, torch.Tensor) else v for v in flat]
            holder: list = []
            outs = iter(_UnitCall.apply(self, i, bare, spec, holder, self.anchors[i], *tensors))
            self.pending[i] += 1
            out_flat, out_spec = holder[0]
            return tree_unflatten([next(outs) if isinstance(v, torch.Tensor) else v for v in out_flat], out_spec)

        return call

    def _forward_of(self, i: int):
        module = self.modules[i]
        return type(module).forward.__get__(module)

    def _prefetch(self, unit: Unit, coming: list[int]) -> None:
        """[Note: prefetch by the recorded order]: the uploads of the units the recorded order calls next."""
        ahead = [self.units[j] for j in coming[: self.streamer.planning.plan.weight_slots - 1]]
        if ahead:
            self.streamer.prefetch([unit, *ahead], 0)

    def run(self, i: int, call, grad: bool, record: bool = False):
        """Unit ``i``'s module computed on ``call`` = (args, kwargs) with its device weights (uploaded now); with
        ``record`` (a training forward's call) recorded, and the next units' uploads started."""
        unit = self.units[i]
        self.streamer.acquire([unit], 0)
        if record:
            k = len(self.calls)
            self.calls.append(i)
            if self.order[: k + 1] == self.calls:  # the recorded order, so far
                self._prefetch(unit, self.order[k + 1 :])
        elif self.cyclic:
            n = len(self.units)
            self._prefetch(unit, [(i + k) % n for k in range(1, n)])
        try:
            # a generation's leaves take a gradient as a loaded model's parameters do, under no_grad: ATen's matmul
            # picks its kernel by that ([Note: same kernels], zerofit/infer/engine.py)
            leaves = self.compute.leaves(unit, grad=grad or self.cyclic)
            args, kwargs = call
            with _reparametrize_module(self.modules[i], leaves, strict=False):
                return self._forward_of(i)(*args, **kwargs)
        finally:
            self.streamer.release(unit)

    # ------------------------------------------------------------------ a call's backward

    def backward(self, i: int, flat: list, spec, inputs: list, grads: list, rng, position: int) -> list:
        """The backward of one call of unit ``i`` (the ``position``-th call of the forward): its inputs' gradients
        (for autograd), its weights' added into the unit's gradient, and the unit handed to the step after its last
        call's."""
        unit = self.units[i]
        self.streamer.acquire([unit], 0)
        if self.order[position : position + 1] == [i]:  # the backward comes in the forward's reverse order
            self._prefetch(unit, self.order[:position][::-1])
        leaves = self.compute.leaves(unit, grad=True)
        names = list(unit.layout.names)
        with torch.enable_grad(), self.compute.rng(rng):
            args, kwargs = tree_unflatten(_filled(flat, inputs), spec)
            with _reparametrize_module(self.modules[i], leaves, strict=False):
                out = self._forward_of(i)(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t.requires_grad]
        sources = [*wanted, *(leaves[n] for n in names)]
        got: tuple = (
            torch.autograd.grad([o for o, _ in pairs], sources, [g for _, g in pairs], allow_unused=True)
            if pairs and sources
            else (None,) * len(sources)
        )
        del out, outs, pairs
        if unit.trains:
            gdst = unit.grads.tensor if unit.grads.tensor is not None else self.grads.buffer(unit)
            self.grads.accumulate(unit, gdst, list(got[len(wanted) :]), names)
        self.streamer.release(unit)
        self.backwards += 1
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._done(unit)
        it = iter(got[: len(wanted)])
        return [next(it) if t.requires_grad else None for t in inputs]

    def _done(self, unit: Unit) -> None:
        """The unit's gradient of this micro-batch is complete: to the step (Step.unit_done), its slot's copy of the
        weights dropped (its update is coming)."""
        self.streamer.evict(unit)
        if unit.trains and unit.grads.tensor is not None:
            self.stepper.unit_done(unit)

    def backward_done(self) -> None:
        """The micro-batch's backward returned: a unit called in its forward whose output the loss did not use has
        had no backward for that call; what the unit's other calls gave goes to the step now."""
        for i, n in enumerate(self.pending):
            if n:
                self.pending[i] = 0
                self._done(self.units[i])
