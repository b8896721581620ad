"""Model shapes for ``zerofit estimate`` without a model folder: the config sizes of common open models by the
names tutorials use, a model built from one on the meta device, and PEFT's LoRA over it."""

from __future__ import annotations

from pathlib import Path

import torch

# the shapes of common open models, by the names tutorials use; ALIASES adds short names for some
SHAPES = {  # name: (model_type, the config's sizes), as the models' own config.json files give them
    "llama-3.2-3b": (
        "llama",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
    ),
    "llama-2-7b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            tie_word_embeddings=False,
        ),
    ),
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
        ),
    ),
    "llama-2-13b": (
        "llama",
        dict(
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
            vocab_size=32000,
            tie_word_embeddings=False,
        ),
    ),
    "llama-3-70b": (
        "llama",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
        ),
    ),  # Llama-3.1-70B's and 3.3's too
    "qwen3-8b": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-32b": (
        "qwen3",
        dict(
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2.5-72b": (
        "qwen2",
        dict(
            hidden_size=8192,
            intermediate_size=29568,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=152064,
            tie_word_embeddings=False,
        ),
    ),
}
ALIASES = {  # other accepted names: bench/'s short names for its shapes, the sizes alone, other releases
    "w1": "llama-3.2-3b",
    "w2": "llama-2-7b",
    "w3": "llama-2-13b",
    "13b": "llama-2-13b",
    "7b": "llama-2-7b",
    "3b": "llama-3.2-3b",
    "w6c": "llama-3-70b",
    "70b": "llama-3-70b",
    "llama-3.1-70b": "llama-3-70b",
    "llama-3.3-70b": "llama-3-70b",
    "llama-3-8b": "llama-3.1-8b",
}


def shape_config(name: str):
    """A transformers config of a named shape (``llama-2-13b``, ``qwen3-8b``, ``70b``...)."""
    from transformers import AutoConfig

    key = ALIASES.get(name.lower(), name.lower())
    if key not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(sorted(SHAPES))} (or 3b, 7b, 13b, 70b)")
    family, sizes = SHAPES[key]
    return AutoConfig.for_model(family, **sizes, max_position_embeddings=4096, attn_implementation="sdpa")


def meta_model(model_dir: str | Path | None = None, shape: str | None = None):
    """The model on the meta device, from a model directory or a named shape."""
    if (model_dir is None) == (shape is None):
        raise ValueError("give a model directory or a shape name (one of them)")
    if model_dir is not None:
        from zerofit.models import ModelDir

        return ModelDir.open(model_dir, config_only=True).build_meta()
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape_config(shape), dtype=torch.float32)


LORA_DEFAULTS = dict(r=16, alpha=32, targets="all-linear")  # what ``--lora`` plans without its own settings


def with_lora(model, r: int = 16, alpha: int = 32, targets="all-linear"):
    """``model`` (on the meta device) with PEFT's LoRA adapters (``target_modules=targets``): its base frozen, as
    ``zerofit train --lora`` trains it. Nothing is allocated: PEFT makes the adapters on the base's meta device."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ValueError("estimating a LoRA model needs peft (pip install peft)") from e
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))
