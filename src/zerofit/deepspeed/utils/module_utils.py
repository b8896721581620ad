"""``deepspeed.utils.module_utils``: ``recursive_getattr`` / ``recursive_setattr`` on dotted module names."""

from __future__ import annotations

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model, module_name: str):
    """``recursive_getattr(model, "model.layers.0.mlp")`` is ``model.model.layers[0].mlp``."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name: str, module) -> None:
    """Replace the submodule at the dotted name ``module_name`` of ``model`` with ``module``."""
    *path, last = module_name.split(".")
    output = model
    for name in path:
        output = getattr(output, name)
    output.__setattr__(last, module)
