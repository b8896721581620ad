"""``deepspeed.comm`` (``import deepspeed.comm as dist``): DeepSpeed's collectives over ``torch.distributed``,
for one process. The functions live in :mod:`zerofit.deepspeed.comm.comm`, as DeepSpeed's do."""

from zerofit.deepspeed.comm.comm import *  # noqa: F403 (the module's public names, re-exported)
from zerofit.deepspeed.comm.comm import (
    __all__,  # noqa: F401 (re-exported)
    __getattr__,  # noqa: F401 (re-exported: the module's refusals)
)
