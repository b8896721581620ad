"""The engine's state as checkpoint entries (a leaf of checkpoint/: state.py, deepspeed_load.py, export.py and
lora/ read it): each unit with its names' prefix, the weights and moments as entries pointing into the units'
buffers, and the config fields whose change breaks an exact resume."""

from __future__ import annotations

import torch

from zerofit.checkpoint.errors import CheckpointStateError
from zerofit.checkpoint.format import Entry

MOMENTS = ("exp_avg", "exp_avg_sq")
# config fields whose change breaks an exact resume (a warning, not an error: changing them can be intended)
RESUME_FIELDS = (
    "precision",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "fp16",
    "micro_batch_size",
    "gradient_accumulation_steps",
)


def named_units(engine):
    """(unit, name prefix) in execution order: the shell (no prefix), then block i (``adapter.block_prefix(i).``)."""
    return [(u, "" if u.index < 0 else engine.adapter.block_prefix(u.index) + ".") for u in engine.units]


def weight_entries(engine, dtype: torch.dtype = torch.float32, frozen: bool = True) -> list[Entry]:
    """The fp32 master weights, one entry per canonical parameter, pointing into the units' buffers; with
    ``frozen`` the frozen parameters' weights too, after each unit's trained ones ([Note: frozen parameters],
    engine/memory/store.py)."""
    out = []
    for u, p in named_units(engine):
        if frozen and u.nf4 is not None:  # [Note: an NF4 base] (engine/model/nf4.py): no 16-bit copy to point at
            raise CheckpointStateError(
                f"{u.name}: its frozen weights are held in NF4 (quantize_base: nf4, or a 4-bit model): a checkpoint "
                "or export with the frozen weights is not written from them; save the trained state "
                "(exclude_frozen_parameters=True; a PEFT model's checkpoints do so), the adapter "
                "(engine.save_pretrained), or a merged model into the dequantized base (zerofit export --merge)"
            )
        parts = [(u.layout, u.master)] + ([(u.frozen, u.frozen_host)] if frozen and u.frozen is not None else [])
        out += [
            Entry(p + n, tuple(s), dtype, base, o)
            for layout, base in parts
            for n, s, o in zip(layout.names, layout.shapes, layout.offsets)
        ]
    return out


def optimizer_entries(engine) -> list[Entry]:
    """``<param>.exp_avg`` then ``<param>.exp_avg_sq`` per unit: each unit's moments go out as two long runs
    (cut where parameter groups interleave in the model's order)."""
    return [
        Entry(f"{p}{n}.{m}", tuple(s), torch.float32, getattr(u, m), o)
        for u, p in named_units(engine)
        for m in MOMENTS
        for n, s, o in zip(u.layout.names, u.layout.shapes, u.layout.offsets)
    ]
