"""``deepspeed.ops.adam.FusedAdam``: DeepSpeed's constructor, torch's Adam (AdamW with ``adam_w_mode``).

::

    from deepspeed.ops.adam import FusedAdam

    optimizer = FusedAdam(groups, lr=1e-4, betas=(0.9, 0.95))              # adam_w_mode=True: AdamW
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

The class is a ``torch.optim.Adam`` built from DeepSpeed 0.19.8's arguments (deepspeed/ops/adam/
fused_adam.py): ``adam_w_mode=True`` is decoupled weight decay (``torch.optim.AdamW``'s math, which torch
runs as ``Adam(decoupled_weight_decay=True)``), ``adam_w_mode=False`` adds the weight decay to the gradient
(L2, ``torch.optim.Adam``'s). Given to ``deepspeed.initialize`` its param_groups and hyperparameters become
zerofit's AdamW's, as a ``torch.optim.AdamW``'s do (zerofit.deepspeed.arguments.client_optimizer); L2 with
a weight decay above 0 is refused there (zerofit implements AdamW only), Adam without weight decay is
AdamW's math and accepted. Stepped by hand (outside ``initialize``) it is torch's Adam: DeepSpeed's
algorithm with torch's rounding, not its fused kernel's, and moments in the parameters' dtype.

Refused at construction, by name: ``amsgrad=True`` (DeepSpeed's own FusedAdam raises for it) and
``bias_correction=False`` (torch's Adam and zerofit's AdamW always correct the moments' bias).
"""

from __future__ import annotations

import torch

from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported


class DeepSpeedAdam(torch.optim.Adam):
    """torch's Adam with the checks DeepSpeed's Adam classes share: no AMSGrad, bias correction always;
    every param group keeps ``bias_correction`` (True) as DeepSpeed's groups do."""

    def __init__(self, params, *, lr, bias_correction, betas, eps, weight_decay, adamw: bool, amsgrad: bool):
        self._check(type(self).__name__, amsgrad=amsgrad, bias_correction=bias_correction)
        self.adam_w_mode = bool(adamw)
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled_weight_decay=self.adam_w_mode
        )
        self.defaults["bias_correction"] = True

    @staticmethod
    def _check(kind: str, *, amsgrad, bias_correction, where: str = "") -> None:
        if amsgrad:
            raise DeepSpeedUnsupported(
                f"{kind}({where}amsgrad=True): DeepSpeed's {kind} does not support the "
                "AMSGrad variant, nor does zerofit's AdamW; leave amsgrad=False"
            )
        if not bias_correction:
            raise DeepSpeedUnsupported(
                f"{kind}({where}bias_correction=False): torch's Adam and zerofit's AdamW "
                "always correct the moments' bias; leave bias_correction=True"
            )

    def add_param_group(self, param_group: dict) -> None:
        where = "a param group's "
        self._check(
            type(self).__name__,
            amsgrad=param_group.get("amsgrad", False),
            bias_correction=param_group.get("bias_correction", True),
            where=where,
        )
        super().add_param_group(param_group)
        self.param_groups[-1]["bias_correction"] = True


class FusedAdam(DeepSpeedAdam):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    set_grad_none)``, DeepSpeed's defaults (weight_decay 0, unlike torch.optim.AdamW's 0.01)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
    ):
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw=adam_w_mode,
            amsgrad=amsgrad,
        )
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        if any(p is not None for p in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise RuntimeError(
                "FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, "
                "and call step() with no arguments."
            )  # DeepSpeed's words
        return super().step(closure)
