"""Where a model's weights come from: the one contract every reader of them uses.

    src = ModelDir.open("path/to/model")          # a folder (16-bit, or 4-bit as transformers saved it)
    model = src.build_meta()                       # the model on the meta device, no memory
    src.fill(["model.embed_tokens.weight"], dst)   # one parameter (by any of its names) into dst, any dtype
    src.close()

A :class:`WeightSource` builds the model on the meta device and fills one parameter at a time into the reader's
own buffer, so no reader holds the model twice. Its ``dtype()`` is the model's own (what transformers'
``from_pretrained`` loads it in); ``tokenizer()`` its tokenizer, or None. The sources: a folder
(:class:`~zerofit.models.ModelDir`), a PEFT model over a folder as ``zerofit train --lora`` builds it
(:class:`~zerofit.lora.model.PeftSource`), a folder and an adapter (``infer/adapter_source.py``), a folder and
several adapters (``serve/adapters.py``), a zerofit checkpoint and a live training engine (``infer/sources.py``).
Training (the engine's materialization), generation, chat, serving and export read through it."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class WeightSource(Protocol):
    """A model's weights, read one parameter at a time (see the module docstring)."""

    @property
    def path(self) -> Path | None:
        """The folder the model was read from (its tokenizer files); None: none."""
        ...

    def build_meta(self) -> nn.Module:
        """The model, every parameter on the meta device (a source that initializes some values itself, an
        adapter's, may hold those as real tensors)."""
        ...

    def dtype(self) -> torch.dtype:
        """The model's own dtype: what ``from_pretrained`` would load it in."""
        ...

    def tokenizer(self):
        """The model's tokenizer (local files only), or None."""
        ...

    def fill(self, names: list[str], dst: torch.Tensor) -> None:
        """The parameter known by any of ``names`` (tied weights have several) into ``dst`` (any dtype and
        device), its shape checked."""
        ...

    def close(self) -> None:
        """Let go of open files (the source is usable again afterwards: they are opened as needed)."""
        ...
