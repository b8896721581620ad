"""A Hugging Face model directory out: from a live engine (``engine.save_pretrained``) or from a
checkpoint folder alone (``zerofit export CHECKPOINT OUT``).

Both stream one tensor at a time: from the engine's fp32 masters (device-resident
ones copied to the host in chunks, cast on the host) or from the checkpoint's
weight shards (one tensor read, cast, written, freed), so neither the GPU nor a
second whole copy on the host is ever needed. The layout is ``save_pretrained``'s:
``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` and
``model.safetensors.index.json`` written after them; ``config.json`` with the
exported dtype; ``generation_config.json`` and tokenizer files when known. Tied
parameters appear once, under their first name, as Hugging Face writes them.

The dtype, unless given, is the model's own, as Hugging Face's ``save_pretrained`` keeps it: the engine's
``model_dtype`` (recorded at initialize, before its parameters became fp32 views of the masters), or the
``model_dtype`` a checkpoint records. An fp32 model exports fp32: a bf16 default would round a fine-tuning
update away (a norm weight of 1.0003 is 1.0 in bf16).
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import torch

from zerofit.checkpoint.commit import verify
from zerofit.checkpoint.durable import disk_bytes, free_bytes, write_file
from zerofit.checkpoint.errors import CheckpointDiskFullError, CheckpointNotFoundError, MissingFileError
from zerofit.checkpoint.format import Entry, index_bytes, plan_shards, read_tensor, write_shards
from zerofit.checkpoint.load import locate, open_checkpoint, shard_files
from zerofit.checkpoint.model_files import CONFIG, model_side_files, with_dtype
from zerofit.checkpoint.save import WEIGHTS_INDEX, SideFile
from zerofit.config.schema import parse_bytes
from zerofit.models.directory import DTYPE_OF_NAME

MODEL_INDEX = "model.safetensors.index.json"
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
_STALE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")


def export_dtype(dtype: str | torch.dtype, what: str = "export dtype") -> torch.dtype:
    """bf16, fp16 or fp32 by name (or as a torch dtype); anything else is refused naming ``what``."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"{what} {dtype!r}: expected one of bf16, fp16, fp32")


def save_pretrained(
    engine,
    out_dir: Path | str,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    workers: int = 4,
    merge: bool = False,
) -> Path:
    """The engine's current weights as a Hugging Face model directory (see the module docstring); ``dtype``
    None: the model's own (``engine.model_dtype``). A PEFT model: its adapter folder
    (zerofit/checkpoint/adapter_files.py), or with ``merge`` the base with the adapters merged in, as a Hugging
    Face model directory (the module's host weights must be current: ``Engine.save_pretrained`` reads
    ``engine.module`` first)."""
    from zerofit.checkpoint.entries import weight_entries
    from zerofit.lora import is_peft

    dt = engine.model_dtype if dtype is None else export_dtype(dtype)
    model = engine.adapter.model
    peft = is_peft(model)
    if merge and not peft:
        raise ValueError("save_pretrained(merge=True) merges LoRA adapters: this model is not a PEFT model")
    if peft and merge and not engine.nf4:  # an NF4 base merges into its dequantized weights (below)
        from zerofit.lora.files import refuse_quantized

        refuse_quantized(model)  # before anything is written
    engine.wait()
    engine.dev.synchronize()
    if peft and not merge:
        from zerofit.checkpoint.adapter_files import save_adapter

        return save_adapter(engine, out_dir)
    if peft:
        from zerofit.checkpoint.adapter_files import merged_entries

        side = model_side_files(model.get_base_model(), engine.source_dir, dt)
        return write_model_dir(
            Path(out_dir), merged_entries(model, dt, _dequantized(engine)), side, parse_bytes(max_shard_size), workers
        )
    side = model_side_files(model, engine.source_dir, dt)
    return write_model_dir(Path(out_dir), weight_entries(engine, dt), side, parse_bytes(max_shard_size), workers)


def _dequantized(engine) -> dict:
    """Name -> the fp32 value of each weight held in NF4 ([Note: an NF4 base], engine/model/nf4.py), computed when
    asked:
    a merge writes the adapters into the dequantized base (merging into 4-bit weights breaks models)."""
    out = {}
    for u in engine.units:
        if u.nf4 is not None:
            prefix = "" if u.index < 0 else engine.adapter.block_prefix(u.index) + "."
            out.update({prefix + n: (lambda u=u, n=n: u.nf4.value(n, torch.float32)) for n in u.nf4.names})
    return out


def export_checkpoint(
    checkpoint: Path | str,
    out_dir: Path | str,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    workers: int = 4,
    merge: bool = False,
    base: Path | str | None = None,
    said: list | None = None,
) -> Path:
    """Export a checkpoint's weights as a Hugging Face model directory. ``checkpoint`` is a tag folder or a
    save folder (its ``latest`` is used). Only the weight shards are read (and verified), never the moments.
    ``dtype`` None: the model's own (:func:`checkpoint_dtype`). A checkpoint of a PEFT run: its adapter folder
    (the files it carries), or with ``merge`` the adapter merged into its base (``base``, default the folder
    the checkpoint names; read whole into host memory by transformers, merged by PEFT's merge_and_unload)."""
    dt = None if dtype is None else export_dtype(dtype)
    opened = open_checkpoint(checkpoint, None)
    if opened is None:
        raise CheckpointNotFoundError(f"{checkpoint}: neither a checkpoint folder nor a folder with a 'latest' file")
    folder, record = opened
    if record.state.get("lora_base") is not None:
        return _export_adapter(folder, record, Path(out_dir), dt, merge, base, max_shard_size, workers, said)
    if merge:
        raise ValueError(f"{folder}: --merge merges LoRA adapters; this checkpoint is of a whole model (no adapter)")
    dt = dt or checkpoint_dtype(record.state)
    model_files = list(record.state.get("model_files", []))
    if CONFIG not in model_files:
        raise MissingFileError(
            folder / CONFIG,
            "this checkpoint has no Hugging Face config.json (the model was not "
            "a transformers model), so it cannot be exported as one",
        )
    files = shard_files(folder, record, WEIGHTS_INDEX)
    verify(folder, record, [WEIGHTS_INDEX, *files, *model_files], workers)
    found = locate(folder, files, WEIGHTS_INDEX)
    order = sorted(found.items(), key=lambda kv: (kv[1][0], kv[1][1].begin))
    entries = [Entry(name, info.shape, dt, fetch=partial(read_tensor, folder / f, info)) for name, (f, info) in order]
    side = [
        SideFile(n, with_dtype((folder / n).read_bytes(), dt) if n == CONFIG else (folder / n).read_bytes())
        for n in model_files
    ]
    return write_model_dir(Path(out_dir), entries, side, parse_bytes(max_shard_size), workers)


def checkpoint_dtype(state: dict) -> torch.dtype:
    """The model's dtype a checkpoint's record holds (``model_dtype``); fp32, its weight shards' own, for a
    checkpoint written before zerofit recorded it."""
    return DTYPE_OF_NAME.get(state.get("model_dtype"), torch.float32)


def write_model_dir(
    out: Path, entries: list[Entry], side: list[SideFile], max_shard_bytes: int, workers: int = 4
) -> Path:
    """Shards, then the index (when sharded), then the side files. Earlier model shards in ``out`` are removed
    first (as ``save_pretrained`` does), so a shard of another export never mixes in."""
    shards = plan_shards(entries, "model", max_shard_bytes, single="model.safetensors")
    small = ([SideFile(MODEL_INDEX, index_bytes(shards))] if len(shards) > 1 else []) + side
    out.mkdir(parents=True, exist_ok=True)
    needed = disk_bytes([s.size for s in shards] + [len(f.data) for f in small], out)
    free = free_bytes(out)
    if needed > free:
        raise CheckpointDiskFullError(out, needed, free, "for the export")
    for p in out.iterdir():
        if _STALE.match(p.name) or p.name in {f.name for f in side}:
            p.unlink()
    write_shards(out, shards, workers)
    for f in small:
        write_file(out / f.name, f.data)
    return out


def _export_adapter(
    folder: Path, record, out: Path, dtype, merge: bool, base, max_shard_size, workers: int, said: list | None = None
) -> Path:
    from zerofit.lora.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    names = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    verify(folder, record, names, workers)
    if not merge:
        out.mkdir(parents=True, exist_ok=True)
        for n in names:
            write_file(out / n, (folder / n).read_bytes())
        return out
    import tempfile

    from zerofit.checkpoint.merge import merge_into_base

    base = base or record.state["lora_base"].get("path")
    if base is None:
        raise ValueError(f"{folder}: the checkpoint's base was not loaded from a folder: give it (--base DIR)")
    from zerofit.checkpoint.state import ZEROFIT_CONFIG

    trained = json.loads((folder / ZEROFIT_CONFIG).read_text()) if (folder / ZEROFIT_CONFIG).is_file() else {}
    nf4 = trained.get("precision", "bf16") if trained.get("quantize_base") == "nf4" else None  # a QLoRA run's
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            (Path(tmp) / n).write_bytes((folder / n).read_bytes())
        return merge_into_base(
            Path(base), Path(tmp), out, dtype, max_shard_size, nf4=nf4, precision=trained.get("precision"), said=said
        )
