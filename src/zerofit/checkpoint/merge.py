"""An adapter folder merged into its base, offline (``zerofit export CHECKPOINT OUT --merge``): transformers
reads the base (whole, into host memory), PEFT loads the adapter over it and merges it (``merge_and_unload``),
transformers writes the result. A live engine merges without a second copy instead
(adapter_files.merged_entries)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from zerofit.lora import LoraError


def merge_into_base(
    base_dir: Path,
    adapter_dir: Path,
    out: Path,
    dtype: torch.dtype | None,
    max_shard_size="5GB",
    nf4: str | None = None,
    precision: str | None = None,
    said: list | None = None,
) -> Path:
    """``nf4``: the adapter was trained over the base's linears in NF4 (a QLoRA run, in that precision): it is
    merged into those weights dequantized, the base it trained over ([Note: an NF4 base], engine/model/nf4.py). A base
    folder saved in 4 bits ([Note: a 4-bit folder]) is dequantized into ``precision`` (the run's; its linears as
    the run computed with them) and the merged model written in 16 bits; ``said`` gets a line saying so."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from zerofit.lora.files import check_adapter_fits, refuse_quantized

    check_adapter_fits(base_dir, adapter_dir)
    from zerofit.models import ModelDir

    md = ModelDir.open(base_dir)
    quant = getattr(md.config, "quantization_config", None)
    four = md.quant4 if quant else None  # a 4-bit folder is read as stored; another quantization is refused
    if four is not None:
        into = DTYPES.get(nf4 or precision or "", _compute_dtype(quant))
        with _no_progress_bars():
            base = dequantized_folder(md, into)
            merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
            merged = merged.to(dtype if dtype is not None else _compute_dtype(quant))
            merged.save_pretrained(out, max_shard_size=max_shard_size)
        _copy_tokenizer(base_dir, out)
        if said is not None:
            said.append(
                f"merged into {base_dir}'s linears dequantized from their 4 bits ({four.quant_type}) into "
                f"{str(into).removeprefix('torch.')}, the weights the adapter trained over: the merged model "
                "is written in 16 bits"
            )
        return out
    if quant:  # from config.json, before the base is read
        raise LoraError(
            f"--merge into {base_dir}, a quantized model ({dict(quant).get('quant_method', 'quantized')}): "
            "merging into quantized weights breaks models (the delta is rounded away); merge into the "
            "16-bit base it was quantized from (--base DIR), then quantize the merged model"
        )
    with _no_progress_bars():
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        refuse_quantized(base)
        if nf4 is not None:
            _dequantized_base(base, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[nf4])
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        if dtype is not None:
            merged = merged.to(dtype)
        merged.save_pretrained(out, max_shard_size=max_shard_size)
    _copy_tokenizer(base_dir, out)
    return out


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _compute_dtype(quant) -> torch.dtype:
    q = quant if isinstance(quant, dict) else quant.to_dict()
    named = str(q.get("bnb_4bit_compute_dtype") or "bfloat16").removeprefix("torch.")
    return getattr(torch, named, torch.bfloat16)


def _copy_tokenizer(base_dir: Path, out: Path) -> None:
    for f in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
    ):
        if (Path(base_dir) / f).is_file():
            (Path(out) / f).write_bytes((Path(base_dir) / f).read_bytes())


def dequantized_folder(md, dtype: torch.dtype):
    """The model of a 4-bit folder as a plain fp32 model: its 16-bit tensors as stored, each 4-bit linear
    dequantized from its stored codes into ``dtype`` (as the engine dequantizes them), then held in fp32."""
    import copy

    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from zerofit.models.directory import load_tensor

    config = copy.deepcopy(md.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    md.prefix = getattr(type(model), "base_model_prefix", "") or ""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if md.is_packed([name]):
                p.copy_(md.packed([name], tuple(p.shape)).dequantize(tuple(p.shape), dtype))
            else:
                load_tensor(md, [name], p.data)
    return model


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' own progress bars (loading and writing shards) off for the duration: the command says what
    it did in one line when it is done."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _dequantized_base(model, dtype: torch.dtype) -> None:
    """Each linear weight of the blocks as the QLoRA run held it: quantized from ``dtype``, dequantized."""
    from torch import nn

    from zerofit.engine.model.adapter import Adapter
    from zerofit.models.nf4 import round_trip

    with torch.no_grad():
        for block in Adapter(model, "auto").blocks:
            for m in block.modules():
                if type(m) is nn.Linear:
                    m.weight.copy_(round_trip(m.weight, dtype))
