"""The schedule: the order of a step's compute over its micro-batches (a part, stateless).

1. pre pass (the shell up to block 0) for every micro-batch;
2. forward, block by block; each block runs *all* micro-batches while its weights are on the device, keeping
   each micro-batch's block input as its checkpoint (activations.py; no autograd graph is kept);
3. post pass (final norm, head, loss) and its backward, per micro-batch (over token chunks: [Note: a smaller GPU
   floor], plan/search.py);
4. backward, block by block in reverse: recompute each micro-batch's block from its checkpoint and
   backpropagate, the block's fp32 gradient summed over the micro-batches on the device and handed to the step
   (step/optimizer_step.py) as soon as it is complete;
5. backward of the pre pass into the shell's gradient.

[Note: checkpoints every k blocks]
Every micro-batch of a step keeps its blocks' inputs until the step's backward (block-major order): 32
micro-batches of the 7B shape keep 34 GB. With plan.checkpoint_every = k (the planner's
last resort, or offload.checkpoint_every) the forward keeps the inputs of blocks 0, k, 2k, ... only. The
backward takes the segments from the last: it first runs the forward of the segment's blocks but its last,
block-major over the micro-batches as the forward did and with the same RNG states, which gives the others'
inputs again, then the segment's backward as before, each block recomputed from its input. The inputs are
the forward's bitwise (the same kernels on the same inputs), so are the gradients and the updates. Cost: a
forward more of k - 1 blocks in k and their weights uploaded once more; the memory: 1/k of the checkpoints,
and a segment's k - 1 inputs at a time on the device. The backward's block order, and so the updates'
order, is unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zerofit.engine.memory.store import Unit
from zerofit.engine.model.adapter import Adapter, PreResult, backward_into, loss_of, post_in_chunks
from zerofit.engine.plan.search import CKPT_AHEAD

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.engine.device import Device
    from zerofit.engine.lifecycle import Lifecycle
    from zerofit.engine.memory.activations import Activations
    from zerofit.engine.memory.grads import Grads
    from zerofit.engine.memory.streamer import Streamer
    from zerofit.engine.step.compute import Compute
    from zerofit.engine.step.hooked import Hooked
    from zerofit.engine.step.optimizer_step import Step
    from zerofit.engine.update.host import HostUpdates


log = logging.getLogger("zerofit")


@dataclass
class Micro:
    """State of one micro-batch between the forward and the backward."""

    batch: dict
    pre: PreResult | None  # the pre pass's result; None on the generic path (no blocks apart)
    ckpts: list = field(default_factory=list)  # (B, T, H) input of each block, compute dtype, device
    rng: list = field(default_factory=list)  # RNG state before each block (models with dropout)
    graphs: list = field(default_factory=list)  # checkpointing off: (x, leaves, y) per block, graph kept
    shell_leaves: dict = field(default_factory=dict)
    grad: torch.Tensor | None = None  # gradient w.r.t. the current block boundary
    output: object = None
    anchors: list = field(default_factory=list)  # the hooked mode: each unit's anchor in this micro-batch's forward

    @property
    def pre_pass(self) -> PreResult:
        """``pre`` on the streaming path, where the block passes read it."""
        assert self.pre is not None  # streaming: the pre pass ran
        return self.pre


class Schedule:
    """Runs the passes over the parts that hold the state: compute (the calls), streamer (the weights),
    activations (the checkpoints), grads (the gradient buffers), the step (each complete gradient)."""

    def __init__(
        self,
        *,
        config: ZerofitConfig,
        dev: Device,
        adapter: Adapter,
        units: list[Unit],
        compute: Compute,
        streamer: Streamer,
        activations: Activations,
        grads: Grads,
        step: Step,
        host_updates: HostUpdates,
        lifecycle: Lifecycle,
        hooked: Hooked | None = None,
        generation: Hooked | None = None,
    ) -> None:
        self.config, self.dev, self.adapter = config, dev, adapter
        self.hooked = hooked  # the hooked mode's calls ([Note: the hooked mode], model/hooked.py), or None
        # a chain's blocks called one by one for generate ([Note: generation over the engine's weights], hooked.py)
        self.generation = generation
        self._kv_shape: Any = None  # the model's shape for a generation's cache (an InferShape), at the first generate
        self.shell, self.blocks = units[0], units[1:]
        self.compute, self.streamer, self.activations, self.grads, self.step = (
            compute,
            streamer,
            activations,
            grads,
            step,
        )
        self.host_updates, self.lifecycle = host_updates, lifecycle

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        micro_batches: list[dict],
        *,
        shell_grad: bool,
        offload: bool = False,
        every: int | None = None,
        first: int = 0,
        ahead: int = CKPT_AHEAD,
    ) -> list[Micro]:
        """Pre pass and block-major forward; returns per-micro-batch state with block checkpoints (with
        ``offload``, most of them in pinned host memory: [Note: offloaded checkpoints]; with ``every`` > 1,
        only every ``every``-th block's: [Note: checkpoints every k blocks]). A training forward gives ``every``
        (it holds for the window's backward; an evaluation forward in the middle of a window leaves it) and
        ``first``, its first micro-batch's place in the window (the DeepSpeed-shaped loop's forwards come one at a
        time); ``ahead``: how many blocks ahead the backward brings offloaded checkpoints back ([Note: one
        checkpoint ahead])."""
        if every is not None:
            self.activations.keep_every(every, ahead)
        every = every or 1
        self.streamer.refresh_shell()
        leaves = self.compute.leaves(self.shell, grad=shell_grad)
        micros = []
        with self.dev.timed("compute", label="pre"):
            for mb in micro_batches:
                batch = self.compute.to_device(mb)
                with torch.set_grad_enabled(shell_grad):
                    pre = self.adapter.pre(self.compute.shell_call(leaves), batch) if self.adapter.streaming else None
                micros.append(Micro(batch, pre, shell_leaves=leaves))
        if not self.adapter.streaming:
            return micros
        xs = [m.pre_pass.hidden.detach() for m in micros]
        order = self.blocks
        for pos, unit in enumerate(order):
            self.lifecycle.safe_point()
            self.streamer.acquire(order, pos)
            self.streamer.prefetch(order, pos)
            keep_graph = not self.config.activation_checkpointing
            leaves_b = self.compute.leaves(unit, grad=keep_graph)
            with self.dev.timed("compute", label=unit.name), torch.set_grad_enabled(keep_graph):
                for m, micro in enumerate(micros):
                    micro.ckpts.append(xs[m] if unit.index % every == 0 else None)
                    micro.rng.append(self.compute.rng_state())
                    if keep_graph:  # all blocks are resident (the planner's rule): the graph may hold their weights
                        x = xs[m].requires_grad_(True)
                        y = self.compute.block(unit, leaves_b, x, micro.pre_pass.calls[unit.index])
                        micro.graphs.append((x, leaves_b, y))
                        xs[m] = y.detach()
                    else:
                        xs[m] = self.compute.block(unit, leaves_b, xs[m], micro.pre_pass.calls[unit.index])
            self.streamer.release(unit)
            if offload and self.activations.offloaded(unit.index):
                self.activations.down(micros, unit.index, first)
        for micro, x in zip(micros, xs):
            micro.grad = x  # holds the final hidden state until the post pass
        return micros

    def generate(self, *args, **kwargs):
        """The model's ``generate`` with each streamed unit uploaded at its call ([Note: generation in the hooked
        mode], [Note: generation over the engine's weights], hooked.py), with the shell's current device weights in
        the model for the call."""
        calls = self.hooked or self.generation
        assert calls is not None  # (built for every engine but the hooked mode's, which has its own)
        self.streamer.refresh_shell()
        kept = calls.cyclic and self.streamer.keep_for_generation(self._generation_room(args, kwargs))
        try:
            with self.compute.shell_weights(self.compute.leaves(self.shell, grad=calls.cyclic)):
                return calls.generate(self.adapter.model, *args, **kwargs)
        finally:
            if kept:
                self.streamer.return_kept()

    def _generation_room(self, args: tuple, kwargs: dict) -> int:
        """[Note: generation keeps blocks] (plan/generation.py), within the plan's device budget (on the CPU, only
        where ``max_gpu_memory`` is set): a chain's ``generate`` whose cache cannot fit beside what stays is refused
        by name (GenerationTooLarge); else, how many streamed blocks it keeps in slots of its own."""
        plan, pool = self.streamer.planning.plan, self.streamer.pool
        if plan.device_budget is None or not self.adapter.streaming:
            return 0
        from zerofit.engine.plan.generation import GenerationTooLarge, blocks_kept, generation_refusal, generation_shape
        from zerofit.estimate.serve import serve_shape

        if self._kv_shape is None:
            self._kv_shape = serve_shape(self.adapter.model, self.streamer.dtype)
        sequences, length, prompt = generation_shape(self.adapter.model, args, kwargs)
        refusal = generation_refusal(plan, self._kv_shape, sequences, length, plan.device_budget)
        if refusal:
            raise GenerationTooLarge(refusal)
        if pool is None:
            return 0
        slot = pool.slots[0].tensor
        beyond = len(self.streamer.beyond_pool())
        slot_bytes = slot.numel() * slot.element_size()
        return blocks_kept(plan, self._kv_shape, sequences, length, plan.device_budget, slot_bytes, beyond, prompt)

    # ------------------------------------------------------------------ post pass

    def _into_shell(self, grads: list, names: list[str]) -> None:
        """``grads`` (of the shell's ``names``) added into the shell's gradient."""
        assert self.shell.grads.tensor is not None  # the shell is resident: its own gradient buffer
        self.grads.accumulate(self.shell, self.shell.grads.tensor, grads, names)

    def post(self, micro: Micro):
        """Post pass with autograd: returns (output, x_L leaf)."""
        if self.hooked is not None:  # [Note: a unit's call as an autograd function]
            with self.hooked.installed(grad=torch.is_grad_enabled()) as anchors:
                micro.anchors = anchors
                return self.adapter.full(self.compute.shell_call(micro.shell_leaves), micro.batch), None
        if not self.adapter.streaming:
            return self.adapter.full(self.compute.shell_call(micro.shell_leaves), micro.batch), None
        assert micro.grad is not None  # the final hidden state, from the forward
        final = micro.grad.detach().requires_grad_(True)
        with self.compute.fork_rng():
            out = self.adapter.post(self.compute.shell_call(micro.shell_leaves), micro.batch, final)
        return out, final

    def post_backward(self, micro: Micro, loss: torch.Tensor, final: torch.Tensor | None, seed_scale: float):
        """The post pass's backward (``loss * seed_scale``) into the shell's gradient and, streaming, the final
        hidden state's gradient (``micro.grad``)."""
        names = list(self.shell.layout.names)
        reached = []

        def accumulate(grads):
            reached.append(any(g is not None for g in grads))
            self._into_shell(grads, names)

        # the hooked mode: its units' anchors are asked for too, so every unit's backward runs
        anchors, micro.anchors = micro.anchors, []
        ran = self.hooked.backwards if self.hooked is not None else 0
        with self.compute.shell_weights(micro.shell_leaves):  # [Note: the model's own checkpointing]
            got = backward_into(
                loss * seed_scale,
                [final] if final is not None else anchors,
                [micro.shell_leaves[n] for n in names],
                accumulate,
            )
        if self.hooked is not None:
            reached[0] = reached[0] or self.hooked.backwards > ran
            self.hooked.backward_done()
        if (final is not None and got[0] is None) or (final is None and not reached[0]):
            raise RuntimeError(
                "backward(loss): the loss does not depend on the engine's last forward (a loss of an "
                "earlier forward, whose graph the next forward dropped, or of another model); call "
                "backward() on what the last engine(...) call returned"
            )
        if final is not None:
            (micro.grad,) = got

    def post_chunked(self, micro: Micro, seed_scale: float, chunks: int) -> torch.Tensor:
        """The post pass and its backward over token chunks (adapter.post_in_chunks); returns the micro-batch's
        loss, its final hidden state's gradient in ``micro.grad``."""
        names = list(self.shell.layout.names)
        assert micro.grad is not None  # the final hidden state, from the forward
        micro.grad, total = post_in_chunks(
            self.adapter,
            self.compute.shell_call(micro.shell_leaves),
            micro.batch,
            micro.grad.detach(),
            [micro.shell_leaves[n] for n in names],
            seed_scale,
            chunks,
            lambda grads: self._into_shell(grads, names),
            fork_rng=self.compute.fork_rng,
            weights=lambda: self.compute.shell_weights(micro.shell_leaves),
        )
        return total

    def _fused_loss(self, micro: Micro) -> bool:
        """Whether train_batch's post pass runs the fused linear cross-entropy ([Note: fast kernels])."""
        kernels = self.compute.kernels
        return (
            kernels is not None
            and kernels.fused_loss
            and self.adapter.streaming
            and self.compute.model.training
            and "labels" in micro.batch
        )

    def post_fused(self, micro: Micro, seed_scale: float, chunks: int) -> torch.Tensor:
        """The post pass as the model's final norm and the fused head and loss ([Note: a fused linear
        cross-entropy], model/linear_loss.py), and its backward: the loss, the final hidden state's gradient in
        ``micro.grad``."""
        kernels = self.compute.kernels
        assert kernels is not None and micro.grad is not None  # the final hidden state, from the forward
        final = micro.grad.detach().requires_grad_(True)
        with self.compute.fork_rng():
            loss = kernels.post_loss(self.compute.shell_call(micro.shell_leaves), micro.batch, final, chunks)
        self.post_backward(micro, loss, final, seed_scale)
        return loss

    def post_all(self, micros: list[Micro], seed_scale: float, chunks: int) -> list[torch.Tensor]:
        """train_batch's post pass and its backward, each micro-batch in turn: the losses (detached)."""
        losses = []
        for micro in micros:
            self.lifecycle.safe_point()
            with self.dev.timed("compute", label="post"):
                if self._fused_loss(micro):
                    loss = self.post_fused(micro, seed_scale, chunks)
                elif chunks > 1:
                    loss = self.post_chunked(micro, seed_scale, chunks)
                else:
                    out, final = self.post(micro)
                    loss = loss_of(out)
                    del out  # the logits are not needed for the backward: free them first
                    self.post_backward(micro, loss, final, seed_scale)
            losses.append(loss.detach())
        return losses

    # ------------------------------------------------------------------ backward

    def _backward_steps(self, first: int = 0) -> list[tuple[Unit, bool]]:
        """The backward's blocks in turn, (unit, recompute): in reverse; with checkpoints every k blocks, each
        segment's recomputed inputs first ([Note: checkpoints every k blocks]). Only blocks ``first`` onwards
        ([Note: no backward below the lowest trained block]); a segment's recomputes only where one of its blocks
        runs its backward."""
        every, L = self.activations.every, len(self.blocks)
        if every == 1:
            return [(u, False) for u in reversed(self.blocks[first:])]
        steps = []
        for start in reversed(range(0, L, every)):
            end = min(start + every, L)
            if end - 1 < first:
                break
            steps += [(self.blocks[i], True) for i in range(start, end - 1)]
            steps += [(self.blocks[i], False) for i in reversed(range(max(start, first), end))]
        return steps

    def _first_backward(self, micros: list[Micro]) -> int:
        """[Note: no backward below the lowest trained block]
        A block's backward makes its weights' gradients and its input's; its input's gradient is needed only by a
        trained block, or shell parameter, before it. Where nothing before block 0 trains (the pre pass's output
        needs no gradient: a frozen embedding) the blocks below the lowest trained one have nothing to give a
        gradient to: their backward is not run, and they are not uploaded again for it. A PEFT model with
        ``layers_to_transform`` above the first layers, or a full fine-tune of the top layers, skips the rest."""
        if any(m.pre_pass.hidden.requires_grad for m in micros):
            return 0
        return next((u.index for u in self.blocks if u.trains), len(self.blocks))

    def _recompute_inputs(self, micros: list[Micro], unit: Unit) -> None:
        """[Note: checkpoints every k blocks]: block ``unit``'s forward again from its input, for the next block's
        input, every micro-batch."""
        self.activations.up(micros, unit.index)
        self.activations.wait(unit.index)
        leaves = self.compute.leaves(unit, grad=False)
        with self.dev.timed("compute", label=f"{unit.name}(inputs)"), torch.no_grad():
            for micro in micros:
                with self.compute.rng(micro.rng[unit.index]):
                    y = self.compute.block(unit, leaves, micro.ckpts[unit.index], micro.pre_pass.calls[unit.index])
                micro.ckpts[unit.index + 1] = y

    def backward_blocks(self, micros: list[Micro]) -> None:
        """The blocks' backward in reverse, block-major over ``micros``, each block's gradient handed to the step
        as it completes; then the pre pass's backward into the shell's gradient."""
        first = self._first_backward(micros)
        steps = self._backward_steps(first)
        order = [u for u, _ in steps]
        if not self.step.deferred or self.step.speculator.current is not None:  # the updates start during it
            self.host_updates.expect(list(reversed(self.blocks)), grads_written=False)
        for pos, (unit, recompute) in enumerate(steps):
            self.lifecycle.safe_point()
            self.streamer.acquire(order, pos)
            self.streamer.prefetch(order, pos)
            if recompute:
                self._recompute_inputs(micros, unit)
                self.streamer.release(unit)
                continue
            gdst = self.grads.buffer(unit)
            names = list(unit.layout.names)
            self.activations.up(micros, unit.index)  # [Note: offloaded checkpoints] (no-op otherwise)
            self.activations.wait(unit.index)
            for ahead in range(1, min(self.activations.ahead, unit.index - first) + 1):  # a no-op but the farthest
                self.activations.up(micros, unit.index - ahead)
            with self.dev.timed("compute", label=unit.name):
                for micro in micros:
                    self._block_backward(unit, micro, names, gdst)
            self.streamer.release(unit)
            self.streamer.evict(unit)
            self.step.unit_done(unit)
        names = list(self.shell.layout.names)
        for micro in micros:  # backward of the pre pass into the shell's gradient
            if names and micro.pre_pass.hidden.requires_grad:  # else nothing before block 0 trains
                with self.dev.timed("compute", label="pre"), self.compute.shell_weights(micro.shell_leaves):
                    backward_into(
                        micro.pre_pass.hidden,
                        [],
                        [micro.shell_leaves[n] for n in names],
                        lambda g: self._into_shell(g, names),
                        micro.grad,
                    )
            micro.grad = None

    def _block_backward(self, unit: Unit, micro: Micro, names: list[str], gdst: torch.Tensor | None) -> None:
        """One micro-batch's backward through block ``unit``: its input's gradient into ``micro.grad``, its weights'
        added into ``gdst``; the recomputed input and output and the weight gradients go when it returns ([Note: one
        micro-batch's gradients at a time], adapter.py)."""
        if micro.graphs:
            x, leaves, y = micro.graphs[unit.index]
            micro.graphs[unit.index] = None
        else:  # recompute the block from its checkpoint, replaying its RNG state
            x = micro.ckpts[unit.index].detach().requires_grad_(True)
            leaves = self.compute.leaves(unit, grad=True)
            with torch.enable_grad(), self.compute.rng(micro.rng[unit.index]):  # y: only its graph is used
                y = self.compute.block(unit, leaves, x, micro.pre_pass.calls[unit.index], unread=True)
        with self.compute.weights(self.adapter.blocks[unit.index], leaves):  # [Note: the model's own checkpointing]
            (micro.grad,) = backward_into(
                y, [x], [leaves[n] for n in names], lambda g: self.grads.accumulate(unit, gdst, g, names), micro.grad
            )
        micro.ckpts[unit.index] = None

    # ------------------------------------------------------------------ the chunked loss's probe

    def chunked_loss_works(self, hidden: int, dtype: torch.dtype) -> bool:
        """Whether the model's head and loss run on a chunk of the final hidden state ([Note: a smaller GPU
        floor], plan/search.py): tried once, on 4 tokens, with the shell's own device weights. A model that reshapes
        the hidden state by the input's length after its blocks (GPT-2) fails it."""
        if not (self.adapter.streaming and self.adapter.chunkable_loss):
            return False
        dev = self.dev.device
        ids = torch.zeros(1, 4, dtype=torch.long, device=dev)
        lab = torch.zeros(1, 2, dtype=torch.long, device=dev)
        final = torch.zeros(1, 2, hidden, dtype=dtype, device=dev)
        try:
            with torch.no_grad():
                out = self.adapter.post(
                    self.compute.shell_call(self.compute.leaves(self.shell, grad=False)),
                    {
                        "input_ids": ids,
                        "labels": lab,
                        "shift_labels": lab,
                        "num_items_in_batch": torch.tensor(2, device=dev),
                    },
                    final,
                )
            loss = loss_of(out)
            logits = out["logits"] if isinstance(out, dict) else getattr(out, "logits", None)
            return loss.dim() == 0 and (logits is None or logits.shape[1] == 2)
        except Exception as e:  # noqa: BLE001 - any failure: this model's loss is not chunked
            log.info(
                "zerofit: the head and loss cannot run over token chunks for this model (%s: %s)", type(e).__name__, e
            )
            return False
