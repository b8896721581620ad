"""FSDP-shaped code on zerofit, with one import changed (docs/fsdp.md):

    from zerofit.fsdp import FullyShardedDataParallel as FSDP      # was: from torch.distributed.fsdp import ...
    from zerofit.fsdp import fully_shard                           # was: from torch.distributed.fsdp import ...

Both build a :class:`zerofit.userloop.UserLoop` over the model ([Note: the user's loop drives the engine]): the
user's forward, ``loss.backward()``, ``clip_grad_norm_`` and ``optimizer.step()`` drive the engine. Each of
FSDP's arguments is honoured, mapped onto zerofit's config, or refused by name (:data:`ARGUMENTS` says which);
torch's own ``CPUOffload``, ``MixedPrecision``, ``ShardingStrategy``, ``MixedPrecisionPolicy`` and
``CPUOffloadPolicy`` are what they read.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging

import torch
import torch.distributed.fsdp as _torch_fsdp
from torch import nn

from zerofit.userloop import UserLoop, UserLoopError

log = logging.getLogger("zerofit")

# torch.distributed.fsdp's other public names as torch has them (CPUOffload, MixedPrecision, ShardingStrategy,
# StateDictType, MixedPrecisionPolicy, CPUOffloadPolicy...): FSDP code imports them from where it imports FSDP
globals().update(
    {n: getattr(_torch_fsdp, n) for n in _torch_fsdp.__all__ if n not in ("FullyShardedDataParallel", "fully_shard")}
)
__all__ = sorted({*_torch_fsdp.__all__, "FSDP", "ARGUMENTS", "UserLoopError"})

# what each argument does on zerofit (docs/fsdp.md prints this table)
ARGUMENTS = {
    "module": "the model; zerofit streams its repeated blocks (the adapter finds them) and keeps the rest resident",
    "auto_wrap_policy": "accepted: zerofit's units are the model's repeated blocks whatever the policy (a policy "
    "naming another layer class is reported)",
    "cpu_offload": "CPUOffload(offload_params=True): zerofit's offload (the planner keeps on the GPU what fits, the "
    "rest in host memory, AdamW on the CPU for it); None or False: nothing offloaded",
    "mixed_precision": "MixedPrecision(param_dtype=bf16 or fp16): compute in that dtype over fp32 master weights (as "
    "FSDP keeps fp32 sharded parameters); fp16 with the loop's GradScaler or ShardedGradScaler "
    "(its unscale_, overflow skip and scale schedule); None: fp32",
    "sharding_strategy": "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD: zerofit's sharding of the same name (several ranks); "
    "HYBRID_SHARD and _HYBRID_SHARD_ZERO2: FULL_SHARD and SHARD_GRAD_OP inside each node, "
    "replicated across the nodes: the hybrid layout on several nodes; FULL_SHARD and "
    "SHARD_GRAD_OP given on several nodes: the full layout (the state sharded over every "
    "node); None: the planner's choice (docs/ranks.md)",
    "device_id": "the compute device (an int or torch.device); None: the GPU if there is one",
    "use_orig_params": "accepted: the parameters are the model's own (views of the engine's master weights)",
    "sync_module_states": "accepted: with several ranks the host's state comes from local rank 0 anyway",
    "backward_prefetch": "accepted: zerofit prefetches the next blocks' uploads itself",
    "forward_prefetch": "accepted (as backward_prefetch)",
    "limit_all_gathers": "accepted (zerofit bounds its uploads by its weight slots)",
    "process_group": "None only: zerofit shards over the default process group, every rank the launcher started; "
    "to train on fewer, launch fewer (torchrun --nproc_per_node N) and leave process_group out",
    "device_mesh": "None only: the layout comes from sharding_strategy (HYBRID_SHARD: sharded inside each node, "
    "replicated across nodes); leave device_mesh out",
    "param_init_fn": "refused: build the model on the meta device and give zerofit its files (zerofit.initialize)",
    "ignored_modules": "refused: to keep modules out of training, freeze their parameters (requires_grad_(False)): "
    "zerofit keeps frozen weights as they are and trains the rest",
    "ignored_states": "refused: freeze those parameters instead (requires_grad_(False))",
    "zerofit_config": "zerofit's own settings (docs/config.md), applied last: max_gpu_memory, "
    "gradient_accumulation_steps (micro-batches held before their blocks' backward), ...",
}


def _precision(param_dtype) -> str:
    if param_dtype in (None, torch.float32):
        return "fp32"
    if param_dtype == torch.bfloat16:
        return "bf16"
    if param_dtype == torch.float16:
        return "fp16"
    raise UserLoopError(f"mixed precision param_dtype {param_dtype}: zerofit computes in fp32, bf16 or fp16")


def _config(
    *, offload: bool, precision: str, device, sharding: str | None, extra: dict | None, layout: str | None = None
) -> dict:
    cfg: dict = {"precision": precision}
    if not offload:
        cfg["offload"] = {"param_device": "none", "optimizer_device": "none"}
    if device is not None:
        cfg["device"] = f"cuda:{device}" if isinstance(device, int) else str(torch.device(device))
    if sharding is not None:
        cfg["sharding"] = sharding
    if layout is not None:
        cfg["nodes_layout"] = layout
    for k, v in (extra or {}).items():
        if k == "offload" and isinstance(v, dict):
            cfg["offload"] = {**cfg.get("offload", {}), **v}
        else:
            cfg[k] = v
    return cfg


def _refuse(**given) -> None:
    for name, value in given.items():
        if value is not None:
            raise UserLoopError(f"FullyShardedDataParallel({name}=...): {ARGUMENTS[name]}")


def _check_policy(policy, loop: UserLoop) -> None:
    classes = getattr(policy, "keywords", {}).get("transformer_layer_cls") if policy is not None else None
    blocks = loop.engine.adapter.blocks
    if classes and len(blocks) and type(blocks[0]) not in set(classes):
        log.warning(
            "zerofit: auto_wrap_policy names %s; zerofit streams the model's repeated %s blocks",
            sorted(c.__name__ for c in classes),
            type(blocks[0]).__name__,
        )


class FullyShardedDataParallel(nn.Module):
    """FSDP1's wrapper, on zerofit: ``FSDP(model, auto_wrap_policy=..., cpu_offload=CPUOffload(True),
    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), device_id=...)``; then the loop as written
    (an optimizer over ``model.parameters()``, ``loss.backward()``, ``model.clip_grad_norm_``,
    ``optimizer.step()``). :data:`ARGUMENTS` says what each argument does here."""

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy=None,
        cpu_offload=None,
        auto_wrap_policy=None,
        backward_prefetch=None,
        mixed_precision=None,
        ignored_modules=None,
        param_init_fn=None,
        device_id=None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states=None,
        device_mesh=None,
        *,
        zerofit_config: dict | None = None,
    ):
        super().__init__()
        _refuse(
            process_group=process_group,
            device_mesh=device_mesh,
            param_init_fn=param_init_fn,
            ignored_modules=ignored_modules,
            ignored_states=ignored_states,
        )
        strategy = getattr(sharding_strategy, "name", sharding_strategy)
        # [Note: the nodes' layout] (engine/plan/engine_plan.py): FSDP's words for the layouts on several nodes
        layout = (
            "hybrid"
            if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
            else "full"
            if strategy in ("FULL_SHARD", "SHARD_GRAD_OP")
            else None
        )
        strategy = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}.get(strategy, strategy)
        if strategy is not None and strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            raise UserLoopError(f"sharding_strategy {strategy}: {ARGUMENTS['sharding_strategy']}")
        offload = bool(getattr(cpu_offload, "offload_params", False))
        precision = _precision(getattr(mixed_precision, "param_dtype", None))
        self.module = module
        self._zerofit = UserLoop(
            module,
            _config(
                offload=offload,
                precision=precision,
                device=device_id,
                sharding=strategy,
                layout=layout,
                extra=zerofit_config,
            ),
        )
        _check_policy(auto_wrap_policy, self._zerofit)
        if precision != "fp32" and (
            getattr(mixed_precision, "cast_root_forward_inputs", False)
            or getattr(mixed_precision, "cast_forward_inputs", False)
        ):
            self._zerofit.cast_inputs = mixed_precision.param_dtype  # FSDP casts the root's inputs
        # state dicts by the model's names, loads into the engine's masters (nested in a LightningModule too)
        self._register_state_dict_hook(self._state_dict_names)
        self._register_load_state_dict_pre_hook(self._load_names)
        self.register_load_state_dict_post_hook(lambda module, keys: self._zerofit.module_loaded())

    @property
    def zerofit_engine(self):
        """The engine under the loop (zerofit's own API: checkpoints, memory_stats, timeline)."""
        return self._zerofit.engine

    def forward(self, *args, **kwargs):
        return self._zerofit.forward(*args, **kwargs)

    def __getattr__(self, name: str):
        """What the wrapper does not have comes from the wrapped model, as torch's FSDP forwards it
        (``model.config``, PEFT's ``model.save_pretrained(dir)``); a method of the model is called with the host
        weights made current first (the engine's pending updates applied), since it may read them."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__["_modules"].get("module")
            if inner is None:
                raise
        attr = getattr(inner, name)
        if not inspect.ismethod(attr):
            return attr
        loop = self.__dict__.get("_zerofit")

        @functools.wraps(attr)
        def with_current_weights(*args, **kwargs):
            if loop is not None:
                _ = loop.engine.module  # the host weights made current
            return attr(*args, **kwargs)

        return with_current_weights

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The step's gradients clipped to ``max_norm`` (their global L2 norm returned): the engine takes its
        optimizer step here, the optimizer's ``step()`` then finds it taken ([Note: the user's loop drives the
        engine])."""
        return self._zerofit.clip_grad_norm_(max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self):
        """FSDP's: gradients accumulate without being reduced; on zerofit they accumulate until the step anyway."""
        yield

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
        """FULL_STATE_DICT: ``model.state_dict()`` is the whole model's, by its own names. SHARDED_STATE_DICT: the
        same whole tensors (a host holds the training state once, shared by its ranks: no rank has a shard of its
        own to give), which ``torch.distributed.checkpoint`` saves once and loads on any number of ranks, the
        optimizer's by :meth:`optim_state_dict`. LOCAL_STATE_DICT (FSDP's flat parameters): refused."""
        name = getattr(state_dict_type, "name", state_dict_type)
        if name not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            raise UserLoopError(
                f"state_dict_type {name}: zerofit gives the model's own tensors by their names "
                "(FULL_STATE_DICT, or SHARDED_STATE_DICT for torch.distributed.checkpoint), not "
                "FSDP's flat parameters; for resumable checkpoints use model.save_checkpoint(dir)"
            )
        yield

    def _state_dict_names(self, module, state_dict, prefix, local_metadata):
        """The full state dict by the model's own names (``prefix`` + the model's name, no ``module.`` level, as
        FSDP's): tensors of their own (the engine's are views of one flat buffer per unit, which safetensors'
        load refuses), the host weights made current first."""
        inner = prefix + "module."
        for k in [k for k in state_dict if k.startswith(inner)]:
            state_dict[prefix + k[len(inner) :]] = state_dict.pop(k).detach().clone()

    def _load_names(self, state_dict, prefix, *args):
        inner = prefix + "module."
        for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + k[len(prefix) :]] = state_dict.pop(k)

    def state_dict(self, *args, **kwargs):
        _ = self._zerofit.engine.module  # the host weights made current (device-optimized units' mirrors)
        return super().state_dict(*args, **kwargs)

    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None) -> dict:
        """FSDP's optimizer state dict keyed by the parameters' names (the model's own): the engine's moments
        and step counts (``optim.state_dict()``, [Note: the user's loop drives the engine]), before its first step
        too (zero moments at step 0: what torch.distributed.checkpoint loads into)."""
        _loop_of_model(model).follow(optim)
        sd = optim.state_dict() if optim_state_dict is None else optim_state_dict
        names = _param_names(model, optim)
        return {
            "state": {names[i]: v for i, v in sd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
        }

    @staticmethod
    def optim_state_dict_to_load(
        model, optim, optim_state_dict, is_named_optimizer: bool = False, load_directly: bool = False, group=None
    ) -> dict:
        """The inverse of :meth:`optim_state_dict`: ``optim.load_state_dict``'s format (``load_directly``: loaded)."""
        _loop_of_model(model).follow(optim)
        index = {n: i for i, n in enumerate(_param_names(model, optim))}
        sd = {
            "state": {index[n]: v for n, v in optim_state_dict["state"].items()},
            "param_groups": [
                {**g, "params": [index[n] for n in g["params"]]} for g in optim_state_dict["param_groups"]
            ],
        }
        if load_directly:
            optim.load_state_dict(sd)
        return sd

    def to(self, *args, **kwargs):
        """The engine places the weights (streamed through the device, masters in host memory): a move is a no-op
        (accelerate's prepare moves the model)."""
        return self

    def cuda(self, device=None):
        return self

    def cpu(self):
        return self

    def save_checkpoint(self, save_dir, tag=None, **kwargs):
        """The engine's checkpoint (weights, AdamW state, step; docs/checkpoints.md)."""
        self._zerofit.engine.save_checkpoint(save_dir, tag=tag, **kwargs)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        return self._zerofit.engine.load_checkpoint(load_dir, tag=tag, **kwargs)


FSDP = FullyShardedDataParallel


def _loop_of_model(model) -> UserLoop:
    """The user's loop of a wrapped model (FSDP1's wrapper, or a model ``fully_shard`` swapped)."""
    loop = getattr(model, "_zerofit", None)
    if not isinstance(loop, UserLoop):
        raise UserLoopError(f"{type(model).__name__}: not a model wrapped by zerofit.fsdp")
    return loop


def _param_names(model, optim) -> list[str]:
    """The name (the model's own) of each parameter of ``optim``, in its groups' order."""
    inner = model.module if isinstance(model, FullyShardedDataParallel) else model
    by_id = {id(p): n for n, p in inner.named_parameters()}
    return [by_id[id(p)] for g in optim.param_groups for p in g["params"]]


# ------------------------------------------------------------------------------------------------ FSDP2

_MARKED = "_zerofit_fully_shard"


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward=True,
    shard_placement_fn=None,
    mp_policy=None,
    offload_policy=None,
    ignored_params=None,
    zerofit_config: dict | None = None,
):
    """FSDP2's ``fully_shard``, on zerofit: applied to each block and then to the root (as FSDP2's examples do);
    the call on the root (a module with ``config``, or one that holds modules already passed here) builds the
    engine over it and returns it, its class swapped as FSDP2 swaps it (its forward is the engine's). The calls
    on the blocks are recorded only. ``mp_policy``/``offload_policy`` as FSDP1's ``mixed_precision``/
    ``cpu_offload``; ``reshard_after_forward`` accepted (zerofit frees a block's slot as it needs it)."""
    if mesh is not None or shard_placement_fn is not None or ignored_params is not None:
        raise UserLoopError("fully_shard(mesh=/shard_placement_fn=/ignored_params=): not on zerofit")
    inner = [m for m in module.modules() if m is not module and getattr(m, _MARKED, False)]
    setattr(module, _MARKED, True)
    if not inner and getattr(module, "config", None) is None:
        return module  # a block: the root's call builds the engine
    offload = type(offload_policy).__name__ == "CPUOffloadPolicy"
    precision = _precision(getattr(mp_policy, "param_dtype", None))
    loop = UserLoop(
        module, _config(offload=offload, precision=precision, device=None, sharding=None, extra=zerofit_config)
    )
    if precision != "fp32" and getattr(mp_policy, "cast_forward_inputs", False):
        loop.cast_inputs = mp_policy.param_dtype  # FSDP2 casts the root's inputs
    module.__dict__["_zerofit"] = loop
    module.__class__ = _fsdp2_class(type(module))
    return module


_CLASSES: dict = {}


def _fsdp2_class(cls):
    if cls in _CLASSES:
        return _CLASSES[cls]

    def forward(self, *args, **kwargs):
        loop = self.__dict__["_zerofit"]
        if loop.inside:  # the engine runs the model's own forward (its shell, the blocks)
            return cls.forward(self, *args, **kwargs)
        return loop.forward(*args, **kwargs)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's: gradients accumulate until the step on zerofit anyway."""

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's: the engine finds the step's end at ``optimizer.step()``."""

    def unshard(self, async_op: bool = False):
        return None

    def reshard(self) -> None:
        return None

    new = type(
        f"FSDP{cls.__name__}",
        (cls,),
        {
            "forward": forward,
            "set_requires_gradient_sync": set_requires_gradient_sync,
            "set_is_last_backward": set_is_last_backward,
            "unshard": unshard,
            "reshard": reshard,
            "zerofit_engine": property(lambda self: self.__dict__["_zerofit"].engine),
        },
    )
    _CLASSES[cls] = new
    return new
