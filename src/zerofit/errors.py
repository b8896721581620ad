"""The base of every error zerofit raises on purpose ([Note: one line per error], cli/errors.py).

A :class:`ZerofitError` says in its message what was found and what to do, and knows how a command ends on it:
``exit_code`` 2 when what was given cannot be used (a configuration, an option, a path, a model, data, a
checkpoint, budgets no plan fits: change them and run again), 1 when the run failed while it ran (the disk, another
rank, the engine). Each class keeps the builtin base it had (``ValueError``, ``RuntimeError``, ``OSError``...), so
code that catches those still does. The lowest floor of the house: it imports nothing of zerofit."""

from __future__ import annotations

EXIT_FAILED = 1  # the run failed while it ran
EXIT_BAD_INPUT = 2  # what was given cannot be used


class ZerofitError(Exception):
    """An error zerofit raises on purpose; ``exit_code``: the command's exit status on it."""

    exit_code: int = EXIT_FAILED

    def one_line(self) -> str:
        """The message as the command prints it: its lines joined into one."""
        return " ".join(part.strip() for part in str(self).splitlines() if part.strip())


class InputError(ZerofitError):
    """What was given cannot be used: the command exits 2."""

    exit_code = EXIT_BAD_INPUT
