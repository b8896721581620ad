"""``deepspeed.runtime.zero.offload_config``: DeepSpeed's offload enums (``OffloadDeviceEnum``,
``OffloadStateTypeEnum``), for scripts that name them. zerofit's offload is set by the config
(docs/config.md); the engine's ``offload_states(include=..., device=OffloadDeviceEnum.cpu)`` and
``reload_states()`` take these (zerofit/engine/faces/offload_states.py)."""

from __future__ import annotations

from enum import Enum

from zerofit.deepspeed.names import refusing_getattr

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    """Valid offload devices."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's engine buffer kinds (``engine.offload_states(include=...)``)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


_CONFIG = (
    "zerofit reads the config's offload_optimizer / offload_param blocks itself (zerofit.config.load_config; "
    "`zerofit config show ds.json`)"
)
__getattr__ = refusing_getattr(
    __name__,
    {
        name: _CONFIG
        for name in ("DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig", "OffloadConfig")
    },
)
