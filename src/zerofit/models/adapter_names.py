"""PEFT's parameter names over a base model's: which of a PEFT model's parameters PEFT added (an adapter's), and the
base model's name of the others (their name in the model directory's files). The one rule every reader of a base
under an adapter uses (the engine's folder source, generation, serving, a merge)."""

from __future__ import annotations

import re

_PEFT_OWN = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def is_adapter_param(name: str) -> bool:
    """Whether a PEFT model's parameter is one PEFT added (an adapter's), not one of the base."""
    return _PEFT_OWN.search(name) is not None


def base_name(name: str) -> str:
    """The base model's name of a PEFT model's parameter (its name in the model directory's files)."""
    name = name.removeprefix("base_model.model.")
    name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
