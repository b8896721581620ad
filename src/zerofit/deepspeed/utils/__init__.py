"""``deepspeed.utils``: the logger and log helpers, ``recursive_getattr`` / ``recursive_setattr`` and
``RepeatingLoader``, as DeepSpeed 0.19.8 has them; what reads ZeRO's partitions or process groups is
refused by name."""

from __future__ import annotations

from zerofit.deepspeed.names import REFUSED_MODULES, refusing_getattr
from zerofit.deepspeed.utils.logging import log_dist, log_dist_once, logger, print_json_dist, set_log_level_from_string
from zerofit.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr
from zerofit.engine.faces.deepspeed_names import ONE_PROCESS

__all__ = [
    "logger",
    "log_dist",
    "log_dist_once",
    "print_json_dist",
    "set_log_level_from_string",
    "recursive_getattr",
    "recursive_setattr",
    "RepeatingLoader",
]


class RepeatingLoader:
    """DeepSpeed's ``RepeatingLoader(loader)``: iterates ``loader`` forever, starting it again when it ends."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


_FULL = REFUSED_MODULES["deepspeed.utils.tensor_fragment"]
_LEAF = (
    "zerofit streams whole blocks, so every parameter of a block is present in its forward; drop the call "
    "(ZeRO-3 leaf modules have no meaning here)"
)
_REFUSED = {
    name: _FULL
    for name in (
        "safe_get_full_fp32_param",
        "safe_get_full_grad",
        "safe_get_full_optimizer_state",
        "safe_set_full_fp32_param",
        "safe_set_full_optimizer_state",
        "safe_set_full_grad",
        "safe_get_local_fp32_param",
        "safe_get_local_grad",
        "safe_get_local_optimizer_state",
        "safe_set_local_fp32_param",
        "safe_set_local_grad",
        "safe_set_local_optimizer_state",
        "safe_update_full_grad_vectorized",
        "tensor_fragment",
        "get_full_hp_param",
        "get_hp_fragment_mapping",
        "fragment_address",
        "get_full_hp_grad",
        "map_to_flat_opt_states",
        "set_full_hp_param",
        "set_full_hp_grad",
        "link_hp_params",
        "lazy_init_hp_params_optimizer_state",
    )
}
_REFUSED.update(
    {
        name: _LEAF
        for name in (
            "set_z3_leaf_modules",
            "unset_z3_leaf_modules",
            "get_z3_leaf_modules",
            "z3_leaf_module",
            "z3_leaf_parameter",
            "set_z3_leaf_module",
            "set_z3_leaf_modules_by_name",
            "set_z3_leaf_modules_by_suffix",
        )
    }
)
_REFUSED.update(
    {
        "groups": ONE_PROCESS,
        "zero_to_fp32": REFUSED_MODULES["deepspeed.utils.zero_to_fp32"],
        "timer": REFUSED_MODULES["deepspeed.utils.timer"],
        "OnDevice": "use deepspeed.zero.Init() to build a model without allocating its parameters",
        "instrument_w_nvtx": "zerofit's engine marks its own phases (engine.trace()); use torch.cuda.nvtx for yours",
        "get_numactl_cmd": "launch with `zerofit deepspeed train.py ...` (one process)",
        "get_caller_func": "zerofit logs no communication (one process)",
    }
)

__getattr__ = refusing_getattr(__name__, _REFUSED, submodules=("logging", "module_utils", "torch"))
