"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam``, DeepSpeed's constructors over torch's Adam.

Passed to ``deepspeed.initialize(optimizer=...)`` they give zerofit's AdamW their hyperparameters (the
engine runs its own AdamW, as it does for a ``torch.optim.AdamW``); see :mod:`.fused_adam`."""

from zerofit.deepspeed.names import REFUSED_MODULES, refusing_getattr
from zerofit.deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
from zerofit.deepspeed.ops.adam.fused_adam import FusedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]

_ZENFLOW = REFUSED_MODULES["deepspeed.ops.adam.zenflow_cpu_adam"]
__getattr__ = refusing_getattr(
    __name__, {"ZenFlowCPUAdam": _ZENFLOW, "ZenFlowSelectiveAdamW": _ZENFLOW, "ZenFlowSelectiveAdamW_stage3": _ZENFLOW}
)
