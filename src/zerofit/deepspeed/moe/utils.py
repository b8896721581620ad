"""``deepspeed.moe.utils``: DeepSpeed 0.19.8's parameter-group helpers (deepspeed/moe/utils.py).

A parameter is an expert parameter when DeepSpeed's MoE layer marked it (``param.allreduce = False``, with
its ``group_name``); zerofit has no MoE layer, so a model's parameters are all shared and the helpers return
DeepSpeed's answer for such a model: ``split_params_into_different_moe_groups_for_optimizer`` the groups as
they are (a dict becomes a one-group list), ``is_moe_param`` False, ``has_moe_layers`` ``(False, 0)``. A
parameter marked as an expert's is refused by name: its gradients would be reduced over an expert group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerofit.deepspeed.names import REFUSED_MODULES
from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported

__all__ = [
    "has_moe_layers",
    "is_moe_param",
    "split_params_into_shared_and_expert_params",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "is_moe_param_group",
    "configure_moe_param_groups",
]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(False, 0)``: zerofit has no MoE layer class a model could hold."""
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: its MoE layer sets ``allreduce = False`` on expert parameters."""
    return hasattr(param, "allreduce") and not param.allreduce


def _no_experts(params, where: str) -> None:
    experts = [tuple(p.shape) for p in params if is_moe_param(p)]
    if experts:
        raise DeepSpeedUnsupported(
            f"{where}: {len(experts)} parameter(s) (shapes {experts[:3]}) are marked as "
            f"expert parameters (allreduce=False): {REFUSED_MODULES['deepspeed.moe.layer']}"
        )


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list, list]:
    params = list(params)
    _no_experts(params, "split_params_into_shared_and_expert_params")
    return params, []


def split_params_grads_into_shared_and_expert_params(group: list[nn.Parameter]) -> tuple[list, list]:
    group = list(group)
    _no_experts(group, "split_params_grads_into_shared_and_expert_params")
    return [p.grad.to(p.dtype) for p in group if p.grad is not None], []


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list[dict]:
    """The optimizer's param groups split by expert group; without expert parameters, the groups themselves
    (a tuple becomes a list, a dict a one-group list), as DeepSpeed returns them."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for i, group in enumerate(param_groups):
        group["params"] = list(group["params"])  # DeepSpeed rebuilds each group's list
        _no_experts(group["params"], f"split_params_into_different_moe_groups_for_optimizer: group {i}")
    return param_groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list):
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                "param argument that would be given to the optimizer should be an iterable of Tensors "
                f"or dicts, but got {type(p)}"
            )
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
