"""Adapters out of an engine that trains a PEFT model.

* :func:`adapter_files`: PEFT's adapter folder as bytes, ``adapter_config.json`` (the model's ``LoraConfig``,
  written by PEFT's config writer) and ``adapter_model.safetensors`` (PEFT's ``get_peft_model_state_dict`` of the
  engine's current fp32 weights: PEFT's own key names). ``PeftModel.from_pretrained(base, folder)`` loads it.
  ``engine.save_pretrained(dir)`` writes them; a checkpoint of a PEFT run carries them too, so that
  ``zerofit export CHECKPOINT OUT`` needs neither the base nor the engine.
* :func:`merged_entries`: the base's weights with each LoRA layer's delta added, as PEFT's ``merge_and_unload``
  adds it (``W + get_delta_weight(adapter)``, in fp32), under the base model's own names, one tensor at a time:
  no second copy of the model is made.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from torch import nn

from zerofit.checkpoint.entries import weight_entries
from zerofit.checkpoint.format import Entry
from zerofit.lora import LoraError
from zerofit.lora.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, refuse_quantized
from zerofit.models.adapter_names import base_name, is_adapter_param


def _trained_state(engine) -> dict[str, torch.Tensor]:
    """The trained parameters' current fp32 values by the PEFT model's names, copied to the host."""
    return {
        e.name: e.base[e.offset : e.offset + e.numel].view(e.shape).to("cpu", torch.float32, copy=True)
        for e in weight_entries(engine, frozen=False)
    }


def adapter_files(engine) -> dict[str, bytes]:
    """``{adapter_config.json: ..., adapter_model.safetensors: ...}`` of the engine's PEFT model now; the
    caller has waited for the engine's updates (``engine.wait()``)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save

    model = engine.adapter.model
    out = {}
    for name in model.peft_config:
        tensors = get_peft_model_state_dict(model, state_dict=_trained_state(engine), adapter_name=name)
        with tempfile.TemporaryDirectory() as tmp:
            model.peft_config[name].save_pretrained(tmp)
            config = json.loads((Path(tmp) / ADAPTER_CONFIG).read_text())
        for key in ("target_modules", "modules_to_save", "exclude_modules"):  # sets, in hash order: sorted
            if isinstance(config.get(key), list):
                config[key] = sorted(config[key])
        out[ADAPTER_CONFIG] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        out[ADAPTER_WEIGHTS] = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
        break  # one adapter: the one PEFT trains (a model with several trains its active one)
    return out


def save_adapter(engine, out_dir: Path | str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in adapter_files(engine).items():
        (out / name).write_bytes(data)
    return out


def merged_entries(model: nn.Module, dtype: torch.dtype, dequantized: dict | None = None):
    """The merged model's tensors (the base model's names, tied ones once), each computed when written.
    ``dequantized``: name -> a function giving the fp32 value of a base weight held in NF4 (the module's is on
    the meta device: [Note: an NF4 base], engine/model/nf4.py)."""
    from peft.tuners.lora import LoraLayer

    dequantized = dequantized or {}
    if not dequantized:
        refuse_quantized(model)
    layer_of = {}
    for m in model.modules():
        if isinstance(m, LoraLayer):
            if getattr(m, "lora_magnitude_vector", None):
                raise LoraError(
                    "merging a DoRA adapter is not supported by zerofit yet: save the adapter and "
                    "merge with PEFT's merge_and_unload"
                )
            layer_of[id(m.get_base_layer().weight)] = m

    def merged(p: torch.Tensor, layer, base=None) -> torch.Tensor:
        w = base() if base is not None else p.detach().clone()
        for a in layer.active_adapters:
            if a in layer.lora_A:
                w += layer.get_delta_weight(a)  # as PEFT's merge (safe_merge's arithmetic)
        return w

    out = []
    for n, p in model.named_parameters():  # tied parameters once, under their first name
        if is_adapter_param(n) or ".original_module." in n:
            continue
        layer, base = layer_of.get(id(p)), dequantized.get(n)
        if layer is not None:
            fetch = lambda p=p, layer=layer, base=base: merged(p, layer, base)  # noqa: E731
        else:
            fetch = base if base is not None else (lambda p=p: p.detach())
        out.append(Entry(base_name(n), tuple(p.shape), dtype, fetch=fetch))
    return out
