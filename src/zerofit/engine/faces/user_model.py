"""The user's own model object between steps: the engine's module, read as the user reads it (a part of no state)."""

from __future__ import annotations

from zerofit.engine.lifecycle import EngineState


def current_for_reads(engine_ref):
    """A forward and state_dict pre-hook for the model (see the note).

    [Note: a read of the user's model]
    The module's parameters are views of the engine's host weights, which a step leaves behind until its updates
    land: the host's AdamW runs on the optimizer thread (deferred to the next forward where the plan defers them),
    a device-optimized unit's host mirror is copied back only when read. ``engine.module`` waits for both; the
    user's own object (the model they passed, called directly: an evaluation, ``generate``) is the same module, so
    a forward pre-hook on it does the same wait before a call the engine does not make itself (``Compute.calling``
    counts those), while the engine is open, and so does a ``state_dict`` pre-hook (``save_pretrained``'s). A read
    between two steps then sees the last step's weights, never a half-written update (the optimizer thread writing
    the masters the forward reads). Holds the engine weakly, and is removed at close, when the final weights are in
    place. One process only: with several ranks the wait is a collective ([Note: engine.module is a collective]),
    which a read on one rank (an evaluation on rank 0) would hang, so there the read goes through
    ``engine.module`` on every rank, as before (docs/ranks.md)."""

    def hook(module, *_):
        engine = engine_ref()
        if engine is None or engine.state is not EngineState.OPEN or engine.compute.calling or engine.ranks.many:
            return
        _ = engine.module  # the pending updates applied, the host mirrors current

    return hook
