"""Speculative host updates under global-norm clipping: update first, validate when the norm is known.

[Note: speculative updates]
Clipping by the global gradient norm needs every gradient before any update,
so without speculation every host update waits for the end of the backward
(deferred updates, engine.py) and can only overlap the next forward. With
speculation (SuperOffload's speculation-then-validation) the CPU worker updates
each streamed block as soon as its gradient is on the host, during the backward,
as if the clipping coefficient were 1:

* the block's squared gradient norm comes down with its gradient (a pinned
  fp64 scalar per block); the worker keeps the running sum, and stops
  speculating for the rest of the step as soon as that partial sum alone proves
  the step will be clipped (or is not finite): those blocks then wait for the
  norm as deferred updates do. Speculation tasks run first-in first-out, ahead
  of every other worker task, so the sum runs in backward order and the set of
  speculated blocks depends on the data alone, never on timing: a rolled-back
  block differs from a directly updated one by rounding, and runs must repeat
  bitwise (resume, tests);
* when the global norm is known: if the coefficient is 1 (no clipping), the
  speculative updates *are* the step, bitwise the same as a deferred update
  with factor 1; otherwise each speculated block is rolled back
  (``adamw.adamw_rollback``, the exact algebraic inverse of the fused AdamW step,
  in fp32: the restored state differs from the old one by rounding only) and
  updated again with the true factor. A non-finite norm rolls them back too.

Speculation pays when clipping is rare (fine-tuning after the first steps);
it costs a wasted update and a rollback pass when it is not, so the engine
speculates only after a step that was not clipped (and on the first step).
fp16 never speculates: its overflow steps must leave the state bitwise as it
was, which a rollback cannot promise.

[Note: updates in the backward of the user's loop]
The user's loop ([Note: the user's loop drives the engine], userloop) clips, unscales and steps after its
backward, so its host updates were all deferred to ``optimizer.step()`` and ran during the next forward, whose
first blocks waited for them. With the learnt window the held micro-batches' blocks backward is left to the call
that prepares the step (a clip, a GradScaler's unscale, or ``optimizer.step()`` itself: Window.backward). When
that call is ``optimizer.step()`` with nothing before it (no clip, no unscale, no fused ``grad_scale``: a bf16 or
fp32 loop without clipping), every factor of the step is known before any block's gradient is final: 1, and the
AdamW settings are the optimizer's now. So that backward runs as a speculation whose threshold is unbounded
(:meth:`Speculator.begin_known`): each streamed block is updated with factor 1 as its gradient comes down,
during the backward of the others, and its settle keeps it; bitwise the deferred update with factor 1, which
is torch's step. Nothing is rolled back, except for a non-finite norm (the step is refused then, the state
to rounding as before it). A loop that clips keeps its deferred updates: the clip's factor is known only
after the last gradient, and a speculated update that the clip then undid would be redone from the
rollback's state, which differs from the old one by rounding (bitwise would need a copy of every speculated
block's master and moments, one more pass over 12 bytes a parameter on the host, the tightest resource:
[Note: speculative updates]). What it speculates is the cast instead: [Note: a speculated cast].

[Note: a speculated cast]
Where the deferred updates run in two passes and the first writes only the streamed block's 16-bit host
copy ([Note: the master behind its cast], split_adamw.py), that first pass changes nothing a later update
reads: master, moments and step stay as they were. So the user's loop runs it early, in the blocks' backward
that brings the step's whole gradient down: its clip call's with the learnt window (the threshold is that
clip's ``max_norm``), the last ``backward()`` of a configured window (the last clip's: loops clip to one
norm). There a cast speculation (:meth:`Speculator.begin_cast`) has the worker run each streamed block's
cast pass with factor 1 and the step's settings as its gradient comes down, during the backward of the
others, into the block's 16-bit copy, its step counted on a copy of the unit's. At
``optimizer.step()`` a block's update then keeps that cast (counts the step, labels the copy, queues the rest
pass) when the clip left its gradient as it was (torch's factor clamped to exactly 1: nothing to multiply),
the step's factor is 1 and its settings are those the cast used; otherwise it runs its first pass again, as
without speculation, over the same untouched state. Either way the bits are the unspeculated step's; a cast
made for nothing (a clipped step, a step never taken) costs one pass of 16 bytes read and 2 written a
parameter, and the partial norm stops it once it proves the clip. A reader that changes the gradients
before the step (a second clip's multiplies, a GradScaler's unscale) waits for the casts and voids them."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Speculation:
    """One step's speculation: which blocks the worker updated early, and whether it gave up.

    Written by the worker thread (``record``) and read by the main thread only after ``worker.drain()``."""

    clip_sq: float  # gradient_clipping ** 2
    partial: float = 0.0  # sum of the squared norms seen so far (worker thread)
    abandoned: bool = False  # the partial sum proved clipping (or was not finite)
    speculated: set[int] = field(default_factory=set)  # id() of the units updated with factor 1
    lock: threading.Lock = field(default_factory=threading.Lock)
    hypers: tuple | None = None  # [Note: a speculated cast]: the settings the casts used; None: an update
    void: bool = False  # the casts may not be kept: the gradients changed before the step (main thread)

    @property
    def cast(self) -> bool:
        """[Note: a speculated cast]: the worker writes the 16-bit copies only."""
        return self.hypers is not None

    def admit(self, sq: float) -> bool:
        """Add a block's squared norm; True if its update may still go ahead with factor 1."""
        with self.lock:
            if self.abandoned:
                return False
            self.partial += sq
            if not math.isfinite(self.partial) or self.partial > self.clip_sq:
                self.abandoned = True
                return False
            return True

    @staticmethod
    def usable(beta1: float, beta2: float) -> bool:
        """The rollback divides by beta1 and beta2."""
        return beta1 > 0.0 and beta2 > 0.0


class Speculator:
    """Whether each step's host updates speculate (a part of the engine's step that outlives the units).

    State: ``can`` (clipping without fp16, speculation on, every group's betas positive: the rollback divides by
    them), ``next`` (the last step was not clipped, or there was none: the next one speculates), ``current``
    (the step in progress's :class:`Speculation`, from its backward's start to its settling) and ``stats``
    (steps held, rolled back, and waited: the ones that did not speculate after a clipped one). ``known``: the
    user's loop may update in the backward where a step's factor is known, ``known_steps`` counts them ([Note:
    updates in the backward of the user's loop]); ``cast``: its steps may cast in the backward (``cast_hypers``:
    the step's settings, set when the user's loop starts), ``cast_steps`` counts them ([Note: a speculated
    cast])."""

    def __init__(self, clip: float, can: bool, known: bool = False, cast: bool = False):
        self.clip_sq, self.can, self.known, self.cast = clip**2, can, known, cast  # cast: the policy allows it
        self.next = True
        self.current: Speculation | None = None
        self.stats = {"held": 0, "rolled_back": 0, "waited": 0}
        self.known_steps = 0  # the user's loop's steps updated in their backward (also counted as held)
        self.cast_steps = 0  # the user's loop's steps whose casts ran in their backward
        self.cast_hypers: Callable[[], tuple] | None = None  # the step's settings now: the user's loop casts
        self.cast_limit = math.inf  # the last clip's max_norm: a cast past it is made for nothing

    def norm_taken(self, clipped: bool) -> None:
        """The step's global norm is known: after a clipped step the next one waits for its norm."""
        self.next = not clipped

    def resume(self, next_speculates: bool) -> None:
        """A checkpoint's record of whether the step after it speculates (its save's ``next``)."""
        self.next = next_speculates

    def begin(self, streaming: bool, whole: bool = True) -> None:
        """Before a step's block backward: whether its host updates speculate (or, under the user's loop, its
        casts, where ``whole``: the step's whole gradient comes down in it: [Note: a speculated cast])."""
        if self.can and streaming:
            if self.next:
                self.current = Speculation(self.clip_sq)
            else:
                self.stats["waited"] += 1
        elif whole:
            self.begin_cast(streaming)

    def begin_known(self, streaming: bool) -> bool:
        """The user's loop, before a backward whose step's factor is known to be 1: its host updates run in it
        ([Note: updates in the backward of the user's loop]). Whether it began."""
        if not (self.known and streaming) or self.current is not None:
            return False
        self.current = Speculation(math.inf)
        self.known_steps += 1
        return True

    def begin_cast(self, streaming: bool, max_norm: float | None = None) -> bool:
        """The user's loop, before a blocks' backward (the one its clip call runs, to ``max_norm``; else the
        last clip's, as loops clip to one norm): the streamed blocks' casts run in it, with the step's settings now
        ([Note: a speculated cast]). Whether it began."""
        if max_norm is not None:
            self.cast_limit = float(max_norm)
        if self.cast_hypers is None or not streaming or self.current is not None:
            return False
        self.current = Speculation(self.cast_limit**2, hypers=tuple(self.cast_hypers()))
        self.cast_steps += 1
        return True

    def take(self) -> Speculation | None:
        """The step in progress's record, for its end (or its discard); the next step begins without one."""
        spec, self.current = self.current, None
        return spec

    def settled(self, clipped: bool) -> None:
        """The speculative step was kept (held) or rolled back and redone with the true factor."""
        self.stats["rolled_back" if clipped else "held"] += 1
