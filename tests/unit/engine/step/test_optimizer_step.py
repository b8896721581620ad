"""Step (step/optimizer_step.py), the optimizer step as a part, on a tiny model on the CPU: where each unit's complete
gradient goes (its route, decided once per plan), a step's updates handed out through the units' records (the
worker's ``updated`` cleared and set again, the device's share left ``pending`` for the next upload), and a dropped
step that forgets every gradient so the next step is plain AdamW's."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.memory.store import Home
from zerofit.engine.step.optimizer_step import GradRoute

pytestmark = pytest.mark.usefixtures("one_thread")
G = 2


def _cfg(**kw):
    cfg = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": G}
    cfg |= {"optimizer": {"lr": 1e-3, "weight_decay": 0.01}, **kw}
    return cfg


def test_each_units_route_follows_where_its_optimizer_runs():
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.qwen2(), _cfg(offload={"assisted_updates": True, "assisted_fraction": 0.5}))
    s = engine.stepper
    for u in engine.units:
        route = s.route(u)
        if u.optimizer_on_device:
            assert route is GradRoute.DEVICE, u.name
        elif engine.device_updates.assisted(u):
            assert route is GradRoute.ASSISTED, u.name
        else:
            assert route is GradRoute.HOST, u.name
    assert {s.route(u) for u in engine.blocks} >= {GradRoute.ASSISTED, GradRoute.HOST}
    assert s.route(engine.blocks[0]) is s.route(engine.blocks[0])  # decided once for the plan
    engine.close()


def test_a_clipped_step_leaves_the_devices_share_pending_and_the_workers_done():
    """Deferred updates (clipping): after train_batch the worker's units are updated (``updated`` set again) and
    the device's share waits in ``pending`` for its next upload; a host read (flush) applies it."""
    torch.manual_seed(0)
    engine = zerofit.initialize(
        tm.qwen2(), _cfg(gradient_clipping=0.05, offload={"speculative_updates": False, "assisted_fraction": 0.5})
    )
    assisted = {u.index for u in engine.blocks if engine.device_updates.assisted(u)}
    assert assisted and assisted == set(engine.plan.assisted_blocks)
    engine.train_batch(tm.batches(1, G)[0])
    engine.worker.drain()
    pending = {u.index for u in engine.units if u.updates.pending is not None}
    assert pending == assisted
    assert all(u.updates.updated.is_set() for u in engine.units)
    engine.device_updates.flush(engine.units)
    assert all(u.updates.pending is None and u.updates.master_event is None for u in engine.units)
    engine.close()


def test_a_dropped_step_forgets_every_gradient():
    """A DeepSpeed-style accumulation dropped half way (the step's discard, as a failed call runs it): every record
    restarts, and the next
    full step gives plain AdamW's weights, as if the dropped micro-batch never ran."""
    torch.manual_seed(0)
    model = tm.llama(layers=3, tied=False)
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(gradient_clipping=1.0, offload={"resident_blocks": 0}))
    dropped, data = tm.batches(1, G)[0], tm.batches(2, G)[1:]
    engine.backward(engine(**dropped[0]).loss)
    assert any(not u.grads.fresh for u in engine.units)
    engine._discard_step()  # what a failed call runs: the parts' resets, the step's discard among them
    assert all(u.grads.fresh for u in engine.units) and not engine.grads.sq_norms
    assert all(u.grads.host_fresh for u in engine.stepper.host_units())
    assert {u.home for u in engine.blocks} == {Home.STREAMED}
    losses = [engine.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(tm.reference_train(ref, data, clip=1.0)))
    tm.assert_masters(engine, ref)
    engine.close()


def test_mirrors_behind_until_a_load_recasts_them():
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(layers=2), _cfg())
    engine.stepper.mirrors_behind()
    assert engine.stepper.mirror_stale
    engine.stepper.weights_loaded()
    assert not engine.stepper.mirror_stale
    engine.close()
