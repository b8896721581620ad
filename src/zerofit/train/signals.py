"""Ctrl-C and SIGTERM in a training run: finish the step, save, exit 130 or 143; a second one stops at once.

[Note: signals of a run]
SIGINT (Ctrl-C) and SIGTERM (what schedulers, ``timeout`` and ``docker stop`` send, usually with a grace
period before SIGKILL) mean the same to a run: stop, keeping what was trained. :class:`RunSignals` holds both
for the life of :func:`zerofit.train.run_training`, in three phases:

* start-up (reading the model, tokenizing, building the engine, loading a checkpoint): nothing is trained
  yet, so the first signal stops at once (:class:`StopNow`). What start-up writes is either atomic or a
  cache (the checkpoint commit protocol, ``datasets``' own cache), so the folder stays one that ``--resume``
  accepts; the engine and its swap file are released on the way out.
* training: the first signal only asks the loop to stop after the current step, which then completes, so the
  state is a whole number of steps and the checkpoint saved next is bitwise the state an uninterrupted run
  had at that step (the engine's own deferral, which can also drop a step that has not begun its updates,
  [Note: Ctrl-C inside a step] in engine/lifecycle.py, rolls speculative updates back only to fp32 rounding;
  a run keeps its resume bitwise by finishing). The run saves, closes the engine (the disk tier's swap file
  is removed) and exits with ``128 + signal``: 130 for SIGINT, 143 for SIGTERM.
* the second signal, in any phase: :class:`StopNow` at once, wherever the run is (a step in progress is
  dropped or, if its updates had begun, fails the engine; a save in progress is abandoned whole, so
  ``latest`` still names the previous checkpoint). The run skips the engine's orderly close (which would
  finish pending updates and copy weights back), so its resources are released by the engine's finalizer
  as the process exits: the CPU optimizer thread stops after its current task, the swap file is removed. A
  third signal exits at once (``os._exit``); the swap file is then left for the next run in that folder,
  which removes it ([Note: swap files are reused, never leaked], engine/disk/tier.py).

Signal handlers can only be installed from the main thread; elsewhere (a run started from a thread) the
process's own handlers stay.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)
PAUSE_ENV = "ZEROFIT_TRAIN_PAUSE_AT"
PHASES = ("data", "engine")
"""Test seams of a run's start-up (:func:`reached`): data: the tokenizer loaded, the data about to be read and
tokenized; engine: the engine built (its swap file reserved), before a resume's load."""


def reached(phase: str) -> None:
    """A run's start-up reached ``phase``: stop this process here (SIGSTOP) if a test asked for it, so that the
    test can signal it at that exact point (as ``zerofit.checkpoint.seams.reached`` does for a save)."""
    if os.environ.get(PAUSE_ENV) == phase:
        os.kill(os.getpid(), signal.SIGSTOP)


def name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def exit_status(signum: int) -> int:
    """The shell's status of a process stopped by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


class StopNow(KeyboardInterrupt):
    """A signal stopped the run at once (during start-up, or a second signal). ``signum``: which one."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class RunSignals:
    """SIGINT and SIGTERM during a run: see [Note: signals of a run]. ``say`` prints a line."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.signum = 0  # the first signal that asked the run to stop; 0: none
        self.training = False  # past start-up: the first signal waits for the end of the step
        self._stopping = False  # StopNow was raised: one more signal exits at once
        self._previous: dict[int, object] = {}

    def __enter__(self) -> RunSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handler(self, signum, frame) -> None:
        if self._stopping:  # StopNow is on its way out: this one ends the process
            os._exit(exit_status(signum))
        if not self.training:  # start-up: nothing to keep
            self._stopping, self.signum = True, signum
            raise StopNow(signum, f"{name(signum)} during start-up: stopped; nothing was trained")
        if self.signum:  # the second
            self._stopping = True
            raise StopNow(signum, f"{name(signum)} again: stopped at once, without saving")
        self.signum = signum
        self.say(
            f"[yellow]{name(signum)}: finishing this step, then saving a checkpoint and stopping "
            f"(exit {exit_status(signum)}; {name(signum)} again stops at once, without saving)[/]"
        )


def _exit_now(signum, frame) -> None:
    os._exit(exit_status(signum))


def exit_at_once() -> None:
    """From now on SIGINT and SIGTERM end the process at once with 130 / 143: for a command whose run is over
    and which is exiting (its summary printed, the interpreter's exit, the engine's finalizer)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _exit_now)


class exit_on_signal:
    """SIGINT and SIGTERM end the process at once with 130 / 143 (``os._exit``): for the stretches of a
    command around a run that hold nothing to save or release (imports before it, the summary after it, the
    interpreter's exit), where Python's own handling would end it by the signal itself (status -2, or -15
    for SIGTERM) or with a traceback. A run installs :class:`RunSignals` inside it. Restored on exit."""

    def __enter__(self) -> exit_on_signal:
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, _exit_now) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
