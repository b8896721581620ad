"""The user's optimizer on a loop: the checks that refuse, by name, an optimizer the engine cannot stand in for
(:func:`check_optimizer`), its groups as the engine's one (:class:`OneGroup`), and the functions torch calls for
every optimizer and module in the process once a loop is wrapped (patches.py installs them): the step pre- and
post-hooks that take the engine's step, and ``zero_grad`` that tells the loop first ([Note: zero_grad], loop.py)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from zerofit.userloop.live import LIVE, loop_of
from zerofit.userloop.loop import UserLoopError

if TYPE_CHECKING:
    from zerofit.userloop.loop import UserLoop


class OneGroup:
    """The user's optimizer as ClientSchedule's carrier: its groups (the same settings each) as the engine's one."""

    def __init__(self, optimizer):
        self.inner = optimizer

    @property
    def param_groups(self):
        return self.inner.param_groups[:1]


def check_optimizer(opt, loop: UserLoop) -> None:
    """Refuse (:class:`UserLoopError`) an optimizer the engine cannot stand in for, by name."""
    name = type(opt).__name__
    if not isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        raise UserLoopError(
            f"{name}: zerofit's engine steps AdamW (torch.optim.AdamW, or Adam without weight decay); use one of them"
        )
    groups = opt.param_groups
    for i, g in enumerate(groups):
        if g.get("amsgrad") or g.get("maximize"):
            raise UserLoopError(f"{name}.param_groups[{i}]: amsgrad / maximize are not zerofit's AdamW")
        if isinstance(opt, torch.optim.Adam) and not isinstance(opt, torch.optim.AdamW) and g["weight_decay"]:
            raise UserLoopError(
                f"torch.optim.Adam with weight_decay {g['weight_decay']} (L2 added to the gradient) "
                "is not AdamW's decoupled decay: use torch.optim.AdamW"
            )
    keys = ("lr", "betas", "eps", "weight_decay")
    if any(tuple(g[k] for k in keys) != tuple(groups[0][k] for k in keys) for g in groups[1:]):
        raise UserLoopError(
            f"{name}: param groups with different settings; the engine's groups are fixed when it "
            "is built: give them in zerofit_config (optimizer) or train with one group"
        )
    ids = {id(p) for g in groups for p in g["params"]}
    if ids & loop.replaced():
        raise UserLoopError(
            f"{name} was built over the model's parameters before it was wrapped: those are not "
            "the ones trained now; build the optimizer over the wrapped model's parameters "
            "(FSDP asks the same)"
        )
    trained = {id(p) for p in loop.engine.module.parameters() if p.requires_grad}
    if not trained <= ids:
        raise UserLoopError(
            f"{name} holds {len(ids & trained)} of the model's {len(trained)} trained parameters: "
            "zerofit trains every parameter with requires_grad; freeze the others"
        )


def step_post_hook(optimizer, args, kwargs):
    """After ``optimizer.step()`` (and the closure it ran: Lightning's forward and backward): the engine's step.
    Torch's own step before it found no ``.grad`` to apply."""
    loop = loop_of(p for g in optimizer.param_groups for p in g["params"])
    if loop is not None:
        loop.on_step(optimizer)


def step_pre_hook(optimizer, args, kwargs):
    loop = loop_of(p for g in optimizer.param_groups for p in g["params"])
    if loop is not None:
        loop._follow(optimizer)  # refused (by name) before anything runs
    elif LIVE:
        stale = [
            lp for lp in list(LIVE) if any(id(p) in lp.replaced() for g in optimizer.param_groups for p in g["params"])
        ]
        if stale:
            check_optimizer(optimizer, stale[0])  # raises: built before the wrap


def zero_grad_of(original, params_of):
    """``original`` (Optimizer.zero_grad or Module.zero_grad), first telling the loop whose parameters its
    object holds ([Note: zero_grad])."""

    @functools.wraps(original)
    def zero_grad(self, *args, **kwargs):
        loop = loop_of(params_of(self)) if LIVE else None
        if loop is not None:
            loop.zero_grad()
        return original(self, *args, **kwargs)

    return zero_grad
