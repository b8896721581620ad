"""What the command's modules share: exit statuses, the precision option, one-line failures."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from zerofit import errors
from zerofit.cli import errors as cli_errors
from zerofit.demo.options import DemoOptions

DEFAULT = DemoOptions()

EXIT_FAILED = errors.EXIT_FAILED  # a run that cannot go on: its folder in use, its checkpoints refused
EXIT_BAD_CONFIG = errors.EXIT_BAD_INPUT
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT (143: SIGTERM, 128 + its number)


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class KernelsChoice(str, Enum):
    auto = "auto"
    exact = "exact"
    fast = "fast"


def fail(console: Console, message: str, status: int = EXIT_BAD_CONFIG) -> None:
    handled = sys.exc_info()[1]
    if handled is not None and cli_errors.debug_requested():
        raise handled  # --debug: the error being reported, with its traceback
    # Text: a message with [brackets] is not markup; soft_wrap: no line breaks inside names; one line
    console.print(Text(cli_errors.one_line(message), style="bold red"), soft_wrap=True)
    raise typer.Exit(status)


def fail_on(err: Exception, *, output: Path | None = None, resume: bool = False) -> None:
    """``err`` as one line on stderr, and its exit status ([Note: one line per error])."""
    code, message = cli_errors.describe(err, output=output, resume=resume)
    Console(stderr=True).print(Text(message, style="bold red"), soft_wrap=True)
    raise typer.Exit(code) from None
