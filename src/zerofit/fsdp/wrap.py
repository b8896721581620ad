"""``torch.distributed.fsdp.wrap`` as torch has it (``transformer_auto_wrap_policy``, ``ModuleWrapPolicy``...):
FSDP code that imports its policies from beside FSDP finds them here. zerofit's units are the model's repeated
blocks whatever the policy names (zerofit.fsdp.ARGUMENTS)."""

from torch.distributed.fsdp.wrap import *  # noqa: F403 (torch's public names, re-exported)
from torch.distributed.fsdp.wrap import __all__  # noqa: F401 (re-exported)
