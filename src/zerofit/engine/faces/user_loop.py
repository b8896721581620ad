"""The engine as the user's own loop drives it (zerofit/userloop: ``zerofit.fsdp``, accelerate, Lightning): a
stateless face over the parts, so that the loop calls these methods and never a part's internals.

The loop's forward and ``backward`` are the DeepSpeed-shaped window's (``engine(**batch)``, ``engine.backward``:
faces/deepspeed_surface.py), one micro-batch at a time; its ``optimizer.step()`` is :meth:`prepare` (every
gradient complete, the norm), then :meth:`apply` or :meth:`skip`; its clip and a GradScaler's unscale read the
prepared step's gradients (:meth:`clip_as_torch`, :meth:`grad_views`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from zerofit.engine.plan.plan import PlanError
from zerofit.engine.step.torch_clip import module_order

if TYPE_CHECKING:
    from zerofit.engine.engine import Engine
    from zerofit.engine.memory.store import Unit
    from zerofit.engine.step.optimizer_step import Prepared


class UserLoopFace:
    """The user's loop's calls on ``engine`` (its parts stay the engine's: this face holds no state)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        """The window of a loop wrapped with ``gradient_accumulation_steps`` 1 takes any number of micro-batches
        (each micro-batch's blocks backward at its own backward()); torch's clip follows the module's order of
        its trained parameters."""
        e = self.engine
        e.window.any_number_of_micro_batches(e.config.gradient_accumulation_steps == 1)
        e.stepper.torch_clip.follow(module_order(e.units, e.adapter, e.module))
        if e.speculator.cast:  # [Note: a speculated cast]: the settings now, not fixed for the step by the read
            e.speculator.cast_hypers = e.hypers.reported

    @property
    def streaming(self) -> bool:
        return self.engine.adapter.streaming

    @property
    def micro_steps(self) -> int:
        """Micro-batches through backward() since the last step."""
        return self.engine.window.micro_steps

    def trained(self) -> dict[str, tuple[Unit, str]]:
        """The model's name of every trained parameter -> (its unit, its name in the unit)."""
        e = self.engine
        where: dict[str, tuple[Unit, str]] = {}
        for u in e.units:
            prefix = "" if u.index < 0 else e.adapter.block_prefix(u.index) + "."
            where.update({prefix + n: (u, n) for n in u.layout.names})
        return where

    def follow_schedule(self, schedule: Any) -> None:
        """Each step's settings from the user's optimizer (a client schedule over it)."""
        self.engine.hypers.attach(schedule)

    # ------------------------------------------------------------------ forward and backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One micro-batch's forward, through the accumulation window (the same path as DeepSpeed's loop: its
        checks, its refusals, the generic fallback); under ``torch.no_grad()`` it keeps nothing."""
        return self.engine.deepspeed(*args, **kwargs)

    def can_offer(self) -> bool:
        """At the start of an accumulation window of more than one micro-batch, in training: a read-ahead of the
        window's batches could serve it ([Note: the loop's loader reads the window ahead], userloop/loop.py)."""
        e = self.engine
        return e.window.model.training and e.window.can_offer()

    @property
    def window_size(self) -> int:
        """The micro-batches of the accumulation window (the config's, or the one the loop's first step taught)."""
        return self.engine.window.G

    def offer(self, batches: list[dict]) -> None:
        """The window's batches, read ahead: if its first forward is for the first of them, or they follow it (a
        wrapper that fetches one batch ahead of the loop: accelerate's), its forwards run at once ([Note: a
        window's forwards at once], step/window.py)."""
        self.engine.window.offer(batches, may_lead=True)

    def backward(self, objective: torch.Tensor) -> None:
        """The engine's backward of ``objective``, unscaled (the loop's objective is its own: no 1/G)."""
        self.engine.deepspeed.backward(objective, scale_wrt_gas=False)

    # ------------------------------------------------------------------ the step

    def prepare(
        self, amp: contextlib.AbstractContextManager, factor_known: bool = False, clip: float | None = None
    ) -> Prepared:
        """The step up to its updates: the held micro-batches' blocks backward (under ``amp``, the forward's
        autocast), every gradient complete, the global norm (fp16: the overflow check). ``factor_known``: the
        step's factor is 1 and its settings are the optimizer's now (its ``optimizer.step()`` with no clip or
        unscale before it): the host updates run in that backward ([Note: updates in the backward of the user's
        loop], update/speculation.py). ``clip``: a clip to that norm prepares it: the streamed blocks' casts run
        in that backward ([Note: a speculated cast])."""
        e = self.engine
        with e.guard(discard_step=True), amp:
            if factor_known and e.window.held_full():
                from zerofit.engine.update.speculation import Speculation

                if all(Speculation.usable(h.beta1, h.beta2) for h in e.hypers.for_step()):  # (a non-finite norm)
                    e.speculator.begin_known(e.adapter.streaming)
            elif clip is not None:  # (it notes the clip's norm for the next steps' casts)
                e.speculator.begin_cast(e.adapter.streaming and e.window.held_full(), clip)
            return e.step_end.prepare()  # [Note: one end of a step]

    @property
    def holding(self) -> bool:
        """The learnt window holds the step's micro-batches, their blocks' backward not run yet."""
        return self.engine.window.held_full()

    def backward_held(self, amp: contextlib.AbstractContextManager) -> None:
        """A forward of the step after its held micro-batches (a tail, or one without autograd): their blocks'
        backward first, under their autocast ``amp``, as their step would have run it."""
        e = self.engine
        with e.guard(discard_step=True), amp, torch.enable_grad():
            e.window.backward_held()

    def clip_as_torch(self, max_norm: float, prepared: Prepared) -> float:
        """torch's ``clip_grad_norm_`` over the prepared step's gradients: their global norm."""
        return self.engine.stepper.clip_as_torch(max_norm, prepared)

    def grad_views(self, prepared: Prepared) -> Iterator[torch.Tensor]:
        """The prepared step's gradients, as tensors a GradScaler's unscale may scale in place."""
        return iter(self.engine.stepper.grad_views(prepared))

    def any_rank(self, flags: list[torch.Tensor]) -> torch.Tensor:
        """Whether any rank set any of ``flags`` (one element each): 1.0 or 0.0 on the compute device."""
        e = self.engine
        local = torch.stack([f.to(e.dev.device).reshape(()) for f in flags]).sum().reshape(1)
        total = e.ranks.all_reduce_world(local) if e.ranks.many else local
        return (total > 0).to(torch.float32)

    def apply(self, prepared: Prepared) -> None:
        """The prepared step's updates; the window starts over."""
        e = self.engine
        with e.guard(discard_step=True):
            e.step_end.apply(prepared)

    def skip(self, prepared: Prepared) -> None:
        """A prepared step not applied (a GradScaler found an overflow): its gradients dropped."""
        e = self.engine
        with e.guard(discard_step=True):
            e.step_end.skip(prepared)

    def hold(self, n: int) -> tuple[int, str]:
        """The window holds the most of ``n`` micro-batches (at least 2) whose checkpoints the plan can keep:
        (how many, ""), or (0, why not) ([Note: the window learns the loop's G], userloop/loop.py)."""
        e = self.engine
        why = ""
        for k in range(n, 1, -1):
            try:
                e.planning.hold_for(k)
            except PlanError as err:
                why = str(err).split("\n")[0]
                continue
            e.window.hold_micro_batches(k)
            return k, ""
        return 0, why

    # ------------------------------------------------------------------ state

    @property
    def many_ranks(self) -> bool:
        return self.engine.ranks.many

    def full_state(self, write_back: bool) -> contextlib.AbstractContextManager:
        """A context in which every unit's optimizer state is whole (the full layout: every node's slices gathered;
        ``write_back``: written back into the node's slices at its end), after the CPU's updates are done."""
        e = self.engine
        e.wait()
        return e.sharding.full_state(e.units, write_back=write_back)

    def module_loaded(self) -> None:
        """The module's parameters were written in place (``load_state_dict``): the host optimizer's masters are
        those views; a device-optimized unit's master takes its host mirror; every copy follows."""
        e = self.engine
        with torch.no_grad():
            for u in e.units:
                if u.optimizer_on_device and u.host is not None and u.host is not u.master and not u.shard.state:
                    assert u.master is not None  # a device-optimized unit's master is made at materialize
                    u.master.copy_(u.host)
        e.sharding.slices.written_whole()  # the full layout: the other nodes' slices handed back at the next upload
        e.weights_loaded()
