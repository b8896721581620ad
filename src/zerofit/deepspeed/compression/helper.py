"""``deepspeed.compression.helper``: ``recursive_getattr`` and ``recursive_setattr`` (deepspeed.utils.module_utils)."""

from zerofit.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
