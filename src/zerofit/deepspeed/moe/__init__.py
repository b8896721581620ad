"""``deepspeed.moe``: the parameter-group helpers of ``deepspeed.moe.utils``, for models without MoE layers.

zerofit has no mixture-of-experts layers (``deepspeed.moe.layer.MoE`` is refused by name); scripts that
call DeepSpeed's MoE helpers on a plain model (DeepSpeedExamples' cifar10 ``--moe-param-group``) get the
groups back unchanged, as from DeepSpeed."""

from zerofit.deepspeed.names import REFUSED_MODULES, refusing_getattr

_NO_MOE = REFUSED_MODULES["deepspeed.moe.layer"]
__getattr__ = refusing_getattr(
    __name__,
    {"layer": _NO_MOE, "MoE": _NO_MOE, "experts": _NO_MOE, "sharded_moe": _NO_MOE, "mappings": _NO_MOE},
    submodules=("utils",),
)
