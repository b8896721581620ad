# Copied from DeepSpeed's tests/unit/util.py (github.com/deepspeedai/DeepSpeed at commit
# edaa7221267243c7be7fb49c5d5f5c4fb97b4641, Apache-2.0, DeepSpeed Team): bf16_required_version_check and
# required_amp_check, as written except that torch_info (deepspeed.git_version_info, the versions DeepSpeed was built
# with, which zerofit does not have: it builds none of DeepSpeed's kernels) reads "0.0" for each, so the check takes
# the running torch's versions, as DeepSpeed's own fallback does.

import torch

from deepspeed.accelerator import get_accelerator

torch_info = {'version': '0.0', 'nccl_version': '0.0', 'cuda_version': '0.0'}


def bf16_required_version_check(accelerator_check=True):
    split_version = lambda x: map(int, x.split('.')[:2])

    # torch_info may have stale/zero values if installed without --no-build-isolation
    # In that case, fall back to runtime detection
    if torch_info['version'] == '0.0':
        # Use runtime torch version
        TORCH_MAJOR, TORCH_MINOR = split_version(torch.__version__)
    else:
        TORCH_MAJOR, TORCH_MINOR = split_version(torch_info['version'])

    if torch_info['nccl_version'] == '0.0':
        # Use runtime NCCL version if available
        if torch.cuda.is_available():  #ignore-cuda
            try:
                nccl_ver = torch.cuda.nccl.version()  #ignore-cuda
                NCCL_MAJOR, NCCL_MINOR = nccl_ver[0], nccl_ver[1]
            except (AttributeError, RuntimeError):
                NCCL_MAJOR, NCCL_MINOR = 0, 0
        else:
            # No CUDA means no NCCL; NPU/HPU/XPU have separate checks below
            NCCL_MAJOR, NCCL_MINOR = 0, 0
    else:
        NCCL_MAJOR, NCCL_MINOR = split_version(torch_info['nccl_version'])

    if torch_info['cuda_version'] == '0.0':
        # Use runtime CUDA version
        if torch.cuda.is_available():  #ignore-cuda
            cuda_ver = torch.version.cuda
            if cuda_ver:
                CUDA_MAJOR, CUDA_MINOR = split_version(cuda_ver)
            else:
                CUDA_MAJOR, CUDA_MINOR = 0, 0
        else:
            CUDA_MAJOR, CUDA_MINOR = 0, 0
    else:
        CUDA_MAJOR, CUDA_MINOR = split_version(torch_info['cuda_version'])

    # Sometimes bf16 tests are runnable even if not natively supported by accelerator
    if accelerator_check:
        accelerator_pass = get_accelerator().is_bf16_supported()
    else:
        accelerator_pass = True

    torch_version_available = TORCH_MAJOR > 1 or (TORCH_MAJOR == 1 and TORCH_MINOR >= 10)
    cuda_version_available = CUDA_MAJOR >= 11
    nccl_version_available = NCCL_MAJOR > 2 or (NCCL_MAJOR == 2 and NCCL_MINOR >= 10)
    npu_available = get_accelerator().device_name() == 'npu'
    hpu_available = get_accelerator().device_name() == 'hpu'
    xpu_available = get_accelerator().device_name() == 'xpu'

    if torch_version_available and cuda_version_available and nccl_version_available and accelerator_pass:
        return True
    elif npu_available:
        return True
    elif hpu_available:
        return True
    elif xpu_available:
        return True
    else:
        return False


def required_amp_check():
    from importlib.util import find_spec
    if find_spec('apex') is None:
        return False
    else:
        return True
