"""The ``zerofit`` command: its commands (commands.py), the errors it turns into messages (errors.py),
``zerofit doctor`` (doctor.py) and the relaunch under torchrun (launch.py). ``app`` and ``main`` are imported on
first use, so that the library's own use of the error messages does not import the command line's packages (typer,
rich)."""

from __future__ import annotations

from typing import Any

__all__ = ["app", "main"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("zerofit.cli.commands"), name)
    raise AttributeError(f"module 'zerofit.cli' has no attribute {name!r}")
