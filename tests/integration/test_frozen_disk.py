"""[Note: a frozen base on the disk] (src/zerofit/engine/disk/tier.py): a frozen base that host memory
cannot hold keeps the 16-bit frozen weights of its last streamed blocks on the disk tier, read-only, read ahead of
each upload. The math is the in-memory path's, bitwise; the planner moves frozen weights there first when the host
budget is short (only reads: the same disk traffic per byte saved as the moments, no writes), and counts them;
checkpoints and the base's fingerprint read them through the swap file's mapping."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

G = 2
CFG = {
    "device": "cpu",
    "precision": "bf16",
    "micro_batch_size": 2,
    "gradient_accumulation_steps": G,
    "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
}


def _lora(layers: int = 4):
    torch.manual_seed(0)
    return peft.get_peft_model(
        tm.llama(tied=False, layers=layers),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False),
    )


def _disk(path, **kw) -> dict:
    return {**CFG, "offload": {"optimizer_device": "nvme", "nvme_path": str(path), **kw}}


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["immediate", "deferred"])
def test_frozen_weights_on_the_disk_train_bitwise_as_in_host_memory(tmp_path, clip):
    model = _lora()
    twin = copy.deepcopy(model)
    base = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters() if not p.requires_grad}
    ref = zerofit.initialize(twin, {**CFG, "gradient_clipping": clip})
    engine = zerofit.initialize(model, {**_disk(tmp_path, disk_frozen_blocks=2), "gradient_clipping": clip})
    plan = engine.plan
    assert plan.disk_frozen == (2, 3) and not plan.disk_blocks
    on_disk = [u for u in engine.blocks if u.frozen_disk]
    assert [u.index for u in on_disk] == [2, 3]
    tier = engine.tier
    lo, hi = tier.file.map.data_ptr(), tier.file.map.data_ptr() + tier.file.nbytes
    assert all(lo <= u.frozen_host.data_ptr() < hi for u in on_disk)  # views of the swap file's mapping
    # the host arenas hold the other blocks' frozen weights only
    held = sum(u.frozen_host.numel() for u in engine.units if u.frozen is not None and not u.frozen_disk)
    assert engine.plan.host_bytes["frozen_weights"] == held * 2
    data = tm.batches(3, G)
    assert [engine.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]
    mine, theirs = engine.master_state_dict(), ref.master_state_dict()
    for n, v in theirs.items():
        assert torch.equal(mine[n], v), n
    for n, v in base.items():  # the frozen weights, read back through the mapping, unchanged
        assert torch.equal(mine[n], v), n
    uploads = tm.upload_labels(engine)
    assert any(lab.endswith("(frozen disk)") for lab in uploads), uploads
    assert tier.bytes_read > 0 and tier.bytes_written == 0  # read-only: nothing trained is on the disk
    engine.close()
    ref.close()


def test_the_planner_puts_frozen_weights_on_the_disk_when_host_memory_is_short(tmp_path):
    """No disk setting but the nvme tier: under a host budget that cannot hold the frozen base, the planner moves
    the last blocks' frozen weights there (before any trained state), and the plan fits the budget."""
    model = _lora(layers=6)
    twin = copy.deepcopy(model)
    roomy = zerofit.initialize(twin, _disk(tmp_path / "a"))
    assert not roomy.plan.disk_frozen and not roomy.plan.disk_blocks  # it fits: nothing on the disk
    need = roomy.plan.host_total
    frozen = roomy.plan.host_bytes["frozen_weights"]
    budget = need - frozen // 3
    engine = zerofit.initialize(model, {**_disk(tmp_path / "b"), "max_host_memory": budget})
    plan = engine.plan
    assert plan.disk_frozen and not plan.disk_blocks, plan.describe()
    assert plan.host_total <= budget
    assert plan.disk_frozen == tuple(range(6 - len(plan.disk_frozen), 6))  # the last blocks'
    read, written = plan.disk_traffic(engine._shape)
    assert written == 0 and read == 2 * plan.disk_frozen_bytes
    data = tm.batches(2, G)
    assert [engine.train_batch(m) for m in data] == [roomy.train_batch(m) for m in data]
    engine.close()
    roomy.close()


def test_a_checkpoint_of_a_base_on_the_disk_resumes_bitwise(tmp_path):
    data = tm.batches(4, G, seed=3)
    a = zerofit.initialize(_lora(), _disk(tmp_path / "a", disk_frozen_blocks=3))
    want = [a.train_batch(m) for m in data]
    a.close()
    b = zerofit.initialize(_lora(), _disk(tmp_path / "b", disk_frozen_blocks=3))
    for m in data[:2]:
        b.train_batch(m)
    b.save_checkpoint(tmp_path / "ck", tag="t")
    b.close()
    c = zerofit.initialize(_lora(), _disk(tmp_path / "c", disk_frozen_blocks=3))  # the fingerprint matches
    c.load_checkpoint(tmp_path / "ck", tag="t")
    assert [c.train_batch(m) for m in data[2:]] == want[2:]
    c.close()
