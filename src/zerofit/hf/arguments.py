"""``TrainingArguments`` as zerofit reads them: every field's status, the refusals, and the zerofit config.

Every field of ``transformers.TrainingArguments`` is in :data:`FIELDS` with one status:

* ``honoured``: same meaning, carried out by zerofit (the optimizer, the schedule, the batch, precision...);
* ``mapped``: zerofit's own mechanism gives the same result (``gradient_checkpointing``: zerofit always
  checkpoints blocks; ``deepspeed``: zerofit reads the JSON);
* ``trainer``: the Trainer's own code does it, unchanged (logging, evaluation and saving schedules, data
  loading, callbacks, seeds);
* ``not-applicable``: no effect with zerofit's engine (DDP's own settings);
* ``refused``: an error before training starts unless the field is at its default, naming the field and
  what to do (``torch_compile``, ``fsdp``, 8-bit optimizers...).

A field this table does not know (a newer transformers) is refused unless at its default.
:func:`check_arguments` applies the refusals; :func:`zerofit_config` builds the engine's configuration:
from the arguments alone, or from the ``deepspeed=`` JSON with its ``"auto"`` values filled from the
arguments exactly as transformers fills them (:func:`fill_deepspeed_auto`, after
``HfTrainerDeepSpeedConfig.trainer_config_process`` and ``trainer_config_finalize`` in
transformers/integrations/deepspeed.py, and accelerate's ``DeepSpeedPlugin.set_mixed_precision``).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zerofit.errors import InputError

__all__ = [
    "FIELDS",
    "UnsupportedArgumentError",
    "check_arguments",
    "check_trainer",
    "zerofit_config",
    "markdown_table",
    "fill_deepspeed_auto",
    "HF_SCHEDULES",
    "ADAMW_OPTIMS",
]

HONOURED, MAPPED, TRAINER, NOT_APPLICABLE, REFUSED = "honoured", "mapped", "trainer", "not-applicable", "refused"

HF_SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")
# transformers 5 builds torch.optim.AdamW for both; adamw_hf is transformers 4's name of the same AdamW
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf")


class UnsupportedArgumentError(InputError, ValueError):
    """A ``TrainingArguments`` field (or ``Trainer`` argument) that zerofit.hf cannot honour. ``field`` names it."""

    def __init__(self, field: str, found: Any, why: str, todo: str) -> None:
        self.field = field
        super().__init__(f"{field}={found!r}: {why}; {todo}")


def _value(v):
    return getattr(v, "value", v)  # transformers' str enums (SchedulerType, OptimizerNames, ...)


# (status, what zerofit does with it). Refusal rules for some fields are in _RULES below.
FIELDS: dict[str, tuple[str, str]] = {
    "output_dir": (TRAINER, "checkpoint-N folders hold a zerofit checkpoint (global_stepN/, latest) and the model"),
    "per_device_train_batch_size": (HONOURED, "zerofit's micro_batch_size"),
    "num_train_epochs": (TRAINER, "the run length; the schedule's total_steps"),
    "max_steps": (TRAINER, "the run length; the schedule's total_steps"),
    "learning_rate": (HONOURED, "AdamW's lr (a deepspeed= optimizer section's \"auto\" lr)"),
    "lr_scheduler_type": (
        HONOURED,
        "linear, cosine, constant, constant_with_warmup with transformers' formulas "
        "(zerofit's hf_* schedules); others refused; ignored when deepspeed= has a "
        "scheduler section, as with DeepSpeed",
    ),
    "lr_scheduler_kwargs": (REFUSED, "refused unless empty (num_cycles etc. are not implemented)"),
    "warmup_steps": (HONOURED, "steps, or a ratio of the run when < 1 (TrainingArguments.get_warmup_steps)"),
    "optim": (
        HONOURED,
        "adamw_torch, adamw_torch_fused (adamw_hf): zerofit's AdamW, torch.optim.AdamW's math; "
        "others refused; ignored when deepspeed= has an optimizer section, as with DeepSpeed",
    ),
    "optim_args": (HONOURED, "ignored for AdamW, as transformers ignores it"),
    "weight_decay": (
        HONOURED,
        "decoupled; biases and norm weights in a no-decay group "
        "(Trainer.get_decay_parameter_names) through zerofit's param_groups",
    ),
    "adam_beta1": (HONOURED, "AdamW's betas[0]"),
    "adam_beta2": (HONOURED, "AdamW's betas[1]"),
    "adam_epsilon": (HONOURED, "AdamW's eps"),
    "optim_target_modules": (REFUSED, "refused unless unset (GaLore/APOLLO optimizers)"),
    "gradient_accumulation_steps": (
        HONOURED,
        "zerofit's gradient_accumulation_steps; a short last accumulation of an epoch steps early, as the Trainer does",
    ),
    "average_tokens_across_devices": (
        TRAINER,
        "the loss is normalised by the step's tokens (with several ranks, "
        "summed over them; the engine averages gradients over the ranks "
        "as DDP does)",
    ),
    "max_grad_norm": (
        HONOURED,
        "zerofit's gradient_clipping (global norm); with deepspeed=, the JSON's "
        "gradient_clipping decides, as with DeepSpeed",
    ),
    "label_smoothing_factor": (HONOURED, "the Trainer's label smoother on the engine's logits"),
    "bf16": (HONOURED, "precision bf16: bf16 compute, fp32 master weights and AdamW state"),
    "fp16": (HONOURED, "precision fp16 with DeepSpeed's dynamic loss scaling"),
    "bf16_full_eval": (REFUSED, "refused: zerofit evaluates in its compute dtype"),
    "fp16_full_eval": (REFUSED, "refused: zerofit evaluates in its compute dtype"),
    "tf32": (TRAINER, "transformers sets torch's TF32 flags; zerofit's kernels follow them"),
    "gradient_checkpointing": (MAPPED, "zerofit always checkpoints every block (and turns the model's own off)"),
    "gradient_checkpointing_kwargs": (MAPPED, "no effect: zerofit checkpoints every block itself"),
    "torch_compile": (REFUSED, "refused: zerofit runs the model block by block itself"),
    "torch_compile_backend": (REFUSED, "refused (implies torch_compile)"),
    "torch_compile_mode": (REFUSED, "refused (implies torch_compile)"),
    "use_liger_kernel": (REFUSED, "refused: Liger patches the model's modules"),
    "liger_kernel_config": (REFUSED, "refused unless unset"),
    "use_cache": (TRAINER, "written into model.config.use_cache"),
    "neftune_noise_alpha": (REFUSED, "refused: embedding noise hooks are not implemented"),
    "torch_empty_cache_steps": (TRAINER, "the Trainer empties the device cache"),
    "auto_find_batch_size": (REFUSED, "refused: zerofit's planner sizes memory; set the batch size"),
    "logging_strategy": (TRAINER, "loss, learning_rate, grad_norm logged as usual"),
    "logging_steps": (TRAINER, ""),
    "logging_first_step": (TRAINER, ""),
    "log_on_each_node": (TRAINER, ""),
    "logging_nan_inf_filter": (TRAINER, ""),
    "include_num_input_tokens_seen": (TRAINER, ""),
    "log_level": (TRAINER, ""),
    "log_level_replica": (TRAINER, ""),
    "disable_tqdm": (TRAINER, ""),
    "report_to": (TRAINER, ""),
    "run_name": (TRAINER, ""),
    "project": (TRAINER, ""),
    "trackio_space_id": (TRAINER, ""),
    "trackio_bucket_id": (TRAINER, ""),
    "trackio_static_space_id": (TRAINER, ""),
    "eval_strategy": (TRAINER, "evaluation forwards run through the engine (eval mode, no autograd)"),
    "eval_steps": (TRAINER, ""),
    "eval_delay": (TRAINER, ""),
    "per_device_eval_batch_size": (TRAINER, ""),
    "prediction_loss_only": (TRAINER, ""),
    "eval_on_start": (TRAINER, ""),
    "eval_do_concat_batches": (TRAINER, ""),
    "eval_use_gather_object": (TRAINER, ""),
    "eval_accumulation_steps": (TRAINER, ""),
    "include_for_metrics": (TRAINER, ""),
    "batch_eval_metrics": (TRAINER, ""),
    "save_only_model": (HONOURED, "the model only, no zerofit checkpoint: such a folder cannot be resumed"),
    "save_strategy": (TRAINER, "each save writes the model and a zerofit checkpoint"),
    "save_steps": (TRAINER, ""),
    "save_on_each_node": (NOT_APPLICABLE, "one node"),
    "save_total_limit": (TRAINER, "older checkpoint-N folders are removed whole"),
    "enable_jit_checkpoint": (TRAINER, "saves through the same checkpoint path"),
    "push_to_hub": (TRAINER, "uploads the checkpoint folders as written (the zerofit checkpoint included)"),
    "hub_token": (TRAINER, ""),
    "hub_private_repo": (TRAINER, ""),
    "hub_model_id": (TRAINER, ""),
    "hub_strategy": (TRAINER, ""),
    "hub_always_push": (TRAINER, ""),
    "hub_revision": (TRAINER, ""),
    "load_best_model_at_end": (HONOURED, "the best checkpoint's weights are loaded into the engine"),
    "metric_for_best_model": (TRAINER, ""),
    "greater_is_better": (TRAINER, ""),
    "ignore_data_skip": (TRAINER, ""),
    "restore_callback_states_from_checkpoint": (TRAINER, ""),
    "full_determinism": (TRAINER, "torch's deterministic flags, which zerofit's kernels follow"),
    "seed": (TRAINER, "seeded by the Trainer before the model and data; zerofit draws no random numbers of its own"),
    "data_seed": (TRAINER, ""),
    "use_cpu": (MAPPED, "zerofit's device: cpu (otherwise the Trainer's CUDA device)"),
    "accelerator_config": (TRAINER, "data loader settings"),
    "parallelism_config": (REFUSED, "refused unless unset: zerofit divides the work over torchrun's ranks itself"),
    "dataloader_drop_last": (TRAINER, ""),
    "dataloader_num_workers": (TRAINER, ""),
    "dataloader_pin_memory": (TRAINER, ""),
    "dataloader_persistent_workers": (TRAINER, ""),
    "dataloader_prefetch_factor": (TRAINER, ""),
    "dataloader_multiprocessing_context": (TRAINER, ""),
    "dataloader_in_order": (TRAINER, ""),
    "remove_unused_columns": (TRAINER, ""),
    "label_names": (TRAINER, ""),
    "train_sampling_strategy": (TRAINER, ""),
    "length_column_name": (TRAINER, ""),
    "ddp_find_unused_parameters": (NOT_APPLICABLE, "no DDP: the engine reduce-scatters each block's gradient"),
    "ddp_bucket_cap_mb": (NOT_APPLICABLE, "no DDP: the engine reduce-scatters each block's gradient"),
    "ddp_broadcast_buffers": (NOT_APPLICABLE, "no DDP: rank 0's weights and buffers are everyone's at start"),
    "ddp_static_graph": (NOT_APPLICABLE, "no DDP"),
    "ddp_backend": (TRAINER, "the process group accelerate makes under torchrun; the engine uses it (docs/ranks.md)"),
    "ddp_timeout": (TRAINER, "the process group's timeout"),
    "fsdp": (REFUSED, "refused: zerofit shards over torchrun's ranks itself (docs/ranks.md); drop fsdp"),
    "fsdp_config": (REFUSED, "refused unless unset"),
    "deepspeed": (
        MAPPED,
        'zerofit reads the JSON (path or dict), "auto" filled from these arguments as '
        "transformers fills them; DeepSpeed is never imported",
    ),
    "debug": (REFUSED, "refused unless empty (underflow_overflow hooks)"),
    "skip_memory_metrics": (TRAINER, ""),
    "do_train": (TRAINER, "not used by the Trainer (scripts read it)"),
    "do_eval": (TRAINER, "not used by the Trainer (scripts read it)"),
    "do_predict": (TRAINER, "not used by the Trainer (scripts read it)"),
    "resume_from_checkpoint": (
        TRAINER,
        "not used by the Trainer; trainer.train(resume_from_checkpoint=...) "
        "loads the zerofit checkpoint of a checkpoint-N folder",
    ),
    "local_rank": (TRAINER, "torchrun's: one engine per rank, one GPU each (docs/ranks.md)"),
}


def _empty(v) -> bool:
    return v is None or v is False or v == "" or (hasattr(v, "__len__") and len(v) == 0)


# field -> (is the value acceptable?, why not, what to do)
_RULES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "lr_scheduler_kwargs": (
        _empty,
        "zerofit implements transformers' schedules without extra arguments",
        "remove lr_scheduler_kwargs",
    ),
    "optim_target_modules": (_empty, "GaLore/APOLLO-style optimizers are not implemented", "remove it"),
    "bf16_full_eval": (_empty, "zerofit evaluates in its compute dtype (bf16=True for bf16)", "set it to False"),
    "fp16_full_eval": (_empty, "zerofit evaluates in its compute dtype (fp16=True for fp16)", "set it to False"),
    "torch_compile": (
        _empty,
        "zerofit runs the model block by block and does not compile it",
        "set torch_compile=False",
    ),
    "torch_compile_backend": (_empty, "zerofit does not compile the model", "remove it"),
    "torch_compile_mode": (_empty, "zerofit does not compile the model", "remove it"),
    "use_liger_kernel": (
        _empty,
        "Liger kernels patch the model's modules, which zerofit does not support",
        "set use_liger_kernel=False",
    ),
    "liger_kernel_config": (_empty, "Liger kernels are not supported", "remove it"),
    "neftune_noise_alpha": (
        _empty,
        "NEFTune's embedding noise hooks are not implemented in zerofit.hf",
        "remove neftune_noise_alpha",
    ),
    "auto_find_batch_size": (
        _empty,
        "zerofit's planner refuses a batch that does not fit before it runs",
        "set auto_find_batch_size=False and choose per_device_train_batch_size",
    ),
    "parallelism_config": (
        _empty,
        "zerofit divides the work over torchrun's ranks itself",
        "remove parallelism_config",
    ),
    "fsdp": (_empty, "FSDP shards the model itself; zerofit streams it instead", "remove fsdp"),
    "fsdp_config": (_empty, "FSDP is not used with zerofit", "remove fsdp_config"),
    "debug": (_empty, "the debug hooks are not supported", "remove debug"),
}


def _known_field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def check_arguments(args) -> None:
    """Raise :class:`UnsupportedArgumentError` for the first field zerofit.hf cannot honour (see the module
    docstring). Called before the Trainer builds its accelerator."""
    from transformers import TrainingArguments

    from zerofit.hf.hooks import deferred_deepspeed

    if getattr(args, "deepspeed_plugin", None) is not None or getattr(args, "hf_deepspeed_config", None) is not None:
        raise UnsupportedArgumentError(
            "deepspeed",
            args.deepspeed,
            "these TrainingArguments were built before zerofit.hf was imported, so "
            "accelerate prepared DeepSpeed itself",
            "import zerofit.hf (or `from zerofit.hf import Trainer`) before building TrainingArguments",
        )
    for f in dataclasses.fields(TrainingArguments):
        value = getattr(args, f.name, None)
        if f.name in _RULES:
            ok, why, todo = _RULES[f.name]
            if not ok(value):
                raise UnsupportedArgumentError(f.name, value, why, todo)
        elif f.name not in FIELDS:
            default = _known_field_default(f)
            if default is dataclasses.MISSING or value != default:
                raise UnsupportedArgumentError(
                    f.name,
                    value,
                    "zerofit.hf does not know this TrainingArguments field (new in this "
                    "transformers?), so it cannot promise its effect",
                    "leave it at its default",
                )
    ds = _deepspeed_dict(deferred_deepspeed(args))
    if ds is None or "scheduler" not in ds:
        kind = _value(args.lr_scheduler_type)
        if kind not in HF_SCHEDULES:
            raise UnsupportedArgumentError(
                "lr_scheduler_type",
                kind,
                "zerofit implements transformers' " + ", ".join(HF_SCHEDULES),
                "choose one of them (or give the deepspeed config a scheduler section)",
            )
    if ds is None or "optimizer" not in ds:
        optim = _value(args.optim)
        if optim not in ADAMW_OPTIMS:
            raise UnsupportedArgumentError(
                "optim",
                optim,
                "zerofit implements AdamW only (fp32 state, torch.optim.AdamW's math)",
                "use optim='adamw_torch' or 'adamw_torch_fused'",
            )
    if args.n_gpu > 1:
        raise UnsupportedArgumentError(
            "n_gpu",
            args.n_gpu,
            "several GPUs are visible to one process, so the Trainer would use DataParallel, which zerofit does not",
            "make one GPU visible (CUDA_VISIBLE_DEVICES=0)",
        )
    if args.device.type not in ("cpu", "cuda"):
        raise UnsupportedArgumentError(
            "device", str(args.device), "zerofit computes on a CUDA GPU or the CPU", "use a CUDA GPU or use_cpu=True"
        )


def check_trainer(trainer) -> None:
    """The Trainer's own arguments zerofit.hf cannot honour, and the model."""
    if trainer.model_init is not None:
        raise UnsupportedArgumentError(
            "Trainer(model_init=...)",
            trainer.model_init,
            "zerofit.hf builds its engine around one model",
            "pass model= instead (hyperparameter search is not supported)",
        )
    if trainer.optimizer is not None or trainer.lr_scheduler is not None:
        raise UnsupportedArgumentError(
            "Trainer(optimizers=...)",
            (trainer.optimizer, trainer.lr_scheduler),
            "zerofit's engine is the optimizer (AdamW on host memory)",
            "leave optimizers unset and choose AdamW's settings in TrainingArguments",
        )
    if trainer.optimizer_cls_and_kwargs is not None:
        raise UnsupportedArgumentError(
            "Trainer(optimizer_cls_and_kwargs=...)",
            trainer.optimizer_cls_and_kwargs,
            "zerofit's engine is the optimizer (AdamW)",
            "leave it unset",
        )
    check_model(trainer.model)


def check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedArgumentError(
            "Trainer(model=...)", type(model).__name__, "zerofit trains an nn.Module", "pass the model"
        )
    # parameters with requires_grad=False stay as they are ([Note: frozen parameters], engine/memory/store.py)


# ------------------------------------------------------------------------------------------ the config


def _deepspeed_dict(value) -> dict | None:
    """The deepspeed= value as a fresh dict: a dict, the path of a JSON file, or the JSON itself (plain or
    base64), as accelerate's HfDeepSpeedConfig reads it."""
    if value is None:
        return None
    if isinstance(value, dict):
        return copy.deepcopy(value)
    text = str(value)
    path = Path(text)
    try:
        is_file = path.is_file()
    except OSError:  # a JSON text too long to be a file name
        is_file = False
    if is_file:
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UnsupportedArgumentError(
                "deepspeed", text, f"not valid JSON ({exc.msg} at line {exc.lineno})", "fix the file"
            ) from None
    for decode in (lambda t: base64.urlsafe_b64decode(t).decode("utf-8"), lambda t: t):
        try:
            loaded = json.loads(decode(text))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(loaded, dict):
            return loaded
    raise UnsupportedArgumentError(
        "deepspeed",
        text,
        "neither an existing JSON file nor a JSON object",
        "pass the path of a DeepSpeed JSON file, or a dict",
    )


def _node(config: dict, path: str) -> tuple[dict | None, str]:
    *parents, key = path.split(".")
    for p in parents:
        config = config.get(p)
        if not isinstance(config, dict):
            return None, key
    return config, key


def fill_deepspeed_auto(ds: dict, args, num_training_steps: int | None) -> dict:
    """A copy of the DeepSpeed config ``ds`` with ``"auto"`` values filled from ``args`` as transformers fills
    them, and its mismatch check: a value that is not "auto" and differs from the argument is an error listing
    every such key, as transformers raises it."""
    ds = copy.deepcopy(ds)
    mismatches: list[str] = []

    def fill(path: str, hf_val, hf_key: str | None = None, must_match: bool = True) -> None:
        node, key = _node(ds, path)
        if node is None:
            return
        if node.get(key) == "auto":
            node[key] = hf_val
            return
        if must_match and node.get(key) is not None and node.get(key) != hf_val:
            mismatches.append(f"- ds {path}={node.get(key)} vs hf {hf_key}={hf_val}")

    # HfTrainerDeepSpeedConfig.trainer_config_process
    train_batch_size = args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size")
    fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    fill("train_batch_size", train_batch_size, "train_batch_size (calculated)")
    fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_min_lr", 0, must_match=False)
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill("fp16.enabled", args.fp16 or args.fp16_full_eval, "fp16|fp16_full_eval")
    fill("bf16.enabled", args.bf16 or args.bf16_full_eval, "bf16|bf16_full_eval")
    # trainer_config_finalize (the hidden-size bucket keys stay "auto": zerofit's planner decides them)
    if num_training_steps is not None:
        fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        fill("scheduler.params.warmup_num_steps", args.get_warmup_steps(num_training_steps), "warmup_steps")
    if mismatches:
        raise ValueError(
            "Please correct the following DeepSpeed config values that mismatch TrainingArguments"
            f" values:\n{chr(10).join(mismatches)}\nThe easiest method is to set these DeepSpeed "
            "config values to 'auto'."
        )
    # accelerate's DeepSpeedPlugin.set_mixed_precision: the arguments' precision enables a missing section
    for name, on in (("fp16", args.fp16), ("bf16", args.bf16)):
        if on and name not in ds:
            ds[name] = {"enabled": True}
    return ds


def _device(args) -> str:
    d = args.device
    return "cpu" if d.type == "cpu" else f"cuda:{d.index if d.index is not None else 0}"


def zerofit_config(trainer, num_training_steps: int | None, overrides: dict | None = None):
    """``(LoadedConfig, param_groups or None)`` for the trainer's model (see the module docstring).

    Without ``deepspeed=``: everything from the arguments. With it: the JSON with "auto" filled; its optimizer
    and scheduler sections when present (transformers then ignores ``optim``/``lr_scheduler_type`` too, and
    gives the DeepSpeed optimizer every parameter in one group), the arguments' AdamW and schedule otherwise.
    The batch is always the Trainer's (per_device_train_batch_size, gradient_accumulation_steps); ``overrides``
    (zerofit fields, ``Trainer(zerofit_config=...)``) come last."""
    from zerofit.config import load_config
    from zerofit.hf.hooks import deferred_deepspeed

    args = trainer.args
    ds = _deepspeed_dict(deferred_deepspeed(args))
    fields: dict[str, Any] = {
        "device": _device(args),
        "micro_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        # several ranks (torchrun): each rank an engine over its GPU, the global batch counts every rank
        # (docs/ranks.md); the Trainer's sampler gives each rank its own micro-batches
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
        "world_size": args.world_size,
    }
    if ds is None:
        source: Any = None
        fields["precision"] = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        fields["gradient_clipping"] = float(args.max_grad_norm or 0.0)
    else:
        source = fill_deepspeed_auto(ds, args, num_training_steps)
    groups = None
    if ds is None or "optimizer" not in ds:
        fields["optimizer"] = {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay,
        }
        if args.weight_decay:
            groups = decay_groups(trainer)
    if ds is None or "scheduler" not in ds:
        kind = _value(args.lr_scheduler_type)
        fields["scheduler"] = {
            "type": f"hf_{kind}",
            "total_steps": num_training_steps,
            "warmup_steps": args.get_warmup_steps(num_training_steps or 0),
        }
    fields.update(overrides or {})
    return load_config(source, **fields), groups


def decay_groups(trainer) -> list[dict]:
    """The Trainer's two AdamW groups (Trainer.create_optimizer): weight decay on all but the parameters
    ``trainer.get_decay_parameter_names`` leaves out (biases, norm weights), in torch.optim's format."""
    args, model = trainer.args, trainer.model
    decay = set(trainer.get_decay_parameter_names(model))
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def markdown_table() -> str:
    """docs/hf_trainer.md's table of every field (tests/integration/test_hf_trainer.py checks that the two agree)."""
    rows = ["| field | status | what zerofit does with it |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | {status} | {note} |".replace(" |  |", " | |") for name, (status, note) in FIELDS.items()]
    return "\n".join(rows)
