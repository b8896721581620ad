"""The accumulation window of the DeepSpeed-shaped loop: ``out = engine(**batch); engine.backward(out.loss);
engine.step()`` (a part).

One micro-batch per call, with the optimizer step at the gradient-accumulation boundary. The blocks' backward
waits for the boundary and runs block-major over the window's micro-batches, as in train_batch; each forward
moves every streamed block's weights, the later ones as 16-bit copies (copies16.py). The engine's public calls
(engine.py) check the batch, hold Ctrl-C and handle errors; this part keeps the window and runs its passes.

[Note: a forward records for backward as autograd says]
As in DeepSpeed, whether a forward can be backpropagated follows ``torch.is_grad_enabled()``, and the
module's mode only says what the model's own code does with it (dropout): a model straight from
``from_pretrained`` is in eval mode, and its ``engine(**batch)``, ``engine.backward(loss)`` trains
without dropout. With autograd on, a forward is kept for a backward(), one micro-batch in flight; one
that no backward() followed is dropped by the next forward or train_batch (DeepSpeed drops its graph),
its loss never counted. Under ``torch.no_grad()`` a forward keeps nothing, so any number of them may
follow each other, also in the middle of an accumulation.

[Note: a window's forwards at once]
A caller that knows the accumulation window's micro-batches before the first of them (the Hugging Face
Trainer fetches a step's batches up front: zerofit.hf) announces them with forward_window(batches): their
forwards run then, block-major, as train_batch's do, so each streamed block crosses PCIe once for all of
them instead of once per micro-batch. The later engine(**batch) calls take the forwards in order: one
whose inputs equal the next announced micro-batch's (every key but the labels and the loss's
num_items_in_batch, which only the post pass reads) gets its post pass (head and loss, with the call's own
labels and keywords) on the forward already made; the losses are those of the forwards the user ran, the
weights being the same all through a window. A call that does not match drops what is left of the window
(its forwards are made again, one at a time, as without it): never a wrong loss, at worst wasted work.

[Note: the block backward waits for the boundary]
backward(loss) runs only the post pass's backward (head and loss) for its micro-batch, keeping the
gradient at the last block's output beside the micro-batch's block checkpoints (which the forward kept
on the device anyway, as train_batch keeps all G). At the accumulation boundary (the G-th backward) the
blocks' backward runs once, block-major over the G micro-batches: each block's weights come up once for
all of them and its gradient goes to the CPU optimizer once, exactly train_batch's backward, so the
gradients (summed in the same order) and the updates are those of train_batch and plain accumulation.
The losses the user sees are those of the forwards they ran. step() takes the optimizer step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from zerofit.engine.lifecycle import EngineState, Lifecycle
from zerofit.engine.step.batch import BatchSpec, check_batch

if TYPE_CHECKING:
    from torch import nn

    from zerofit.config.schema import ZerofitConfig
    from zerofit.engine.device import Device
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.memory.copies16 import Copies16
    from zerofit.engine.memory.grads import Grads
    from zerofit.engine.memory.streamer import Streamer
    from zerofit.engine.model.adapter import Adapter
    from zerofit.engine.plan.engine_plan import Planning
    from zerofit.engine.step.compute import Compute
    from zerofit.engine.step.schedule import Micro, Schedule
    from zerofit.engine.step.timeline import Timeline
    from zerofit.engine.update.assisted import DeviceUpdates
    from zerofit.engine.update.speculation import Speculator


log = logging.getLogger("zerofit")

# keys only the post pass (head and loss) reads: a call may differ from its announced micro-batch in these
_WINDOW_LOSS_KEYS = frozenset(
    {
        "labels",
        "num_items_in_batch",
        # nor the blocks' forward: the engine runs them without a cache, and TRL's
        # fused-head flag (SFTTrainer's compute_loss adds both) is the post pass's
        "use_cache",
        "fused_lm_head",
    }
)


def same_forward_inputs(announced: dict, batch: dict) -> bool:
    """Whether ``batch`` makes the forward ``announced`` made: the same keys and values, the loss's aside."""
    keys = set(announced) - _WINDOW_LOSS_KEYS
    if keys != set(batch) - _WINDOW_LOSS_KEYS:
        return False
    for k in keys:
        a, b = announced[k], batch[k]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.shape == b.shape
                and torch.equal(a.to(b.device), b)
            ):
                return False
        elif a != b:
            return False
    return True


class Window:
    """State: ``micro_steps`` (backward()s since the optimizer step), ``pending`` (the micro-batch whose forward
    waits for its backward), ``held`` (micro-batches whose blocks' backward waits for the boundary),
    ``announced`` ((batch, micro-batch) forwards made ahead by forward_window), ``offered`` (a window the
    engine's own loader read ahead), ``boundary`` (set_gradient_accumulation_boundary's override) and ``stats``
    (forward_window() calls, and calls that dropped an announced window)."""

    def __init__(
        self,
        *,
        config: ZerofitConfig,
        dev: Device,
        ranks: Ranks,
        adapter: Adapter,
        model: nn.Module,
        planning: Planning,
        schedule: Schedule,
        streamer: Streamer,
        grads: Grads,
        copies16: Copies16,
        device_updates: DeviceUpdates,
        compute: Compute,
        speculator: Speculator,
        clock: Timeline,
        lifecycle: Lifecycle,
        batch_spec: BatchSpec,
        carry: Window | None = None,
    ) -> None:
        self.config, self.dev, self.ranks, self.adapter, self.model = config, dev, ranks, adapter, model
        self.planning, self.schedule, self.streamer, self.grads = planning, schedule, streamer, grads
        self.copies16, self.device_updates, self.compute = copies16, device_updates, compute
        self.speculator, self.clock, self.lifecycle, self.batch_spec = speculator, clock, lifecycle, batch_spec
        self.micro_steps = 0
        self.pending: Micro | None = None  # the last forward's, until its backward
        self.held: list = []
        self.announced: list[tuple] = []
        self.offered: list[dict] | None = None
        self.offer_leads = False  # the offer may start one batch after the window's first (Window.offer)
        # what outlives a rebuild of the parts ([Note: generic fallback], recovery.py): the caller's override
        # and the counters
        self.boundary: bool | None = carry.boundary if carry is not None else None
        self.stats: dict[str, int] = carry.stats if carry is not None else {"announced": 0, "mismatched": 0}
        # the user's loop ([Note: the user's loop drives the engine], userloop): any number of micro-batches per
        # step, the held ones' blocks backward whenever G of them are held
        self.unbounded: bool = carry.unbounded if carry is not None else False
        # the user's loop with the default window: the loop's G, learnt from its first step (None: the config's)
        self.hold: int | None = carry.hold if carry is not None else None

    @property
    def G(self) -> int:
        return self.hold if self.hold is not None else self.config.gradient_accumulation_steps

    def hold_micro_batches(self, n: int | None) -> None:
        """The user's loop: hold the first ``n`` micro-batches of each step before their blocks' backward, any
        after them each at its own ``backward()`` ([Note: the window learns the loop's G], userloop); None: a window
        of one. Any number of micro-batches per step either way."""
        self.hold = n
        self.unbounded = True

    @property
    def in_tail(self) -> bool:
        """The user's loop, past the micro-batches its window holds: each goes on at its own backward()."""
        return self.hold is not None and self.micro_steps >= self.hold

    def reset(self) -> None:
        """Drop the window in progress (a failed step): nothing of it is left."""
        self.pending = None
        self.micro_steps = 0
        self.held = []
        self.announced, self.offered = [], None

    def position(self) -> dict | None:
        """Where in a window the engine is, for a checkpoint's record: None at a boundary, else the micro-batches
        since the last step, whether a forward waits for its backward, whether they are held (their blocks'
        backward not run yet)."""
        if not self.in_progress():
            return None
        return {"micro_batches": self.micro_steps, "forward_pending": self.pending is not None, "held": bool(self.held)}

    def any_number_of_micro_batches(self, yes: bool) -> None:
        """Whether a window of one takes any number of micro-batches before its step (the user's loop: each
        micro-batch's blocks backward at its own ``backward()``) instead of refusing the G+1-th."""
        self.unbounded = yes

    def in_progress(self) -> str | None:
        """What of a window is open (a forward without backward(), micro-batches without step(), announced
        forwards), in words; None when none is."""
        if not (self.micro_steps or self.pending is not None or self.announced):
            return None
        return (
            f"{self.micro_steps} micro-batches since the last optimizer step, forward pending: "
            f"{self.pending is not None}"
        )

    def override(self, is_boundary: bool | None) -> None:
        """set_gradient_accumulation_boundary's value (None: count gradient_accumulation_steps)."""
        self.boundary = is_boundary

    # ------------------------------------------------------------------ forwards

    def drop_unused(self) -> None:
        """A forward that no backward() followed: dropped ([Note: a forward records for backward as autograd
        says])."""
        if self.pending is None:
            return
        log.debug("zerofit: a forward without backward() is dropped")
        self.pending = None
        if not self.micro_steps and not self.held:  # it opened the window: nothing of the window is left
            self.streamer.return_kept()
            self.announced = []

    def may_announce(self, batches: list[dict]) -> bool:
        """forward_window()'s checks: at the start of a window, with autograd on, at most G micro-batches the model
        takes (errors otherwise). False where announcing does nothing: the generic path, several ranks."""
        if not torch.is_grad_enabled() or not batches:
            raise RuntimeError(
                "forward_window() announces training forwards: call it with autograd on, and at least one micro-batch"
            )
        self.drop_unused()
        if self.in_progress() or self.held:
            raise RuntimeError(
                "forward_window() is for the start of an accumulation window (after step() took the "
                "optimizer step, before the window's first forward)"
            )
        if len(batches) > self.G:
            raise ValueError(
                f"forward_window() got {len(batches)} micro-batches; a window holds at most "
                f"gradient_accumulation_steps = {self.G}"
            )
        for b in batches:
            check_batch(b, self.batch_spec)
        # several ranks: every rank must make the same forwards in the same order (their weight gathers are
        # collectives); a window one rank drops and another keeps would leave them waiting on each other
        return self.adapter.streaming and not self.ranks.many

    def announce(self, batches: list[dict]) -> None:
        """[Note: a window's forwards at once]: the window's forwards, now, block-major."""
        self.clock.start()
        self.planning.ensure(batches)
        micros = self.schedule.forward(
            batches, shell_grad=True, **self.planning.checkpoint_args(self.adapter.streaming)
        )
        if self.adapter.streaming:  # not after a fall-back to the generic path: its forwards come later
            self.announced = list(zip(batches, micros))
            self.stats["announced"] += 1

    def can_offer(self) -> bool:
        """At the start of a window, where announced forwards could help ([Note: the loader reads the window
        ahead], deepspeed_surface.py)."""
        return (
            self.G > 1
            and self.adapter.streaming
            and not self.ranks.many
            and not self.micro_steps
            and self.pending is None
            and not self.held
            and not self.announced
            and not self.stats["mismatched"]
            and self.lifecycle.state is EngineState.OPEN
        )

    def offer(self, batches: list[dict], may_lead: bool = False) -> None:
        """A loader read the window ahead: if the window's first call is for ``batches[0]``, its forwards are made
        at once ([Note: a window's forwards at once]). ``may_lead``: the batches may start one after the window's
        first (a loader wrapped by one that fetches a batch ahead of the one it yields: accelerate's); a first
        call for another batch then takes it and the offered ones after it (each later call checked as always)."""
        self.offered = list(batches) if len(batches) > 1 and self.can_offer() else None
        self.offer_leads = may_lead

    def _take_offer(self, batch: dict) -> None:
        offered, self.offered = self.offered, None
        assert offered is not None  # the caller saw an offer
        if self.micro_steps or self.announced or not torch.is_grad_enabled() or not self.model.training:
            return
        if not same_forward_inputs(offered[0], batch):
            if not self.offer_leads:
                return
            offered = [batch, *offered[: self.G - 1]]
        try:
            for b in offered:
                check_batch(b, self.batch_spec)
        except Exception:  # noqa: BLE001 - an odd batch is refused where it is called, not here
            return
        offered[0] = batch
        self.announce(offered)

    def _take_announced(self, batch: dict):
        """The announced forward for ``batch`` if it is the next one, else None (the window dropped)."""
        announced, micro = self.announced.pop(0)
        if same_forward_inputs(announced, batch):
            micro.batch = self.compute.to_device(batch)  # the post pass reads this call's labels and keywords
            return micro
        log.warning(
            "zerofit: engine(**batch) got other inputs than the next micro-batch announced with "
            "forward_window(); the rest of the window's forwards are made again, one at a time"
        )
        self.announced = []
        self.stats["mismatched"] += 1
        return None

    def refuse_past_g(self) -> None:
        """A forward past the window's G micro-batches, before step(), is refused before the step's guard: the
        refusal changes nothing (the window and its held backward stay, whatever updates they began), so the
        step() its message asks for can follow."""
        if self.micro_steps >= self.G and not self.unbounded:
            raise RuntimeError(
                f"{self.micro_steps} micro-batches went through backward() since the last optimizer "
                f"step and gradient_accumulation_steps is {self.G}: call engine.step() after each "
                "backward() (it steps at the accumulation boundary), as DeepSpeed's loop does"
            )

    def forward(self, batch: dict):
        """One micro-batch's forward and post pass: its output; the micro-batch waits for its backward()
        ([Note: the block backward waits for the boundary]). The caller has refused a forward past G
        (:meth:`refuse_past_g`)."""
        G = self.G
        if self.offered is not None:
            self._take_offer(batch)
        micro = self._take_announced(batch) if self.announced else None
        if micro is not None:
            out, final = self.schedule.post(micro)
            micro.output = (out, final)
            self.pending = micro
            return out
        if self.micro_steps == 0:
            self.clock.start()
        self.planning.ensure([batch])
        if self.micro_steps == 0 and G > 1 and self.copies16.possible():
            self.copies16.enable(self.device_updates)
        override = self.boundary  # more forwards of this window follow?
        more = (self.micro_steps % G < G - 1 and not self.in_tail) if override is None else not override
        if self.micro_steps == 0 and more and self.adapter.streaming:  # (the hooked mode's backward runs at once:
            self.streamer.keep_blocks(self.grads.pool)  # its gradient slots are never idle between forwards)
        with self.copies16.filling(more):
            micros = self.schedule.forward(
                [batch],
                shell_grad=True,
                first=self.micro_steps,
                **self.planning.checkpoint_args(self.adapter.streaming),
            )
            if more and self.adapter.streaming:
                self.streamer.prefetch_first_blocks()
        micro = micros[0]
        out, final = self.schedule.post(micro)
        micro.output = (out, final)
        self.pending = micro
        return out

    # ------------------------------------------------------------------ backward and the boundary

    def take_pending(self):
        """The micro-batch a backward() is for (its forward's), or RuntimeError."""
        if self.pending is None:
            raise RuntimeError("backward() without a forward through the engine")
        return self.pending

    def backward(self, micro, loss: torch.Tensor, scale_wrt_gas: bool, scale: float) -> None:
        """The post pass's backward of ``micro`` (``loss`` / G unless ``scale_wrt_gas`` is False, times the fp16
        ``scale``, over the ranks); at the boundary the blocks' backward over the window."""
        self.pending = None
        _, final = micro.output
        micro.output = None
        G = self.G
        with self.dev.timed("compute", label="post"):
            # averaged over the ranks, as DeepSpeed's data parallelism does ([Note: sharded units])
            self.schedule.post_backward(micro, loss, final, scale / (G if scale_wrt_gas else 1) / self.ranks.world)
        tail = self.in_tail
        self.micro_steps += 1
        if self.adapter.streaming:
            self.held.append(micro)
            if self.hold is not None and not tail and self.boundary is None and len(self.held) >= G:
                return  # the user's loop: left to the call that prepares its step, or to its next forward
            if len(self.held) >= G or self.boundary is True or tail:
                self._backward_held()

    def held_full(self) -> bool:
        """The user's loop's learnt window holds its micro-batches and their blocks' backward has not run: it runs
        in the call that prepares the step (before_step) or before the next forward (:meth:`backward_held`),
        so that a step whose factor is known by then updates in it ([Note: updates in the backward of the user's
        loop], update/speculation.py)."""
        return self.hold is not None and bool(self.held) and len(self.held) >= self.G

    def backward_held(self) -> None:
        """The held micro-batches' blocks backward, now (a tail micro-batch's forward comes first)."""
        if self.held:
            self._backward_held()

    def _backward_held(self) -> None:
        self.streamer.return_kept()
        held, self.held = self.held, []
        if self.speculator.current is None:
            # the step's whole gradient in this backward: a window the step must end (or the loop said it ends)
            whole = self.micro_steps == len(held) and (
                self.boundary is True or (len(held) >= self.G and not self.unbounded and self.hold is None)
            )
            self.speculator.begin(self.adapter.streaming, whole)
        self.schedule.backward_blocks(held)

    def at_boundary(self) -> bool:
        """Whether step() takes the optimizer step now (else it is a no-op)."""
        override = self.boundary
        return not (self.micro_steps == 0 or override is False or (override is None and self.micro_steps < self.G))

    def before_step(self) -> None:
        """The boundary's step: the blocks' backward if the boundary was set after the last backward(); announced
        forwards nobody called for are dropped."""
        if self.held:
            self._backward_held()
        self.announced = []

    def stepped(self) -> None:
        """The optimizer step was taken (or skipped): a new window begins."""
        self.micro_steps = 0
