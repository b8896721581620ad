"""``deepspeed.runtime``: ``runtime.zero`` (zerofit's ``deepspeed.zero``, one module as in DeepSpeed),
``runtime.engine.DeepSpeedEngine`` (the type of zerofit's engines), ``runtime.lr_schedules`` (DeepSpeed's schedule
names and keys; its classes are the types of the config schedules' views) and ``runtime.utils.see_memory_usage``;
DeepSpeed's config, pipeline and ZeRO stages are refused by name."""

from zerofit.deepspeed import zero
from zerofit.deepspeed.names import REFUSED_MODULES, refusing_getattr

__all__ = ["zero"]

_REFUSED = {
    name.rpartition(".")[2]: hint
    for name, hint in REFUSED_MODULES.items()
    if name.rpartition(".")[0] == "deepspeed.runtime"
}

__getattr__ = refusing_getattr(__name__, _REFUSED, submodules=("engine", "lr_schedules", "utils"))
