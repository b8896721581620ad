"""One AdamW step (or its undoing, or one of its two passes) on a unit's state, each parameter group with its own
hyperparameters: the one entry for every update and rollback of the engine."""

from __future__ import annotations

import torch

from zerofit.engine.update import split_adamw
from zerofit.engine.update.adamw import adamw_flat, adamw_rollback
from zerofit.optim.hyper import Hyper


def unit_adamw(
    unit,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hypers: tuple[Hyper, ...],
    factor: float = 1.0,
    *,
    start: int = 0,
    inverse: bool = False,
    part: str | None = None,
    out16: torch.Tensor | None = None,
    threads: int | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One AdamW step (``inverse``: its undoing, :func:`adamw_rollback`) on a unit's state, each parameter group
    with its own hyperparameters. Every update and rollback of the engine goes through here.

    The tensors hold the unit's flat elements ``[start, start + master.numel())``: the whole unit, or a chunk
    of it (assisted updates); ``hypers[g]`` is group ``g``'s. A segment of the unit (see [Note: segments per
    unit] in store.py) that the range cuts is updated on its part inside the range.

    [Note: one step per unit]
    The fused kernel increments the ``step`` it is given, and the bias corrections read it. Every segment
    must see the same starting step, so each segment's call gets its own copy and the unit's ``step`` advances
    once, at the end (decreases once, for ``inverse``). A unit of one segment (no groups) is one call on the
    whole buffers with ``step`` itself, as before groups existed.

    ``part``: one of the two passes of the step ([Note: moments after the forward], split_adamw.py): "master"
    (the new master) then "moments"; or, [Note: the master behind its cast], "cast" (the new master cast into
    ``out16``, the unit's 16-bit copy over the same elements, the master left as it was) then "rest" (moments
    and master). The first pass counts the step. ``threads``: the second pass's ([Note: threads for the rest
    pass]). ``found_inf`` (one pass, not inverse): see adamw_flat; the unit's ``step`` then stays too."""
    if inverse and factor != 1.0:
        raise ValueError("a rollback undoes an update taken with factor 1 (a speculative update)")

    if (part == "cast") != (out16 is not None):
        raise ValueError("a 16-bit output goes with the cast pass, and only with it")

    def run(p, g, m, v, s, h, o):
        if inverse:
            adamw_rollback(p, g, m, v, s, h)
        elif part in ("master", "cast"):  # [Note: moments after the forward] (split_adamw.py)
            split_adamw.master_pass(p, g, m, v, s, h, factor, out16=o)
        elif part in ("moments", "rest"):
            split_adamw.rest_pass(p, g, m, v, s, h, factor, with_master=part == "rest", threads=threads)
        else:
            adamw_flat(p, g, m, v, s, h, factor, found_inf=found_inf)

    if len(unit.segments) == 1:
        run(master, grad, exp_avg, exp_avg_sq, step, hypers[unit.segments[0].group], out16)
        return
    n = master.numel()
    for seg in unit.segments:
        a, b = max(seg.offset, start) - start, min(seg.offset + seg.numel, start + n) - start
        if a < b:
            run(
                master[a:b],
                grad[a:b],
                exp_avg[a:b],
                exp_avg_sq[a:b],
                step.clone(),
                hypers[seg.group],
                None if out16 is None else out16[a:b],
            )
    if part not in ("moments", "rest"):  # the first pass counted the step
        step.add_(-1 if inverse else (1 if found_inf is None else 1 - found_inf.to(step.device)))
