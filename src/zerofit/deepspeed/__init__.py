"""A drop-in for DeepSpeed's training entry points: ``import zerofit.deepspeed as deepspeed``.

::

    import zerofit.deepspeed as deepspeed

    engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                              model_parameters=model.parameters(),
                                                              config="ds_config.json")
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

``initialize`` takes DeepSpeed's arguments, in DeepSpeed's order, and returns DeepSpeed's tuple ``(engine,
optimizer, training_dataloader, lr_scheduler)``: the engine is zerofit's :class:`~zerofit.engine.engine.Engine`
with DeepSpeed's engine surface (zerofit/engine/faces/deepspeed_surface.py), the optimizer and scheduler are views of
its AdamW settings and learning-rate schedule. What zerofit cannot do as DeepSpeed does is refused with
:class:`DeepSpeedUnsupported` naming the argument, attribute or call; docs/migration.md has the table.

The modules DeepSpeed scripts import sit under this package in DeepSpeed 0.19.8's layout
(``zerofit.deepspeed.accelerator``, ``.comm``, ``.ops.adam``, ``.moe.utils``, ``.runtime.utils``, ``.utils``,
``.zero``; zerofit/deepspeed/names.py), so that with ``import zerofit.deepspeed.alias`` (or the
``zerofit deepspeed train.py`` launcher) a script's own ``import deepspeed`` and ``from deepspeed.<path>
import ...`` lines are zerofit's, unchanged. ``__version__`` is ``"0.19.8+zerofit"``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable

import torch

from zerofit.config import ConfigError
from zerofit.deepspeed import zero
from zerofit.deepspeed.arguments import (
    add_config_arguments,
    check_client_scheduler,
    check_single_process,
    client_optimizer,
    dataloader_drop_last,
    groups_from_model_parameters,
    raw_config,
    resolve_config,
)
from zerofit.deepspeed.names import DEEPSPEED_VERSION, REFUSED_MODULES, UnsupportedModule
from zerofit.engine.faces.deepspeed_names import (
    ONE_PROCESS,
    DeepSpeedAssertion,
    DeepSpeedUnsupported,
    UnsupportedAttribute,
)

__all__ = [
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "zero",
    "get_accelerator",
    "log_dist",
    "logger",
    "DeepSpeedUnsupported",
    "DeepSpeedAssertion",
    "DeepSpeedConfigError",
    "UnsupportedAttribute",
    "UnsupportedModule",
    "__version__",
]

DeepSpeedConfigError = ConfigError
"""DeepSpeed's config error is zerofit's: a config zerofit refuses raises it (``except deepspeed.DeepSpeedConfigError``
catches it), naming the key, what was expected and what was found."""

__version__ = DEEPSPEED_VERSION + "+zerofit"
"""DeepSpeed's version, 0.19.8, whose names and meanings this surface follows, with the PEP 440 local label
``+zerofit`` (where DeepSpeed's own source builds put their git hash). ``packaging.version.parse`` orders it
after 0.19.8 and before 0.19.9, so version checks written for DeepSpeed (``>= "0.9"``, ``>= "0.19.8"``)
pass as for 0.19.8, and a printed version says whose it is."""
__version_major__, __version_minor__, __version_patch__ = (int(v) for v in DEEPSPEED_VERSION.split("."))
__git_hash__ = __git_branch__ = "unknown"  # as in DeepSpeed's released wheels
HAS_TRITON = False  # DeepSpeed's switch for its Triton kernels; zerofit has none

DeepSpeedOptimizerCallable = Callable[[Iterable[torch.nn.Parameter] | dict[str, Iterable]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
log = logging.getLogger("zerofit")


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
    **overrides,
):
    """DeepSpeed's ``initialize``: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config``: a DeepSpeed (or zerofit) JSON path or dict; or ``config_params``; or ``args.deepspeed_config``.
    ``model_parameters``: parameters (all of the model's) or torch-format groups (dicts with ``params`` and
    their own ``lr``, ``weight_decay``, ``betas``, ``eps``). ``optimizer``: a ``torch.optim.AdamW`` (or
    equivalent Adam, or a callable returning one), whose settings replace the config's optimizer block.
    ``training_data``: a torch Dataset; the loader (DeepSpeed's order) comes back third. ``collate_fn``: for it.
    ``lr_scheduler``: a scheduler over ``optimizer``, or a callable building one from the optimizer it is given
    (as DeepSpeed calls it); it replaces the config's scheduler block and is returned fourth, stepped by
    ``engine.step()`` ([Note: a client scheduler drives the engine's lr]). ``mpu``, ``mesh_param``: refused.
    ``dist_init_required=True`` initializes ``torch.distributed`` for one process, as :func:`init_distributed`.
    ``distributed_port``: unused (one process). ``overrides``: zerofit config fields beyond DeepSpeed's
    vocabulary (``max_gpu_memory="24GiB"``, ``device="cpu"``), as for :func:`zerofit.initialize`.

    The optimizer view is always returned (zerofit always trains with its AdamW; DeepSpeed too returns its
    ZeRO optimizer without an optimizer block); the scheduler is ``None`` when the config has no schedule,
    as in DeepSpeed.
    """
    import zerofit

    if model is None:  # DeepSpeed: assert model is not None (an AssertionError there)
        raise DeepSpeedAssertion(
            "deepspeed.initialize requires a model: pass model=<your nn.Module> (initialize's "
            "first positional argument is args, as in DeepSpeed)"
        )
    if mpu is not None:
        raise DeepSpeedUnsupported(f"initialize(mpu=...): a model-parallel unit needs several processes; {ONE_PROCESS}")
    if mesh_param is not None:
        raise DeepSpeedUnsupported(f"initialize(mesh_param={mesh_param!r}): {ONE_PROCESS}")
    check_single_process("deepspeed.initialize")
    check_client_scheduler(lr_scheduler, optimizer)
    if dist_init_required:
        init_distributed()
    config = resolve_config(args, config, config_params)
    raw = raw_config(config)

    groups, torch_optimizer = None, None
    if optimizer is not None:
        hypers, groups, torch_optimizer = client_optimizer(optimizer, model, model_parameters)
        if "optimizer" in raw:
            log.warning(
                "zerofit: the client optimizer's settings replace the config's optimizer block, as in DeepSpeed"
            )
        overrides["optimizer"] = hypers
    else:
        groups = groups_from_model_parameters(model, model_parameters)
    if lr_scheduler is not None:
        from zerofit.config import SchedulerConfig

        if "scheduler" in raw:
            log.warning("zerofit: the client lr_scheduler replaces the config's scheduler block, as in DeepSpeed")
        overrides["scheduler"] = {**SchedulerConfig().model_dump(), "one_cycle": None, "lr_range_test": None}
    kwargs = {"param_groups": groups} if groups is not None else {}
    engine = zerofit.initialize(model, config, **kwargs, **overrides)
    try:
        names = [g["params"] for g in groups] if groups is not None else None  # each group's, as given
        engine.configure_deepspeed(names, collate_fn, dataloader_drop_last(raw), training_data)
        sched = engine.config.scheduler
        if lr_scheduler is not None or (
            torch_optimizer is not None and sched.type == "constant" and sched.warmup_steps == 0
        ):
            # [Note: a client scheduler drives the engine's lr]: as DeepSpeed, the engine applies the client
            # optimizer's param_groups (unless the config's schedule sets them)
            from zerofit.optim.client_schedule import attach

            attach(engine, lr_scheduler, torch_optimizer)
    except BaseException:
        engine.close()
        raise
    zero.register_engine(engine)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # DeepSpeed aligns it with the device it uses
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def init_distributed(
    dist_backend=None,
    auto_mpi_discovery=True,
    distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose=True,
    timeout=None,
    init_method=None,
    dist_init_required=None,
    config=None,
    rank=-1,
    world_size=-1,
) -> None:
    """Initialize ``torch.distributed`` for this one process (rank 0 of 1), so that a script's
    ``torch.distributed.get_rank()`` and collectives work as under DeepSpeed on one GPU. Nothing to do when it
    is initialized already or ``dist_init_required`` is False. Several ranks are refused."""
    import datetime

    import torch.distributed as dist

    check_single_process("deepspeed.init_distributed")
    if world_size > 1 or rank > 0:
        raise DeepSpeedUnsupported(f"init_distributed(rank={rank}, world_size={world_size}): {ONE_PROCESS}")
    if dist_init_required is False or dist.is_initialized():
        return
    if dist_backend is None:  # as DeepSpeed: the accelerator's (nccl on CUDA, gloo on the CPU)
        from zerofit.deepspeed.accelerator import get_accelerator

        dist_backend = get_accelerator().communication_backend_name()
    backend = dist_backend
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout or datetime.timedelta(minutes=30)
    )


_DEEPSPEED_NAMES = {
    "init_inference": "zerofit trains; for generation use engine.module (the model with its current weights)",
    "InferenceEngine": "zerofit trains; for generation use engine.module (the model with its current weights)",
    "DeepSpeedInferenceConfig": "zerofit trains; for generation use engine.module",
    "default_inference_config": "zerofit trains; for generation use engine.module",
    "tp_model_init": ONE_PROCESS,
    "set_autotp_mode": ONE_PROCESS,
    "load_ds_config": ONE_PROCESS,
    "merge_tp_model_init_into_config": ONE_PROCESS,
    "record_tp_model_init_args": ONE_PROCESS,
    "PipelineModule": ONE_PROCESS,
    "PipelineEngine": ONE_PROCESS,
    "DualPipeVEngine": ONE_PROCESS,
    "DualPipeVModule": ONE_PROCESS,
    "checkpointing": "zerofit checkpoints every block's activations itself (activation_checkpointing)",
    "DeepSpeedHybridEngine": "zerofit has no inference hybrid engine",
    "DeepSpeedConfig": "zerofit reads DeepSpeed configs into zerofit.config.ZerofitConfig (zerofit.config.load_config)",
    "DeepSpeedOptimizer": "zerofit runs its own AdamW; initialize() returns a view of it (engine.optimizer)",
    "DeepSpeedDataLoader": "initialize(training_data=...) returns the loader (engine.deepspeed_io builds one)",
    "MUON_OPTIMIZER": "zerofit runs AdamW only",
    "set_optimizer_flags": "zerofit runs AdamW only",
    "resolve_per_head_muon_after_sharding": "zerofit runs AdamW only",
    "replace_transformer_layer": "zerofit does not replace the model's modules",
    "revert_transformer_layer": "zerofit does not replace the model's modules",
    "DeepSpeedTransformerLayer": "zerofit does not replace the model's modules",
    "DeepSpeedTransformerConfig": "zerofit does not replace the model's modules",
    "add_tuning_arguments": "zerofit's schedules come from the config's scheduler block",
    "OnDevice": "use zero.Init() to build a model without allocating its parameters",
    "domino": ONE_PROCESS,
}
# DeepSpeed's other top-level modules (deepspeed.inference, deepspeed.pipe, ...): refused as their imports are
_DEEPSPEED_NAMES.update(
    {
        name[len("deepspeed.") :]: hint
        for name, hint in REFUSED_MODULES.items()
        if name.count(".") == 1 and name[len("deepspeed.") :] not in _DEEPSPEED_NAMES
    }
)

# zerofit's modules of DeepSpeed's layout (zerofit.deepspeed.names), imported on first access as DeepSpeed's
# eager imports make them attributes of `deepspeed`; and the names DeepSpeed re-exports from them
_SUBMODULES = ("accelerator", "comm", "compression", "moe", "ops", "runtime", "utils")
_FROM_SUBMODULES = {
    "get_accelerator": "accelerator",
    "log_dist": "utils",
    "logger": "utils",
    "DeepSpeedEngine": "runtime.engine",
}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _FROM_SUBMODULES:
        return getattr(importlib.import_module(f"{__name__}.{_FROM_SUBMODULES[name]}"), name)
    if name in _DEEPSPEED_NAMES:
        raise UnsupportedAttribute(f"zerofit's deepspeed has no {name}: {_DEEPSPEED_NAMES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
