"""The DeepSpeed-shaped API: ``out = engine(**batch); engine.backward(out.loss); engine.step()``.

One micro-batch per call, with the optimizer step at the gradient-accumulation boundary; slower than
``train_batch`` (each call moves every streamed block's weights: docs/engine.md). Evaluation forwards
(``engine.eval()`` or ``torch.no_grad()``) keep nothing. A mixin of :class:`~zerofit.engine.engine.Engine`.
"""

from __future__ import annotations


import torch

from zerofit.engine.batch import check_batch
from zerofit.engine.planner import PlanError
from zerofit.engine.store import Home, HostArena


class DeepSpeedStyleAPI:
    """Mixed into :class:`~zerofit.engine.engine.Engine`: ``__call__``/``forward``, ``backward``, ``step``."""


    def __call__(self, **batch):
        """Forward one micro-batch; returns the model's output (with ``.loss``).

        Training (the module in train mode, autograd on): pair with backward(); one micro-batch in flight.
        Evaluation (``engine.eval()``, or under ``torch.no_grad()``): the output only, nothing is kept, so
        any number of forwards may follow each other (also in the middle of an accumulation)."""
        self._check_open()
        if not (torch.is_grad_enabled() and self._model.training):
            return self._evaluate(batch)
        if self._pending is not None:
            raise RuntimeError("forward called twice without backward(); zerofit keeps one micro-batch in flight "
                               "(for evaluation, call engine.eval() or run under torch.no_grad())")
        check_batch(batch, self._batch_spec)
        with self._call(discard_step=True):
            return self._with_fallback(lambda: self._forward_micro(batch))

    forward = __call__

    def _forward_micro(self, batch: dict):
        if self._micro_steps == 0:
            self._ds_t0, self._ds_busy0 = self._start_clock()
        self._ensure_plan([batch])
        if self.deferred is False and self.adapter.streaming and any(not u.optimizer_on_device for u in self.units):
            self._enable_accumulation()
        micros = self._forward([batch], shell_grad=True)
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

    def _enable_accumulation(self) -> None:
        """DeepSpeed-style steps need per-unit host gradient buffers: switch to deferred updates.

        The plan is made again for deferred updates (same placement) and refused if the host
        gradient buffers do not fit, before they are allocated."""
        self.worker.drain()
        try:    # assisted updates need device buffers the first plan may not have room for
            self.plan = self._replan(self._plan_batch, deferred_updates=True)
        except PlanError:
            self.plan = self._replan(self._plan_batch, deferred_updates=True, assisted_updates=False)
        self.deferred = True
        streamed = [u for u in self.blocks if u.home is Home.STREAMED]
        if self.plan.assisted_updates and self._assist is None and streamed:
            self._alloc_assist(max(u.numel for u in streamed))
        host_units = [u for u in self.units if not u.optimizer_on_device]
        a = HostArena(sum(u.numel for u in host_units), torch.float32, self.dev.is_cuda and self.config.offload.pin_memory)
        self._arenas.append(a)
        for u in host_units:
            self._host_grads[id(u)] = a.take(u.numel)


    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss`` (from this engine's forward) through the model, accumulating gradients.

        The gradient is that of ``loss / gradient_accumulation_steps``; with ``scale_wrt_gas=False``
        (DeepSpeed's keyword) that of ``loss`` itself, for callers that already divided it as they want
        (Hugging Face's Trainer: by the micro-batches of the step, or by the step's token count)."""
        self._check_open()
        micro = self._pending
        if micro is None:
            raise RuntimeError("backward() without a forward through the engine")
        with self._call(discard_step=True):
            self._pending = None
            _, final = micro.output
            micro.output = None
            G = self.config.gradient_accumulation_steps if scale_wrt_gas else 1
            scale = self.scaler.scale if self.scaler else 1.0
            with self.dev.timed("compute", label="post"):
                self._post_backward(micro, loss, final, scale / G)
            if self.adapter.streaming:
                self._backward_blocks([micro])
            self._micro_steps += 1

    def step(self) -> None:
        """Take the optimizer step at the gradient-accumulation boundary (a no-op before it)."""
        self._check_open()
        override = self._boundary_override
        if self._micro_steps == 0 or override is False or \
                (override is None and self._micro_steps < self.config.gradient_accumulation_steps):
            return
        with self._call(discard_step=True):
            self.worker.drain()
            applied = self._finish_step()
            self._micro_steps = 0
            self._end_step(self._ds_t0, self._ds_busy0, applied)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether step() would take the optimizer step now (the override when one is set)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return self._micro_steps == self.config.gradient_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's override of where an accumulation ends, set before each micro-batch's backward: True
        makes step() take the optimizer step over however many micro-batches were accumulated (a short last
        accumulation, as accelerate's DeepSpeed wrapper and zerofit.hf ask for at the end of an epoch), False
        holds it back, None returns to counting gradient_accumulation_steps."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary must be True, False or None, found {is_boundary!r}")
        self._boundary_override = is_boundary

