"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters`` and ``ZeroParamStatus``.

``ZeroParamStatus`` is DeepSpeed's enum. zerofit never partitions a parameter: every parameter is
``AVAILABLE`` and none carries DeepSpeed's ``ds_id`` / ``ds_status``, so the check scripts write for ZeRO-3
(``hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE``, DeepSpeed-Chat's) is False and
they read parameters directly, as DeepSpeed's scripts do below ZeRO-3.

As in DeepSpeed, ``Init`` and ``GatheredParameters`` are defined here and ``deepspeed.zero`` re-exports them.

DeepSpeed's ``zero.Init`` partitions each parameter across the ranks as the model is built, so that no
process ever holds the whole model. zerofit has one process and its own storage: under ``Init`` every
*parameter* is created on the meta device (no memory), while buffers (rotary tables, masks) are computed
for real as the model's ``__init__`` computes them. ``zerofit.deepspeed.initialize`` then materializes the
parameters unit by unit into the engine's own buffers, initialized by the model's ``_init_weights`` (Hugging
Face models) or each module's ``reset_parameters`` (zerofit/engine/model/materialize.py).

Of ``Init``'s arguments, those that only say where DeepSpeed keeps its partitions or how it allocates them
are accepted and ignored (``remote_device``, ``pin_memory``, ``mem_efficient_linear``, ``config_dict_or_path``
/ ``config``, which is still read and checked, ``module``, ``dtype``); those that change what is trained or
need several processes are refused by name. The initial weights are a fresh random initialization (on the
compute device), not bitwise those of the same model built without ``Init``; DeepSpeed's are not either
(it initializes on the GPU and, with fp16 or ``dtype``, rounds them to 16 bits; zerofit keeps fp32 masters).

[Note: parameters on meta, buffers real]
``Init`` wraps ``nn.Module.register_parameter`` (as accelerate's ``init_empty_weights`` does): a parameter is
moved to the meta device when its module registers it. A parameter already on meta (a tied weight assigned
again, ``lm_head.weight = embed.weight``) is registered as it is, so ties stay one object. The wrap is
process-wide while the outermost ``Init`` is open: a model built by another thread meanwhile is affected too.
"""

from __future__ import annotations

import threading
import weakref
from enum import Enum

import torch
from torch import nn

from zerofit.deepspeed.names import refusing_getattr
from zerofit.engine.faces.deepspeed_names import ONE_PROCESS, DeepSpeedUnsupported

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus"]

_lock = threading.Lock()
_depth = 0
original_register = nn.Module.register_parameter
_engines: weakref.WeakSet = weakref.WeakSet()  # engines made by zerofit.deepspeed.initialize


def _register_on_meta(module: nn.Module, name: str, param) -> None:
    """[Note: parameters on meta, buffers real]"""
    original_register(module, name, param)
    if param is None or param.is_meta:
        return
    if type(param) is not nn.Parameter:
        raise DeepSpeedUnsupported(
            f"zero.Init: parameter {name!r} of {type(module).__name__} is a "
            f"{type(param).__name__}; zerofit builds plain nn.Parameter objects on the meta "
            "device only. Build this model outside zero.Init"
        )
    meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    meta.__dict__.update(param.__dict__)
    module._parameters[name] = meta


class Init:
    """``with deepspeed.zero.Init(): model = MyModel()``: parameters on the meta device, materialized by
    ``initialize``. Also usable as ``deepspeed.zero.Init(module=model)`` (a model already built: nothing to do)."""

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear=True,
        remote_device=None,
        pin_memory=False,
        config_dict_or_path=None,
        config=None,
        enabled=True,
        dtype=None,
        mpu=None,
        zero_param_parallel_group=None,
        zero_quantized_weights=False,
        zero_quantized_nontrainable_weights=False,
        sequence_data_parallel_group=None,
        param_swapper=None,
    ):
        for name, value in (
            ("mpu", mpu),
            ("data_parallel_group", data_parallel_group),
            ("zero_param_parallel_group", zero_param_parallel_group),
            ("sequence_data_parallel_group", sequence_data_parallel_group),
        ):
            if value is not None:
                raise DeepSpeedUnsupported(f"zero.Init({name}=...): {ONE_PROCESS}")
        if param_swapper is not None:
            raise DeepSpeedUnsupported(
                "zero.Init(param_swapper=...): zerofit has no parameter swapper (its disk "
                "tier holds optimizer state; the 16-bit weights stay in host memory)"
            )
        for name, value in (
            ("zero_quantized_weights", zero_quantized_weights),
            ("zero_quantized_nontrainable_weights", zero_quantized_nontrainable_weights),
        ):
            if value:
                raise DeepSpeedUnsupported(f"zero.Init({name}=True): zerofit keeps weights at full precision")
        if dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"zero.Init(dtype={dtype}): DeepSpeed accepts torch.half, torch.bfloat16 or torch.float")
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None:
            from zerofit.config import load_config

            load_config(source)  # a bad config fails here, as DeepSpeed's Init reads it
        self.enabled = bool(enabled) and module is None
        self.module = module

    def __enter__(self):
        global _depth
        if self.enabled:
            with _lock:
                if _depth == 0:
                    nn.Module.register_parameter = _register_on_meta
                _depth += 1
        return self

    def __exit__(self, *exc) -> None:
        global _depth
        if self.enabled:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    nn.Module.register_parameter = original_register


class GatheredParameters:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=None):`` read parameters whole.

    zerofit never partitions a parameter, so there is nothing to gather: on entry the parameters of a model
    that an engine (from ``zerofit.deepspeed.initialize``) trains are brought up to date (the engine's pending
    updates applied and its weights copied to the module, as ``engine.module`` does). Reading them is exact.
    Writing is refused: with ``modifier_rank`` set on an engine's parameters (the engine would not take the
    new values), and on parameters still on the meta device under ``zero.Init`` (they hold no values until
    ``initialize``). A model built without ``Init`` and not yet given to ``initialize`` is plain tensors: the
    context does nothing and changes stay, which ``initialize`` then copies (DeepSpeed's behaviour for
    parameters it has not partitioned). With ``modifier_rank=None`` DeepSpeed discards changes made inside;
    do not make any: on an engine's parameters zerofit would keep some of them."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled or not self.params:
            return None
        meta = [tuple(p.shape) for p in self.params if p.is_meta]
        if meta:
            raise DeepSpeedUnsupported(
                f"zero.GatheredParameters: {len(meta)} parameter(s) (shapes {meta[:3]}) are on the meta device "
                "(built under zero.Init): they hold no values until zerofit.deepspeed.initialize materializes "
                "them. Read or change them afterwards through engine.module, or build the model without zero.Init "
                "to load weights into it first"
            )
        ids = {id(p) for p in self.params}
        owners = [e for e in list(_engines) if any(id(p) in ids for p in e.adapter.model.parameters())]
        if owners and self.modifier_rank is not None:
            raise DeepSpeedUnsupported(
                f"zero.GatheredParameters(modifier_rank={self.modifier_rank}) on parameters an engine trains: "
                "zerofit cannot take changed weights back into a running engine. Change the model before "
                "zerofit.deepspeed.initialize, or load weights with engine.load_checkpoint"
            )
        for e in owners:
            _ = e.module  # applies the pending updates and refreshes the module's weights
        return None

    def __exit__(self, *exc) -> None:
        return None


def register_engine(engine) -> None:
    _engines.add(engine)


DEEPSPEED_ZERO_NAMES = {
    "TiledLinear": "zerofit does not replace the model's modules",
    "TiledLinearReturnBias": "zerofit does not replace the model's modules",
    "register_external_parameter": "zerofit runs the model's own forward with every parameter of a block present",
    "unregister_external_parameter": "zerofit runs the model's own forward with every parameter of a block present",
    "MiCS_Init": ONE_PROCESS,
    "ZeroParamType": "zerofit's parameters are plain nn.Parameter objects, never partitioned",
    "DeepSpeedTensorOverride": "zerofit's parameters are plain nn.Parameter objects, never partitioned",
    "DeepSpeedZeRoOffload": "zerofit has no ZeRO stages: it streams whole blocks through the GPU",
    "unwrap_model_for_generation": "zerofit never partitions the model: use engine.module for generation",
    "DeepSpeedTiledLinear": "zerofit does not replace the model's modules",
}


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # fully present on every process: every zerofit parameter
    NOT_AVAILABLE = 2  # partitioned or remote (never in zerofit)
    INFLIGHT = 3  # being gathered (never in zerofit)


__getattr__ = refusing_getattr("zerofit.deepspeed.zero.partition_parameters", DEEPSPEED_ZERO_NAMES)
