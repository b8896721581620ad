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
with DeepSpeed's engine surface (zerofit/engine/deepspeed_surface.py), the optimizer and scheduler are views of
its AdamW settings and learning-rate schedule. What zerofit cannot do as DeepSpeed does is refused with
:class:`DeepSpeedUnsupported` naming the argument, attribute or call; docs/migration.md has the table.
"""

from __future__ import annotations

import logging

import torch

from zerofit.deepspeed import zero
from zerofit.deepspeed.arguments import (add_config_arguments, check_client_scheduler, check_single_process,
                                         client_optimizer, dataloader_drop_last, groups_from_model_parameters,
                                         raw_config, resolve_config)
from zerofit.engine.deepspeed_surface import ONE_PROCESS, DeepSpeedUnsupported, GroupSettings, UnsupportedAttribute

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "DeepSpeedUnsupported",
           "UnsupportedAttribute"]

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
log = logging.getLogger("zerofit")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, mesh_param=None, config_params=None, **overrides):
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

    if model is None:
        raise ValueError("deepspeed.initialize requires a model")
    if mpu is not None:
        raise DeepSpeedUnsupported(f"initialize(mpu=...): a model-parallel unit needs several processes; "
                                   f"{ONE_PROCESS}")
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
            log.warning("zerofit: the client optimizer's settings replace the config's optimizer block, as in "
                        "DeepSpeed")
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
        settings = None
        if groups is not None:
            opt = engine.config.optimizer
            settings = [GroupSettings.of(opt, g["params"], **{k: v for k, v in g.items() if k != "params"})
                        for g in groups]
        engine._configure_deepspeed(settings, collate_fn, dataloader_drop_last(raw), training_data)
        sched = engine.config.scheduler
        if lr_scheduler is not None or (torch_optimizer is not None and sched.type == "constant"
                                        and sched.warmup_steps == 0):
            # [Note: a client scheduler drives the engine's lr]: as DeepSpeed, the engine applies the client
            # optimizer's param_groups (unless the config's schedule sets them)
            from zerofit.optim.client_schedule import attach

            attach(engine, lr_scheduler, torch_optimizer)
    except BaseException:
        engine.close()
        raise
    zero.register_engine(engine)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank           # DeepSpeed aligns it with the device it uses
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT,
                     verbose=True, timeout=None, init_method=None, dist_init_required=None, config=None, rank=-1,
                     world_size=-1) -> None:
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
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout or datetime.timedelta(minutes=30))


_DEEPSPEED_NAMES = {
    "init_inference": "zerofit trains; for generation use engine.module (the model with its current weights)",
    "InferenceEngine": "zerofit trains; for generation use engine.module (the model with its current weights)",
    "DeepSpeedInferenceConfig": "zerofit trains; for generation use engine.module",
    "default_inference_config": "zerofit trains; for generation use engine.module",
    "tp_model_init": ONE_PROCESS,
    "PipelineModule": ONE_PROCESS,
    "PipelineEngine": ONE_PROCESS,
    "pipe": ONE_PROCESS,
    "comm": ONE_PROCESS + "; torch.distributed works after init_distributed() (rank 0 of 1)",
    "checkpointing": "zerofit checkpoints every block's activations itself (activation_checkpointing)",
    "DeepSpeedEngine": "zerofit.deepspeed.initialize returns zerofit's Engine (zerofit.engine.engine.Engine)",
    "DeepSpeedHybridEngine": "zerofit has no inference hybrid engine",
    "DeepSpeedConfig": "zerofit reads DeepSpeed configs into zerofit.config.ZerofitConfig (zerofit.config.load_config)",
    "DeepSpeedConfigError": "zerofit raises zerofit.config.ConfigError",
    "ops": "zerofit has its own CPU AdamW; DeepSpeed's kernels are not used",
    "module_inject": "zerofit does not replace the model's modules",
    "replace_transformer_layer": "zerofit does not replace the model's modules",
    "revert_transformer_layer": "zerofit does not replace the model's modules",
    "DeepSpeedTransformerLayer": "zerofit does not replace the model's modules",
    "DeepSpeedTransformerConfig": "zerofit does not replace the model's modules",
    "add_tuning_arguments": "zerofit's schedules come from the config's scheduler block",
    "moe": "zerofit has no mixture-of-experts layers of its own",
    "runtime": "see the names zerofit.deepspeed offers: initialize, init_distributed, add_config_arguments, zero",
    "accelerator": "zerofit uses the GPU torch sees (config device: auto, cpu, cuda, cuda:N)",
    "OnDevice": "use zero.Init() to build a model without allocating its parameters",
    "domino": ONE_PROCESS,
}


def __getattr__(name: str):
    if name in _DEEPSPEED_NAMES:
        raise UnsupportedAttribute(f"zerofit's deepspeed has no {name}: {_DEEPSPEED_NAMES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
