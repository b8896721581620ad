"""``deepspeed.ops.adam.DeepSpeedCPUAdam``: DeepSpeed's constructor, torch's Adam (AdamW with ``adamw_mode``).

DeepSpeed 0.19.8's CPU Adam (deepspeed/ops/adam/cpu_adam.py) is the same algorithm as its FusedAdam on the
host; here it is :class:`~zerofit.deepspeed.ops.adam.fused_adam.DeepSpeedAdam` (torch's Adam) with this
constructor, and given to ``deepspeed.initialize`` its settings become zerofit's AdamW's, whose moments are
fp32 on the host (DeepSpeed's ``fp32_optimizer_states=True``). ``fp32_optimizer_states=False`` (moments in
the parameters' dtype) is refused by name, with ``amsgrad=True`` and ``bias_correction=False``.
"""

from __future__ import annotations

from zerofit.deepspeed.ops.adam.fused_adam import DeepSpeedAdam
from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported


class DeepSpeedCPUAdam(DeepSpeedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)``, DeepSpeed's defaults (weight_decay 0)."""

    optimizer_id = 0

    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
    ):
        if not fp32_optimizer_states:
            raise DeepSpeedUnsupported(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False): zerofit keeps its AdamW "
                "moments in fp32 on the host; leave fp32_optimizer_states=True"
            )
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw=adamw_mode,
            amsgrad=amsgrad,
        )
        self.fp32_optimizer_states = True
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
