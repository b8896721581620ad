"""The base a PEFT run trains over, by reference: a checkpoint of such a run holds only the trainable state
(the adapters, ``modules_to_save``, their moments) beside the base model's folder and a fingerprint of its
weights; a load into an engine over another base is refused by name.

[Note: the base's fingerprint]
SHA-256 over each frozen tensor's name and shape and 64 evenly spaced values of it (fp32), read from the
engine's own host buffers of the frozen weights: the same whichever way the base was given (a model directory,
a module), cheap (a few values per tensor, not a pass over the base), and different for another model, another
size or another fine-tune of the same architecture (whose weights differ everywhere). It does not prove the
base is the same byte for byte: a base edited in a few values only would pass.
"""

from __future__ import annotations

import hashlib
import math

import torch

SAMPLES = 64


def fingerprint(engine) -> str:
    from zerofit.checkpoint.entries import named_units

    h = hashlib.sha256()
    for u, prefix in named_units(engine):
        if u.frozen is None:
            continue
        q = u.nf4.names if u.nf4 is not None else []
        for n, shape, off in zip(u.frozen.names, u.frozen.shapes, u.frozen.offsets):
            numel = math.prod(shape)
            if n in q:  # [Note: an NF4 base] (engine/model/nf4.py): its packed codes
                data = u.nf4.packed(q.index(n)).data
                h.update(f"{prefix}{n}:{tuple(shape)}:nf4;".encode())
                idx = torch.linspace(0, data.numel() - 1, min(SAMPLES, data.numel())).long()
                h.update(data[idx].numpy().tobytes())
                continue
            h.update(f"{prefix}{n}:{tuple(shape)};".encode())
            idx = torch.linspace(0, numel - 1, min(SAMPLES, numel)).long() + off
            h.update(u.frozen_host[idx].to(torch.float32).numpy().tobytes())
    return h.hexdigest()[:32]


def record(engine) -> dict:
    """What a checkpoint of a PEFT run says of its base."""
    return {
        "path": str(engine.source_dir) if engine.source_dir is not None else None,
        "fingerprint": fingerprint(engine),
        "frozen_numel": sum(u.frozen_numel for u in engine.units),
    }


def check(engine, saved: dict, folder) -> None:
    """Refuse (CheckpointMismatchError) a checkpoint trained over another base than this engine's."""
    from zerofit.checkpoint.errors import CheckpointMismatchError

    now = fingerprint(engine)
    if saved.get("fingerprint") != now:
        where = saved.get("path") or "a base not loaded from a folder"
        here = engine.source_dir or "the model given"
        raise CheckpointMismatchError(
            f"{folder}: the checkpoint holds adapters trained over another base ({where}, fingerprint "
            f"{saved.get('fingerprint')}); this engine's base is {here} (fingerprint {now}): resume over the base "
            f"it was trained from (--model {where})"
        )
