"""16-bit host copies of the streamed blocks and the weights epoch they are valid in (a part).

[Note: 16-bit copies for extra forwards]
Each DeepSpeed-style forward sees one micro-batch, so a streamed block's weights cross PCIe once per
micro-batch, not once per step as in train_batch. The first forward of an accumulation window uploads
the fp32 master and casts it on the device (as always); the cast weights are then sent down into a
pinned 16-bit host copy (the download engine is idle during forwards), and the window's later forwards
and its block backward upload that copy: half the bytes, and bitwise the weights the device cast. A copy
is valid while the engine's weights epoch is the one it was taken in: the epoch moves whenever masters
may change (every optimizer step, a dropped step, a checkpoint load), and a unit whose update may
start (its gradient went down) drops its copy at once. Host memory: 2 B/param of the streamed
blocks, planned; without room the engine goes on with fp32 uploads.

[Note: 16-bit copies after the update]
With immediate updates (no clipping; bf16) a block's update also refreshes its 16-bit copy: the CPU worker
casts the new master into it right after the block's AdamW (a pass of 6 B/param, during the backward), and a
block the device updates in the backward ([Note: assisted updates in the backward], update/assisted.py) casts its
new weights there and sends them down with master and moments (2 B/param more, on the download engine). So the
next window's first forward uploads 16-bit weights too, half the bytes of the fp32 masters, bitwise what the
device's cast would give (one rounding, to nearest even, on either side). Such a copy is labelled
("after", E), E the weights epoch its update belongs to; the optimizer step's move of the epoch to E+1
makes that label the valid one, and any other move (a rolled-back step, a checkpoint load) invalidates it.
With deferred updates (clipping, fp16) only the device's share does it: its update runs in the next
window's first forward, after the step moved the epoch, and its copy is labelled with the epoch itself;
the CPU's deferred updates are on that forward's critical path and add no cast.
The cast costs the CPU about a third of an AdamW (CAST_SHARE, plan/search.py), and the CPU already paces the
backward (on a 7B model it was busy about as long as the backward computed, and with the casts longer, its
updates spilling into the next forward: docs/benchmarks.md, the DeepSpeed-shaped loop), so with the copies the device
takes a larger share of the updates (copies_fraction: 0.375 -> 0.53, unless offload.assisted_fraction is set): the CPU's
busy time stays what it was, the copy engines take the rest; the blocks it takes on get their moments moved into pinned
memory once. Its AdamW rounds unlike the CPU's, so the loop then matches train_batch at fp32 rounding (bitwise with the
same split). train_batch keeps no copies: unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from zerofit.engine.memory.store import CopyLabel, Home, HostArena, Unit
from zerofit.engine.plan.search import PlanError, copies_fraction

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.engine.device import Device, Event
    from zerofit.engine.distributed.ranks import Ranks
    from zerofit.engine.plan.engine_plan import Planning


log = logging.getLogger("zerofit")


class Copies16:
    """State: the weights ``epoch`` (moves whenever masters may change) and ``after`` (the label a copy made right
    after an update in the backward carries, valid once the step moved the epoch); ``fill``: the forward in
    progress sends its cast weights down into the copies (more forwards of its window follow); ``refused``:
    the plan had no room for the copies (asked once)."""

    def __init__(
        self,
        config: ZerofitConfig,
        dtype: torch.dtype,
        dev: Device,
        ranks: Ranks,
        planning: Planning,
        blocks: list[Unit],
        arenas: list,
        deferred: bool,
    ) -> None:
        self.config, self.dtype, self.dev, self.ranks = config, dtype, dev, ranks
        self.planning, self.blocks, self.arenas, self.deferred = planning, blocks, arenas, deferred
        self.epoch = 0  # bumped whenever masters may change
        self.after: tuple[str, int] | None = None  # the label valid after the last step's bump
        self.fill = False
        self.refused = False

    def valid(self, unit: Unit) -> bool:
        """Whether ``unit.host16`` holds the weights the master holds now."""
        e = unit.copy16.epoch
        return unit.host16 is not None and (e == self.epoch or (e is not None and e == self.after))

    def weights_changed(self) -> None:
        """Masters may change other than by the optimizer step (a rollback, a checkpoint load): every 16-bit
        host copy goes stale, those made after an update too."""
        self.epoch += 1
        self.after = None

    def weights_loaded(self) -> None:
        """A checkpoint load wrote the masters: the 16-bit host copies of the old weights go stale."""
        self.weights_changed()

    def step_moves(self) -> None:
        """The optimizer step changes the weights from here; the copies made right after its updates are the ones
        valid now."""
        self.after = ("after", self.epoch)
        self.epoch += 1

    def label(self, unit: Unit, now: bool = False) -> CopyLabel | None:
        """The label of a 16-bit copy made right after this unit's update, or None when none is made: one valid
        from the coming optimizer step's move of the weights epoch (an update during the backward), or with
        ``now``, valid at once (a deferred update, after that move)."""
        # (no copies with several ranks: possible())
        if unit.host16 is None or unit.swap is not None or not self.config.offload.copies_after_update:
            return None
        return self.epoch if now else ("after", self.epoch)

    @contextlib.contextmanager
    def filling(self, fill: bool):
        """Within the block (a forward with more forwards of its window to come: ``fill``), the uploads send their
        cast weights down into the copies."""
        self.fill = fill
        try:
            yield
        finally:
            self.fill = False

    def filled(self, unit: Unit, event: Event) -> None:
        """A forward sent ``unit``'s cast weights down into its copy (the download's ``event``): valid in this
        epoch."""
        unit.copy16.made(self.epoch, event)

    def stale(self, unit: Unit) -> None:
        """The unit's update may start now: its 16-bit copy goes stale."""
        unit.copy16.epoch = -1

    def possible(self) -> bool:
        """Whether the streamed blocks could have copies they do not have yet (16-bit compute, one rank)."""
        streamed = [u for u in self.blocks if u.home is Home.STREAMED and u.swap != "all"]  # "all": has one
        # several ranks upload only a shard of each block: no 16-bit host copies ([Note: sharded units])
        return (
            self.dtype != torch.float32
            and bool(streamed)
            and not self.ranks.many
            and streamed[0].host16 is None
            and not self.refused
        )

    def enable(self, device_updates) -> None:
        """Give the streamed blocks their copies, where the plan has room for them (else they stay without,
        and ``refused``); the device's updates then cast their new weights for them too."""
        changes = {}
        off = self.config.offload
        if off.copies_after_update and not self.deferred and "assisted_fraction" not in off.model_fields_set:
            # [Note: 16-bit copies after the update]: the device takes a larger share of the updates
            changes["assisted_fraction"] = copies_fraction(off.assisted_fraction)
        try:
            self.planning.adopt_host16(**changes)
        except PlanError as e:
            self.refused = True
            log.info(
                "zerofit: no room for 16-bit host copies of the streamed blocks (%s); DeepSpeed-style "
                "forwards upload fp32 weights",
                e,
            )
            return
        streamed = [u for u in self.blocks if u.home is Home.STREAMED and u.swap != "all"]
        a = HostArena(sum(u.numel for u in streamed), self.dtype, self.dev.is_cuda and off.pin_memory)
        self.arenas.append(a)
        for u in streamed:
            u.host16, u.copy16.epoch = a.take(u.numel), -1
        device_updates.cast_for_copies(self.blocks)
