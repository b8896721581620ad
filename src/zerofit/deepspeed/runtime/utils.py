"""``deepspeed.runtime.utils``: ``see_memory_usage`` as DeepSpeed 0.19.8 prints it (deepspeed/runtime/utils.py).

The rest of DeepSpeed's runtime utilities work on its engine's partitions and are refused by name."""

from __future__ import annotations

import contextlib
import gc

import psutil

from zerofit.deepspeed.names import refusing_getattr

__all__ = ["see_memory_usage", "noop_context"]


def see_memory_usage(message, force=False) -> None:
    """With ``force``: print ``message``, the accelerator's allocated (MA) and reserved (CA) memory and their
    peaks, and the host's virtual memory in use, then reset the peaks (on rank 0 of a group only)."""
    from zerofit.deepspeed import comm as dist
    from zerofit.deepspeed.accelerator import get_accelerator

    if not force:
        return
    if dist.is_initialized() and not dist.get_rank() == 0:
        return
    gc.collect()  # python does not collect in real time: collect for a truthful reading
    acc = get_accelerator()
    gib = 1024**3
    print(message)
    print(
        f"MA {round(acc.memory_allocated() / gib, 2)} GB \
        Max_MA {round(acc.max_memory_allocated() / gib, 2)} GB \
        CA {round(acc.memory_reserved() / gib, 2)} GB \
        Max_CA {round(acc.max_memory_reserved() / gib)} GB "
    )
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {round((vm.total - vm.available) / gib, 2)} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()


def noop_context():
    return contextlib.nullcontext()


_PARTITIONS = (
    "zerofit's engine keeps its own buffers; clip with the config's gradient_clipping, read weights "
    "through engine.module"
)
__getattr__ = refusing_getattr(
    __name__,
    {
        name: _PARTITIONS
        for name in (
            "clip_grad_norm_",
            "get_global_norm",
            "get_grad_norm",
            "get_weight_norm",
            "clip_tensors_by_global_norm",
            "get_global_norm_of_tensors",
            "get_flattened_grad_norm",
            "align_dense_tensors",
            "all_gather_dp_groups",
            "PartitionedTensor",
            "CheckOverflow",
            "DummyOptim",
            "memory_status",
            "empty_cache",
            "call_to_str",
            "get_only_unique_item",
            "bwc_tensor_model_parallel_rank",
            "is_model_parallel_parameter",
        )
    },
)
