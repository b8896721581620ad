"""The run folder: one run holds it, and where ``--resume`` continues (never by destroying a checkpoint).

[Note: where a run starts]
Decided before the model is read, from ``OUTPUT/checkpoints/`` alone (:func:`plan_start`):

* ``--resume`` and ``latest`` present: the checkpoint it names (the load verifies it and refuses a broken
  one, naming the file: nothing falls back silently past a checkpoint the run said was its newest).
* ``--resume`` without ``latest`` (it was deleted, or the folder was copied without it): the newest
  complete checkpoint, newest by the global step its commit record holds (not by file times, which a copy
  or a restore changes), and the run says so; two complete ones at the same step are ambiguous and refused
  with their tags. Tag folders that are not complete are named and never used.
* ``--resume`` with no checkpoint at all (the run was stopped before its first save: no ``checkpoints/``,
  or only a killed save's hidden temporary folder): a fresh start, with a line saying there was nothing to
  resume. Only incomplete tag folders and no ``latest``: refused, naming them (a person should look).
* no ``--resume`` but complete checkpoints there: refused. A fresh run would save the same tags over the
  earlier run's checkpoints and append to its metrics.

Pruning (``--keep``) never deletes the checkpoint the run started from, nor any complete checkpoint that was
there before the run started and is at least as new as it (:attr:`StartPlan.protect`): whatever a resume
chose, the checkpoints it passed over stay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from zerofit.checkpoint.commit import LATEST, Found, read_latest, survey
from zerofit.checkpoint.lock import RUN_LOCK, FolderLock, hold
from zerofit.errors import ZerofitError

RUN_ADVICE = "wait for it or choose another --output"


class RunFolderError(ZerofitError, RuntimeError):
    """The run folder's checkpoints do not allow this start (see [Note: where a run starts]); the message
    says what was found and what to do. ``exit_status``: the CLI's (1: the folder's state, 2: an option)."""

    def __init__(self, message: str, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = self.exit_code = exit_status


def hold_run_folder(output: Path | str, command: str | None = None) -> FolderLock:
    """Hold the run folder ``output`` for this run ([Note: one writer per folder], checkpoint/lock.py), or
    raise :class:`~zerofit.checkpoint.lock.FolderInUseError` naming the run that holds it."""
    return hold(output, RUN_LOCK, what="zerofit train", advice=RUN_ADVICE, command=command)


@dataclass(frozen=True)
class StartPlan:
    """Where a run starts: ``tag`` None with ``resume`` True means ``latest``; ``resume`` False: from the
    model directory. ``note``: the line to print (None: nothing to say)."""

    resume: bool
    tag: str | None = None
    step: int = 0
    note: str | None = None
    protect: frozenset[str] = field(default_factory=frozenset)
    found: tuple[Found, ...] = ()


def _listing(found: list[Found]) -> str:
    return ", ".join(f"{f.tag} (step {f.step})" if f.complete else f"{f.tag} ({f.problem})" for f in found)


def plan_start(ckpt_dir: Path, resume: bool) -> StartPlan:
    """See [Note: where a run starts]."""
    found = survey(ckpt_dir)
    complete = [f for f in found if f.complete]
    latest = read_latest(ckpt_dir) if ckpt_dir.is_dir() else None
    if not resume:
        if complete:
            raise RunFolderError(
                f"{ckpt_dir} holds checkpoints of an earlier run ({_listing(complete)}): continue it with "
                "--resume, or choose another --output (a new run would save over them)",
                exit_status=2,
            )
        return StartPlan(False, found=tuple(found))
    if latest is not None:
        at = next((f for f in complete if f.tag == latest), None)
        step = at.step if at is not None else 0
        return StartPlan(True, None, step, None, _protect(complete, latest, step), tuple(found))
    if not found:
        return StartPlan(
            False,
            note=f"--resume: nothing to resume in {ckpt_dir} (no checkpoint was saved "
            "before the run stopped); starting from the model directory",
        )
    if not complete:
        raise RunFolderError(
            f"--resume: {ckpt_dir} has no {LATEST!r} and no complete checkpoint, only {_listing(found)}: "
            f"nothing to resume from. Remove {ckpt_dir} to start over, or restore a complete checkpoint"
        )
    newest = complete[-1]
    tied = [f.tag for f in complete if f.step == newest.step]
    if len(tied) > 1:
        raise RunFolderError(
            f"--resume: {ckpt_dir} has no {LATEST!r}, and {len(tied)} complete checkpoints are at step "
            f"{newest.step}: {', '.join(tied)}. Write the tag to resume from into {ckpt_dir / LATEST}"
        )
    note = (
        f"--resume: {ckpt_dir / LATEST} is missing; resuming from {newest.tag}, the newest complete "
        f"checkpoint by global step (found {_listing(found)})"
    )
    return StartPlan(True, newest.tag, newest.step, note, _protect(complete, newest.tag, newest.step), tuple(found))


def _protect(complete: list[Found], start: str, step: int) -> frozenset[str]:
    return frozenset({start} | {f.tag for f in complete if f.step >= step})
