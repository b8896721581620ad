"""Where generation's weights come from: a model directory, a zerofit checkpoint, or a live training engine.

Each source builds the model on the meta device (no memory) and fills one
parameter at a time (``fill(names, dst)``: ``names`` every alias of the
parameter, ``dst`` its place in the inference engine's buffers, any dtype), so
the host never holds the model twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zerofit.checkpoint.model_files import model_dtype
from zerofit.models.directory import TOKENIZER_FILES, ModelDir, ModelDirError, load_tensor

__all__ = ["open_source", "engine_source", "load_tokenizer"]


def load_tokenizer(folder: Path | None):
    """The folder's own tokenizer (local files only), or None when it has none."""
    if folder is None or not any((Path(folder) / n).is_file() for n in TOKENIZER_FILES[:5]):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@dataclass
class DirSource:
    path: Path
    md: ModelDir

    def __post_init__(self):
        self._fds: dict = {}

    def build_meta(self) -> nn.Module:
        model = self.md.build_meta()
        _generation_config(model, self.path)
        return model

    def dtype(self) -> torch.dtype:
        """As transformers' ``from_pretrained`` loads the folder: config.json's dtype, else its weights'."""
        return model_dtype(None, self.md)

    def tokenizer(self):
        return load_tokenizer(self.path)

    def fill(self, names: list[str], dst: torch.Tensor) -> None:
        load_tensor(self.md, names, dst, self._fds)  # any dtype and device

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class _CheckpointSource:
    path: Path  # the checkpoint folder (a tag)
    md: ModelDir  # its config.json (weights come from the checkpoint's shards)
    found: dict  # tensor name -> (file, TensorInfo)
    model_dtype: torch.dtype  # the trained model's own dtype, as the checkpoint's record names it

    def build_meta(self) -> nn.Module:
        model = self.md.build_meta()
        _generation_config(model, self.path)
        return model

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
        return _CheckpointSource(folder, ModelDir(folder, config, {}), found, checkpoint_dtype(record.state))
    return DirSource(p, ModelDir.open(p))


def _generation_config(model: nn.Module, folder: Path) -> None:
    if (folder / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)


def engine_source(engine) -> tuple[nn.Module, callable]:
    """A meta twin of the training engine's model, and a fill that reads the engine's current weights."""
    import copy

    live = engine.module  # the user's model, its parameters the engine's fp32 weights
    params = dict(live.named_parameters(remove_duplicate=False))
    if hasattr(live, "config") and hasattr(type(live), "_from_config"):
        with torch.device("meta"):
            twin = type(live)._from_config(live.config, dtype=torch.float32)
        if hasattr(live, "generation_config"):
            twin.generation_config = copy.deepcopy(live.generation_config)
    else:
        twin = copy.deepcopy(live)

    def fill(names: list[str], dst: torch.Tensor) -> None:
        src = next((params[n] for n in names if n in params), None)
        if src is None:
            raise KeyError(f"parameter {names[0]!r} is not in the training engine's model")
        dst.copy_(src.detach())

    return twin, fill
