"""``python -m zerofit.cli``: the ``zerofit`` command."""

from zerofit.cli.commands import main

main()
