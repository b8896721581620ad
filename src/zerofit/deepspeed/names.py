"""The DeepSpeed module names zerofit's ``deepspeed`` answers to, and those it refuses by name.

``zerofit.deepspeed`` mirrors DeepSpeed 0.19.8's module layout for what scripts import:
``zerofit.deepspeed.<path>`` is DeepSpeed's ``deepspeed.<path>`` (``accelerator``, ``comm``, ``ops.adam``,
``moe.utils``, ``runtime.utils``, ``utils``, ``compression.helper``, ``zero`` and its
``partition_parameters`` and ``offload_config``), with one exception DeepSpeed has too: ``deepspeed.zero``
and ``deepspeed.runtime.zero`` are one module (zerofit's home for it is ``zerofit.deepspeed.zero``).
:func:`zerofit_module` turns a DeepSpeed module name into zerofit's; the alias (``zerofit.deepspeed.alias``)
imports through it.

A DeepSpeed module zerofit does not provide is refused with :class:`UnsupportedModule` (an
``ImportError`` too, so ``try: import deepspeed.ops.lamb except ImportError:`` still works) whose message
says what to do instead: :data:`REFUSED_MODULES` names the common ones; any other gets the general
message. Names inside a module that zerofit does not provide are refused with ``UnsupportedAttribute``
through :func:`refusing_getattr`, which also imports a package's submodules on first access
(``deepspeed.moe.utils`` after only ``import deepspeed``, as DeepSpeed's eager imports allow).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping

from zerofit.engine.faces.deepspeed_names import ONE_PROCESS, DeepSpeedUnsupported, UnsupportedAttribute

DEEPSPEED_VERSION = "0.19.8"  # the DeepSpeed release whose names and meanings zerofit's surface follows
ZEROFIT_DEEPSPEED = "zerofit.deepspeed"

_ALIASED_PACKAGES = {"deepspeed.runtime.zero": "zerofit.deepspeed.zero"}  # DeepSpeed's deepspeed.zero is it

_NO_KERNELS = (
    "zerofit runs its own AdamW on the host (torch.optim.AdamW's math) and builds none of DeepSpeed's "
    "kernels; pass torch.optim.AdamW or deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam as the "
    "optimizer, or put AdamW in the config's optimizer block"
)
_NO_MOE = (
    "zerofit has no mixture-of-experts layers (DeepSpeed's MoE needs its expert-parallel groups); train a "
    "model without deepspeed.moe.layer.MoE (DeepSpeedExamples' cifar10: leave out --moe)"
)
_NO_INFERENCE = "zerofit trains; for generation use engine.module (the model with its current weights)"
_NO_INJECT = "zerofit runs the model's own modules and does not replace them"

_GET_ACCELERATOR = "use `from deepspeed.accelerator import get_accelerator`: get_accelerator() is zerofit's accelerator"

REFUSED_MODULES: dict[str, str] = {
    "deepspeed.accelerator.real_accelerator": _GET_ACCELERATOR,
    "deepspeed.accelerator.abstract_accelerator": _GET_ACCELERATOR,
    "deepspeed.accelerator.cuda_accelerator": _GET_ACCELERATOR,
    "deepspeed.accelerator.cpu_accelerator": _GET_ACCELERATOR,
    "deepspeed.ops.lamb": _NO_KERNELS,
    "deepspeed.ops.adagrad": _NO_KERNELS,
    "deepspeed.ops.lion": _NO_KERNELS,
    "deepspeed.ops.muon": _NO_KERNELS,
    "deepspeed.ops.adam.zenflow_cpu_adam": _NO_KERNELS,
    "deepspeed.ops.adam.zenflow_torch_adam": _NO_KERNELS,
    "deepspeed.ops.adam.multi_tensor_apply": _NO_KERNELS,
    "deepspeed.ops.op_builder": _NO_KERNELS,
    "deepspeed.ops.transformer": _NO_INJECT,
    "deepspeed.ops.aio": "zerofit's disk tier has its own reader and writer (offload.optimizer_device: nvme)",
    "deepspeed.ops.quantizer": "zerofit keeps weights at full precision",
    "deepspeed.ops.fp_quantizer": "zerofit keeps weights at full precision",
    "deepspeed.moe.layer": _NO_MOE,
    "deepspeed.moe.experts": _NO_MOE,
    "deepspeed.moe.sharded_moe": _NO_MOE,
    "deepspeed.moe.mappings": _NO_MOE,
    "deepspeed.runtime.config": "zerofit reads DeepSpeed configs into zerofit.config.ZerofitConfig "
    "(zerofit.config.load_config; `zerofit config show ds.json`)",
    "deepspeed.runtime.activation_checkpointing": "zerofit checkpoints every block's activations itself "
    "(the config's activation_checkpointing)",
    "deepspeed.runtime.pipe": ONE_PROCESS,
    "deepspeed.pipe": ONE_PROCESS,
    "deepspeed.runtime.fp16": "zerofit's loss scaling follows the config's fp16 block (zerofit.optim.loss_scaler)",
    "deepspeed.runtime.zero.stage3": "zerofit has no ZeRO stages: it streams whole blocks through the GPU",
    "deepspeed.runtime.zero.stage_1_and_2": "zerofit has no ZeRO stages: it streams whole blocks through the GPU",
    "deepspeed.runtime.zero.tiling": _NO_INJECT,
    "deepspeed.runtime.zero.linear": _NO_INJECT,
    "deepspeed.utils.zero_to_fp32": "zerofit's checkpoints hold fp32 weights already: `zerofit export CKPT OUT` "
    "writes a Hugging Face model directory, engine.module is the model",
    "deepspeed.utils.groups": ONE_PROCESS,
    "deepspeed.utils.timer": "use engine.timeline() and engine.trace() (zerofit's per-step timings)",
    "deepspeed.utils.tensor_fragment": "zerofit never partitions a parameter: engine.module is the model with "
    "its current fp32 weights",
    "deepspeed.inference": _NO_INFERENCE,
    "deepspeed.module_inject": _NO_INJECT,
    "deepspeed.model_implementations": _NO_INJECT,
    "deepspeed.checkpoint": "zerofit's checkpoints are its own (docs/checkpoints.md): engine.save_checkpoint, "
    "engine.load_checkpoint, zerofit export",
    "deepspeed.launcher": "launch with `zerofit deepspeed train.py ...` (one process)",
    "deepspeed.autotuning": "`zerofit estimate` prints the plan zerofit would choose",
    "deepspeed.profiling": "use engine.timeline() and engine.trace()",
    "deepspeed.monitor": "log engine(**batch).loss and engine.get_lr() yourself; zerofit train has --progress",
    "deepspeed.sequence": ONE_PROCESS,
    "deepspeed.nvme": "zerofit's disk tier is offload.optimizer_device: nvme (zerofit doctor --disk measures it)",
    "deepspeed.compile": "zerofit runs the model's own forward block by block",
}


class UnsupportedModule(DeepSpeedUnsupported, ModuleNotFoundError):
    """A DeepSpeed module zerofit does not provide (a ``ModuleNotFoundError`` too, as for a missing module)."""


def is_deepspeed_name(fullname: str) -> bool:
    return fullname == "deepspeed" or fullname.startswith("deepspeed.")


def zerofit_module(fullname: str) -> str:
    """``deepspeed.<path>`` -> ``zerofit.deepspeed.<path>`` (and ``deepspeed.runtime.zero[.x]`` ->
    ``zerofit.deepspeed.zero[.x]``)."""
    for prefix, target in _ALIASED_PACKAGES.items():
        if fullname == prefix or fullname.startswith(prefix + "."):
            return target + fullname[len(prefix) :]
    return ZEROFIT_DEEPSPEED + fullname[len("deepspeed") :]


def deepspeed_module(name: str) -> str:
    """zerofit's module name as DeepSpeed spells it (``zerofit.deepspeed.ops.adam`` -> ``deepspeed.ops.adam``)."""
    return "deepspeed" + name[len(ZEROFIT_DEEPSPEED) :] if name.startswith(ZEROFIT_DEEPSPEED) else name


def unsupported_module(fullname: str) -> UnsupportedModule:
    """The refusal of DeepSpeed module ``fullname`` (or of the closest refused package above it)."""
    probe = fullname
    while probe and probe not in REFUSED_MODULES:
        probe = probe.rpartition(".")[0]
    hint = REFUSED_MODULES.get(probe) or (
        "zerofit provides the DeepSpeed modules training scripts import (deepspeed.accelerator, deepspeed.comm, "
        "deepspeed.ops.adam, deepspeed.moe.utils, deepspeed.runtime.utils, deepspeed.utils, deepspeed.zero; "
        "docs/migration.md lists them); drop this import, or use real DeepSpeed for this script"
    )
    err = UnsupportedModule(f"zerofit's deepspeed has no module {fullname}: {hint}")
    err.name = fullname
    return err


def refusing_getattr(module_name: str, refused: Mapping[str, str], submodules: Iterable[str] = ()):
    """A module ``__getattr__`` (PEP 562): ``submodules`` are imported on first access; a name of
    ``refused`` raises :class:`UnsupportedAttribute` with its hint; any other name is an AttributeError."""
    lazy = frozenset(submodules)
    where = deepspeed_module(module_name)

    def __getattr__(name: str):
        if name in lazy:
            return importlib.import_module(f"{module_name}.{name}")
        if name in refused:
            raise UnsupportedAttribute(f"zerofit's {where} has no {name}: {refused[name]}")
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__
