"""Learning rates that are not one formula of the step for all groups: a client's own torch scheduler, and
DeepSpeed's per-group and per-step settings (OneCycle's betas, its broadcast lrs).

``Hypers.for_step`` (engine/step/hypers.py) asks :func:`engine_hypers` first; ``None`` leaves it to its own rule
([Note: group learning rates], engine/step/hypers.py). The methods take the engine's
:class:`~zerofit.engine.step.hypers.Hypers`
(``engine.hypers``: the step count the values follow).

[Note: a client scheduler drives the engine's lr]
``zerofit.deepspeed.initialize(optimizer=AdamW(...), lr_scheduler=LambdaLR(...))`` (or a callable
``lr_scheduler(optimizer) -> scheduler``, which DeepSpeed calls with its optimizer) is run as DeepSpeed runs
it: zerofit never steps the torch optimizer (the *carrier*: the client's own optimizer, or, for a callable
without one, a ``torch.optim.AdamW`` over the engine's parameters with the groups' settings, which never
allocates state), but the user's scheduler object writes into its ``param_groups`` as it would in a torch
loop, and at each optimizer step the engine takes every group's ``lr``, ``betas``, ``eps`` and
``weight_decay`` from there (:meth:`ClientSchedule.hypers`). After each *applied* step (not a skipped fp16
step) ``engine.step()`` calls ``scheduler.step()``, as DeepSpeed's engine does at each boundary, so the lr
of step k is the one the same scheduler gives at step k in a plain loop (``scheduler.step()`` after each
``optimizer.step()``). A path that takes steps without ``engine.step()`` (``train_batch``) is caught up
before the next read. The values of one step are read once, at its first use (the boundary's backward may
already update blocks): a change to the carrier between that backward and its ``step()`` applies from the
next step. ``engine.get_lr()``, ``optimizer.param_groups`` and the scheduler's own ``get_last_lr()`` all
report the carrier's values, the ones applied. The carrier's groups are re-pointed at the engine's
parameters, so the model's original tensors are not kept alive by it.

A client optimizer without ``lr_scheduler`` and without a schedule in the config is a carrier too, with no
scheduler: as in DeepSpeed, whose optimizer *is* the client's, a change to its ``param_groups`` (by the
script, or by a scheduler the script steps itself) applies from the next step. With a config schedule the
engine's own rule sets the lr (DeepSpeed's config scheduler would overwrite the groups at every step).

Checkpoints: ``scheduler.state_dict()`` and the carrier's group settings go into the side file
:data:`LR_SCHEDULER` of ``engine.save_checkpoint``; ``load_checkpoint`` restores both (a scheduler's
``load_state_dict`` does not touch its optimizer's lrs), so a resumed run applies the same lr at every step.
"""

from __future__ import annotations

import inspect
import io
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from zerofit.errors import InputError
from zerofit.optim.hyper import Hyper
from zerofit.optim.schedules import betas_at, lr_at

log = logging.getLogger("zerofit")

LR_SCHEDULER = "lr_scheduler.pt"
"""the checkpoint's side file with the client scheduler's state"""

_DEEPSPEED_PER_GROUP = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_DEEPSPEED_BROADCAST = ("OneCycle", "LRRangeTest")
_HYPERS = ("lr", "betas", "eps", "weight_decay")


class ClientScheduleError(InputError, ValueError):
    """A client scheduler or optimizer that zerofit cannot follow; the message says what to pass instead."""


@dataclass
class ClientSchedule:
    """A client scheduler over the carrier optimizer (see the module docstring)."""

    optimizer: torch.optim.Optimizer
    """the carrier: one param group per engine group, in the engine's order; never stepped"""
    scheduler: Any
    """the user's scheduler (torch's LRScheduler, DeepSpeed's own, anything with step()) over ``optimizer``;
    None: a client optimizer alone, whose lrs the user (or a scheduler they step themselves) may change"""
    train_batch_size: int
    """passed to a ``step`` that needs an argument, as DeepSpeed does (its TypeError fallback)"""
    stepped: int = 0
    """applied optimizer steps the scheduler has been stepped for"""
    _read: tuple = field(default=(None, ()), repr=False)
    """(step key, hypers) of the step in progress: [Note: a client scheduler drives the engine's lr]"""

    def hypers(self, steps) -> tuple[Hyper, ...]:
        """The AdamW settings of the engine's step in progress, one per group, from the carrier. ``steps``: the
        engine's Hypers (its step counts)."""
        self.catch_up(steps)
        key = (steps.global_step, steps.skipped_steps)
        if self._read[0] != key:
            self._read = (key, self.current(speculating=steps.speculating))
        return self._read[1]

    def reported(self, steps) -> tuple[Hyper, ...]:
        """What the next (or the in-progress) step applies: the values read for it once it has begun, else the
        carrier's now."""
        self.catch_up(steps)
        key = (steps.global_step, steps.skipped_steps)
        return self._read[1] if self._read[0] == key else self.current()

    def current(self, speculating: bool = False) -> tuple[Hyper, ...]:
        """The carrier's settings now (what the optimizer view and get_lr() report)."""
        out = []
        for i, g in enumerate(self.optimizer.param_groups):
            lr, eps, wd = float(g["lr"]), float(g["eps"]), float(g["weight_decay"])
            b1, b2 = (float(b) for b in g["betas"])
            where = f"{type(self.optimizer).__name__}.param_groups[{i}]"
            if not (math.isfinite(lr) and lr >= 0):
                raise ClientScheduleError(
                    f"{where}['lr'] is {lr} after the client scheduler's step: expected a finite lr >= 0"
                )
            if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
                raise ClientScheduleError(f"{where}['betas'] is {(b1, b2)}: expected each in [0, 1)")
            if speculating and (b1 == 0.0 or b2 == 0.0):
                raise ClientScheduleError(
                    f"{where}['betas'] is {(b1, b2)}: a speculative update is undone by "
                    "dividing by the betas; set offload.speculative_updates false"
                )
            out.append(Hyper(lr, b1, b2, eps, wd))
        return tuple(out)

    def catch_up(self, steps, lr_kwargs: dict | None = None) -> None:
        """Step the scheduler once per applied optimizer step it has not seen (one, after engine.step())."""
        if self.scheduler is None:
            self.stepped = steps.global_step
        while self.stepped < steps.global_step:
            self.optimizer._opt_called = True  # torch's order check: the engine took the optimizer's step
            step = self.scheduler.step
            if lr_kwargs:
                step(**lr_kwargs)
            elif _needs_argument(step):
                step(self.train_batch_size)  # DeepSpeed: lr_scheduler.step(self.train_batch_size())
            else:
                step()
            self.stepped += 1

    # ----------------------------------------------------------------- checkpoints

    def state_bytes(self, steps) -> bytes:
        self.catch_up(steps)
        state = getattr(self.scheduler, "state_dict", None)
        if state is None and self.scheduler is not None:
            log.warning(
                "zerofit: the client lr_scheduler (%s) has no state_dict(): a resumed run replays it from "
                "the start to the checkpoint's step",
                type(self.scheduler).__name__,
            )
        buf = io.BytesIO()
        torch.save(
            {
                "scheduler": state() if state is not None else None,
                "stepped": self.stepped,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            },
            buf,
        )
        return buf.getvalue()

    def restore(self, data: bytes | None, global_step: int, where: str) -> None:
        """The state :meth:`state_bytes` wrote (None: not saved; the scheduler is replayed to ``global_step``)."""
        self._read = (None, ())
        if data is None:
            log.warning(
                "%s: saved without a client lr_scheduler state; the scheduler is stepped %d times from its start",
                where,
                global_step,
            )
            self.stepped = 0
            return
        saved = torch.load(io.BytesIO(data), weights_only=False)
        groups = saved["param_groups"]
        if len(groups) != len(self.optimizer.param_groups):
            raise ClientScheduleError(
                f"{where}: the client optimizer had {len(groups)} param groups, this one has "
                f"{len(self.optimizer.param_groups)}"
            )
        for g, s in zip(self.optimizer.param_groups, groups):
            g.update(s)
        if saved["scheduler"] is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
            self.stepped = int(saved["stepped"])
        else:
            self.stepped = 0 if self.scheduler is not None else global_step


def _needs_argument(step) -> bool:
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


# ---------------------------------------------------------------------------------------------- the engine's hook


def engine_hypers(hypers) -> tuple[Hyper, ...] | None:
    """The AdamW settings of each group for the engine's step in progress (``hypers``: its Hypers), where they do
    not follow ``Hypers.for_step``'s own rule: a client scheduler's (the carrier's values); DeepSpeed's OneCycle and
    LRRangeTest (one lr for every group, OneCycle's betas: [Note: OneCycle and LRRangeTest]); DeepSpeed's
    warm-up schedules over groups with their own lr (each group's own schedule, as DeepSpeed gives each group
    its lr as the peak, or the schedule's peak to all of them when ``warmup_max_lr`` is set). ``None``: the
    engine's rule."""
    if hypers.client is not None:
        return hypers.client.hypers(hypers)
    sched, step = hypers.config.scheduler, hypers.global_step
    if sched.type in _DEEPSPEED_BROADCAST:
        lr = lr_at(step, hypers.config.optimizer.lr, sched)
        return tuple(
            Hyper(lr, *betas_at(step, g.optimizer.betas, sched), g.optimizer.eps, g.optimizer.weight_decay)
            for g in hypers.groups
        )
    base = hypers.config.optimizer.lr
    if sched.type in _DEEPSPEED_PER_GROUP and any(g.optimizer.lr != base for g in hypers.groups):
        return tuple(Hyper.of(g.optimizer, lr_at(step, g.optimizer.lr, sched)) for g in hypers.groups)
    return None


# ---------------------------------------------------------------------------------------------- attaching


def attach(engine, lr_scheduler, client_optimizer: torch.optim.Optimizer | None) -> ClientSchedule:
    """Build the :class:`ClientSchedule` of ``lr_scheduler`` (a scheduler over ``client_optimizer``, a callable
    taking the optimizer, or None: the client optimizer's own lrs) for ``engine``, and attach it
    (``engine.hypers.attach``)."""
    carrier = client_optimizer if client_optimizer is not None else _carrier(engine)
    if len(carrier.param_groups) != len(engine.param_groups):
        raise ClientScheduleError(
            f"the client optimizer has {len(carrier.param_groups)} param groups and the "
            f"engine {len(engine.param_groups)}"
        )
    params = dict(engine.adapter.model.named_parameters())
    for g, zg in zip(carrier.param_groups, engine.param_groups):
        g["params"] = [params[n] for n in zg.names]  # the engine's own tensors: the originals are released
    carrier._opt_called = True  # torch's order check (a scheduler stepped by the script): the engine steps it
    if lr_scheduler is None:
        if any("initial_lr" in g and g["initial_lr"] != g["lr"] for g in carrier.param_groups):
            log.warning(
                "zerofit: a scheduler built over the client optimizer has changed its lr (initial_lr %s, "
                "lr now %s) and was not passed to initialize(): as DeepSpeed, the engine applies the "
                "param_groups' lr, which follows that scheduler only if the script steps it; pass it as "
                "lr_scheduler=... to have engine.step() step it",
                [g.get("initial_lr") for g in carrier.param_groups],
                [g["lr"] for g in carrier.param_groups],
            )
        scheduler = None
    elif callable(lr_scheduler):  # DeepSpeed: isinstance(client_lr_scheduler, Callable) -> call it
        kind = getattr(lr_scheduler, "__name__", type(lr_scheduler).__name__)
        scheduler = lr_scheduler(carrier)
        if scheduler is None or not callable(getattr(scheduler, "step", None)):
            raise ClientScheduleError(
                f"lr_scheduler: the callable {kind} returned a {type(scheduler).__name__}, "
                "not a scheduler with step(); return one built over the optimizer it is given"
            )
    else:
        scheduler = lr_scheduler
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not carrier:
        raise ClientScheduleError(
            f"lr_scheduler={type(scheduler).__name__} is not over the optimizer zerofit reads its learning rates "
            "from ("
            + (
                "the optimizer passed to initialize"
                if client_optimizer is not None
                else "the one zerofit passes to a callable lr_scheduler"
            )
            + "): build it over that optimizer"
        )
    schedule = ClientSchedule(carrier, scheduler, engine.config.train_batch_size, stepped=engine.global_step)
    engine.hypers.attach(schedule)
    return schedule


def _carrier(engine) -> torch.optim.AdamW:
    """DeepSpeed calls a callable lr_scheduler with its own optimizer: here a torch AdamW over the engine's
    parameters with each group's settings, never stepped (no state is allocated)."""
    params = dict(engine.adapter.model.named_parameters())
    groups = [
        {
            "params": [params[n] for n in g.names],
            "lr": g.optimizer.lr,
            "betas": g.optimizer.betas,
            "eps": g.optimizer.eps,
            "weight_decay": g.optimizer.weight_decay,
        }
        for g in engine.param_groups
    ]
    opt = engine.config.optimizer
    return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
