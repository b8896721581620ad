"""Generation with a base model directory and a PEFT adapter folder (``zerofit generate --model BASE --adapter
DIR``): the inference engine streams the PEFT model itself, not a merged copy. The base is built on the meta
device, PEFT's layers put on it there (``PeftModel`` with the folder's ``LoraConfig``), and every tensor is read
once into the inference engine's buffers: the base's from its files, the adapters' from
``adapter_model.safetensors`` (PEFT's key names: the parameter's name less the adapter's). The math is PEFT's
forward (``x @ W + s * dropout(x) @ A @ B``; dropout off in eval), so greedy tokens and logits are those of
PEFT's own ``generate`` over the same base. An adapter for another base is refused from the files' headers
before anything is allocated (zerofit/lora/files.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from zerofit.lora.files import ADAPTER_WEIGHTS
from zerofit.models.adapter_names import base_name


class AdapterSource:
    """A :class:`~zerofit.models.source.WeightSource`: the base directory's tensors and the adapter folder's."""

    def __init__(self, base_dir: str | os.PathLike, adapter_dir: str | os.PathLike):
        from safetensors import safe_open

        from zerofit.lora.files import check_adapter_fits
        from zerofit.models import ModelDir

        self.base = ModelDir.open(Path(base_dir).expanduser())
        self.adapter_dir = Path(adapter_dir).expanduser()
        check_adapter_fits(self.base.path, self.adapter_dir)
        self.path = self.base.path
        self._file = safe_open(str(self.adapter_dir / ADAPTER_WEIGHTS), "pt")
        self._keys = set(self._file.keys())
        self.adapter_name = "default"

    def build_meta(self) -> nn.Module:
        from peft import PeftConfig, PeftModel

        base = self.base.build_meta()
        config = PeftConfig.from_pretrained(self.adapter_dir)
        with torch.device("meta"):
            model = PeftModel(base, config, adapter_name=self.adapter_name)
        return model

    def dtype(self) -> torch.dtype:
        return self.base.dtype()

    def tokenizer(self):
        return self.base.tokenizer()

    def fill(self, names: list[str], dst: torch.Tensor) -> None:
        for n in names:
            key = n.replace(f".{self.adapter_name}.", ".")
            if key in self._keys:
                dst.copy_(self._file.get_tensor(key))
                return
        self.base.fill([base_name(n) for n in names], dst)

    def close(self) -> None:
        self.base.close()
