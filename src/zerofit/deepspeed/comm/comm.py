"""DeepSpeed's communication functions (deepspeed/comm/comm.py, 0.19.8) over ``torch.distributed``, one process.

::

    import deepspeed.comm as dist

    dist.barrier()
    if dist.get_rank() == 0:
        print("loss", loss.item())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)     # one rank: t as it was

Each function takes DeepSpeed's arguments in DeepSpeed's order and runs torch's collective on torch's
default group (DeepSpeed's comms-logging keywords ``prof``, ``log_name``, ``debug`` are accepted; DeepSpeed
logs nothing with them unless its comms logger is configured, which zerofit refuses). ``op`` is DeepSpeed's
:class:`ReduceOp` or torch's. zerofit trains in one process: on a world of one rank ``all_reduce`` and
``broadcast`` leave the tensor as it is, ``all_gather`` copies it, ``barrier`` returns. Point-to-point calls
(``send``, ``recv``, ``batch_isend_irecv``) have no peer and are refused by name, as are the comms logger and
the cluster discovery helpers.

[Note: comm before init_distributed]
DeepSpeed's ``initialize()`` initializes the process group itself, so scripts call ``dist.barrier()`` or
``dist.get_rank()`` after it without ``init_distributed()`` (DeepSpeedExamples' offload_states). zerofit's
``initialize()`` leaves ``torch.distributed`` alone unless asked (``dist_init_required=True``). So the rank
queries answer for the one process without a group (rank 0, world size 1, ``LOCAL_RANK``), and a collective
called without a group first initializes ``torch.distributed`` for this one process (``init_distributed()``:
gloo on the CPU, nccl with a GPU), then runs. With a group (the script's, or torch's own), the answers are
torch's. DeepSpeed asserts "backend not set" before its ``initialize()``; zerofit answers instead.
"""

from __future__ import annotations

import functools
import os
from enum import Enum

import torch.distributed as tdist

from zerofit.deepspeed import init_distributed
from zerofit.deepspeed.names import refusing_getattr
from zerofit.engine.faces.deepspeed_names import ONE_PROCESS

__all__ = [
    "ReduceOp",
    "init_distributed",
    "is_initialized",
    "is_available",
    "destroy_process_group",
    "new_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_global_rank",
    "get_all_ranks_from_group",
    "get_world_group",
    "barrier",
    "monitored_barrier",
    "all_reduce",
    "inference_all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "allgather_fn",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_fn",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
]


class ReduceOp(Enum):
    """DeepSpeed's reduce operations (deepspeed/comm/reduce_op.py); torch's ``ReduceOp`` is accepted too."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


# torch 2.13 names them *_single (the *_tensor names are deprecated there); torch 2.6 has only *_tensor
_all_gather_single = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_reduce_scatter_single = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def _torch_op(op):
    if isinstance(op, ReduceOp):
        if op is ReduceOp.UNUSED:
            raise ValueError("ReduceOp.UNUSED is not a reduce operation; pass ReduceOp.SUM, AVG, MIN, MAX, ...")
        return getattr(tdist.ReduceOp, op.name)
    return op


def _collective(fn):
    """Accept DeepSpeed's comms-logging keywords; make the one-process group first when there is none
    ([Note: comm before init_distributed])."""

    @functools.wraps(fn)
    def run(*args, prof=False, log_name=None, debug=None, **kwargs):
        if not tdist.is_initialized():
            init_distributed()
        return fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------------------------------------- the group


def is_initialized() -> bool:
    return tdist.is_initialized()


def is_available() -> bool:
    return True


def destroy_process_group(group=None) -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group(group)


@_collective
def new_group(ranks):
    return tdist.new_group(ranks)


@_collective
def get_world_group():
    return tdist.group.WORLD


def get_rank(group=None) -> int:
    return tdist.get_rank(group) if tdist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return tdist.get_world_size(group) if tdist.is_initialized() else 1


def get_local_rank() -> int:
    """The launcher's ``LOCAL_RANK`` (or Open MPI's), 0 without one: DeepSpeed's get_local_rank_from_launcher."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    if tdist.is_initialized():
        return tdist.get_global_rank(group if group is not None else tdist.group.WORLD, group_rank)
    if group_rank != 0:
        raise ValueError(f"get_global_rank(group_rank={group_rank}): the one process is rank 0")
    return 0


def get_all_ranks_from_group(group=None) -> list[int]:
    return tdist.get_process_group_ranks(group or tdist.group.WORLD) if tdist.is_initialized() else [0]


# ---------------------------------------------------------------------------------------------- collectives


@_collective
def barrier(group=None, async_op=False, device_ids=None):
    return tdist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@_collective
def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    return tdist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


@_collective
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return tdist.all_reduce(tensor, op=_torch_op(op), group=group, async_op=async_op)


@_collective
def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    tdist.all_reduce(tensor, op=_torch_op(op), group=group)
    return tensor


@_collective
def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    works = [tdist.all_reduce(t, op=_torch_op(op), group=group, async_op=async_op) for t in tensors]
    return works[-1] if async_op and works else None


@_collective
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    return tdist.reduce(tensor, dst, op=_torch_op(op), group=group, async_op=async_op)


@_collective
def broadcast(tensor, src, group=None, async_op=False):
    return tdist.broadcast(tensor, src, group=group, async_op=async_op)


@_collective
def broadcast_object_list(object_list, src, group=None, device=None):
    return tdist.broadcast_object_list(object_list, src, group=group, device=device)


@_collective
def all_gather(tensor_list, tensor, group=None, async_op=False):
    return tdist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


@_collective
def all_gather_object(object_list, obj, group=None):
    return tdist.all_gather_object(object_list, obj, group=group)


@_collective
def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False):
    return _all_gather_single(output_tensor, tensor, group=group, async_op=async_op)


@_collective
def allgather_fn(output_tensor, input_tensor, group=None, async_op=False):
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


@_collective
def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    works = [_all_gather_single(o, i, group=group, async_op=async_op) for o, i in zip(output_tensors, input_tensors)]
    return works[-1] if async_op and works else None


@_collective
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    return tdist.reduce_scatter(output, input_list, op=_torch_op(op), group=group, async_op=async_op)


@_collective
def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return _reduce_scatter_single(output_tensor, tensor, op=_torch_op(op), group=group, async_op=async_op)


@_collective
def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return _reduce_scatter_single(output_tensor, tensor, op=_torch_op(op), group=group, async_op=async_op)


@_collective
def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    return tdist.all_to_all_single(
        output,
        tensor,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=async_op,
    )


@_collective
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return tdist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@_collective
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    return tdist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


@_collective
def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    return tdist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


_NO_PEER = "zerofit trains in one process, so there is no peer to send to or receive from"
_NO_LOG = "zerofit logs no communication (one process); engine.timeline() has each step's phases"
_REFUSED = {name: _NO_PEER for name in ("send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv")}
_REFUSED.update(
    {
        name: _NO_LOG
        for name in (
            "configure",
            "log_summary",
            "reset_log",
            "has_comm_data",
            "get_comm_operation_count",
            "get_logged_comm_ops",
            "comms_logger",
            "timers",
        )
    }
)
_REFUSED.update(
    {
        name: ONE_PROCESS
        for name in (
            "initialize_mesh_device",
            "enable_symm_mem_for_group",
            "mpi_discovery",
            "in_aml",
            "in_aws_sm",
            "in_dlts",
            "patch_aml_env_for_torch_nccl_backend",
            "patch_aws_sm_env_for_torch_nccl_backend",
            "init_deepspeed_backend",
            "set_backend",
            "cdb",
            "ProcessGroup",
        )
    }
)

__getattr__ = refusing_getattr("zerofit.deepspeed.comm", _REFUSED)
