"""``deepspeed.utils.torch``: ``required_torch_version``, DeepSpeed's check of the running torch's version (scripts
and DeepSpeed's own tests gate on it), with DeepSpeed 0.19.8's meaning."""

from __future__ import annotations

import torch
from packaging import version as pkg_version

from zerofit.deepspeed.names import refusing_getattr

__all__ = ["required_torch_version"]


def required_torch_version(min_version=None, max_version=None) -> bool:
    """Whether the running torch is at least ``min_version`` and at most ``max_version``."""
    assert min_version or max_version, "Must provide a min_version or max_version argument"
    torch_version = pkg_version.parse(torch.__version__)
    if min_version and pkg_version.parse(str(min_version)) > torch_version:
        return False
    if max_version and pkg_version.parse(str(max_version)) < torch_version:
        return False
    return True


__getattr__ = refusing_getattr(
    __name__,
    {
        name: "DeepSpeed's internal helpers for its own modules"
        for name in ("is_functorch_transforming", "register_grad_hook", "jit_script_compat")
    },
)
