# A stand-in for DeepSpeed's tests/unit/common.py (github.com/deepspeedai/DeepSpeed at commit
# edaa7221267243c7be7fb49c5d5f5c4fb97b4641, Apache-2.0, DeepSpeed Team) for the ported unit tests. DeepSpeed's
# DistributedTest starts `world_size` processes (torch.multiprocessing), initializes torch.distributed in each and
# runs the test method there; the cases ported here run in one process (world_size 1, or cases that need only one
# rank), so this DistributedTest runs the method in the pytest process itself, where zerofit's deepspeed.comm
# answers rank 0 of 1 and initializes torch.distributed for this process at the first collective (as
# deepspeed.initialize would). get_test_path and preferred_dtype are DeepSpeed's, as written.

from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator


class DistributedExec:
    world_size = 1
    backend = "gloo"
    init_distributed = True
    set_dist_env = True
    requires_cuda_env = False
    reuse_dist_env = False
    non_daemonic_procs = False
    exec_timeout = 600


class DistributedTest(DistributedExec):
    """Runs each test method in this process (see the module's first lines)."""


def get_test_path(filename):
    curr_path = Path(__file__).parent
    return str(curr_path.joinpath(filename))


# bf16 > fp16 > fp32
def preferred_dtype():
    if get_accelerator().is_bf16_supported():
        return torch.bfloat16
    elif get_accelerator().is_fp16_supported():
        return torch.float16
    else:
        return torch.float32
