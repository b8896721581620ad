"""Parameter groups: ``torch.optim.AdamW``'s ``param_groups``, resolved against the model's parameters.

[Note: parameter groups]
``zerofit.initialize(model, config, param_groups=[{"params": [...], "weight_decay": 0.0}, ...])`` takes the
groups a user would give ``torch.optim.AdamW`` (the Hugging Face Trainer's decay / no-decay split, DeepSpeed's
``model_parameters``). ``params`` holds the model's parameters (matched by identity) or their names (as
``model.named_parameters()`` gives them, any name of a tied weight); a group may set ``lr``,
``weight_decay``, ``betas`` and ``eps``, and takes the config's ``optimizer`` value for a key it leaves out.
``name`` and keys starting with ``_`` are ignored; any other key (``amsgrad``, ``maximize``, ``foreach``...)
is refused, as zerofit does not implement it. A plain list of parameters is one group.

A parameter is trained when it requires a gradient and is in a group, as with ``torch.optim``: one with
``requires_grad=False`` (listed or not) gets no gradient, and one in no group is never stepped; both are
*frozen* ([Note: frozen parameters], store.py). A parameter in two groups is refused (a tied weight counts
once, under any of its names), naming it, before anything is allocated; so is a model with nothing left to
train. The groups are resolved to canonical names (ParamTable) here, while the model's own parameters still
exist: materialization then replaces them with views of the units' buffers.

Each unit places its parameters group by group ([Note: segments per unit], store.py) and runs AdamW per
segment with its group's hyperparameters (update/unit_adamw.py). The learning-rate schedule scales every
group's lr by the same factor, ``lr_at(step) / optimizer.lr``, as ``torch.optim.lr_scheduler.LambdaLR`` does
with ``make_lambda`` (Hypers.for_step, hypers.py).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from zerofit.config.schema import ConfigError, OptimizerConfig, config_error_from, show

log = logging.getLogger("zerofit")
GROUP_KEYS = ("params", "lr", "weight_decay", "betas", "eps")
_SHOWN = 8  # parameter names shown in an error before "and N more"


@dataclass(frozen=True)
class ParamGroup:
    """One resolved group: its parameters' canonical names (model order) and its AdamW hyperparameters."""

    names: tuple[str, ...]
    optimizer: OptimizerConfig  # the group's own values over the config's optimizer section

    def record(self) -> dict:
        """JSON form, as a checkpoint records it."""
        o = self.optimizer
        return {
            "params": list(self.names),
            "lr": o.lr,
            "weight_decay": o.weight_decay,
            "betas": list(o.betas),
            "eps": o.eps,
        }


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def trainable(table) -> list[str]:
    """The canonical names of the parameters that require a gradient, in model order."""
    return [n for n, p in table.canonical.items() if p.requires_grad]


def resolve_groups(groups, table, optimizer: OptimizerConfig, untrained: bool = False) -> tuple[ParamGroup, ...]:
    """``groups`` (torch's format, or None) as :class:`ParamGroup` s over ``table``'s canonical names of the
    parameters that are trained (see [Note: parameter groups]).

    None: one group of every parameter that requires a gradient, with the config's values. Raises
    :class:`ConfigError` (field ``param_groups...``) for an unknown key, a bad value, a parameter not of this
    model, a parameter in two groups, or nothing to train (unless ``untrained``: an engine for forwards and
    generation alone, no group)."""
    canonical = trainable(table)
    if not canonical and untrained:
        return ()
    if not canonical:
        raise ConfigError(
            "parameters",
            "at least one parameter to train (requires_grad=True)",
            f"all {len(table.canonical)} parameters of the model have requires_grad=False",
            "unfreeze the parameters to train (p.requires_grad_(True)) before zerofit.initialize",
        )
    if groups is None:
        return (ParamGroup(tuple(canonical), optimizer),)
    if isinstance(groups, (dict, str, torch.Tensor)) or not hasattr(groups, "__iter__"):
        raise ConfigError(
            "param_groups",
            "a list of dicts in torch.optim's format ({'params': [...], ...}) or a list of parameters",
            f"a {type(groups).__name__}",
        )
    groups = list(groups)
    if groups and not any(isinstance(g, dict) for g in groups):
        groups = [{"params": groups}]  # torch's other form: an iterable of parameters, one group
    by_id = {id(p): n for n, p in table.canonical.items()}
    by_name = {a: n for n, aliases in table.aliases.items() for a in aliases}
    owner: dict[str, int] = {}  # canonical name -> its group
    twice: dict[str, list[int]] = {}
    resolved = []
    for i, group in enumerate(groups):
        where = f"param_groups[{i}]"
        if not isinstance(group, dict):
            raise ConfigError(where, "a dict such as {'params': [...], 'weight_decay': 0.0}", show(group))
        unknown = [k for k in group if k not in GROUP_KEYS and k != "name" and not str(k).startswith("_")]
        if unknown:
            raise ConfigError(
                f"{where}.{unknown[0]}",
                f"only the keys {', '.join(GROUP_KEYS)} (and 'name')",
                f"{unknown[0]}={show(group[unknown[0]])}",
                "zerofit runs AdamW with its own kernel (no amsgrad, maximize, foreach, fused, "
                "capturable or differentiable): remove the key",
            )
        if "params" not in group:
            raise ConfigError(f"{where}.params", "the group's parameters (or parameter names)", "nothing")
        values = {**optimizer.model_dump(), **{k: group[k] for k in GROUP_KEYS[1:] if k in group}}
        try:
            opt = OptimizerConfig.model_validate(values)
        except ValidationError as exc:
            raise config_error_from(exc, OptimizerConfig, prefix=where) from None
        mine: set[str] = set()
        for p in _param_list(group["params"], where):
            name = _resolve(p, by_id, by_name, where)
            if name in mine:
                continue  # listed twice in one group, or under two names of a tied weight
            mine.add(name)
            if name in owner:
                twice.setdefault(name, [owner[name]]).append(i)
            else:
                owner[name] = i
        resolved.append(ParamGroup(tuple(n for n in canonical if n in mine), opt))  # frozen ones left out
    if twice:
        shown = [f"{n} (groups {', '.join(map(str, gs))})" for n, gs in twice.items()]
        raise ConfigError(
            "param_groups",
            "every parameter in exactly one group",
            f"{len(twice)} in more than one: {_names(shown)}",
            "a tied weight counts once, whichever of its names lists it",
        )
    missing = [n for n in canonical if n not in owner]
    if len(missing) == len(canonical):
        raise ConfigError(
            "param_groups",
            "at least one parameter that requires a gradient in a group",
            "none: every group is empty or holds only parameters with requires_grad=False",
        )
    if missing:
        log.warning(
            "zerofit: %d parameters that require a gradient are in no parameter group: they are not trained "
            "(frozen), as torch.optim leaves them: %s",
            len(missing),
            _names(missing),
        )
    return tuple(resolved)  # a group left with no trained parameter stays, so group indices keep their meaning


def _param_list(params, where: str) -> list:
    if isinstance(params, (torch.Tensor, str)):
        return [params]  # torch accepts a lone tensor as a group's params
    if isinstance(params, dict) or not hasattr(params, "__iter__"):
        raise ConfigError(f"{where}.params", "a list of parameters or parameter names", show(params))
    return list(params)


def _resolve(p, by_id: dict[int, str], by_name: dict[str, str], where: str) -> str:
    if isinstance(p, str):
        if p in by_name:
            return by_name[p]
        close = difflib.get_close_matches(p, list(by_name), n=1)
        raise ConfigError(
            f"{where}.params",
            "names of the model's parameters (model.named_parameters())",
            repr(p),
            f"did you mean {close[0]!r}?" if close else "",
        )
    if isinstance(p, torch.Tensor):
        if id(p) in by_id:
            return by_id[id(p)]
        raise ConfigError(
            f"{where}.params",
            "parameters of this model (matched by identity)",
            f"a tensor of shape {list(p.shape)} that is not one of them",
            "build the groups from this model's parameters, before zerofit.initialize",
        )
    raise ConfigError(f"{where}.params", "parameters (tensors) or parameter names (str)", show(p))
