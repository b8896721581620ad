"""Grads (memory/grads.py): each unit's gradient record (``Unit.grads``) through the part's own methods, on a tiny model
on the CPU: the first write of a step copies and the rest add, a streamed unit's gradient lives in a slot it takes
fresh and gives back, the host buffer's first write is told once per step, and a load zeroes and restarts."""

from __future__ import annotations

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.memory.store import Home

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(**kw):
    torch.manual_seed(0)
    cfg = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    cfg |= {"offload": {"resident_blocks": 0, "prefetch_depth": 1}, **kw}
    return zerofit.initialize(tm.llama(layers=4, tied=False), cfg)


def test_the_first_write_of_a_step_copies_and_the_next_ones_add():
    engine = _engine()
    grads, u = engine.grads, engine.shell
    assert u.home is Home.RESIDENT and u.grads.tensor is not None
    names = list(u.layout.names)
    dst = u.grads.tensor
    dst.fill_(7.0)  # a stale gradient: a copying write must not add to it
    one = [torch.full(u.layout.views(dst)[n].shape, 1.5) for n in names[:1]]
    grads.restart(u)
    grads.accumulate(u, dst, one + [None] * (len(names) - 1), names)
    views = u.layout.views(dst)
    assert torch.equal(views[names[0]], one[0]) and not u.grads.fresh
    assert all(torch.count_nonzero(views[n]) == 0 for n in names[1:]), "a partial first write zeroes the rest"
    grads.accumulate(u, dst, [torch.full_like(one[0], 0.25)] + [None] * (len(names) - 1), names)
    assert torch.equal(views[names[0]], torch.full_like(one[0], 1.75))
    engine.close()


def test_a_streamed_units_gradient_slot_is_taken_fresh_and_given_back():
    engine = _engine()
    grads = engine.grads
    u = next(b for b in engine.blocks if b.home is Home.STREAMED)
    g = grads.buffer(u)
    assert g is not None and u.grads.tensor is g and u.grads.slot is not None and u.grads.slot.tenant is u
    assert u.grads.fresh
    names = list(u.layout.names)
    grads.accumulate(u, g, [torch.ones(s) for s in u.layout.shapes], names)
    assert not u.grads.fresh
    slot = u.grads.slot
    grads.release_slot(u, None)
    assert (u.grads.slot, u.grads.tensor, u.grads.fresh, slot.tenant) == (None, None, True, None)
    engine.close()


def test_a_slot_taken_from_a_tenant_leaves_it_without_a_gradient():
    engine = _engine()
    grads = engine.grads
    assert grads.pool is not None
    streamed = [b for b in engine.blocks if b.home is Home.STREAMED]
    held = [(u, grads.buffer(u)) for u in streamed[: len(grads.pool.slots)]]
    first = held[0][0]
    grads.pool.take()  # round robin: the first tenant's slot
    assert first.grads.slot is None and first.grads.tensor is None
    engine.close()


def test_the_host_buffers_first_write_is_told_once_per_step():
    engine = _engine()
    u = engine.blocks[0]
    assert engine.grads.host_written(u) is True
    assert engine.grads.host_written(u) is False
    engine.grads.host_taken([u])
    assert engine.grads.host_written(u) is True
    engine.close()


def test_a_load_zeroes_resident_gradients_and_the_next_writes_copy():
    """Two micro-batches' backward through the DeepSpeed-shaped loop leave the shell's gradient summed; a load
    (restart_all, then the part's weights_loaded) zeroes it and drops the partial norms."""
    engine = _engine()
    for mb in tm.batches(1, 2)[0]:
        engine.backward(engine(**mb).loss)
    shell = engine.shell
    assert shell.grads.tensor is not None and torch.count_nonzero(shell.grads.tensor) > 0 and not shell.grads.fresh
    engine.grads.sq_norms[id(shell)] = torch.ones((), dtype=torch.float64)
    engine.grads.restart_all(engine.units)
    engine.grads.weights_loaded()
    assert torch.count_nonzero(shell.grads.tensor) == 0
    assert all(u.grads.fresh and u.grads.host_fresh for u in engine.units) and not engine.grads.sq_norms
    engine.close()
