"""A PEFT LoRA model over a Hugging Face model directory, for ``zerofit train --model DIR --lora``.

The base is built on the meta device (as ``zerofit.initialize(DIR)`` builds it), PEFT wraps it there
(``get_peft_model``: its layers on the meta device too), then only the adapters are made real and initialized
with PEFT's own init (``reset_lora_parameters``), seeded. The engine reads every other weight tensor by tensor
from the files through :class:`PeftSource`, which maps PEFT's names onto the directory's (``base_model.model.``,
``.base_layer``, ``.original_module``, ``.modules_to_save.<adapter>`` removed): the host never holds the base
twice. Refusals (targets that match nothing) come before anything is allocated.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from zerofit.lora import LoraError
from zerofit.lora.options import LoraOptions  # noqa: F401 - re-exported
from zerofit.models.adapter_names import base_name


def wrap(model: nn.Module, options: LoraOptions, where: str = "the model"):
    """``peft.get_peft_model(model, options.config())``; targets that match nothing: :class:`LoraError`."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, options.config())
    except ValueError as e:  # peft's NoMatchingPeftModuleError is a ValueError
        if "not found in the base model" not in str(e) and "No modules were targeted" not in str(e):
            raise
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
            | {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
        )
        raise LoraError(
            f"--lora-targets {options.targets}: matches no module of {where} ({e}); its linear "
            f"layers are named {', '.join(linear)}: name some of them, or use all-linear"
        ) from None


class PeftSource:
    """A :class:`~zerofit.models.source.WeightSource` of a PEFT model over a model directory (what ``zerofit train
    --lora`` trains): the base's tensors from the folder's files under their base names, the adapters' from the
    values PEFT initialized (the only parameters of the model that are not on the meta device). It answers the
    folder's own questions (a 4-bit folder's pieces, its tokenizer files) by the PEFT model's names."""

    def __init__(self, md, model: nn.Module):
        self.md = md
        self.model = model
        self.path = md.path
        self.config = md.config
        self.weights = md.weights
        self.own = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}

    def build_meta(self) -> nn.Module:
        """The PEFT model it was made for: its base on the meta device, its adapters initialized."""
        return self.model

    def dtype(self) -> torch.dtype:
        return self.md.dtype()

    def tokenizer(self):
        return self.md.tokenizer()

    def fill(self, names: list[str], dst: torch.Tensor) -> None:
        from zerofit.models.directory import load_tensor

        load_tensor(self, names, dst, self.__dict__.setdefault("_fds", {}))

    def close(self) -> None:
        for fd in self.__dict__.pop("_fds", {}).values():
            os.close(fd)
        self.md.close()

    @property
    def prefix(self) -> str:
        return self.md.prefix

    def own_value(self, names: list[str]) -> torch.Tensor | None:
        """The initialized value of a parameter PEFT added (an adapter's), None for one of the base."""
        for n in names:
            if n in self.own:
                return self.own[n]
        return None

    def tensor(self, names: list[str]):
        return self.md.tensor([base_name(n) for n in names])

    @property
    def quant4(self):
        return self.md.quant4

    def is_packed(self, names: list[str]) -> bool:
        return self.md.is_packed([base_name(n) for n in names])

    def packed(self, names: list[str], shape: tuple):
        return self.md.packed([base_name(n) for n in names], shape)

    def check_packed(self, names: list[str], shape: tuple) -> None:
        self.md.check_packed([base_name(n) for n in names], shape)

    def tokenizer_files(self) -> list[Path]:
        return self.md.tokenizer_files()


def from_model_dir(path: str | Path, options: LoraOptions, seed: int = 0):
    """(PEFT model on the meta device but its adapters, :class:`PeftSource`) for the model directory
    ``path``: what ``zerofit train --lora`` trains (the engine: ``Engine(model, config, source=source)``)."""
    from peft.tuners.lora import LoraLayer

    from zerofit.models import ModelDir

    md = ModelDir.open(path)
    _ = md.quant4  # a 4-bit folder is read as it is stored; another quantization is refused here, by name
    model = wrap(md.build_meta(), options, where=str(md.path))
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        for m in model.modules():
            if isinstance(m, LoraLayer):
                for adapter in m.active_adapters:
                    for part in (m.lora_A, m.lora_B, m.lora_embedding_A, m.lora_embedding_B):
                        if adapter in part:
                            part[adapter] = _real(part[adapter])
                    m.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)
    return model, PeftSource(md, model)


def _real(x):
    if isinstance(x, nn.Module):
        return x.to_empty(device="cpu")
    return nn.Parameter(torch.empty(x.shape, dtype=torch.float32), requires_grad=x.requires_grad)
