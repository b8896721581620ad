"""Where generation's weights come from, beside a model directory (:class:`~zerofit.models.ModelDir`) and its
adapters (adapter_source.py): a zerofit checkpoint, and a live training engine. Each is a
:class:`~zerofit.models.source.WeightSource`: it builds the model on the meta device (no memory) and fills one
parameter at a time (``fill(names, dst)``: ``names`` every alias of the parameter, ``dst`` its place in the
inference engine's buffers, any dtype), so the host never holds the model twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from zerofit.models.directory import ModelDir, ModelDirError, load_tokenizer

__all__ = ["CheckpointSource", "EngineSource", "load_tokenizer", "open_source"]


class CheckpointSource:
    """A zerofit checkpoint (a tag folder): its config.json's model, its weight shards' tensors."""

    def __init__(self, path: Path, md: ModelDir, found: dict, model_dtype: torch.dtype):
        self.path = path  # the checkpoint folder (its tokenizer files)
        self.md = md  # its config.json (the weights come from the checkpoint's shards)
        self.found = found  # tensor name -> (file, TensorInfo)
        self.model_dtype = model_dtype  # the trained model's own dtype, as the checkpoint's record names it

    def build_meta(self) -> nn.Module:
        return self.md.build_meta()

    def dtype(self) -> torch.dtype:
        """The trained model's own dtype (not its fp32 masters'): what ``zerofit export`` writes by default."""
        return self.model_dtype

    def tokenizer(self):
        return load_tokenizer(self.path)

    def fill(self, names: list[str], dst: torch.Tensor) -> None:
        from zerofit.checkpoint.format import read_tensor

        name = next((n for n in names if n in self.found), None)
        if name is None:
            raise ModelDirError(
                f"{self.path}: tensor {names[0]!r} is not in the checkpoint's weights (a checkpoint of another model?)"
            )
        f, info = self.found[name]
        if tuple(info.shape) != tuple(dst.shape):
            raise ModelDirError(
                f"{self.path / f}: tensor {name!r} has shape {list(info.shape)}, the model "
                f"built from config.json expects {list(dst.shape)}"
            )
        dst.copy_(read_tensor(self.path / f, info))

    def close(self) -> None:
        pass  # (each read opens and closes its shard)


class EngineSource:
    """The current weights of a live training engine, in a model of their own: a meta twin of the engine's model,
    filled from the engine's host weights (the engine is not changed)."""

    def __init__(self, engine):
        self.engine = engine
        self.path = getattr(engine, "source_dir", None)

    def build_meta(self) -> nn.Module:
        import copy

        live = self.engine.module  # the user's model, its parameters the engine's fp32 weights (made current)
        self._params = dict(live.named_parameters(remove_duplicate=False))
        if hasattr(live, "config") and hasattr(type(live), "_from_config"):
            with torch.device("meta"):
                twin = type(live)._from_config(live.config, dtype=torch.float32)
            if hasattr(live, "generation_config"):
                twin.generation_config = copy.deepcopy(live.generation_config)
            return twin
        return copy.deepcopy(live)

    def dtype(self) -> torch.dtype:
        return self.engine.model_dtype  # the user's model's, not its fp32 masters'

    def tokenizer(self):
        """The engine's own, else the one of the folder it was read from (or None)."""
        return getattr(self.engine, "tokenizer", None) or load_tokenizer(self.path)

    def fill(self, names: list[str], dst: torch.Tensor) -> None:
        params = self.__dict__.get("_params") or dict(self.engine.module.named_parameters(remove_duplicate=False))
        src = next((params[n] for n in names if n in params), None)
        if src is None:
            raise KeyError(f"parameter {names[0]!r} is not in the training engine's model")
        dst.copy_(src.detach())

    def close(self) -> None:
        self.__dict__.pop("_params", None)


def open_source(path: str | os.PathLike):
    """A model directory, or a checkpoint (a tag folder, or a save folder with ``latest``)."""
    from zerofit.checkpoint.commit import RECORD
    from zerofit.checkpoint.export import checkpoint_dtype
    from zerofit.checkpoint.load import locate, open_checkpoint, shard_files
    from zerofit.checkpoint.save import WEIGHTS_INDEX

    p = Path(path).expanduser()
    if p.is_dir() and ((p / RECORD).is_file() or (p / "latest").is_file()):
        folder, record = open_checkpoint(p, None)
        if not (folder / "config.json").is_file():
            raise ModelDirError(
                f"{folder}: this checkpoint has no config.json (the model was not a transformers "
                "model): generation needs one"
            )
        from zerofit.models.directory import read_config

        config = read_config(folder)  # a wrong field is a ModelDirError naming the file and the field
        found = locate(folder, shard_files(folder, record, WEIGHTS_INDEX), WEIGHTS_INDEX)
        return CheckpointSource(folder, ModelDir(folder, config, {}), found, checkpoint_dtype(record.state))
    return ModelDir.open(p)
