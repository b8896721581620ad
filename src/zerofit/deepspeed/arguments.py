"""``deepspeed.initialize``'s arguments, read as DeepSpeed reads them and mapped onto zerofit's.

What maps exactly is accepted; what would change the training silently is refused with
:class:`DeepSpeedUnsupported` naming the argument and what to pass instead:

* the config: ``config`` (a path or a dict), else ``config_params``, else ``args.deepspeed_config`` (or the
  deprecated ``args.deepscale_config``); two of them at once is an error, as in DeepSpeed;
* ``model_parameters``: the parameters to train (as DeepSpeed, the others, and those with
  ``requires_grad=False``, are left untouched: frozen); a list of dicts becomes torch-format parameter
  groups (``params`` as canonical parameter names, and the group's own ``lr``, ``weight_decay``, ``betas``,
  ``eps``);
* a client ``optimizer``: a ``torch.optim.AdamW``, or a ``torch.optim.Adam`` whose weight decay is decoupled
  or zero (then it is AdamW's math), or a callable that returns one of them from the model parameters (as
  DeepSpeed calls it). Its hyperparameters replace the config's optimizer block, its param_groups become
  the groups; a group's base lr is its ``initial_lr`` where a scheduler has been attached (a warm-up may have
  set ``lr`` itself to 0). Anything else is refused: zerofit runs its own AdamW;
* a client ``lr_scheduler``: a scheduler over the client optimizer (torch's ``LRScheduler``, transformers'
  ``get_scheduler``, DeepSpeed's own classes: anything with ``step()``), or a callable that builds one from the
  optimizer it is given, as DeepSpeed calls it. It replaces the config's scheduler block, as in DeepSpeed, and
  drives the lr of every step ([Note: a client scheduler drives the engine's lr], optim/client_schedule.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerofit.engine.faces.deepspeed_names import ONE_PROCESS, DeepSpeedAssertion, DeepSpeedUnsupported

_HYPERS = ("lr", "weight_decay", "betas", "eps")  # other group keys (foreach, fused, ...) only pick an implementation


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (and the deprecated ``--deepscale*``) options."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on the engine)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config")
    return parser


def check_single_process(what: str) -> None:
    """Refuse a launch of several ranks (``WORLD_SIZE`` > 1), naming it."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip() and int(world) > 1:
        raise DeepSpeedUnsupported(
            f"{what} with WORLD_SIZE={world}: {ONE_PROCESS}. Launch one process "
            "(python train.py, or deepspeed --num_gpus 1 train.py)"
        )


def resolve_config(args, config, config_params):
    """The config source DeepSpeed would use: ``config``, else ``config_params``, else ``args.deepspeed_config``."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    legacy = getattr(args, "deepscale_config", None)
    if legacy is not None:
        if from_args is not None:
            raise ValueError(
                "both args.deepscale_config and args.deepspeed_config are set; keep "
                "args.deepspeed_config (--deepscale_config is deprecated)"
            )
        from_args = legacy
    if from_args is not None:
        if config is not None:
            raise ValueError(
                f"a config came both as args.deepspeed_config ({from_args!r}) and as the config "
                "argument of initialize(); pass one of them"
            )
        config = from_args
    if config is None:
        raise ValueError(
            "initialize() needs a configuration: config='ds_config.json' (or a dict), or "
            "--deepspeed_config through deepspeed.add_config_arguments(parser)"
        )
    return config


def raw_config(config) -> dict:
    """The config as a dict (read from its file when a path), for the keys zerofit's config does not keep."""
    from zerofit.config import ZerofitConfig, read_json

    if isinstance(config, (str, os.PathLike)):
        return read_json(Path(config))
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, ZerofitConfig):
        return {}
    raise ValueError(f"config must be the path of a .json file or a dict, got a {type(config).__name__}")


def dataloader_drop_last(raw: Mapping) -> bool:
    from zerofit.config.deepspeed import is_deepspeed_config
    from zerofit.config.deepspeed_keys import default

    value = raw.get("dataloader_drop_last", default("dataloader_drop_last")) if is_deepspeed_config(raw) else False
    return bool(value)


# ---------------------------------------------------------------------------------------------- parameters


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its canonical (first) name; tied parameters once."""
    return {id(p): n for n, p in model.named_parameters()}


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _covering(model: nn.Module, found: list[str], where: str) -> bool:
    """Whether ``found`` (canonical names, each once) holds every parameter of the model that requires a
    gradient. The others are not trained (frozen), as DeepSpeed's optimizer leaves them ([Note: frozen
    parameters], engine/memory/store.py)."""
    seen, twice = set(), []
    for n in found:
        (twice.append(n) if n in seen else seen.add(n))
    if twice:
        raise ValueError(f"{where} names {_names(twice)} more than once")
    return all(n in seen for n, p in model.named_parameters() if p.requires_grad)


def _name_of(p, ids: dict[int, str], model: nn.Module, where: str) -> str:
    if isinstance(p, str):
        if p not in dict(model.named_parameters()):
            raise ValueError(f"{where}: {p!r} is not a parameter name of the model")
        return p
    if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):  # torch's named parameters
        p = p[1]
    if not isinstance(p, torch.Tensor) or id(p) not in ids:
        raise ValueError(
            f"{where}: a {type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))} that is not a "
            "parameter of the model"
        )
    return ids[id(p)]


def groups_from_model_parameters(model: nn.Module, model_parameters) -> list[dict] | None:
    """None for all parameters in one group (the config's optimizer); torch-format groups for a list of dicts."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    ids = parameter_names(model)
    if items and all(isinstance(g, Mapping) for g in items):
        groups = []
        for i, g in enumerate(items):
            where = f"model_parameters[{i}]"
            if "params" not in g:
                raise ValueError(f"{where} has no 'params'")
            ps = g["params"]
            ps = [ps] if isinstance(ps, (torch.Tensor, str)) else list(ps)
            group = {"params": [_name_of(p, ids, model, where) for p in ps]}
            group.update(_group_hypers(g, where))
            groups.append(group)
        _covering(model, [n for g in groups for n in g["params"]], "model_parameters")
        return groups
    if any(isinstance(g, Mapping) for g in items):
        raise ValueError("model_parameters mixes parameter groups (dicts) and parameters; pass one kind")
    names = [_name_of(p, ids, model, "model_parameters") for p in items]
    if _covering(model, names, "model_parameters"):
        return None
    return [{"params": names}]  # the parameters left out are frozen


def _group_hypers(g: Mapping, where: str, *, decoupled_default: bool = True, base_lr: bool = False) -> dict[str, Any]:
    """The group's AdamW settings, refusing those that change the math away from AdamW's."""
    if g.get("amsgrad"):
        raise DeepSpeedUnsupported(f"{where}: amsgrad=True; zerofit's AdamW has no amsgrad variant")
    if g.get("maximize"):
        raise DeepSpeedUnsupported(f"{where}: maximize=True; zerofit's AdamW minimizes the loss")
    if g.get("bias_correction", True) is False:
        raise DeepSpeedUnsupported(f"{where}: bias_correction=False; zerofit's AdamW is always bias-corrected")
    out = {}
    for k in _HYPERS:
        if k in g:
            # a torch scheduler keeps the lr it was built with as initial_lr, and may have changed lr already
            v = g["initial_lr"] if k == "lr" and base_lr and "initial_lr" in g else g[k]
            out[k] = tuple(float(b) for b in v) if k == "betas" else float(v)
    if not g.get("decoupled_weight_decay", decoupled_default) and out.get("weight_decay", 0.0) > 0:
        raise DeepSpeedUnsupported(
            f"{where}: Adam with weight_decay={out['weight_decay']} adds it to the gradient "
            "(L2, torch.optim.Adam's default); zerofit implements AdamW (decoupled weight "
            "decay). Use torch.optim.AdamW, or Adam(decoupled_weight_decay=True)"
        )
    return out


# ---------------------------------------------------------------------------------------------- client objects

_INSTEAD_OPTIMIZER = (
    "zerofit runs its own AdamW (the math of torch.optim.AdamW); pass a torch.optim.AdamW, "
    'or leave optimizer=None and put the settings in the config: "optimizer": {"type": "AdamW", '
    '"params": {"lr": ..., "betas": [...], "eps": ..., "weight_decay": ...}}'
)


def client_optimizer(
    optimizer, model: nn.Module, model_parameters
) -> tuple[dict, list[dict] | None, torch.optim.Optimizer]:
    """(the config's optimizer block as zerofit fields, the groups or None, the torch optimizer) from a client
    optimizer (or the callable that builds one)."""
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise DeepSpeedUnsupported(
                f"optimizer: the callable returned a {type(built).__name__}, not a torch "
                f"optimizer; {_INSTEAD_OPTIMIZER}"
            )
        optimizer = built
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        # (an AssertionError too: DeepSpeed asserts on an untested client optimizer under ZeRO)
        raise DeepSpeedAssertion(
            f"optimizer={type(optimizer).__module__}.{type(optimizer).__name__}: {_INSTEAD_OPTIMIZER}"
        )
    kind = type(optimizer).__name__
    if any(optimizer.state.values()):
        raise DeepSpeedUnsupported(
            f"optimizer: this {kind} has state (it has taken steps); zerofit's AdamW starts "
            "from zero moments. Pass a fresh optimizer, or resume with engine.load_checkpoint"
        )
    ids = parameter_names(model)
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        where = f"{kind}.param_groups[{i}]"
        hypers = _group_hypers(g, where, decoupled_default=decoupled, base_lr=True)
        groups.append({"params": [_name_of(p, ids, model, where) for p in g["params"]], **hypers})
    covers = _covering(model, [n for g in groups for n in g["params"]], f"optimizer ({kind})")
    first = {k: groups[0][k] for k in _HYPERS}
    if len(groups) == 1 and covers:
        return first, None, optimizer
    return first, groups, optimizer


def check_client_scheduler(lr_scheduler, optimizer) -> None:
    """Refuse what DeepSpeed refuses: a scheduler object (not a callable) without a client optimizer it
    could be over; and anything that is neither a scheduler nor a callable."""
    if lr_scheduler is None or callable(lr_scheduler):
        return
    kind = type(lr_scheduler).__name__
    if not callable(getattr(lr_scheduler, "step", None)):
        raise DeepSpeedUnsupported(
            f"lr_scheduler={kind}: expected a scheduler with step() (torch's LRScheduler, "
            "transformers' get_scheduler) or a callable that builds one from the optimizer"
        )
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        raise DeepSpeedAssertion(
            f"lr_scheduler={kind} without the optimizer it was built over: zerofit would not see its learning rates "
            "(DeepSpeed asserts this for torch's old _LRScheduler class; with torch 2's schedulers it steps one whose "
            "lr never reaches the optimizer it trains). Pass optimizer=<the "
            "scheduler's optimizer> too, or lr_scheduler=lambda optimizer: ... to build it over the optimizer "
            "zerofit gives it"
        )
