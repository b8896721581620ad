"""The step count and each step's AdamW settings per parameter group (a part): the one place the learning rate
of a step is computed.

:meth:`Hypers.for_step` is what the step in progress applies (every update and rollback of the step takes it);
:meth:`Hypers.reported` what the optimizer and scheduler views (views.py: the DeepSpeed door, the Hugging Face
Trainer, a user's own loop) report for the next step: the same values.

[Note: group learning rates]
The schedule gives the lr of ``optimizer.lr``; a group with its own lr takes the same multiplier,
``lr * lr_at(step) / optimizer.lr``, as ``LambdaLR`` with ``make_lambda`` (and DeepSpeed's
WarmupCosineLR) scale each group's initial lr; DeepSpeed's WarmupLR and WarmupDecayLR would instead set
every group to the schedule's one lr. A group with the config's lr gets ``lr_at(step)`` itself, bitwise
what it was before groups existed. A client scheduler, DeepSpeed's OneCycle/LRRangeTest and DeepSpeed's
warm-ups over groups of their own lr take theirs from ``engine_hypers`` ([Note: a client scheduler drives
the engine's lr], optim/client_schedule.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerofit.optim.hyper import Hyper

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig


class Hypers:
    """State: ``global_step`` (optimizer steps applied: the schedule's position), ``skipped_steps`` (fp16 steps
    skipped for an overflow), ``client`` (a client scheduler driving the lr: optim/client_schedule.py, or None).
    ``groups``: the resolved parameter groups (groups.py), ``speculating``: whether steps may speculate (a
    client's betas must then stay positive)."""

    def __init__(self, config: ZerofitConfig, groups: tuple, speculating: bool) -> None:
        self.config, self.groups, self.speculating = config, groups, speculating
        self.global_step = 0
        self.skipped_steps = 0
        self.client = None

    def attach(self, client) -> None:
        """A client scheduler drives the lr from now on ([Note: a client scheduler drives the engine's lr])."""
        self.client = client

    def counted(self, applied: bool) -> None:
        """A step ended: applied, or skipped (fp16 overflow)."""
        if applied:
            self.global_step += 1
        else:
            self.skipped_steps += 1

    def lr_at(self, step: int) -> float:
        """The config schedule's lr at ``step`` (``optimizer.lr``'s: a group of its own lr scales it)."""
        from zerofit.optim.schedules import lr_at

        return lr_at(step, self.config.optimizer.lr, self.config.scheduler)

    def for_step(self) -> tuple[Hyper, ...]:
        """This step's AdamW hyperparameters, one per parameter group ([Note: group learning rates])."""
        from zerofit.optim.client_schedule import engine_hypers

        hypers = engine_hypers(self)
        if hypers is not None:
            return hypers
        base = self.config.optimizer.lr
        lr = self.lr_at(self.global_step)
        return tuple(
            Hyper.of(g.optimizer, lr if g.optimizer.lr == base else g.optimizer.lr * (lr / base)) for g in self.groups
        )

    def reported(self) -> tuple[Hyper, ...]:
        """The settings the engine will use for each group at its next step (or uses in the step in progress):
        what every optimizer view reports."""
        return self.client.reported(self) if self.client is not None else self.for_step()
