"""``deepspeed.zero``: ``Init`` (build a model without allocating its weights) and ``GatheredParameters``,
defined in its ``partition_parameters`` module as in DeepSpeed ([Note: parameters on meta, buffers real] there).

This package is also DeepSpeed's ``deepspeed.runtime.zero``, with its ``partition_parameters`` (``Init``,
``GatheredParameters``, ``ZeroParamStatus``: every zerofit parameter is available) and ``offload_config``
(DeepSpeed's offload enums) submodules.
"""

from __future__ import annotations

from zerofit.deepspeed.names import refusing_getattr
from zerofit.deepspeed.zero.partition_parameters import (
    DEEPSPEED_ZERO_NAMES,
    GatheredParameters,
    Init,
    ZeroParamStatus,
    original_register,  # noqa: F401 (re-exported: tests compare against it)
    register_engine,  # noqa: F401 (re-exported: zerofit.deepspeed calls zero.register_engine)
)

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus"]

__getattr__ = refusing_getattr(__name__, DEEPSPEED_ZERO_NAMES, submodules=("partition_parameters", "offload_config"))
