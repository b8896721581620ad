"""The DeepSpeed-shaped API: ``out = engine(**batch); engine.backward(out.loss); engine.step()``.

One micro-batch per call, with the optimizer step at the gradient-accumulation boundary. The blocks'
backward waits for the boundary and runs block-major over the window's micro-batches, as in train_batch;
each forward moves every streamed block's weights, the later ones as 16-bit copies (docs/engine.md). Evaluation forwards
(``engine.eval()`` or ``torch.no_grad()``) keep nothing. A mixin of :class:`~zerofit.engine.engine.Engine`.
"""

from __future__ import annotations

import logging


import torch

from zerofit.engine.batch import check_batch
from zerofit.engine.lifecycle import EngineState
from zerofit.engine.planner import PlanError, copies_fraction
from zerofit.engine.store import Home, HostArena, Slot, WeightState

log = logging.getLogger("zerofit")


# keys only the post pass (head and loss) reads: a call may differ from its announced micro-batch in these
_WINDOW_LOSS_KEYS = frozenset({"labels", "num_items_in_batch"})


def _same_forward_inputs(announced: dict, batch: dict) -> bool:
    """Whether ``batch`` makes the forward ``announced`` made: the same keys and values, the loss's aside."""
    keys = set(announced) - _WINDOW_LOSS_KEYS
    if keys != set(batch) - _WINDOW_LOSS_KEYS:
        return False
    for k in keys:
        a, b = announced[k], batch[k]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and torch.equal(a.to(b.device), b)):
                return False
        elif a != b:
            return False
    return True


class DeepSpeedStyleAPI:
    """Mixed into :class:`~zerofit.engine.engine.Engine`: ``__call__``/``forward``, ``backward``, ``step``."""


    def __call__(self, **batch):
        """Forward one micro-batch; returns the model's output as the model returns it.

        [Note: a forward records for backward as autograd says]
        As in DeepSpeed, whether a forward can be backpropagated follows ``torch.is_grad_enabled()``, and the
        module's mode only says what the model's own code does with it (dropout): a model straight from
        ``from_pretrained`` is in eval mode, and its ``engine(**batch)``, ``engine.backward(loss)`` trains
        without dropout. With autograd on, a forward is kept for a backward(), one micro-batch in flight; one
        that no backward() followed is dropped by the next forward or train_batch (DeepSpeed drops its graph),
        its loss never counted. Under ``torch.no_grad()`` a forward keeps nothing, so any number of them may
        follow each other, also in the middle of an accumulation."""
        self.lifecycle.check_open()
        if not torch.is_grad_enabled():
            return self._evaluate(batch)
        check_batch(batch, self._batch_spec)
        self._drop_unused_forward()
        with self._call(discard_step=True):
            return self._with_fallback(lambda: self._forward_micro(batch))

    def _drop_unused_forward(self) -> None:
        """A forward that no backward() followed: dropped ([Note: a forward records for backward as autograd
        says])."""
        if self._pending is None:
            return
        log.debug("zerofit: a forward without backward() is dropped")
        self._pending = None
        if not self._micro_steps and not self._held:       # it opened the window: nothing of the window is left
            self._return_kept()
            self._announced = []

    forward = __call__

    # [Note: a window's forwards at once]
    # A caller that knows the accumulation window's micro-batches before the first of them (the Hugging Face
    # Trainer fetches a step's batches up front: zerofit.hf) announces them with forward_window(batches): their
    # forwards run then, block-major, as train_batch's do, so each streamed block crosses PCIe once for all of
    # them instead of once per micro-batch. The later engine(**batch) calls take the forwards in order: one
    # whose inputs equal the next announced micro-batch's (every key but the labels and the loss's
    # num_items_in_batch, which only the post pass reads) gets its post pass (head and loss, with the call's own
    # labels and keywords) on the forward already made; the losses are those of the forwards the user ran, the
    # weights being the same all through a window. A call that does not match drops what is left of the window
    # (its forwards are made again, one at a time, as without it): never a wrong loss, at worst wasted work.

    def forward_window(self, batches: list[dict]) -> None:
        """Announce the accumulation window's micro-batches: run their forwards now, together ([Note: a window's
        forwards at once]); each later ``engine(**batch)`` of the window takes its forward from here. Only at
        the start of a window, in training mode; a no-op on the generic path (a model that does not stream) and
        with several ranks."""
        self.lifecycle.check_open()
        if not torch.is_grad_enabled() or not batches:
            raise RuntimeError("forward_window() announces training forwards: call it with autograd on, and at "
                               "least one micro-batch")
        self._drop_unused_forward()
        if self._micro_steps or self._pending is not None or self._held or self._announced:
            raise RuntimeError("forward_window() is for the start of an accumulation window (after step() took the "
                               "optimizer step, before the window's first forward)")
        if len(batches) > self.config.gradient_accumulation_steps:
            raise ValueError(f"forward_window() got {len(batches)} micro-batches; a window holds at most "
                             f"gradient_accumulation_steps = {self.config.gradient_accumulation_steps}")
        for b in batches:
            check_batch(b, self._batch_spec)
        if not self.adapter.streaming or self.ranks.many:
            # several ranks: every rank must make the same forwards in the same order (their weight gathers are
            # collectives); a window one rank drops and another keeps would leave them waiting on each other
            return
        with self._call(discard_step=True):
            self._with_fallback(lambda: self._announce(batches))

    def _announce(self, batches: list[dict]) -> None:
        self.clock.start()
        self.planning.ensure(batches)
        micros = self._forward(batches, shell_grad=True, **self.planning.checkpoint_args(self.adapter.streaming))
        if self.adapter.streaming:       # not after a fall-back to the generic path: its forwards come later
            self._announced = list(zip(batches, micros))
            self.window_stats["announced"] += 1

    def _can_offer(self) -> bool:
        """At the start of a window, where announced forwards could help ([Note: the loader reads the window
        ahead], deepspeed_surface.py)."""
        return (self.config.gradient_accumulation_steps > 1 and self.adapter.streaming and not self.ranks.many
                and not self._micro_steps
                and self._pending is None and not self._held and not self._announced
                and not self.window_stats["mismatched"] and self.state is EngineState.OPEN)

    def _offer_window(self, batches: list[dict]) -> None:
        """The engine's own training loader read the window ahead: if the window's first call is for
        ``batches[0]``, its forwards are made at once ([Note: a window's forwards at once])."""
        self._offered = list(batches) if len(batches) > 1 and self._can_offer() else None

    def _take_offer(self, batch: dict) -> None:
        offered, self._offered = self._offered, None
        if (self._micro_steps or self._announced or not _same_forward_inputs(offered[0], batch)
                or not torch.is_grad_enabled() or not self._model.training):
            return
        try:
            for b in offered:
                check_batch(b, self._batch_spec)
        except Exception:      # noqa: BLE001 - an odd batch is refused where it is called, not here
            return
        offered[0] = batch
        self._announce(offered)

    def _take_window(self, batch: dict):
        """The announced forward for ``batch`` if it is the next one, else None (the window dropped)."""
        announced, micro = self._announced.pop(0)
        if _same_forward_inputs(announced, batch):
            micro.batch = self._to_device(batch)     # the post pass reads this call's labels and keywords
            return micro
        log.warning("zerofit: engine(**batch) got other inputs than the next micro-batch announced with "
                    "forward_window(); the rest of the window's forwards are made again, one at a time")
        self._announced = []
        self.window_stats["mismatched"] += 1
        return None

    def _forward_micro(self, batch: dict):
        """[Note: the block backward waits for the boundary]"""
        G = self.config.gradient_accumulation_steps
        if self._micro_steps >= G:
            raise RuntimeError(f"{self._micro_steps} micro-batches went through backward() since the last optimizer "
                               f"step and gradient_accumulation_steps is {G}: call engine.step() after each "
                               "backward() (it steps at the accumulation boundary), as DeepSpeed's loop does")
        if self._offered is not None:
            self._take_offer(batch)
        micro = self._take_window(batch) if self._announced else None
        if micro is not None:
            out, final = self._post(micro)
            micro.output = (out, final)
            self._pending = micro
            return out
        if self._micro_steps == 0:
            self.clock.start()
        self.planning.ensure([batch])
        if self._micro_steps == 0 and G > 1 and self._host16_possible():
            self._enable_host16()
        override = self._boundary_override           # more forwards of this window follow?
        self._host16_fill = (self._micro_steps % G < G - 1) if override is None else not override
        if self._micro_steps == 0 and self._host16_fill:
            self._keep_blocks()
        try:
            micros = self._forward([batch], shell_grad=True, first=self._micro_steps, **self.planning.checkpoint_args(self.adapter.streaming))
            if self._host16_fill and self.adapter.streaming:
                self._prefetch_first_blocks()
        finally:
            self._host16_fill = False
        micro = micros[0]
        out, final = self._post(micro)
        micro.output = (out, final)
        self._pending = micro
        return out

    def _evaluate(self, batch: dict):
        """The model's output for ``batch`` without autograd; no state of a step is touched or kept."""
        check_batch(batch, self._batch_spec)
        n = len(self.dev.intervals)
        with self._call(discard_step=False), torch.no_grad():
            out = self._with_fallback(lambda: self._post(self._forward([batch], shell_grad=False)[0])[0])
        del self.dev.intervals[n:]            # not part of any step's timeline
        return out

    # [Note: 16-bit copies for extra forwards]
    # Each DeepSpeed-style forward sees one micro-batch, so a streamed block's weights cross PCIe once per
    # micro-batch, not once per step as in train_batch. The first forward of an accumulation window uploads
    # the fp32 master and casts it on the device (as always); the cast weights are then sent down into a
    # pinned 16-bit host copy (the download engine is idle during forwards), and the window's later forwards
    # and its block backward upload that copy: half the bytes, and bitwise the weights the device cast. A copy
    # is valid while the engine's weights epoch is the one it was taken in: the epoch moves whenever masters
    # may change (every optimizer step, a dropped step, a checkpoint load), and a unit whose update may
    # start (its gradient went down) drops its copy at once. Host memory: 2 B/param of the streamed
    # blocks, planned; without room the engine goes on with fp32 uploads.

    # [Note: 16-bit copies after the update]
    # With immediate updates (no clipping; bf16) a block's update also refreshes its 16-bit copy: the CPU worker
    # casts the new master into it right after the block's AdamW (a pass of 6 B/param, during the backward), and a
    # block the device updates in the backward ([Note: assisted updates in the backward]) casts its new weights
    # there and sends them down with master and moments (2 B/param more, on the download engine). So the next
    # window's first forward uploads 16-bit weights too, half the bytes of the fp32 masters, bitwise what the
    # device's cast would give (one rounding, to nearest even, on either side). Such a copy is labelled
    # ("after", E), E the weights epoch its update belongs to; the optimizer step's move of the epoch to E+1
    # makes that label the valid one, and any other move (a rolled-back step, a checkpoint load) invalidates it.
    # With deferred updates (clipping, fp16) only the device's share does it: its update runs in the next
    # window's first forward, after the step moved the epoch, and its copy is labelled with the epoch itself;
    # the CPU's deferred updates are on that forward's critical path and add no cast.
    # The cast costs the CPU about a third of an AdamW (CAST_SHARE, planner.py), and the CPU already paces the
    # backward (W2: 1.6 s busy against 1.5 s of backward compute; with the casts 2.0 s, its updates spilling into
    # the next forward), so with the copies the device takes a larger share of the updates (copies_fraction:
    # 0.375 -> 0.53, unless offload.assisted_fraction is set): the CPU's busy time stays what it was, the copy
    # engines take the rest; the blocks it takes on get their moments moved into pinned memory once. Its AdamW
    # rounds unlike the CPU's, so the loop then matches train_batch at fp32 rounding (bitwise with the same
    # split). train_batch keeps no copies: unchanged.

    def _prefetch_first_blocks(self) -> None:
        """Another forward of this window follows: start uploading its first streamed blocks now (into the
        slots the last blocks just left: [Note: slot reuse] orders it after their compute), so that forward
        does not begin by waiting for PCIe."""
        streamed = [u for u in self.blocks if u.home is Home.STREAMED]
        window = tuple(streamed[: self.plan.weight_slots])
        for u in streamed[: max(self.plan.weight_slots - 1, 1)]:
            if not self._begin_upload(u, window, wait=self.ranks.many):   # ranks: [Note: sharded units]
                break

    # [Note: a window keeps some blocks]
    # Between a window's first forward and its boundary the gradient buffers (grad_pool: fp32, a block each) are
    # idle: the blocks' backward, their only user, waits for the boundary. Each holds two blocks' 16-bit weights
    # (one in fp32), so the first forward uploads that many streamed blocks into slots carved from them, where
    # they stay, and the window's later forwards find them on the device instead of uploading them again: no
    # device memory beyond the plan's. Kept are the streamed blocks just before the last weight_slots ones,
    # which the pool slots still hold when the boundary's backward begins. At the boundary, before the backward
    # takes the gradient buffers, the kept blocks go back to ON_HOST (the backward uploads them as usual); the
    # compute stream's reads of them come before its first gradient write (one stream), the downloads that read
    # them into host copies are waited for, and the first upload into a carved slot waits for the gradient
    # buffer's last reader (its free_event). A failed step empties every slot, these too ([Note: slot reuse]).

    def _keep_blocks(self) -> None:
        """At a window's first forward, with more forwards to come: carve slots for some streamed blocks out of
        the idle gradient buffers ([Note: a window keeps some blocks])."""
        if (self._kept or not self.config.offload.window_keep_blocks or self.grad_pool is None or self.ranks.many
                or any(g.tenant is not None for g in self.grad_pool.slots)):
            return
        cap = self.weight_pool.slots[0].tensor.numel()
        slots = []
        for g in self.grad_pool.slots:
            room = g.tensor.view(self.dtype)      # (2 x capacity,) in 16-bit, (capacity,) in fp32
            for j in range(room.numel() // cap):
                slots.append(Slot(room[j * cap:(j + 1) * cap], free_event=g.free_event))
        streamed = [u for u in self.blocks if u.home is Home.STREAMED]
        candidates = streamed[:max(len(streamed) - self.plan.weight_slots, 0)]
        keep = candidates[max(len(candidates) - len(slots), 0):]
        for u, slot in zip(keep, slots):
            if u.state is not WeightState.ON_HOST:     # in a pool slot (prefetched): give that slot back first
                self._evict(u)
            self._kept[id(u)] = slot

    def _return_kept(self) -> None:
        """The window's forwards are done: the kept blocks' slots go back to being gradient memory."""
        kept, self._kept = self._kept, {}
        for slot in kept.values():
            self.dev.wait(self.dev.compute, slot.read_event)    # a download filling a host copy from it
            if slot.tenant is not None:
                self._evict(slot.tenant)

    def _host16_possible(self) -> bool:
        streamed = [u for u in self.blocks if u.home is Home.STREAMED and u.swap != "all"]   # "all": has one
        # several ranks upload only a shard of each block: no 16-bit host copies ([Note: sharded units])
        return (self.dtype != torch.float32 and bool(streamed) and not self.ranks.many
                and streamed[0].host16 is None and not getattr(self, "_host16_refused", False))

    def _enable_host16(self) -> None:
        changes = {}
        off = self.config.offload
        if off.copies_after_update and not self.deferred and "assisted_fraction" not in off.model_fields_set:
            # [Note: 16-bit copies after the update]: the device takes a larger share of the updates
            changes["assisted_fraction"] = copies_fraction(off.assisted_fraction)
        try:
            self.planning.adopt_host16(**changes)
        except PlanError as e:
            self._host16_refused = True
            log.info("zerofit: no room for 16-bit host copies of the streamed blocks (%s); DeepSpeed-style "
                     "forwards upload fp32 weights", e)
            return
        streamed = [u for u in self.blocks if u.home is Home.STREAMED and u.swap != "all"]
        a = HostArena(sum(u.numel for u in streamed), self.dtype, self.dev.is_cuda and self.config.offload.pin_memory)
        self._arenas.append(a)
        for u in streamed:
            u.host16, u.host16_epoch = a.take(u.numel), -1
        if self._assist is not None:    # [Note: 16-bit copies after the update]
            self._assist16 = [torch.empty(s[0].numel(), dtype=self.dtype, device=self.dev.device)
                              for s in self._assist]
            self._pin_assisted_moments()

    def _pin_assisted_moments(self) -> None:
        """The blocks the device now updates too (a larger share: copies_fraction) copy their moments over PCIe
        every step: move them into pinned memory, as materialize.py placed the planned share's (a pageable copy
        runs at a seventh of the speed and blocks the host). Once, before the first DeepSpeed-style backward."""
        if not (self.dev.is_cuda and self.config.offload.pin_memory):
            return
        # (assisted blocks are streamed, host-optimized and off the disk tier: the planner's choice)
        movers = [u for u in self.blocks if u.index in self.plan.assisted_blocks and not u.exp_avg.is_pinned()]
        if not movers:
            return
        self.worker.drain()          # no CPU update of the last step still reads or writes them
        self.dev.synchronize()
        arena = HostArena(2 * sum(u.numel for u in movers), torch.float32, True)
        self._arenas.append(arena)
        for u in movers:
            for name in ("exp_avg", "exp_avg_sq"):
                t = arena.take(u.numel)
                t.copy_(getattr(u, name))
                setattr(u, name, t)
        self.clock.note_host()

    # [Note: the block backward waits for the boundary]
    # backward(loss) runs only the post pass's backward (head and loss) for its micro-batch, keeping the
    # gradient at the last block's output beside the micro-batch's block checkpoints (which the forward kept
    # on the device anyway, as train_batch keeps all G). At the accumulation boundary (the G-th backward) the
    # blocks' backward runs once, block-major over the G micro-batches: each block's weights come up once for
    # all of them and its gradient goes to the CPU optimizer once, exactly train_batch's backward, so the
    # gradients (summed in the same order) and the updates are those of train_batch and plain accumulation.
    # The losses the user sees are those of the forwards they ran. step() takes the optimizer step.

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss`` (from this engine's forward) through the model, accumulating gradients
        (the blocks' part at the accumulation boundary: [Note: the block backward waits for the boundary]).

        The gradient is that of ``loss / gradient_accumulation_steps``; with ``scale_wrt_gas=False``
        (DeepSpeed's keyword) that of ``loss`` itself, for callers that already divided it as they want
        (Hugging Face's Trainer: by the micro-batches of the step, or by the step's token count)."""
        self.lifecycle.check_open()
        micro = self._pending
        if micro is None:
            raise RuntimeError("backward() without a forward through the engine")
        with self._call(discard_step=True):
            self._pending = None
            _, final = micro.output
            micro.output = None
            G = self.config.gradient_accumulation_steps
            scale = self.scaler.scale if self.scaler else 1.0
            with self.dev.timed("compute", label="post"):
                # averaged over the ranks, as DeepSpeed's data parallelism does ([Note: sharded units])
                self._post_backward(micro, loss, final, scale / (G if scale_wrt_gas else 1) / self.ranks.world)
            self._micro_steps += 1
            if self.adapter.streaming:
                self._held.append(micro)
                if len(self._held) >= G or self._boundary_override is True:
                    self._backward_held()

    def _backward_held(self) -> None:
        self._return_kept()
        held, self._held = self._held, []
        if self._spec is None:
            self._begin_speculation()
        self._backward_blocks(held)

    def step(self) -> None:
        """Take the optimizer step at the gradient-accumulation boundary (a no-op before it)."""
        self.lifecycle.check_open()
        override = self._boundary_override
        if self._micro_steps == 0 or override is False or \
                (override is None and self._micro_steps < self.config.gradient_accumulation_steps):
            return
        with self._call(discard_step=True):
            if self._held:          # the boundary was set after the last backward()
                self._backward_held()
            self._announced = []        # announced forwards nobody called for: dropped
            applied = self._finish_step()
            self._micro_steps = 0
            self._end_step(applied)

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's override of where an accumulation window ends, set before each micro-batch's forward
        (or at least before its backward): True ends the window with this micro-batch, however many came
        before it (a short last window, as accelerate's DeepSpeed wrapper and zerofit.hf ask for at the end of
        an epoch), so its backward runs the blocks' backward and step() steps; False holds the step back
        (a window stays at most gradient_accumulation_steps long: the device keeps that many micro-batches'
        block checkpoints); None returns to counting gradient_accumulation_steps."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary must be True, False or None, found {is_boundary!r}")
        self._boundary_override = is_boundary

