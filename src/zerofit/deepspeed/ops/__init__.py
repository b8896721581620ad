"""``deepspeed.ops``: of DeepSpeed's kernels, the Adam optimizers' names (``deepspeed.ops.adam``), which map
onto zerofit's AdamW; the other optimizers and kernels are refused by name (``zerofit.deepspeed.names``)."""

from zerofit.deepspeed.names import REFUSED_MODULES, refusing_getattr

_KERNELS = {
    name.rpartition(".")[2]: hint
    for name, hint in REFUSED_MODULES.items()
    if name.rpartition(".")[0] == "deepspeed.ops"
}
_KERNELS.update(
    {
        "DeepSpeedTransformerLayer": REFUSED_MODULES["deepspeed.ops.transformer"],
        "DeepSpeedTransformerConfig": REFUSED_MODULES["deepspeed.ops.transformer"],
        "__compatible_ops__": REFUSED_MODULES["deepspeed.ops.op_builder"],
    }
)

__getattr__ = refusing_getattr(__name__, _KERNELS, submodules=("adam",))
