"""DeviceUpdates (update/assisted.py), the device's share of the host-optimized units' updates, on the CPU ([Note:
assisted updates]): which units it takes, a deferred update left in the unit's record until the next upload or a
flush, applied then with plain AdamW's weights, and a load that leaves none pending."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm

pytestmark = pytest.mark.usefixtures("one_thread")
G = 2


def _engine(model, fraction=0.5):
    cfg = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": G}
    cfg |= {"optimizer": {"lr": 1e-3, "weight_decay": 0.01}, "gradient_clipping": 0.05}
    cfg |= {"offload": {"speculative_updates": False, "assisted_fraction": fraction}}
    return zerofit.initialize(model, cfg)


def test_it_takes_the_planned_blocks_and_applies_their_pending_updates_at_a_flush():
    torch.manual_seed(0)
    model = tm.qwen2()
    ref = copy.deepcopy(model)
    engine = _engine(model)
    d = engine.device_updates
    assert {u.index for u in engine.units if d.assisted(u)} == set(engine.plan.assisted_blocks)
    data = tm.batches(1, G)
    engine.train_batch(data[0])
    engine.worker.drain()
    pending = [u for u in engine.units if u.updates.pending is not None]
    assert pending and all(d.assisted(u) for u in pending)
    before = {u.name: u.master.clone() for u in pending}
    d.flush(engine.units)
    assert all(u.updates.pending is None and u.updates.master_event is None for u in engine.units)
    assert all(not torch.equal(before[u.name], u.master) for u in pending), "the flush applied them"
    tm.reference_train(ref, data, clip=0.05)
    tm.assert_masters(engine, ref)
    engine.close()


def test_a_load_leaves_no_update_pending():
    torch.manual_seed(0)
    engine = _engine(tm.qwen2(), fraction=1.0)
    engine.train_batch(tm.batches(1, G)[0])
    engine.worker.drain()
    assert any(u.updates.pending is not None for u in engine.units)
    engine.device_updates.weights_loaded(engine.units)
    assert all(u.updates.pending is None and u.updates.master_event is None for u in engine.units)
    engine.close()
