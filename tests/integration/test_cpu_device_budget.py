"""A device budget on the CPU ([Note: a device budget on the CPU], engine/plan/search.py): ``max_gpu_memory`` bounds
what the CPU's plan keeps resident as a GPU of that size would, for the block chain and the hooked mode alike, so
the choice between resident and streamed units is made, and trained, in CI. Under a budget smaller than the model,
some units are resident and the others go through the weight slots one by one, with plain PyTorch's numbers (fp32,
torch's fused AdamW) over 3 steps; without one, every unit streams."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import any_models as am
from tests.support import tiny_models as tm
from zerofit.engine.memory.streamer import Streamer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _device_bytes(plan) -> int:
    return sum(v for k, v in plan.host_bytes.items() if k.startswith("device:"))


def _plain(model, data, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    losses = []
    for mbs in data:
        total = 0.0
        for mb in mbs:
            loss = model(**mb)["loss"] / len(mbs)
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("kind", ["chain", "hooked"])
def test_a_budget_smaller_than_the_model_keeps_some_units_and_streams_the_rest(kind, monkeypatch):
    torch.manual_seed(0)
    make = (lambda: tm.llama(tied=False, layers=6)) if kind == "chain" else (lambda: am.UNet(p=0.0))
    cfg = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    cfg |= {"optimizer": {"lr": 1e-3, "weight_decay": 0.01}, "kernels": "exact"}
    cfg |= {"adapter": "hooked"} if kind == "hooked" else {}
    # the plan's device bytes with every unit streamed, and with every unit resident: a budget between them
    low, high = (zerofit.initialize(make(), cfg | extra) for extra in ({}, {"max_gpu_memory": "1GiB"}))
    lo, hi, units = _device_bytes(low.plan), _device_bytes(high.plan), len(low.blocks)
    assert low.plan.resident_blocks == 0 and high.plan.resident_blocks == units and lo < hi
    low.close(), high.close()
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, cfg | {"max_gpu_memory": (lo + hi) // 2})
    resident = engine.plan.resident_blocks
    assert 0 < resident < units and _device_bytes(engine.plan) <= (lo + hi) // 2
    assert "max_gpu_memory" in engine.plan.describe()
    streamed = [u.name for u in engine.blocks if u.home.name == "STREAMED"]
    uploads: list[str] = []
    original = Streamer.upload
    monkeypatch.setattr(Streamer, "upload", lambda self, u, d: uploads.append(u.name) or original(self, u, d))
    data = tm.batches(3, 2, T=8)
    got = [engine.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_plain(ref, data)), rtol=1e-5, atol=1e-6)
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), rtol=0, atol=1e-5, msg=n)
    # the streamed units, and only they, went through the slots
    assert streamed and {n for n in uploads if n != "shell"} == set(streamed)
    engine.close()
