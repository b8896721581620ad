"""A model folder saved in 4 bits (bitsandbytes' ``load_in_4bit``, as transformers' ``save_pretrained`` writes
it): its form from config.json, which weights are packed, and each one read as it is stored.

[Note: a 4-bit folder]
transformers writes each quantized linear's weight as its packed codes (two a byte; stored as uint8, or as the
``bnb_4bit_quant_storage`` dtype's bytes) and its quant state beside it: ``<name>.absmax`` (the scales: uint8
with double quantization, else fp32), ``.quant_map`` (the 4-bit code's 16 values), with double quantization
``.nested_absmax`` and ``.nested_quant_map`` (the scales' fp32 scales and 8-bit map), and
``.quant_state.bitsandbytes__nf4`` (or ``__fp4``): a JSON of quant_type, blocksize, dtype, shape and the nested
offset. These are taken byte for byte into the engine's 4-bit base ([Note: an NF4 base], engine/model/nf4.py): nothing
is dequantized and quantized again. config.json's ``quantization_config`` gives the form (NF4 or FP4, double
quantization or not) before any weight file is read, so ``zerofit estimate`` plans from it alone; each tensor's
own quant state is checked against it and against the model's shape as it is read. Other quantizations (8-bit,
GPTQ, AWQ, fp8, compressed-tensors) are refused by name, with what to do.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from zerofit.models.safetensors import WeightFileError, descriptor, read_into

STATE = ".quant_state.bitsandbytes__"


class QuantizedFolderError(WeightFileError):
    """A quantized folder zerofit cannot read, or one whose 4-bit tensors are inconsistent; names the file."""


@dataclass(frozen=True)
class FolderQuant:
    """A 4-bit folder's form, from its config.json: the code (``nf4`` or ``fp4``), double quantization."""

    quant_type: str
    nested: bool
    blocksize: int = 64  # transformers' 4-bit loading quantizes in bitsandbytes' default blocks


def folder_quant(config, where) -> FolderQuant | None:
    """The 4-bit form of a folder whose config is ``config`` (None: not quantized), or
    :class:`QuantizedFolderError` for a quantization zerofit does not read (``where``: config.json's path)."""
    q = getattr(config, "quantization_config", None)
    if not q:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method", "bitsandbytes" if "load_in_4bit" in q or "load_in_8bit" in q else None)
    sixteen = (
        "give the 16-bit model instead (zerofit train --qlora holds its linears in 4 bits, quantized as they are read)"
    )
    if method == "bitsandbytes" and (q.get("load_in_4bit") or q.get("_load_in_4bit")):
        kind = q.get("bnb_4bit_quant_type", "fp4")
        if kind not in ("nf4", "fp4"):
            raise QuantizedFolderError(f"{where}: bnb_4bit_quant_type {kind!r}: zerofit reads nf4 and fp4")
        return FolderQuant(kind, bool(q.get("bnb_4bit_use_double_quant", False)))
    if method == "bitsandbytes":
        raise QuantizedFolderError(
            f"{where}: a model saved in 8 bits (bitsandbytes' LLM.int8): zerofit reads 4-bit "
            f"folders (load_in_4bit) and 16-bit ones; {sixteen}"
        )
    raise QuantizedFolderError(
        f"{where}: a model saved quantized by {method!r}: zerofit reads bitsandbytes' 4-bit "
        f"folders (load_in_4bit) and 16-bit ones; {sixteen}"
    )


def state_key(weights: dict, stored: str) -> str | None:
    """The quant state's key of the stored weight ``stored``, if the folder holds it packed."""
    return next((k for k in (stored + STATE + "nf4", stored + STATE + "fp4") if k in weights), None)


def _raw(weights: dict, key: str, fds: dict | None) -> torch.Tensor:
    info = weights.get(key)
    if info is None:
        raise KeyError(key)
    out = torch.empty(tuple(info.shape), dtype=info.dtype)
    read_into(info, out, descriptor(fds, info.file))
    return out


def weight_shape(weights: dict, info) -> tuple:
    """The shape of the weight stored as ``info``: its quant state's for a 4-bit one, else as stored."""
    key = state_key(weights, info.name)
    if key is None:
        return tuple(info.shape)
    try:
        return tuple(json.loads(bytes(_raw(weights, key, None).tolist()).decode())["shape"])
    except (KeyError, ValueError, TypeError) as e:
        raise QuantizedFolderError(
            f"{info.file}: its quant state {key!r} cannot be read ({type(e).__name__}: {e})"
        ) from None


def check_packed(weights: dict, info, shape: tuple, form: FolderQuant, fds: dict | None = None) -> dict:
    """The 4-bit weight stored as ``info`` (the codes' entry) checked from the headers and its quant state's JSON
    alone (no codes read): its state's shape is the model's ``shape``, each piece is there with the dtype and size
    that shape and the blocksize give, the form is the config's. Returns the state (quant_type, blocksize, nested
    offset) and the pieces' keys."""
    from zerofit.models.nf4 import BLOCK2

    key = state_key(weights, info.name)
    where = f"{info.file}: {info.name!r}"
    if key is None:
        raise QuantizedFolderError(
            f"{where} has no quant state ({info.name}{STATE}nf4): the folder is not "
            "bitsandbytes' 4-bit format as transformers saves it; save it again with "
            "save_pretrained, or give the 16-bit model"
        )
    try:
        state = json.loads(bytes(_raw(weights, key, fds).tolist()).decode())
        kind, blocksize = state["quant_type"], int(state["blocksize"])
        stored_shape = tuple(state["shape"])
    except (KeyError, ValueError, TypeError) as e:
        raise QuantizedFolderError(
            f"{where}: its quant state {key!r} cannot be read ({type(e).__name__}: {e})"
        ) from None
    if stored_shape != tuple(shape):
        raise QuantizedFolderError(
            f"{where}: its quant state's shape {list(stored_shape)} is not the "
            f"{list(shape)} the model built from config.json expects"
        )
    if kind != form.quant_type:
        raise QuantizedFolderError(
            f"{where}: quantized in {kind}, config.json's quantization_config says {form.quant_type}"
        )
    numel = math.prod(shape)
    blocks = -(-numel // blocksize)
    nested = (info.name + ".nested_absmax") in weights
    if nested != form.nested:
        raise QuantizedFolderError(
            f"{where}: double quantization {'on' if nested else 'off'}, config.json's "
            f"bnb_4bit_use_double_quant says {'on' if form.nested else 'off'}"
        )
    if nested and int(state.get("nested_blocksize", BLOCK2)) != BLOCK2:
        raise QuantizedFolderError(
            f"{where}: double quantization in blocks of {state['nested_blocksize']}: bitsandbytes' is {BLOCK2}"
        )
    codes = math.prod(info.shape) * info.dtype.itemsize  # (the codes' bytes, whatever dtype stores them)
    if codes != (numel + 1) // 2:
        raise QuantizedFolderError(f"{where}: {codes} bytes of codes, a {list(shape)} weight has {(numel + 1) // 2}")
    pieces = (
        {
            ".absmax": (blocks, torch.uint8),
            ".nested_absmax": (-(-blocks // BLOCK2), torch.float32),
            ".nested_quant_map": (256, torch.float32),
        }
        if nested
        else {".absmax": (blocks, torch.float32)}
    )
    for suffix, (size, dtype) in pieces.items():
        piece = weights.get(info.name + suffix)
        if piece is None:
            raise QuantizedFolderError(f"{where}: its quant state's {info.name + suffix!r} is not in the folder")
        if piece.dtype != dtype or math.prod(piece.shape) != size:
            raise QuantizedFolderError(
                f"{where}: {info.name + suffix!r} holds {math.prod(piece.shape)} "
                f"{piece.dtype} values, a {list(shape)} weight in blocks of {blocksize} has "
                f"{size} {dtype}"
            )
    return {
        "quant_type": kind,
        "blocksize": blocksize,
        "nested": nested,
        "offset": float(state.get("nested_offset", 0.0)),
    }


def read_packed(weights: dict, info, shape: tuple, form: FolderQuant, fds: dict | None = None):
    """The 4-bit weight stored as ``info`` with its quant state, as a :class:`~zerofit.models.nf4.Packed`,
    checked first (:func:`check_packed`)."""
    from zerofit.models.nf4 import Packed

    st = check_packed(weights, info, shape, form, fds)

    def piece(suffix: str) -> torch.Tensor:
        return _raw(weights, info.name + suffix, fds).reshape(-1)

    data = _raw(weights, info.name, fds).reshape(-1).view(torch.uint8)
    if st["nested"]:
        return Packed(
            data,
            piece(".absmax"),
            st["offset"],
            piece(".nested_absmax"),
            piece(".nested_quant_map"),
            st["blocksize"],
            st["quant_type"],
        )
    return Packed(data, piece(".absmax"), blocksize=st["blocksize"], quant_type=st["quant_type"])
