"""The loops alive in the process: where the optimizer's hooks (optimizer.py) and the patched callables (patches.py)
find the loop of an optimizer's, a clip's or a module's parameters ([Note: the process-wide patches]). The one state
the package's modules share; a loop adds itself when it is built (loop.py)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerofit.userloop.loop import UserLoop

# every loop alive in the process: the process-wide hooks and patches do nothing while it is empty
LIVE: weakref.WeakSet[UserLoop] = weakref.WeakSet()


def loop_of(params) -> UserLoop | None:
    """The live loop holding any of ``params`` (None: none does, as for every optimizer while no loop lives)."""
    ids = {id(p) for p in params}
    for loop in list(LIVE):
        if ids & loop.params:
            return loop
    return None


def offering() -> UserLoop | None:
    """The one live loop at the start of an accumulation window that a loader's read-ahead could serve ([Note: the
    loop's loader reads the window ahead], loop.py); None where none is, or several are (whose batches would be
    unknown)."""
    ready = [loop for loop in list(LIVE) if loop.face.can_offer()]
    return ready[0] if len(ready) == 1 else None
