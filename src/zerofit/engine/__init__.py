"""The training engine: one optimizer step over many micro-batches, block-major, composed of parts.

The rooms, in the order a step meets them (docs/engine.md has each part, its state and its notes):

======================  =====================================================================================
``engine.py``           :class:`Engine`: builds the parts, the public surface (``train_batch``, ``save``, ...)
``lifecycle.py``        the engine's states, its guard, what it releases, Ctrl-C held back
``device.py``           the compute device and its streams and events; page-locked host memory
``recovery.py``         the generic fallback; the weights a closing engine takes off the disk tier
``model/``              the model as the engine sees it: shell and blocks (``adapter``), its parameters
                        materialized as flat buffers (``materialize``, ``startup``), parameter groups, an NF4 base,
                        the MLP over sequence tiles (``tiling``)
``plan/``               where each unit lives: the ``Plan`` (``plan``), the placement search (``search``), the
                        engine's plan and its replans (``engine_plan``)
``memory/``             where each tensor lives and how it moves: the units (``store``), weights up
                        (``streamer``), gradients down (``grads``), checkpoints (``activations``), 16-bit copies
``step/``               one step's work: its order (``schedule``), the model's code over the units
                        (``compute``), the optimizer step (``optimizer_step``), the accumulation window, batch
                        checks, hyperparameters, the clock (``timeline``), torch's clip for the user's loop
``update/``             AdamW on flat buffers and who runs it when: the CPU worker, the device's share
                        (``assisted``), speculation, the two-pass kernel
``disk/``               the NVMe tier (``tier``) over its swap file (``swapfile``)
``distributed/``        several ranks and nodes: the process group, sharding, the nodes' slices, failures
``faces/``              other libraries' names over the engine: DeepSpeed's engine, its views and
                        ``offload_states``, torch.optim's optimizer and scheduler views
======================  =====================================================================================

Public names: :class:`Engine`, :class:`Plan`, :class:`PlanError`, :func:`make_plan`. The rest is the parts'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "Plan", "PlanError", "make_plan"]

if TYPE_CHECKING:
    from zerofit.engine.engine import Engine
    from zerofit.engine.plan.plan import Plan, PlanError
    from zerofit.engine.plan.search import make_plan

_HOMES = {
    "Engine": "zerofit.engine.engine",
    "Plan": "zerofit.engine.plan.plan",
    "PlanError": "zerofit.engine.plan.plan",
    "make_plan": "zerofit.engine.plan.search",
}


def __getattr__(name: str) -> Any:
    # imported on first use: a part's module imports zerofit.engine first, which must not import every part
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'zerofit.engine' has no attribute {name!r}")
