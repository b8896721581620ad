"""The Hugging Face files around the weights: config.json, generation_config.json, tokenizer files.

A checkpoint carries them so that ``zerofit export CHECKPOINT OUT`` needs nothing
else; an export writes them with the dtype of the exported weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from zerofit.checkpoint.save import SideFile
from zerofit.models.directory import DTYPE_OF_NAME, most_dtype

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
_DTYPE_NAMES = {v: k for k, v in DTYPE_OF_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``float32``, ``bfloat16`` or ``float16``: the name config.json (and a checkpoint's record) uses."""
    return _DTYPE_NAMES[dtype]


def model_dtype(model: nn.Module, source=None) -> torch.dtype:
    """The dtype the user's model had, before the engine made its parameters fp32 views of the masters: what
    an export writes unless told otherwise. A source (``source``, a :class:`~zerofit.models.source.WeightSource`
    whose meta model is built in fp32): its own (a folder's config.json's ``dtype``, else the dtype most of its
    stored weights have). A module: the dtype most of its floating parameters' elements have (a model that keeps
    a few norms in fp32 is the 16-bit model it mostly is). fp32 when nothing says."""
    if source is not None:
        return source.dtype()
    return most_dtype((p.dtype, p.numel()) for p in model.parameters() if p.is_floating_point())  # tied: once


def with_dtype(config: bytes, dtype: torch.dtype) -> bytes:
    """``config.json`` bytes with its dtype (``dtype``, and the older ``torch_dtype`` when present) set."""
    cfg = json.loads(config)
    cfg["dtype"] = _DTYPE_NAMES[dtype]
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = _DTYPE_NAMES[dtype]
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def model_side_files(model: nn.Module, source_dir: Path | str | None, dtype: torch.dtype) -> list[SideFile]:
    """config.json (dtype and architectures set, as ``save_pretrained`` does), generation_config.json when the
    model can generate, and the tokenizer files of ``source_dir`` when known. Empty for a non-HF model."""
    out = []
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        d = json.loads(cfg.to_json_string())
        d["architectures"] = [type(model).__name__]
        d.pop("quantization_config", None)  # the weights written are never the 4-bit ones ([Note: an NF4 base])
        out.append(SideFile(CONFIG, with_dtype(json.dumps(d).encode(), dtype)))
        gen = getattr(model, "generation_config", None)
        can = getattr(model, "can_generate", None)
        if gen is not None and (can is None or can()):
            out.append(SideFile(GENERATION_CONFIG, gen.to_json_string().encode()))
    return out + tokenizer_files(source_dir)


def tokenizer_files(source_dir: Path | str | None) -> list[SideFile]:
    if source_dir is None:
        return []
    src = Path(source_dir)
    return [SideFile(n, (src / n).read_bytes()) for n in TOKENIZER_FILES if (src / n).is_file()]
