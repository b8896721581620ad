"""The NF4 format of a 4-bit weight, as bitsandbytes stores it (QLoRA's): 4-bit codes in blocks of 64, each
block's scale quantized again to 8 bits in blocks of 256 ("double quantization"), 0.516 B/param. The format and its
arithmetic are bitsandbytes' (``quantize_4bit``, ``dequantize_4bit``: docs/dependencies.md says why that library):
:class:`Packed` holds one weight's pieces, :class:`Spec` where they sit in a flat buffer, :func:`dequantize_into`
the one dequantization every reader of them runs (the engine where a block computes, engine/model/nf4.py; a 4-bit
folder's reader, quantized.py; a merge). The engine's units and layers over it are engine/model/nf4.py's."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from zerofit.errors import InputError

BLOCK, BLOCK2 = 64, 256  # bitsandbytes' defaults: codes per scale, scales per second-level scale


class QuantError(InputError, ValueError):
    """A QLoRA request that cannot be carried out; the message says what to do."""


def bnb_functional():
    """``bitsandbytes.functional``, or :class:`QuantError` naming the install."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)  # its import reports optional CPU kernels it did not find
    try:
        import bitsandbytes.functional as bf
    except ImportError as e:
        raise QuantError(
            f"QLoRA (an NF4 base) needs bitsandbytes ({e}): pip install 'zerofit[qlora]' "
            "(bitsandbytes>=0.48, CPU or CUDA)"
        ) from None
    finally:
        log.setLevel(level)
    return bf


def up4(n: int) -> int:
    """``n`` rounded up to a multiple of 4 (the pieces' alignment)."""
    return (n + 3) // 4 * 4


@dataclass(frozen=True)
class Spec:
    """Where one NF4 tensor's pieces are in its unit's packed buffer (byte offsets), and its shape."""

    shape: tuple[int, ...]
    start: int  # its first element in the unit's frozen layout
    blocksize: int
    nested: bool  # double quantization: 8-bit scales (else fp32 ones)
    data: int  # ((numel + 1) // 2,) uint8 codes
    absmax: int  # (blocks,) uint8 (nested) or fp32
    absmax2: int  # nested: (ceil(blocks / 256),) fp32
    code2: int  # nested: (256,) fp32, the scales' 8-bit map
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> int:
        return -(-self.numel // self.blocksize)

    @staticmethod
    def at(offset: int, shape, start: int, blocksize: int = BLOCK, nested: bool = True) -> Spec:
        numel = math.prod(shape)
        blocks = -(-numel // blocksize)
        data = offset
        absmax = up4(data + (numel + 1) // 2)
        if not nested:
            return Spec(tuple(shape), start, blocksize, False, data, absmax, 0, 0, absmax + 4 * blocks)
        absmax2 = up4(absmax + blocks)
        code2 = absmax2 + 4 * -(-blocks // BLOCK2)
        return Spec(tuple(shape), start, blocksize, True, data, absmax, absmax2, code2, code2 + 4 * 256)


def nbytes(numel: int, blocksize: int = BLOCK, nested: bool = True) -> int:
    """Host bytes of one NF4 tensor of ``numel`` elements (the planner's count: ~0.52 B/param nested)."""
    return Spec.at(0, (numel,), 0, blocksize, nested).end


@dataclass
class Packed:
    """One weight in NF4 as host tensors: bitsandbytes' codes and QuantState (nested or not)."""

    data: torch.Tensor  # uint8 codes, two a byte
    absmax: torch.Tensor  # uint8 (nested) or fp32 scales
    offset: float = 0.0  # nested: the scales' mean, taken out before they were quantized
    absmax2: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    blocksize: int = BLOCK
    quant_type: str = "nf4"  # the 4-bit code: nf4 (QLoRA's), or fp4

    @classmethod
    def quantize(cls, w: torch.Tensor, device: torch.device | None = None) -> Packed:
        """bitsandbytes' NF4 of ``w`` with double quantization (as ``Params4bit`` quantizes at load), on ``device``
        (a GPU: its kernel, as bitsandbytes' loading onto a GPU quantizes; its CPU path is one core's), or where
        ``w`` is. The pieces stay where they were made: :meth:`UnitNF4.put` copies them into the unit's host
        buffer, from a GPU without waiting ([Note: start-up progress], startup.py)."""
        bf = bnb_functional()
        if device is not None:
            w = w.to(device, non_blocking=False)
        q, qs = bf.quantize_4bit(
            w.contiguous(), blocksize=BLOCK, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8
        )
        return cls.of_state(q, qs, host=False)

    @classmethod
    def of_state(cls, q: torch.Tensor, qs, host: bool = True) -> Packed:
        """A ``Params4bit``'s codes and ``QuantState`` (quantized in this process, or loaded from a folder, whose
        pieces may come shaped otherwise: each is taken flat); ``host``: copied to the host (else where they are)."""
        if qs.quant_type not in ("nf4", "fp4"):
            raise QuantError(f"a 4-bit weight in {qs.quant_type!r}: zerofit holds nf4 and fp4")

        def flat(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().reshape(-1)
            return t.cpu() if host else t

        data = flat(q).view(torch.uint8)
        if qs.nested:
            s2 = qs.state2
            if s2.blocksize != BLOCK2:
                raise QuantError(f"double quantization in blocks of {s2.blocksize}: bitsandbytes' is {BLOCK2}")
            return cls(
                data,
                flat(qs.absmax),
                float(qs.offset),
                flat(s2.absmax.float()),
                flat(s2.code.float()),
                qs.blocksize,
                qs.quant_type,
            )
        return cls(data, flat(qs.absmax.float()), blocksize=qs.blocksize, quant_type=qs.quant_type)

    @property
    def nested(self) -> bool:
        return self.absmax2 is not None

    def dequantize(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The weight of ``shape`` dequantized into ``dtype``, where its pieces are (:func:`dequantize_into`)."""
        out = torch.empty(shape, dtype=dtype, device=self.data.device)
        dequantize_into(
            self.data, self.absmax, self.absmax2, self.code2, self.offset, shape, self.blocksize, self.quant_type, out
        )
        return out


def round_trip(w: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w`` (read in ``dtype``, as the engine reads it) quantized to NF4 and dequantized into ``out_dtype``: the
    base a QLoRA run trained over, for a merge made offline from its checkpoint (checkpoint/merge.py)."""
    return Packed.quantize(w.to(dtype)).dequantize(tuple(w.shape), out_dtype)


def dequantize_into(
    data: torch.Tensor,
    absmax: torch.Tensor,
    absmax2: torch.Tensor | None,
    code2: torch.Tensor | None,
    offset: float,
    shape: tuple,
    blocksize: int,
    quant_type: str,
    out: torch.Tensor,
) -> None:
    """One 4-bit weight from its pieces into ``out`` (its dtype and device): ``Linear4bit``'s own dequantization,
    the scales first (nested: from their 8 bits, plus the offset), then the codes, into the compute dtype as its
    training forward does. Every reader of NF4 runs this, so each reads the same values."""
    bf = bnb_functional()
    if absmax2 is not None:
        state2 = bf.QuantState(absmax=absmax2, code=code2, blocksize=BLOCK2, dtype=torch.float32)
        scales = bf.dequantize_blockwise(absmax, state2)
        scales += offset
    else:
        scales = absmax
    qs = bf.QuantState(
        absmax=scales, shape=torch.Size(shape), dtype=out.dtype, blocksize=blocksize, quant_type=quant_type
    )
    if out.is_cuda:
        bf.dequantize_4bit(data, quant_state=qs, out=out)
    else:  # (bitsandbytes' CPU backend has no ``out`` variant)
        out.copy_(bf.dequantize_4bit(data, quant_state=qs))


def is_linear4bit(m: nn.Module) -> bool:
    """bitsandbytes' ``Linear4bit`` (and its subclasses), without importing bitsandbytes."""
    return any(c.__name__ == "Linear4bit" and c.__module__.startswith("bitsandbytes") for c in type(m).__mro__)
