"""Compute: the model's own code run over the units' device weights (a part, stateless).

``functional_call`` of the shell (through the adapter's pre and post passes) and of one block, with the unit's
device weights as its parameters (as leaves that take a gradient for the backward, the trained ones only:
[Note: frozen parameters], store.py); a block recomputed with the RNG state its forward saw (models with
dropout). The gradients it computes are summed into each unit's flat fp32 buffer by Grads (memory/grads.py:
:meth:`Grads.accumulate`, the one place a weight gradient is written).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

from zerofit.engine.device import Device
from zerofit.engine.memory.store import Unit
from zerofit.engine.model.adapter import Adapter, block_output
from zerofit.engine.model.attention import Attention
from zerofit.engine.model.kernels import Kernels
from zerofit.engine.step.batch import to_device


class Compute:
    """Holds what the calls need: the model, its adapter (the block modules), the device, the shell's buffers."""

    def __init__(
        self,
        model: nn.Module,
        adapter: Adapter,
        dev: Device,
        shell: Unit,
        kernels: Kernels | None = None,
        attention: Attention | None = None,
    ):
        self.model, self.adapter, self.dev, self.shell = model, adapter, dev, shell
        self.kernels = kernels  # [Note: fast kernels] (model/kernels.py); None: the model's own code
        self.attention = attention  # [Note: attention's backend] (model/attention.py); None: torch's own choice
        self.calling = 0  # the engine's own calls of the model in progress ([Note: a read of the user's model])

    def shell_call(self, leaves: dict):
        """The model's own forward with the shell's ``leaves`` (and buffers) as its parameters: ``call(kwargs)``."""
        params = {**leaves, **self.shell.buffers}

        def call(kw: dict):
            self.calling += 1
            try:
                return functional_call(self.model, params, (), kw, strict=False)
            finally:
                self.calling -= 1

        return call

    @contextlib.contextmanager
    def weights(self, module: nn.Module, params: dict):
        """[Note: the model's own checkpointing]
        ``module``'s parameters are ``params`` (the device weights a call used) for the duration: a backward runs
        inside it. A model that checkpoints its own code (``torch.utils.checkpoint`` in its forward or its blocks',
        Hugging Face's ``gradient_checkpointing_enable()``) recomputes that code during the backward, after the
        ``functional_call`` that ran it has put the module's own parameters back (the host's fp32 masters, not the
        device's 16-bit weights the forward computed with): recomputed there it would use other tensors, in another
        dtype and on another device, and torch's checkpoint would refuse the values it recomputed (or, where they
        matched in shape, the gradient would be of other weights). Under this the recompute sees the forward's
        weights, so the model's checkpointing composes with the engine's (its gradients are the forward's)."""
        with _reparametrize_module(module, params, tie_weights=True, strict=False):
            yield

    def shell_weights(self, leaves: dict):
        """:meth:`weights` of the whole model with the shell's ``leaves`` and buffers (what :meth:`shell_call` ran
        with)."""
        return self.weights(self.model, {**leaves, **self.shell.buffers})

    def leaves(self, unit: Unit, grad: bool) -> dict[str, torch.Tensor]:
        """The unit's device tensors by name for ``functional_call``; with ``grad``, its trained weights as leaves
        that take a gradient (frozen ones never do: [Note: frozen parameters])."""
        views = unit.layout.views(unit.device_weights())
        if grad:
            views = {k: v.detach().requires_grad_(True) for k, v in views.items()}
        return {**views, **unit.frozen_weights(), **unit.buffers}

    def block(self, unit: Unit, leaves: dict, x: torch.Tensor, call, unread: bool = False) -> torch.Tensor:
        """Block ``unit``'s output for input ``x`` and the rest of what the model passed it (``call``).
        ``unread``: a recompute for the backward, whose output's value is not read (the fast kernels skip what only
        that value needs: [Note: a recompute's unread output], model/kernels.py)."""
        module = self.adapter.blocks[unit.index]
        with self.attention.around(x) if self.attention is not None else contextlib.nullcontext():
            if self.kernels is not None and self.kernels.compiled(x):
                return self.kernels.block(module, leaves, x, call, unread)
            return block_output(functional_call(module, leaves, (x, *call.args), call.kwargs, strict=False))

    @contextlib.contextmanager
    def rng(self, state):
        """Replay a saved RNG state for a recompute, leaving the outer stream untouched."""
        if state is None:
            yield
            return
        devices = [self.dev.device] if self.dev.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(state[0])
            if self.dev.is_cuda:
                torch.cuda.set_rng_state(state[1], self.dev.device)
            yield

    def rng_state(self):
        """The RNG state a block's recompute must replay (models with dropout, in training mode), or None."""
        if not (self.adapter.has_dropout and self.model.training):
            return None
        return (torch.get_rng_state(), torch.cuda.get_rng_state(self.dev.device) if self.dev.is_cuda else None)

    def fork_rng(self):
        """The post pass's RNG fork: what it draws (dropout in the head) leaves the outer stream as it was."""
        devices = [self.dev.device] if self.dev.is_cuda else []
        return torch.random.fork_rng(devices=devices, enabled=self.adapter.has_dropout)

    def to_device(self, batch: dict) -> dict:
        return to_device(batch, self.dev.device)  # token ids as int64: [Note: token ids of any integer dtype]
