"""A frozen base in 4 bits (QLoRA): NF4 with double quantization, in bitsandbytes' format (a part).

[Note: an NF4 base]
QLoRA keeps the frozen linear weights of the blocks in NF4: 4-bit codes in blocks of 64, each block's scale quantized
again to 8 bits in blocks of 256 ("double quantization"), 0.516 B/param; the linears of a 70B base (Llama-3-70B's shape:
68.5 B parameters) in 32.9 GiB of host memory (zerofit estimate --qlora). The format and its arithmetic are
bitsandbytes' (``quantize_4bit``, ``dequantize_4bit``: docs/dependencies.md says why that library), so a model loaded
with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`` is taken as it
is (its ``Params4bit`` codes and ``QuantState``), and ``quantize_base: nf4`` (``zerofit train --qlora``) quantizes each
frozen ``nn.Linear`` weight of the blocks the way that loading does: one tensor at a time, as it is read from the
model's files (in the compute dtype, as ``from_pretrained(dtype=...)`` reads it), never the whole base in 16 bits.

Where the pieces live: a unit's NF4 weights are one flat uint8 host buffer (``UnitNF4.host``, pinned when the
engine pins), each tensor's codes, 8-bit scales, their fp32 scales and map at fixed byte offsets. The unit's
``frozen`` layout still names every frozen parameter: the 16-bit ones first (``frozen_host``, as before), then
the NF4 ones, whose place in the weight slot (or in a resident unit's ``frozen_dev``) receives their
dequantized values. An upload copies the packed bytes to the device (``Streamer``'s NF4 stage, on the upload
stream) and dequantizes them there into the slot, once per residency of the block: a resident unit once at
start. On the CPU the host buffer is read in place.

The math: the module's layer becomes a :class:`DequantizedLinear` whose weight is that dequantized tensor and
whose forward is ``Linear4bit``'s training forward (``bnb.matmul_4bit``: dequantize into the input's dtype,
``F.linear``); its backward gives the input's gradient only (a frozen weight). PEFT's LoRA layers wrap it as
they wrapped the ``Linear4bit`` (their forward calls ``base_layer(x)``). tests/integration/test_qlora.py:
bitwise bitsandbytes' own QLoRA path (PEFT over a ``BitsAndBytesConfig`` model, torch's AdamW) on the CPU.

Outside a step the module's NF4 weights are on the meta device (there is no 16-bit copy of them to view);
``master_state_dict``, a merge and the base's fingerprint read them from the packed buffer, and so does the
layer's own forward ([Note: the user's 4-bit layers outside a step]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from zerofit.models.nf4 import (
    BLOCK,
    BLOCK2,
    Packed,
    QuantError,
    Spec,
    bnb_functional,
    dequantize_into,
    is_linear4bit,
    up4,
)

if TYPE_CHECKING:
    from zerofit.models.quantized import FolderQuant


class DequantizedLinear(nn.Module):
    """A frozen linear layer whose weight the engine holds in NF4 ([Note: an NF4 base]): ``weight`` is the
    dequantized one, in the compute dtype, that the engine puts where the block computes; ``forward`` is
    bitsandbytes' ``Linear4bit`` training forward over it.

    [Note: the user's 4-bit layers outside a step]
    Outside a step ``weight`` is on the meta device, and the layer is still the user's model's: a forward (an
    evaluation, ``generate``) dequantizes the packed host bytes the engine holds (``held_in``: its unit's buffer,
    as :meth:`BaseNF4.held` last placed it) into the compute dtype, as the engine does where the block computes,
    so the user's own object gives the engine's numbers, during the run and after ``close()`` (the buffer lives
    as long as the layer refers to it). ``state_dict`` holds ``Linear4bit``'s entries (the packed codes and
    bitsandbytes' quant state, views of that buffer): what the model holds, without a dequantized copy of the
    base (PEFT's ``save_pretrained`` reads the whole ``state_dict`` to pick the adapters out of it)."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty((out_features, in_features), device="meta", dtype=dtype), requires_grad=False
        )
        self.bias = bias
        self.held_in: tuple[UnitNF4, int] | None = None  # where the engine holds this weight packed (BaseNF4.held)

    def host_weight(self) -> torch.Tensor:
        """The weight dequantized on the host, in the compute dtype ([Note: the user's 4-bit layers outside a
        step])."""
        if self.held_in is None:
            raise QuantError(
                "this 4-bit layer's weight is not held by a zerofit engine yet (zerofit.initialize builds it)"
            )
        unit, i = self.held_in
        return unit.value(unit.names[i], self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w: torch.Tensor = self.weight
        if w.is_meta:  # [Note: the user's 4-bit layers outside a step]
            w = self.host_weight().to(x.device)
        inp = x.dtype
        x = x.to(w.dtype)
        bias = None if self.bias is None else self.bias.to(w.dtype)
        return F.linear(x, w, bias).to(inp)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.is_meta and self.held_in is not None:  # [Note: the user's 4-bit layers outside a step]
            unit, i = self.held_in
            codes, state = unit.linear4bit_entries(i, self.weight.dtype)
            destination[prefix + "weight"] = codes
            destination.update({f"{prefix}weight.{k}": v for k, v in state.items()})

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


class BaseNF4:
    """Which frozen weights are held in NF4, by canonical name, before the units are built: a ``Packed`` (a
    ``Linear4bit``'s, taken as it is) or None (to quantize as the weight is read). Made by :meth:`prepare`,
    which swaps their modules for :class:`DequantizedLinear`; empty when the model has none."""

    def __init__(self, dtype: torch.dtype, device: torch.device | None = None):
        self.dtype = dtype
        self.device = device if device is not None and device.type == "cuda" else None  # where to quantize
        self.packed: dict[str, Packed | None] = {}
        self.originals: dict[str, torch.Tensor] = {}  # name -> the user's 16-bit weight, quantized at build
        self.on_meta: dict[str, nn.Linear] = {}  # name -> its nn.Linear on the meta device (no files):
        self.init: Callable[[nn.Module], object] | None = None  # initialized by the model's own init, then quantized
        self.from_folder: dict[str, tuple] = {}  # name -> (source, shape): stored in 4 bits there
        self.layers: dict[str, DequantizedLinear] = {}  # name -> the model's layer that computes with it
        self.folder: FolderQuant | None = None  # that folder's form ([Note: a 4-bit folder])

    def __contains__(self, name: str) -> bool:
        return name in self.packed

    def __bool__(self) -> bool:
        return bool(self.packed)

    @classmethod
    def prepare(
        cls,
        model: nn.Module,
        adapter,
        dtype: torch.dtype,
        quantize: bool,
        many: bool = False,
        check: bool = True,
        device: torch.device | None = None,
        source=None,
    ) -> BaseNF4:
        """Swap each ``Linear4bit`` of ``model``, each linear the model folder ``source`` stores in 4 bits ([Note:
        a 4-bit folder], models/quantized.py), and with ``quantize`` each frozen ``nn.Linear`` of its blocks, for
        a :class:`DequantizedLinear`. Refusals (:class:`QuantError`) come before anything is allocated."""
        out = cls(dtype, device)
        out.folder = getattr(source, "quant4", None)
        if not quantize and out.folder is None and not any(is_linear4bit(m) for m in model.modules()):
            return out
        if many:
            raise QuantError(
                "QLoRA (an NF4 base) on several ranks: not yet; train it in one process (LoRA over "
                "a 16-bit base runs on several)"
            )
        if (quantize or out.folder is not None) and check:
            bnb_functional()  # installed and loadable, or say so now (not for an estimate)
        in_blocks = set()
        for block in adapter.blocks:
            in_blocks |= {id(m) for m in block.modules()}
        for path, m in list(model.named_modules()):
            if is_linear4bit(m):
                out.packed[path + ".weight"] = Packed.of_state(m.weight.data, m.weight.quant_state)
            elif (
                out.folder is not None
                and type(m) is nn.Linear
                and (id(m) in in_blocks or source.weights)
                and source.is_packed([path + ".weight"])
            ):  # (config.json alone: the blocks' linears)
                name = path + ".weight"
                if m.weight.requires_grad:
                    raise QuantError(
                        f"{name}: stored in 4 bits in {source.path}: a 4-bit weight does not train; "
                        "train LoRA adapters over it (zerofit train --lora, or PEFT's get_peft_model)"
                    )
                if id(m) not in in_blocks:
                    raise QuantError(
                        f"{name}: stored in 4 bits in {source.path}, outside the model's repeated "
                        "blocks: zerofit holds 4-bit weights in the blocks only; give the 16-bit "
                        "model (with --qlora)"
                    )
                source.check_packed([name], tuple(m.weight.shape))  # its quant state, before any allocation
                out.packed[name] = None
                out.from_folder[name] = (source, tuple(m.weight.shape))
            elif quantize and type(m) is nn.Linear and id(m) in in_blocks and not m.weight.requires_grad:
                out.packed[path + ".weight"] = None
                if not m.weight.is_meta:
                    out.originals[path + ".weight"] = m.weight.detach()
                else:
                    out.on_meta[path + ".weight"] = m
                    out.init = getattr(model, "_init_weights", None)
            else:
                continue
            if m.bias is not None and m.bias.requires_grad:
                raise QuantError(
                    f"{path}: a trained bias beside a 4-bit weight: freeze it, or leave the layer "
                    "out of the quantization"
                )
            parent_path, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            layer = out.layers[path + ".weight"] = DequantizedLinear(m.in_features, m.out_features, m.bias, dtype)
            setattr(parent, leaf, layer)
        if quantize and not out.packed:
            raise QuantError(
                "quantize_base: nf4: the blocks have no frozen nn.Linear layer to hold in 4 bits "
                "(a model of other layers, or one whose linear layers all train)"
            )
        return out

    def form(self, name: str) -> tuple[bool, int]:
        """(nested, blocksize) of ``name``'s NF4: its ``Linear4bit``'s, its folder's, or the quantization's."""
        p = self.packed[name]
        if p is None and name in self.from_folder:
            assert self.folder is not None  # its names come from the folder
            return self.folder.nested, self.folder.blocksize
        return (True, BLOCK) if p is None else (p.nested, p.blocksize)

    def unit_bytes(self, shapes_names: list[tuple]) -> int:
        """Host bytes of a unit's packed buffer holding ``(shape, name)`` in order (UnitNF4's layout)."""
        at = 0
        for shape, name in shapes_names:
            nested, blocksize = self.form(name)
            at = up4(Spec.at(at, shape, 0, blocksize, nested).end)
        return at

    def unit(self, names: list[str], rel: list[str], shapes: list, starts: list[int], pinned: bool) -> UnitNF4:
        """A unit's empty packed buffer for ``names`` (canonical; ``rel``: the unit's names of them)."""
        forms = [self.form(n) for n in names]
        return UnitNF4(rel, shapes, starts, [f[0] for f in forms], [f[1] for f in forms], pinned)

    def pack_of(self, name: str, read) -> Packed:
        """The NF4 of ``name``: the one taken from a ``Linear4bit``, or ``read()`` (the weight, in the compute
        dtype) quantized now."""
        p = self.packed[name]
        if p is not None:
            return p
        if name in self.from_folder:  # its codes and quant state as the folder stores them
            source, shape = self.from_folder[name]
            return source.packed([name], shape)
        w = self.originals.pop(name, None)
        m = self.on_meta.pop(name, None)
        if w is None and read is None and m is not None:
            # a model on the meta device without files (a benchmark's): initialized as materialize.py initializes
            # the rest of such a model (its own _init_weights, else reset_parameters), on the device that quantizes
            # (the rest of a meta model is initialized on the compute device too; the CPU's generator is one core's)
            m.to_empty(device=self.device or "cpu")
            with torch.no_grad():
                self.init(m) if self.init is not None else m.reset_parameters()
            w = m.weight.detach()
            m.to_empty(device="meta")  # (the 16-bit weight goes once it is quantized)
        if w is None and read is None:
            raise QuantError(f"{name}: no weights to quantize")
        w = read() if w is None else w.to(self.dtype)
        return Packed.quantize(w, self.device)

    def held(self, name: str, unit: UnitNF4, i: int) -> None:
        """``name`` is now in ``unit``'s buffer: a rebuild of the units takes it from there (nothing else kept), and
        its layer computes from there outside a step ([Note: the user's 4-bit layers outside a step])."""
        self.packed[name] = unit.packed(i)
        if name in self.layers:
            self.layers[name].held_in = (unit, i)


class UnitNF4:
    """A unit's NF4 weights: one flat uint8 host buffer and each tensor's :class:`Spec` (its pieces, where its
    dequantized values go in the unit's frozen layout)."""

    def __init__(
        self,
        names: list[str],
        shapes: list[tuple],
        starts: list[int],
        nested: list[bool],
        blocksizes: list[int],
        pinned: bool,
    ):
        self.names = list(names)
        self.specs: list[Spec] = []
        at = 0
        for shape, start, n, b in zip(shapes, starts, nested, blocksizes):
            s = Spec.at(at, shape, start, b, n)
            self.specs.append(s)
            at = up4(s.end)
        self.nbytes = at
        # page-locked at its exact size (the caching host allocator would round it up to a power of two: 16%
        # more host memory for a 70B model's blocks), freed with the arena
        from zerofit.engine.memory.store import HostArena

        self._arena = HostArena(at, torch.uint8, pinned)
        self.host = self._arena.tensor[:at]
        self.offsets = [0.0] * len(self.specs)
        self.quant_types = ["nf4"] * len(self.specs)
        self.start = min(starts)  # where the NF4 tensors begin in the frozen layout (after the 16-bit ones)

    def packed(self, i: int) -> Packed:
        """Tensor ``i``'s NF4 as views of the host buffer (a rebuild of the units takes them from here)."""
        s, h = self.specs[i], self.host
        data = h[s.data : s.data + (s.numel + 1) // 2]
        if s.nested:
            return Packed(
                data,
                h[s.absmax : s.absmax + s.blocks],
                self.offsets[i],
                h[s.absmax2 : s.code2].view(torch.float32),
                h[s.code2 : s.end].view(torch.float32),
                s.blocksize,
                self.quant_types[i],
            )
        return Packed(
            data, h[s.absmax : s.end].view(torch.float32), blocksize=s.blocksize, quant_type=self.quant_types[i]
        )

    def put(self, i: int, p: Packed) -> None:
        s, h = self.specs[i], self.host
        if p.nested != s.nested or p.blocksize != s.blocksize or p.data.numel() != (s.numel + 1) // 2:
            raise QuantError(f"{self.names[i]}: its 4-bit weight is not laid out as planned")
        nb = h.is_pinned()  # from a GPU: without waiting (build_units synchronizes before the buffer is read)
        h[s.data : s.data + p.data.numel()].copy_(p.data.reshape(-1), non_blocking=nb)
        if s.nested:
            assert p.absmax2 is not None and p.code2 is not None  # a nested one's second-level scales (checked above)
            h[s.absmax : s.absmax + s.blocks].copy_(p.absmax.reshape(-1).view(torch.uint8), non_blocking=nb)
            h[s.absmax2 : s.code2].view(torch.float32).copy_(p.absmax2.reshape(-1), non_blocking=nb)
            h[s.code2 : s.end].view(torch.float32).copy_(p.code2.reshape(-1), non_blocking=nb)
            self.offsets[i] = p.offset
        else:
            h[s.absmax : s.end].view(torch.float32).copy_(p.absmax.reshape(-1), non_blocking=nb)
        self.quant_types[i] = p.quant_type

    def dequantize(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Each tensor's weight from the packed bytes ``src`` (the host buffer, or its copy on the device) into
        the unit's frozen layout ``dst`` (compute dtype, same device): ``Linear4bit``'s own dequantization
        (the scales first, then the codes, into the compute dtype as its training forward does)."""
        for i, s in enumerate(self.specs):
            self._one(i, src, dst[s.start : s.start + s.numel].view(s.shape))

    def _one(self, i: int, src: torch.Tensor, out: torch.Tensor) -> None:
        s = self.specs[i]
        nested = (src[s.absmax2 : s.code2].view(torch.float32), src[s.code2 : s.end].view(torch.float32))
        dequantize_into(
            src[s.data : s.data + (s.numel + 1) // 2],
            src[s.absmax : s.absmax + s.blocks] if s.nested else src[s.absmax : s.end].view(torch.float32),
            nested[0] if s.nested else None,
            nested[1] if s.nested else None,
            self.offsets[i],
            s.shape,
            s.blocksize,
            self.quant_types[i],
            out,
        )

    def linear4bit_entries(self, i: int, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Tensor ``i`` as a ``Linear4bit``'s ``state_dict`` holds it: its codes ``(numel / 2, 1)`` uint8 and
        bitsandbytes' ``QuantState.as_dict(packed=True)`` (``dtype``: the weight's, the compute dtype here)."""
        bf = bnb_functional()
        p, s = self.packed(i), self.specs[i]
        state2 = None
        if p.nested:
            assert p.absmax2 is not None and p.code2 is not None  # a nested one's second-level scales
            state2 = bf.QuantState(absmax=p.absmax2, code=p.code2, blocksize=BLOCK2, dtype=torch.float32)
        qs = bf.QuantState(
            absmax=p.absmax,
            shape=torch.Size(s.shape),
            code=bf.get_4bit_type(p.quant_type, device="cpu"),
            blocksize=p.blocksize,
            quant_type=p.quant_type,
            dtype=dtype,
            offset=torch.tensor(p.offset) if p.nested else None,
            state2=state2,
        )
        return p.data.view(-1, 1), qs.as_dict(packed=True)

    def value(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` (the unit's relative name) dequantized on the host (a merge, ``master_state_dict``)."""
        i = self.names.index(name)
        out = torch.empty(self.specs[i].shape, dtype=dtype)
        self._one(i, self.host, out)
        return out
