"""The ``zerofit`` command's entry point: the command line's own dependencies (typer, rich: the ``cli`` extra) are
not the library's, so a library-only install says what to add instead of failing on an import."""

from __future__ import annotations

import sys

CLI_PACKAGES = ("typer", "rich", "click")


def main() -> None:
    try:
        from zerofit.cli import main as cli_main
    except ModuleNotFoundError as e:
        if e.name not in CLI_PACKAGES:
            raise
        sys.exit(
            f"zerofit: the command line needs {e.name}, which the library alone does not install: "
            "pip install 'zerofit[cli]'"
        )
    cli_main()
