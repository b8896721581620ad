"""Several LoRA adapters over one base, chosen per request: the served names and the model that holds them.

    names = adapter_names(["/runs/a/adapter", "support=/runs/b/adapter"])   # {"adapter": Path, "support": Path}
    src = MultiAdapterSource(base_dir, names)                                # InferenceEngine.from_source(src)

[Note: one base, several adapters]
The base's weights are read, held and streamed once; every adapter's A and B
matrices sit beside its layer in the same block (PEFT's LoRA layers, one entry
per adapter name), so a block's upload carries all of them and a request for
any adapter shares it. A forward over a batch passes PEFT's ``adapter_names``
(one per row, ``__base__`` for the base): PEFT computes the base layer for the
whole batch and adds each adapter's ``B(A x) * scaling`` to its own rows
(``_mixed_batch_forward``), the same arithmetic per row as PEFT's model with
that adapter alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from torch import nn

from zerofit.lora.files import ADAPTER_WEIGHTS
from zerofit.models.adapter_names import base_name

_LORA_KEY = re.compile(r"\.(lora_[A-Za-z_]+)\.([^.]+)\.")
BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch


def adapter_names(specs: list[str]) -> dict[str, Path]:
    """``--adapter`` values (``DIR`` or ``NAME=DIR``) as served names: a folder's name unless one is given
    (a folder named ``adapter``, as ``zerofit train --lora`` writes it, takes its parent's name)."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep:
            name, folder = "", spec
        path = Path(folder).expanduser()
        if not name:
            name = path.resolve().name
            if name == "adapter" and path.resolve().parent.name:
                name = path.resolve().parent.name
        if not name or "/" in name or name == BASE:
            raise ValueError(f"--adapter {spec}: give a name, --adapter NAME=DIR")
        if name in out:
            raise ValueError(f"--adapter {spec}: the name {name!r} is taken by {out[name]}: give NAME=DIR")
        if not (path / ADAPTER_WEIGHTS).is_file():
            raise ValueError(f"--adapter {spec}: {path} has no {ADAPTER_WEIGHTS} (not a PEFT adapter folder)")
        out[name] = path
    return out


class MultiAdapterSource:
    """A :class:`~zerofit.models.source.WeightSource`: the base directory's tensors, and each adapter folder's
    under its name ([Note: one base, several adapters])."""

    def __init__(self, base_dir: str | os.PathLike, adapters: dict[str, Path]):
        from safetensors import safe_open

        from zerofit.lora.files import check_adapter_fits
        from zerofit.models import ModelDir

        if not adapters:
            raise ValueError("MultiAdapterSource: no adapters (serve the base directory itself)")
        self.base = ModelDir.open(Path(base_dir).expanduser())
        self.path = self.base.path
        self.adapters = dict(adapters)
        self._files = {}
        for name, folder in self.adapters.items():
            check_adapter_fits(self.base.path, folder)
            f = safe_open(str(folder / ADAPTER_WEIGHTS), "pt")
            self._files[name] = (f, set(f.keys()))

    def build_meta(self) -> nn.Module:
        from peft import PeftConfig, PeftModel

        base = self.base.build_meta()
        names = list(self.adapters)
        with torch.device("meta"):
            model = PeftModel(base, PeftConfig.from_pretrained(self.adapters[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                model.add_adapter(name, PeftConfig.from_pretrained(self.adapters[name]))
        return model

    def dtype(self) -> torch.dtype:
        return self.base.dtype()

    def tokenizer(self):
        return self.base.tokenizer()

    def fill(self, names: list[str], dst: torch.Tensor) -> None:
        for n in names:
            m = _LORA_KEY.search(n)  # ...q_proj.lora_A.<adapter>.weight -> adapter's file key ...q_proj.lora_A.weight
            if m is not None and m.group(2) in self._files:
                f, keys = self._files[m.group(2)]
                key = n[: m.start()] + f".{m.group(1)}." + n[m.end() :]
                if key in keys:
                    dst.copy_(f.get_tensor(key))
                    return
        self.base.fill([base_name(n) for n in names], dst)

    def close(self) -> None:
        self.base.close()
