"""LoRA with PEFT over a frozen base: PEFT models trained by the engine through every door, the
adapters out, the base by reference. See docs/lora.md.

| module | concept |
| --- | --- |
| ``options.py`` | the options of ``zerofit train --lora`` (PEFT's ``LoraConfig`` fields) |
| ``model.py`` | a PEFT model over a model directory, built on the meta device; its weights read from the files |
| ``files.py`` | adapters out: PEFT's adapter folder, or a merged Hugging Face model, from an engine |
| ``base.py`` | the base a checkpoint was trained over: its folder and a fingerprint of its weights |
| ``merge.py`` | an adapter folder merged into its base offline; an adapter checked against a base's headers |
| ``infer.py`` | generation over a base directory and an adapter folder |
"""

from __future__ import annotations

__all__ = ["LoraError", "LoraOptions", "is_peft"]


class LoraError(ValueError):
    """A LoRA request that cannot be carried out (targets that match nothing, an adapter of another base, a
    merge into a quantized base); the message says what was found and what to do."""


def is_peft(model) -> bool:
    """Whether ``model`` is a PEFT model (``peft.PeftModel`` and its task classes), without importing peft."""
    return any(c.__module__.startswith("peft.") and c.__name__.startswith("PeftModel") for c in type(model).__mro__)


def __getattr__(name: str):
    if name == "LoraOptions":
        from zerofit.lora.options import LoraOptions

        return LoraOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
