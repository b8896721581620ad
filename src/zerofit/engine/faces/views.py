"""The engine's AdamW as torch.optim sees an optimizer and its scheduler: one view for every door.

The DeepSpeed door's ``engine.optimizer``/``engine.lr_scheduler`` (deepspeed_surface.py), the Hugging Face
Trainer's optimizer and scheduler (zerofit/hf/trainer.py) and a user's own loop read the same two classes; each
door adds only what its loop does with ``step()`` and ``state_dict()``. What they report is what the engine
applies: each parameter group's lr, betas, eps and weight decay of the next step, from ``Hypers.reported``
(hypers.py: [Note: group learning rates], [Note: a client scheduler drives the engine's lr]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from zerofit.engine.step.hypers import Hypers


class ParamGroup(dict):
    """One entry of ``optimizer.param_groups``: read-only, since the engine would not see a change."""

    def _refuse(self, *args, **kwargs):
        from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported

        raise DeepSpeedUnsupported(
            "optimizer.param_groups is read-only in zerofit here: the engine computes each step's lr from the "
            "config's optimizer and scheduler blocks and would not see a change made here; set them in the config, "
            "or pass initialize() a torch optimizer (and lr_scheduler=...), whose param_groups the engine reads at "
            "every step"
        )

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

    def __reduce__(self):  # copies (copy.deepcopy(optimizer.param_groups)) are plain dicts
        return (dict, (dict(self),))


class OptimizerView:
    """torch.optim's face of the engine's AdamW: ``param_groups`` (each group's parameters, with the lr, betas,
    eps and weight decay its next step applies), ``defaults`` (the config's optimizer block), ``zero_grad()``
    (a no-op: the engine starts each accumulation from zero). The engine takes the step; gradients and moments
    live in its buffers and its checkpoints hold them.

    ``names``: each group's parameter names as the door was given them (the DeepSpeed door's
    ``model_parameters``); None: the engine's groups (one group of every parameter when the engine has one)."""

    def __init__(self, hypers: Hypers, model: nn.Module, names: tuple | None = None) -> None:
        self._hypers, self._model, self._names = hypers, model, names

    def hypers(self) -> tuple:
        """The AdamW settings the engine will use for each group at its next step (Hyper per group)."""
        hypers = self._hypers.reported()
        groups = len(self._names) if self._names is not None else len(self._hypers.groups)
        if len(hypers) != groups:
            raise RuntimeError(f"zerofit: the optimizer view has {groups} groups and the engine {len(hypers)}")
        return hypers

    def lrs(self) -> list[float]:
        """Each group's lr for the next step."""
        return [h.lr for h in self.hypers()]

    def _group_params(self) -> list[list]:
        params = dict(self._model.named_parameters())
        names = self._names
        if names is None:
            groups = self._hypers.groups
            names = (None,) if len(groups) == 1 else tuple(g.names for g in groups)
        return [list(params.values()) if n is None else [params[k] for k in n] for n in names]

    @property
    def param_groups(self) -> list[dict]:
        """Each group's settings for the next step. With a client scheduler, the client optimizer's own groups
        (writable: the engine reads them at each step, as DeepSpeed's optimizer does)."""
        client = self._hypers.client
        if client is not None:
            client.catch_up(self._hypers)
            return client.optimizer.param_groups
        return [
            ParamGroup(params=p, lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay)
            for p, h in zip(self._group_params(), self.hypers())
        ]

    @property
    def defaults(self) -> dict:
        c = self._hypers.config.optimizer
        return {"lr": c.lr, "betas": c.betas, "eps": c.eps, "weight_decay": c.weight_decay}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: gradients live in the engine, which starts each accumulation from zero."""


class SchedulerView:
    """torch's scheduler face of the engine's schedule: ``get_last_lr()``/``get_lr()`` (each group's lr of the
    next step, as ``LambdaLR`` reports after its ``step()``), ``last_batch_iteration`` (-1 before the first
    applied step), ``state_dict()``. The engine steps the schedule with each applied optimizer step."""

    def __init__(self, hypers: Hypers, optimizer: OptimizerView) -> None:
        self._hypers = hypers
        self.optimizer = optimizer

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's scheduler position: -1 before the first applied step."""
        return self._hypers.global_step - 1

    def get_last_lr(self) -> list[float]:
        return self.optimizer.lrs()

    def get_lr(self) -> list[float]:
        return self.optimizer.lrs()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}
