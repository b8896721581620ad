"""How a rank's failure reaches the others (a face the ``Ranks`` dataclass inherits: its state is Ranks' own
``failed_key``, ``_stop``, ``_beats``, ``_heard``; the monitor thread that calls ``_beat`` and ``_check_peers`` every
second is ranks.py's ``_Process``).

[Note: a failing rank]
A collective blocks until every rank joins it, so an exception on one rank would leave the others waiting
forever. An error inside a zerofit call on any rank is recorded in the process group's store (the first one
wins) and the rank goes on raising. Every rank runs a monitor thread that polls that key: when another rank
has failed, it logs the rank and the cause, gives the main thread a grace period to fail on its own (a gloo
peer that exited closes its sockets at once), and then ends the process with status 1. No rank hangs, and
each names the rank that failed first and why. The key is the engine's own (``zerofit/failed/<restart>/<n>``,
the n-th engine of several ranks in this process, the same n on every rank since every rank makes the same
engines): a failure an earlier engine recorded never fails a later one. The monitor is one thread per process,
started by the first engine of several ranks, which polls the keys of the engines open now (a weak set: an
engine closed, or dropped before it was complete, leaves it at once), so no thread outlives its engine's
worth; it is stopped and joined at exit, before the group is destroyed, never left inside a store call while
the interpreter finalizes.

[Note: a rank that dies]
A rank whose process is killed (the OOM killer, a node lost) records nothing. So each rank's monitor also beats,
every second, a counter under the engine's key (``zerofit/alive/<restart>/<n>/<rank>``, "closed" once it closes)
and notes when it last saw each other rank's move. When a collective raises because a peer went away (gloo's
closed connection, NCCL's errors), the rank watches the heartbeats for a few seconds (``_SAMPLE_S``) and records
the one that stopped as the group's failure, "rank 2 (node 1): stopped answering", before its own error could
name itself; every other rank then names it. A rank that stays blocked instead (a collective that never errors)
is ended by its monitor once a peer has been silent for ``_SILENT_S``, named so. If the group's store (rank 0's
host) is gone, rank 0 is named. A heartbeat moves while its rank computes or waits (the monitor is a thread of
its own), so only a process that is gone, or stopped whole, is taken for dead.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from zerofit.errors import ZerofitError

if TYPE_CHECKING:
    import threading

log = logging.getLogger("zerofit")

FAILED = "zerofit/failed"
_ALIVE = "zerofit/alive"
_GRACE_S = 10.0
_SILENT_S = 30.0  # a rank whose heartbeat has not moved for this long is taken for dead ([Note: a rank that dies])
_SAMPLE_S = 3.0  # after a collective's error: how long the heartbeats are watched for the one that stopped


class RankFailedError(ZerofitError, RuntimeError):
    """Another rank failed: this one cannot go on (its next collective would wait forever)."""


class RankFailures:
    """Ranks' failure methods ([Note: a failing rank], [Note: a rank that dies])."""

    if TYPE_CHECKING:  # the state of Ranks (ranks.py) these methods read: declared there, as dataclass fields
        world: int
        rank: int
        local_world: int
        failed_key: str
        _stop: threading.Event
        _beats: int
        _heard: dict

        @property
        def many(self) -> bool: ...

        @property
        def nodes(self) -> int: ...

        @property
        def who(self) -> str: ...

    # ------------------------------------------------------------------ failures: [Note: a failing rank]

    def _store(self):
        return dist.distributed_c10d._get_default_store()

    def fail(self, err: BaseException) -> None:
        """Record this rank's failure (the first failure of the group wins)."""
        if not self.many or isinstance(err, RankFailedError):
            return
        cause = f"{self.who}: {type(err).__name__}: {err}"
        try:
            self._store().compare_set(self.failed_key, "", cause)
        except Exception as e:  # noqa: BLE001 - the store may be gone already
            log.debug("zerofit: could not record the failure: %r", e)

    # ------------------------------------------------------------------ [Note: a rank that dies]

    def _alive_key(self, rank: int) -> str:
        return f"{_ALIVE}{self.failed_key[len(FAILED) :]}/{rank}"

    def _beat(self) -> None:
        """The monitor's heartbeat for this engine (every second), and what it last heard of the others."""
        try:
            self._store().set(self._alive_key(self.rank), str(self._beats))
            self._beats += 1
            self._listen()
        except Exception:  # noqa: BLE001 - the store may be gone (its host with it): _check_peers says so
            pass

    def _listen(self) -> None:
        store, now = self._store(), time.monotonic()
        for r in range(self.world):
            if r == self.rank:
                continue
            key = self._alive_key(r)
            value = store.get(key).decode() if store.check([key]) else None
            last = self._heard.get(r)
            if value is not None and (last is None or last[0] != value):
                self._heard[r] = (value, now)

    def _silent(self, after_s: float) -> list[int]:
        """The ranks whose heartbeat (once heard) has not moved for ``after_s`` seconds, and have not closed."""
        now = time.monotonic()
        return [r for r, (value, t) in sorted(self._heard.items()) if value != "closed" and now - t > after_s]

    def _name(self, rank: int) -> str:
        return f"rank {rank}" + (f" (node {rank // self.local_world})" if self.nodes > 1 else "")

    def _blame_silent(self, after_s: float) -> str | None:
        """Record the first silent rank as the failure (the first failure of the group wins); the cause, or None."""
        silent = self._silent(after_s)
        if not silent:
            return None
        quiet = time.monotonic() - self._heard[silent[0]][1]
        cause = (
            f"{self._name(silent[0])}: stopped answering (no heartbeat for {quiet:.0f} s: its process was "
            "killed or its host lost)"
        )
        try:
            self._store().compare_set(self.failed_key, "", cause)
        except Exception:  # noqa: BLE001
            pass
        return self.failure() or cause

    def _communication_error(self, err: BaseException) -> bool:
        """An error a collective raised because a peer went away (gloo's closed connection, NCCL's errors)."""
        dist_error = getattr(dist, "DistError", ())
        text = str(err)
        return isinstance(err, dist_error) or (
            isinstance(err, RuntimeError)
            and any(w in text for w in ("gloo", "Connection", "NCCL", "connection", "ProcessGroup", "Broken pipe"))
        )

    def failure(self) -> str | None:
        """The first recorded failure of any rank, or None."""
        if not self.many:
            return None
        try:
            store = self._store()
            if store.check([self.failed_key]):
                value = store.get(self.failed_key).decode()
                return value or None
        except Exception:  # noqa: BLE001
            return None
        return None

    def peer_error(self, err: BaseException) -> BaseException:
        """An error a collective raised, named after the rank that failed first when one did: one that recorded its
        error, or one that stopped answering ([Note: a rank that dies]: its heartbeat watched for a few seconds)."""
        cause = self.failure()
        if not cause and self.many and self._communication_error(err):
            deadline = time.monotonic() + _SAMPLE_S
            while not cause and time.monotonic() < deadline:
                time.sleep(0.5)
                try:
                    self._listen()
                except Exception:  # noqa: BLE001 - the store is gone: rank 0's host with it
                    cause = f"{self._name(0)}: stopped answering (the group's store, on its host, is gone)"
                    break
                cause = self.failure() or self._blame_silent(_SAMPLE_S - 1.0)
        if cause and not cause.startswith(f"{self.who}:"):
            return RankFailedError(f"another rank failed first ({cause}); this rank (rank {self.rank}) stops too")
        return err

    def _check_peers(self) -> None:
        """The monitor's poll of this engine's key: another rank's failure ends this process unless this engine
        ends (closes, or fails itself) within the grace period."""
        cause = self.failure() or self._blame_silent(_SILENT_S)
        if self._stop.is_set() or not cause or cause.startswith(f"{self.who}:"):
            return
        print(
            f"zerofit: rank {self.rank}: another rank failed ({cause}); ending this rank in "
            f"{_GRACE_S:.0f} s unless it ends by itself",
            file=sys.stderr,
            flush=True,
        )
        if self._stop.wait(_GRACE_S):
            return
        print(
            f"zerofit: rank {self.rank}: exiting (status 1) after the failure of {cause}", file=sys.stderr, flush=True
        )
        os._exit(1)
