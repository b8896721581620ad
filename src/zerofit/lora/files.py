"""PEFT's adapter folder: its files' names, an adapter checked against a base from the files' headers, and the
refusal of a merge into a quantized base. Writing one from an engine is the checkpoint's (checkpoint/adapter_files.py);
merging one into its base offline too (checkpoint/merge.py)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from zerofit.lora import LoraError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def refuse_quantized(model: nn.Module) -> None:
    """A merge into a quantized base is refused (:class:`LoraError`), before anything is written."""
    cfg = getattr(model, "config", None)
    quant = getattr(cfg, "quantization_config", None)
    if quant or any(
        getattr(p, "quant_state", None) is not None or type(p).__name__ in ("Params4bit", "NF4Tensor")
        for p in model.parameters()
    ):
        raise LoraError(
            "--merge into a quantized base: merging into 4-bit weights breaks models (the delta is "
            "rounded away); save the adapter (without --merge), then merge it into the 16-bit base"
        )


def check_adapter_fits(base_dir: Path, adapter_dir: Path) -> None:
    """Refuse, from the files' headers alone (before anything is allocated), an adapter whose tensors do not
    fit the base's layers: an adapter trained over another model."""
    from safetensors import safe_open

    from zerofit.models import ModelDir

    md = ModelDir.open(base_dir)
    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise LoraError(
            f"{adapter_dir}: no {ADAPTER_WEIGHTS}: not a PEFT adapter folder (engine.save_pretrained "
            "or zerofit export of a LoRA run writes one)"
        )
    with safe_open(str(weights), "pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            module = key.removeprefix("base_model.model.")
            for part in (".lora_A.weight", ".lora_B.weight"):
                if not module.endswith(part):
                    continue
                layer = module[: -len(part)]
                try:
                    md.tensor([layer + ".weight"])
                except Exception:  # noqa: BLE001 - ModelDirError: the layer is not in the base at all
                    raise LoraError(
                        f"{adapter_dir}: adapter tensor {key} is for layer {layer}, which {base_dir} does "
                        "not have: the adapter was trained over another base; give that base"
                    ) from None
                shape_w = md.weight_shape([layer + ".weight"])  # (a 4-bit weight's from its quant state)
                out_f, in_f = shape_w[0], shape_w[-1]
                conv1d = getattr(md.config, "model_type", "") == "gpt2"  # Conv1D stores (in, out)
                if conv1d:
                    in_f, out_f = out_f, in_f
                want = in_f if part == ".lora_A.weight" else out_f
                got = shape[1] if part == ".lora_A.weight" else shape[0]
                if got != want:
                    raise LoraError(
                        f"{adapter_dir}: adapter tensor {key} is {list(shape)}, the layer {layer} of "
                        f"{base_dir} takes {in_f} -> {out_f}: the adapter was trained over another base "
                        "(shape mismatch); give the base it was trained over"
                    )
