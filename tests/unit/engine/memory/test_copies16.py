"""Copies16 (memory/copies16.py): which weights a streamed block's 16-bit host copy holds (``Unit.copy16``), through the
part's own methods ([Note: 16-bit copies for extra forwards], [Note: 16-bit copies after the update]): a copy filled
in this epoch is valid until the weights move, one made right after an update becomes valid with the step's move
and with no other, and a unit whose update may start drops its own."""

from __future__ import annotations

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.memory.store import Home

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def engine():
    torch.manual_seed(0)
    cfg = {"device": "cpu", "precision": "bf16", "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    cfg |= {"offload": {"resident_blocks": 0, "prefetch_depth": 1}}
    e = zerofit.initialize(tm.llama(layers=3, tied=False), cfg)
    yield e
    e.close()


def _with_copy(engine):
    """A streamed block given a 16-bit host copy (as Copies16.enable gives them), and the part."""
    u = next(b for b in engine.blocks if b.home is Home.STREAMED)
    u.host16 = torch.empty(u.numel, dtype=torch.bfloat16)
    return u, engine.copies16


def test_a_copy_filled_in_an_epoch_is_valid_until_the_weights_move(engine):
    u, c = _with_copy(engine)
    assert not c.valid(u)  # a new unit's copy holds nothing
    c.filled(u, None)
    assert c.valid(u) and u.copy16.epoch == c.epoch
    c.weights_changed()  # a rollback, a load
    assert not c.valid(u)
    c.filled(u, None)
    c.step_moves()  # the optimizer step
    assert not c.valid(u)


def test_a_copy_made_after_an_update_is_valid_from_the_steps_move_only(engine):
    u, c = _with_copy(engine)
    label = c.label(u)  # an update in the backward, before the step moves the epoch
    assert label == ("after", c.epoch)
    u.copy16.made(label)
    assert not c.valid(u), "not before the step"
    c.step_moves()
    assert c.valid(u)
    c.weights_changed()
    assert not c.valid(u), "a rolled-back step or a load invalidates it"
    now = c.label(u, now=True)  # a deferred update, after the move
    u.copy16.made(now, None)
    assert c.valid(u)


def test_a_unit_whose_update_may_start_drops_its_copy(engine):
    u, c = _with_copy(engine)
    c.filled(u, None)
    c.stale(u)
    assert not c.valid(u) and u.copy16.epoch == -1


def test_no_label_without_a_copy(engine):
    u, c = _with_copy(engine)
    assert c.label(u) is not None
    u.host16 = None
    assert c.label(u) is None and not c.valid(u)
