"""A barrier that says which collective it is and fails when a rank does not come.

[Note: engine.module is a collective]
With several ranks, ``engine.module`` returns the model whose parameters view the host state every rank of
the host shares ([Note: sharded units], ranks.py): the whole tensors are there, but each rank's CPU worker
applies the last update to its own shard, and only that rank knows when it is done; units whose state is
sharded over the GPUs are gathered from every GPU. So reading it is a collective: every rank applies its
updates, then all go on together. A script that reads it on one rank only (``if rank == 0:
model = engine.module``) used to wait in a plain barrier for the other ranks, silently, until the process
group's timeout (600 s). The wait is now a barrier in the process group's store that knows its name: it
waits at most ``MODULE_WAIT_S`` (``ZEROFIT_COLLECTIVE_WAIT_S``; never longer than the group's timeout),
stops at once when another rank failed, and then raises :class:`CollectiveMismatchError` naming the call,
the ranks that did not make it and what to do; the engine then fails on that rank, which ends the other
ranks too ([Note: a failing rank]).

Why not read it without a collective: the data is local (shared memory) only for units updated on the host,
and even there whether another rank's worker has finished its shard is known to that rank alone; it would
have to publish its progress from its worker, and a GPU-sharded unit would still need the gather. A named,
bounded barrier keeps the one meaning (every rank's updates applied) at the cost of every rank calling it,
as DeepSpeed's ZeRO-3 parameters need every rank's GatheredParameters.
"""

from __future__ import annotations

import os
import time

from zerofit.engine.distributed.rank_failures import RankFailedError
from zerofit.errors import ZerofitError

MODULE_WAIT_S = 30.0
WAIT_ENV = "ZEROFIT_COLLECTIVE_WAIT_S"
_calls: dict[str, int] = {}  # per name, in this process: the same sequence on every rank


class CollectiveMismatchError(ZerofitError, RuntimeError):
    """A collective of the engine that some ranks did not call (in time): each would wait for the others."""


def wait_s(group_timeout_s: float) -> float:
    """How long a named barrier waits for the other ranks: ``ZEROFIT_COLLECTIVE_WAIT_S`` or MODULE_WAIT_S, at
    most the process group's own timeout."""
    value = os.environ.get(WAIT_ENV, "").strip()
    try:
        chosen = float(value) if value else MODULE_WAIT_S
    except ValueError:
        raise ValueError(f"{WAIT_ENV}={value!r}: expected seconds, such as 30") from None
    return max(0.0, min(chosen, group_timeout_s))


def named_barrier(ranks, what: str, timeout_s: float) -> None:
    """Every rank of ``ranks`` calls ``what`` (e.g. ``"engine.module"``) here: wait for them all through the
    store, at most ``timeout_s``; :class:`CollectiveMismatchError` naming the absent ranks after that,
    :class:`RankFailedError` at once when another rank failed. One process: nothing."""
    if not ranks.many:
        return
    n = _calls.get(what, 0)
    _calls[what] = n + 1
    key = f"zerofit/collective/{what}/{n}"
    store = ranks._store()
    store.set(f"{key}/rank{ranks.rank}", "1")
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while arrived < ranks.world:
        cause = ranks.failure()
        if cause and not cause.startswith(f"{ranks.who}:"):
            raise RankFailedError(f"another rank failed first ({cause}); this rank (rank {ranks.rank}) stops too")
        if time.monotonic() >= deadline:
            absent = [r for r in range(ranks.world) if not store.check([f"{key}/rank{r}"])]
            raise CollectiveMismatchError(
                f"{what} is a collective with {ranks.world} ranks (every rank applies its shard of the updates "
                f"first): rank {ranks.rank} waited {timeout_s:g} s and rank{'s' if len(absent) > 1 else ''} "
                f"{', '.join(map(str, absent))} did not read it. Read {what} on every rank at the same point of "
                f"the script (then use it on one: `model = engine.module` before `if rank == 0:`); if a rank is "
                f"only slower to get there, set {WAIT_ENV} to more seconds"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = store.add(key, 0)
