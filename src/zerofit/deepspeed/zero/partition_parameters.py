"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters`` and ``ZeroParamStatus``.

``ZeroParamStatus`` is DeepSpeed's enum. zerofit never partitions a parameter: every parameter is
``AVAILABLE`` and none carries DeepSpeed's ``ds_id`` / ``ds_status``, so the check scripts write for ZeRO-3
(``hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE``, DeepSpeed-Chat's) is False and
they read parameters directly, as DeepSpeed's scripts do below ZeRO-3."""

from __future__ import annotations

from enum import Enum

from zerofit.deepspeed.zero import _DEEPSPEED_ZERO_NAMES, GatheredParameters, Init
from zerofit.deepspeed.names import refusing_getattr

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus"]


class ZeroParamStatus(Enum):
    AVAILABLE = 1           # fully present on every process: every zerofit parameter
    NOT_AVAILABLE = 2       # partitioned or remote (never in zerofit)
    INFLIGHT = 3            # being gathered (never in zerofit)


__getattr__ = refusing_getattr("zerofit.deepspeed.zero.partition_parameters", _DEEPSPEED_ZERO_NAMES)
