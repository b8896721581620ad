"""LoRA with PEFT over a frozen base: PEFT models trained by the engine through every door, the
adapters out, the base by reference. See docs/lora.md.

| module | concept |
| --- | --- |
| ``options.py`` | the options of ``zerofit train --lora`` (PEFT's ``LoraConfig`` fields) |
| ``model.py`` | a PEFT model over a model directory, built on the meta device; its weights read from the files |
| ``files.py`` | PEFT's adapter folder: its files, an adapter checked against a base's headers, no merge into 4 bits |

A lower floor of the house (CONTRIBUTING.md, Layers): what uses an engine lives above it. The adapters out of an
engine, the base's fingerprint and the offline merge are the checkpoint's (checkpoint/adapter_files.py,
lora_base.py, merge.py); generation over a base and an adapter the inference engine's (infer/adapter_source.py);
PEFT's parameter names over a base the model folder's (models/adapter_names.py).
"""

from __future__ import annotations

from zerofit.errors import InputError

__all__ = ["LoraError", "LoraOptions", "is_peft"]


class LoraError(InputError, ValueError):
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
