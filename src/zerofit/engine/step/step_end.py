"""The end of an optimizer step, one sequence for every door (a part: ``engine.step_end``).

[Note: one end of a step]
Whichever door ends a step (``train_batch``; the DeepSpeed-shaped loop's ``step()`` at its boundary; the user's own
loop's ``optimizer.step()``, after a clip or a GradScaler's unscale may have come between), its end is the same:
the window closes (its held backward runs; :meth:`~zerofit.engine.step.window.Window.before_step`), the step is
prepared (every gradient complete, the norm, the clip factor, an fp16 overflow: ``Step.prepare``), then applied
(the updates: ``Step.apply``) or skipped (its gradients dropped), the window starts over, and the engine counts
the step and closes its timeline (``Engine.end_step``). ``train_batch`` has no window: ``windowed=False``. The
caller holds the engine's guard."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerofit.engine.step.optimizer_step import Prepared, Step
    from zerofit.engine.step.window import Window


class StepEnd:
    def __init__(self, stepper: Step, window: Window, ended: Callable[[bool, float | None], None]) -> None:
        self.stepper, self.window = stepper, window
        self.ended = ended  # (applied, norm): the engine counts the step and closes its timeline

    def prepare(self, windowed: bool = True) -> Prepared:
        """The window closed, the step up to its updates."""
        if windowed:
            self.window.before_step()
        return self.stepper.prepare()

    def apply(self, prepared: Prepared, windowed: bool = True, before_end: Callable[[], object] | None = None) -> None:
        """The prepared step's updates; the window starts over; ``before_end()`` (a read of the step's loss) runs
        before the engine closes the step's timeline."""
        applied, norm = self.stepper.apply(prepared)
        if windowed:
            self.window.stepped()
        if before_end is not None:
            before_end()
        self.ended(applied, norm)

    def skip(self, prepared: Prepared, windowed: bool = True) -> None:
        """A prepared step not applied (a GradScaler found an overflow): its gradients dropped (a speculation's
        work undone first)."""
        if prepared.spec is not None:
            self.stepper.drop(prepared.spec)
        self.stepper.discard_grads()
        if windowed:
            self.window.stepped()
        self.ended(False, prepared.norm)

    def finish(self, windowed: bool = True, before_end: Callable[[], object] | None = None) -> None:
        """Prepared and applied at once (no clip or unscale between)."""
        self.apply(self.prepare(windowed), windowed, before_end)
