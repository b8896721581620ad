"""Errors at the command line: one line each, with the exit status docs/cli.md promises.

[Note: one line per error]
Every error that reaches a ``zerofit`` command is printed as one line on stderr (the exception's type and
its message, which names the path or field and what to do) and exits with:

- ``2``: what was given cannot be used (a configuration, an option, a path, a model directory, a data file,
  a checkpoint to resume from, budgets no plan fits): change the command or the files and run it again;
- ``1``: the run failed while it ran (the disk filled up, an I/O error, another rank failed, the engine
  failed) or with an error zerofit did not expect (then the line says so).

No traceback, unless ``zerofit --debug COMMAND ...`` or ``ZEROFIT_DEBUG=1`` asks for one (the error is then
raised as it is). Ctrl-C keeps its own handling (exit 130).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from zerofit.errors import EXIT_BAD_INPUT, EXIT_FAILED, ZerofitError

DEBUG_ENV = "ZEROFIT_DEBUG"
_debug = {"flag": False}  # ``zerofit --debug``: set by the command group's callback, each invocation
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_BAD_PATH = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG)


def debug_flag(on: bool) -> None:
    """What ``zerofit --debug`` said, for this invocation."""
    _debug["flag"] = bool(on)


def debug_requested() -> bool:
    """``--debug`` on the command line, or ``ZEROFIT_DEBUG`` set to anything but 0/false/no/off/empty."""
    return _debug["flag"] or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def one_line(text: str) -> str:
    """A message's lines joined into one."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def describe(err: BaseException, *, output: Path | None = None, resume: bool = False) -> tuple[int, str]:
    """(exit status, one line) for ``err``. ``output``: ``zerofit train``'s run folder (an error on a path in
    it names ``--output``); ``resume``: the run was asked to ``--resume`` from ``output/checkpoints``. An error
    zerofit raises on purpose (:class:`~zerofit.errors.ZerofitError`) carries its own exit status."""
    from zerofit.checkpoint import CheckpointDiskFullError, CheckpointError
    from zerofit.engine.plan.search import PlanError

    name = type(err).__name__
    if isinstance(err, PlanError):
        return err.exit_code, f"{name}: {_plan_line(str(err))}"
    if isinstance(err, CheckpointDiskFullError):
        return err.exit_code, f"{name}: {err.one_line()}{_after_full_disk(output)}"
    if isinstance(err, CheckpointError):
        return err.exit_code, f"{name}: {err.one_line()}{_resume_advice(err, output) if resume else ''}"
    if isinstance(err, ZerofitError):
        return err.exit_code, f"{name}: {err.one_line() or '(no message)'}"
    if isinstance(err, OSError) and err.errno is not None:
        return _os_error(err, output)
    text = one_line(err) or "(no message)"
    # a step with a non-finite gradient, refused (FloatingPointError: its message says what to do); out of memory
    if isinstance(err, (MemoryError, FloatingPointError)):
        return EXIT_FAILED, f"{name}: {text}"
    return EXIT_FAILED, (
        f"{name}: {text} (an error zerofit did not expect: `zerofit --debug ...` or "
        f"{DEBUG_ENV}=1 shows its traceback; please report it)"
    )


def _os_error(err: OSError, output: Path | None) -> tuple[int, str]:
    path = err.filename
    where = f"{path}: " if path else ""
    if output is not None and path and _inside(Path(path), Path(output)):
        same = Path(path).absolute() == Path(output).absolute()
        where = f"--output {output}: " if same else f"--output {output}: {path}: "
    what = err.strerror or str(err)
    if err.errno in _NO_SPACE:
        return (
            EXIT_FAILED,
            f"{type(err).__name__}: {where}{what}: free space on that disk, or choose a folder on another",
        )
    if err.errno in _NOT_WRITABLE:
        return EXIT_BAD_INPUT, (
            f"{type(err).__name__}: {where}not writable ({what}): choose a folder this user "
            "can write to" + (" (--output DIR)" if where.startswith("--output") else "")
        )
    if err.errno in _BAD_PATH:
        return EXIT_BAD_INPUT, f"{type(err).__name__}: {where}{what}"
    return EXIT_FAILED, f"{type(err).__name__}: {where}{what} (errno {err.errno})"


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.absolute().relative_to(folder.absolute())
        return True
    except ValueError:
        return False


def _after_full_disk(output: Path | None) -> str:
    """How ``zerofit train`` goes on once there is space: from the newest checkpoint it kept, if any."""
    from zerofit.checkpoint.commit import list_tags

    if output is None:
        return ""
    tags = list_tags(Path(output) / "checkpoints")
    if tags:
        return f" Then zerofit train --resume continues from {tags[-1]}."
    return " No checkpoint of this run was saved before: run it again once there is space."


def _resume_advice(err: BaseException, output: Path | None) -> str:
    """What to do when the checkpoint ``--resume`` reads cannot be loaded: the other checkpoints there."""
    from zerofit.checkpoint import CheckpointMismatchError
    from zerofit.checkpoint.commit import list_tags

    if output is None:
        return ""
    ckpts = Path(output) / "checkpoints"
    if isinstance(err, CheckpointMismatchError):
        return (
            f" The checkpoints in {ckpts} were saved from another model: resume with the --model they were "
            "trained from, or train this one into another --output."
        )
    bad = getattr(err, "path", None)
    bad_tag = None
    if bad is not None and _inside(Path(bad), ckpts):
        parts = Path(bad).absolute().relative_to(ckpts.absolute()).parts
        bad_tag = parts[0] if len(parts) > 1 else None
    others = [t for t in list_tags(ckpts) if t != bad_tag]
    older = (
        f"resume from another checkpoint by writing its tag into {ckpts / 'latest'} (there: "
        f"{', '.join(others[-3:])}), or "
        if others
        else ""
    )
    return f" --resume cannot continue from it: {older}start over without --resume (another --output keeps this one)."


def _plan_line(text: str) -> str:
    """A planner's refusal in one line: why, and what would fit (the smallest plan's table is left to
    ``zerofit estimate``)."""
    head, _, rest = text.partition("smallest plan:")
    _, _, tips = rest.partition("what would fit:")
    line = one_line(head).rstrip("; ")
    fits = [t.strip()[2:] for t in tips.splitlines() if t.strip().startswith("- ")]
    if fits:
        line += "; what would fit: " + "; or ".join(fits)
    return line + " (zerofit estimate shows the plans)"
