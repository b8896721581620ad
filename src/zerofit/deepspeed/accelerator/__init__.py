"""``deepspeed.accelerator``: ``get_accelerator()``, DeepSpeed 0.19.8's accelerator interface over torch.

::

    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().device_name(), local_rank)     # "cuda" or "cpu"
    get_accelerator().set_device(local_rank)
    get_accelerator().manual_seed_all(seed)
    print(get_accelerator().max_memory_allocated())

The accelerator is chosen as DeepSpeed chooses it (deepspeed/accelerator/real_accelerator.py):
``DS_ACCELERATOR=cuda`` or ``cpu`` when set, else CUDA when torch sees a GPU, else the CPU. Every method of
DeepSpeed's ``DeepSpeedAccelerator`` that maps onto torch is here with DeepSpeed's meaning for that device
(cuda_accelerator.py, cpu_accelerator.py): the CPU accelerator's memory figures are the process's resident
set size and its peak, as DeepSpeed's are, ``device(i)`` is ``None`` and ``Stream``/``Event`` are ``None``
there. Two differences, both for the CPU: ``current_device()`` is ``int(LOCAL_RANK)`` (DeepSpeed returns
the environment string) and ``device_count()`` is ``LOCAL_SIZE`` or 1 (DeepSpeed counts NUMA nodes).
What builds or loads DeepSpeed's kernels (op builders), other accelerators and ``set_accelerator`` are
refused by name.

The accelerator answers the script's own calls; zerofit's engine takes its device from the config
(``device``: auto, cpu, cuda, cuda:N), which picks the same device unless ``DS_ACCELERATOR`` says otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from zerofit.deepspeed.names import refusing_getattr
from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported, UnsupportedAttribute

__all__ = [
    "get_accelerator",
    "set_accelerator",
    "is_current_accelerator_supported",
    "DeepSpeedAccelerator",
    "CUDA_Accelerator",
    "CPU_Accelerator",
]

_NO_OPS = "zerofit builds none of DeepSpeed's kernels (its AdamW runs on the host, in torch)"
_REFUSED_METHODS = {
    "op_builder_dir": _NO_OPS,
    "create_op_builder": _NO_OPS,
    "get_op_builder": _NO_OPS,
    "build_extension": _NO_OPS + "; for your own extensions use torch.utils.cpp_extension.BuildExtension",
    "register_host_memory": "pin host tensors with get_accelerator().pin_memory(t) (tensor.pin_memory())",
    "unregister_host_memory": "pin host tensors with get_accelerator().pin_memory(t) (tensor.pin_memory())",
    "prefer_triton_grouped_mm": "zerofit has no mixture-of-experts kernels",
    "amp": "DeepSpeed 0.19.8's accelerators have no amp(); use torch.autocast(get_accelerator().device_name(), "
    "dtype=torch.bfloat16)",
}


class DeepSpeedAccelerator:
    """The methods both devices share; :class:`CUDA_Accelerator` and :class:`CPU_Accelerator` add the rest."""

    _name = "?"
    _communication_backend_name = "?"
    supports_nvtx_domain = False

    def __init__(self):
        self._compile_backend = "inductor"

    def __getattr__(self, name: str):
        if name in _REFUSED_METHODS:
            raise UnsupportedAttribute(f"zerofit's accelerator has no {name}: {_REFUSED_METHODS[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<zerofit {type(self).__name__} {self._name}>"

    # what DeepSpeed's timers and streams ask of a device
    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def random(self):
        return torch.random

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned()

    def unpin_memory(self, tensor):
        return None

    def pin_memory_alignment(self) -> int:
        return 1

    def pin_empty(self, *size, dtype, device="cpu"):
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        _host(device)
        return self._pinned_empty(shape, dtype)

    def pin_empty_like(self, tensor, device="cpu", dtype=None):
        _host(device)
        return self._pinned_empty(tuple(tensor.shape), tensor.dtype if dtype is None else dtype)

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported Backends are {supported}")
        self._compile_backend = backend


def _host(device) -> None:
    """pin_empty's device must be the host's."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"pin_empty allocates host memory; device must be cpu, got {device!r}")


class CUDA_Accelerator(DeepSpeedAccelerator):
    """DeepSpeed's CUDA accelerator (deepspeed/accelerator/cuda_accelerator.py) over ``torch.cuda``."""

    _name = "cuda"
    _communication_backend_name = "nccl"
    supports_nvtx_domain = False  # zerofit does not use the nvtx package's domains

    def is_synchronized_device(self) -> bool:
        return False

    # devices
    def device_name(self, device_index=None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index=None):
        return torch.device("cuda", device_index)

    def set_device(self, device_index) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index=None):
        return torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def communication_backend_version(self):
        return torch.cuda.nccl.version()

    # random numbers
    def set_rng_state(self, new_state, device_index=None):
        return (
            torch.cuda.set_rng_state(new_state)
            if device_index is None
            else torch.cuda.set_rng_state(new_state, device_index)
        )

    def get_rng_state(self, device_index=None):
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed):
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index):
        return torch.cuda.default_generators[device_index]

    # streams and events
    @property
    def Stream(self):
        return torch.cuda.Stream

    @property
    def Event(self):
        return torch.cuda.Event

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    # memory
    def empty_cache(self):
        return torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None):
        return torch.cuda.reset_max_memory_allocated(device_index)

    def memory_cached(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)  # torch's name for it since 1.4

    def max_memory_cached(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None):
        return torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index=None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None):
        return torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index=None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index=None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]  # the driver's free bytes, as DeepSpeed's NVML reading

    # data types
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True

    def is_fp16_supported(self) -> bool:
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def is_triton_supported(self) -> bool:
        return self.is_available() and torch.cuda.get_device_capability()[0] >= 8

    # profiling ranges, lazy calls, graphs
    def range_push(self, msg, domain=None, category=None):
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None):
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()

    # tensors
    BFloat16Tensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.bfloat16, device="cuda"))
    ByteTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.uint8, device="cuda"))
    DoubleTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.double, device="cuda"))
    FloatTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.float, device="cuda"))
    HalfTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.half, device="cuda"))
    IntTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.int, device="cuda"))
    LongTensor = property(lambda self: functools.partial(torch.tensor, dtype=torch.long, device="cuda"))

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        if make_copy:
            return tensor.pin_memory()
        shape = tensor.shape if match_shape else (tensor.numel(),)  # a template only: a fresh pinned buffer
        return self._pinned_empty(tuple(shape), tensor.dtype)

    def _pinned_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def on_accelerator(self, tensor) -> bool:
        return str(tensor.device).startswith("cuda:")

    def export_envs(self) -> list[str]:
        return ["NCCL"]


class CPU_Accelerator(DeepSpeedAccelerator):
    """DeepSpeed's CPU accelerator (deepspeed/accelerator/cpu_accelerator.py): memory is the process's RSS."""

    _name = "cpu"
    _communication_backend_name = "gloo"  # what zerofit's init_distributed uses on the CPU

    def __init__(self):
        super().__init__()
        import psutil

        self._process = psutil.Process()
        self.max_mem = self._process.memory_info().rss

    def is_synchronized_device(self) -> bool:
        return True

    # devices
    def device_name(self, device_index=None) -> str:
        return "cpu"

    def device(self, device_index=None):
        return None

    def set_device(self, device_index) -> None:
        return None

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0) or 0)

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return max(1, int(os.environ.get("LOCAL_SIZE", 0) or 0))

    def synchronize(self, device_index=None) -> None:
        return None

    def is_available(self) -> bool:
        return True

    # random numbers
    def set_rng_state(self, new_state, device_index=None):
        return torch.set_rng_state(new_state)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def manual_seed(self, seed):
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index):
        return torch.default_generator

    # streams and events: none on the CPU
    Stream = property(lambda self: None)
    Event = property(lambda self: None)

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    def default_stream(self, device_index=None):
        return None

    # memory: the process's resident set size, as DeepSpeed's CPU accelerator reports it
    def empty_cache(self) -> None:
        return None

    def _rss(self) -> int:
        mem = self._process.memory_info().rss
        self.max_mem = max(self.max_mem, mem)
        return mem

    def _reset(self) -> None:
        self.max_mem = self._process.memory_info().rss

    def memory_allocated(self, device_index=None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index=None) -> int:
        self._rss()
        return self.max_mem

    def reset_max_memory_allocated(self, device_index=None) -> None:
        self._reset()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index=None) -> dict:
        mem = self._rss()
        return {"allocated_bytes.all.current": mem, "allocated_bytes.all.peak": self.max_mem}

    def total_memory(self, device_index=None) -> int:
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        import psutil

        return psutil.virtual_memory().available

    # data types
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:
            return False

    def is_triton_supported(self) -> bool:
        return False

    # profiling ranges, lazy calls, graphs: nothing to do on the CPU
    def range_push(self, msg, domain=None, category=None) -> None:
        return None

    def range_pop(self, domain=None) -> None:
        return None

    def lazy_call(self, callback):
        return callback()

    def is_current_stream_capturing(self) -> bool:
        return False

    def create_graph(self):
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        return None

    # tensors
    BFloat16Tensor = property(lambda self: torch.BFloat16Tensor)
    ByteTensor = property(lambda self: torch.ByteTensor)
    DoubleTensor = property(lambda self: torch.DoubleTensor)
    FloatTensor = property(lambda self: torch.FloatTensor)
    HalfTensor = property(lambda self: torch.HalfTensor)
    IntTensor = property(lambda self: torch.IntTensor)
    LongTensor = property(lambda self: torch.LongTensor)

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return tensor  # DeepSpeed's CPU accelerator pins nothing (no device to pin for)

    def _pinned_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)  # not page-locked, as DeepSpeed's CPU accelerator

    def on_accelerator(self, tensor) -> bool:
        return str(tensor.device).startswith("cpu")

    def export_envs(self) -> list[str]:
        return []


_accelerator: DeepSpeedAccelerator | None = None


def get_accelerator() -> DeepSpeedAccelerator:
    """The process's accelerator: ``DS_ACCELERATOR`` (cuda or cpu) when set, else CUDA when torch sees a GPU,
    else the CPU, as DeepSpeed 0.19.8 picks it."""
    global _accelerator
    if _accelerator is None:
        name = os.environ.get("DS_ACCELERATOR")
        if name is None:
            name = "cuda" if torch.cuda.device_count() > 0 and torch.cuda.is_available() else "cpu"
        if name not in ("cuda", "cpu"):
            raise DeepSpeedUnsupported(
                f"DS_ACCELERATOR={name!r}: zerofit runs on CUDA GPUs and the CPU; set "
                "DS_ACCELERATOR=cuda or DS_ACCELERATOR=cpu, or unset it"
            )
        _accelerator = CUDA_Accelerator() if name == "cuda" else CPU_Accelerator()
    return _accelerator


def set_accelerator(accel_obj) -> None:
    raise DeepSpeedUnsupported(
        f"set_accelerator({type(accel_obj).__name__}): zerofit's accelerator is torch's device (CUDA or the CPU, "
        "DS_ACCELERATOR=cuda or cpu picks it), and its engine takes its device from the config (device: cpu, cuda, "
        "cuda:N)"
    )


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in ("cuda", "cpu")


__getattr__ = refusing_getattr(
    __name__,
    {
        "real_accelerator": "get_accelerator() is zerofit's accelerator",
    },
)
