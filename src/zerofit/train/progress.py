"""What the progress line says while nothing else moves: before the engine exists and during the first step.

[Note: the first step's seconds]
Measured on this project's CPU machine (2 cores, shared), ``zerofit train`` on a tiny Llama: step 1 took 4-9 s,
the next ones 0.1 s; plain PyTorch (the same model, its own forward and backward) took 1.6 s then 0.08 s.
A profile puts the seconds in torch's own kernels: each of the first few hundred small matrix products took
~16 ms instead of 0.05 ms (``F.linear`` alone, in a bare process, shows the same), while with
``OMP_WAIT_POLICY=PASSIVE`` or one MKL thread they are fast from the start: the OpenMP threads that MKL
starts at its first use wait for a core the other processes hold, until they settle. zerofit's own one-time
work in step 1 on the CPU is negligible in that profile (its buffers are allocated at initialize). On a GPU the first
step loads CUDA kernels and fills the allocator's pools; and on a GPU, with clipping or fp16, initialize
compiles the split AdamW kernel the first time on a machine (about a minute, cached:
``zerofit.engine.update.split_adamw``), which :func:`kernel_build_note` announces.
"""

from __future__ import annotations

import torch

from zerofit.config.schema import ZerofitConfig


def first_step_note(device: torch.device | str) -> str:
    """The progress line's text until the first step ends ([Note: the first step's seconds])."""
    if torch.device(device).type == "cpu":
        return "step 1: torch's CPU kernels warm up (MKL's threads start: seconds, once)"
    return "step 1: CUDA kernels load, memory pools fill (once)"


def kernel_build_note(config: ZerofitConfig, device: torch.device | str) -> str | None:
    """A line to print before ``zerofit.initialize`` when it will compile the split AdamW kernel, else None."""
    from zerofit.engine.plan.engine_plan import needs_norm, split_wanted
    from zerofit.engine.update import split_adamw

    deferred = needs_norm(config)  # the engine's deferred updates
    if not split_wanted(config, torch.device(device).type == "cuda", deferred) or not split_adamw.will_build():
        return None
    return (
        "building zerofit's CPU AdamW kernel (the split updates, offload.split_updates): its first use on "
        "this machine, about a minute; later runs load it from torch's extensions cache"
    )
