"""A frozen base costs what it must and no more ([Note: frozen parameters], engine/memory/store.py).

A frozen parameter is held once, in host memory, in the compute dtype (2 B/param in bf16, 4 in fp32), and is
uploaded as it is; it has no master, moments, gradient slot, staging buffer or host gradient; the planner counts
it so. The math is what it was: in bf16 the device computed with the bf16 rounding of the fp32 frozen weights,
now with the stored bf16 copy, which is that rounding (the reference here: the same engine training the base at
lr 1e-30, too small to move an fp32 weight, whose fp32 masters are then cast on the device as the frozen weights
were before; checked once also against the previous commit's code: the same losses and adapter weights, bitwise).
"""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm

G = 2
CFG = {
    "device": "cpu",
    "precision": "bf16",
    "micro_batch_size": 2,
    "gradient_accumulation_steps": G,
    "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
}

peft = pytest.importorskip("peft")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _lora(zero_b: bool = False, targets="all-linear", **kw):
    """PEFT LoRA over a tiny Llama: every linear of the blocks adapted; ``zero_b``: PEFT's default init (B = 0)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = tm.llama(tied=False)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=True if zero_b else False, **kw
    )
    return get_peft_model(base, cfg)


def test_bf16_frozen_base_is_held_in_bf16_and_trains_as_the_fp32_base_did():
    """The frozen base in bf16 host memory (2 B/param), uploaded as it is; losses and adapter weights bitwise those
    of the same engine with the base trained at lr 1e-30 (fp32 masters, cast on the device: the path frozen weights took
    before they were stored in bf16)."""
    model = _lora()
    twin = copy.deepcopy(model)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = zerofit.initialize(model, CFG)
    frozen = [u for u in engine.units if u.frozen is not None]
    assert frozen and all(u.frozen_host.dtype == torch.bfloat16 for u in frozen)
    assert sum(u.frozen_host.numel() for u in frozen) == sum(p.numel() for p in base_before.values())
    # the reference: every parameter trained, the base in a group of its own at lr 1e-30 (lr > 0 is required) and
    # no weight decay: its updates round away, the fp32 masters stay as they were (asserted below)
    adapters = [p for p in twin.parameters() if p.requires_grad]
    base = [p for p in twin.parameters() if not p.requires_grad]
    for p in base:
        p.requires_grad_(True)
    groups = [{"params": adapters}, {"params": base, "lr": 1e-30, "weight_decay": 0.0}]
    ref = zerofit.initialize(twin, CFG, param_groups=groups)
    assert not ref.frozen
    data = tm.batches(3, G)
    got = [engine.train_batch(mbs) for mbs in data]
    want = [ref.train_batch(mbs) for mbs in data]
    assert got == want
    mine, theirs = dict(engine.module.named_parameters()), dict(ref.module.named_parameters())
    for n, p in mine.items():
        if p.requires_grad:
            assert p.dtype == torch.float32 and torch.equal(p.detach(), theirs[n].detach()), n
        else:  # the module's frozen parameters view the stored bf16 copy: the rounding of the fp32 weights
            assert p.dtype == torch.bfloat16, n
            assert torch.equal(p.detach(), base_before[n].to(torch.bfloat16)), n
            assert torch.equal(theirs[n].detach(), base_before[n]), n  # the reference's base did not move
    # master_state_dict: the frozen weights in their stored dtype
    msd = engine.master_state_dict()
    assert all(msd[n].dtype == torch.bfloat16 for n in base_before)
    engine.close()
    ref.close()


def _plain(model, data, lr: float, wd: float) -> list[float]:
    """Plain PyTorch: loss / G accumulated, fused AdamW over the trained parameters; each step's mean loss, averaged
    as the engine averages it (in fp32)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=True)
    out = []
    for mbs in data:
        opt.zero_grad()
        losses = []
        for mb in mbs:
            loss = model(**mb).loss
            (loss / len(mbs)).backward()
            losses.append(loss.detach())
        opt.step()
        out.append(torch.stack(losses).float().mean().item())
    return out


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["immediate", "deferred"])
def test_a_lora_models_buffers_hold_the_adapters_only(clip):
    """Per unit: master, moments and gradients sized by the adapters (and modules_to_save), the base only in
    ``frozen_host``; a block with no adapter gets no gradient, staging or host gradient and nothing of it is
    downloaded; the gradient slots, staging buffers and weight slots are the plan's."""
    model = _lora(
        targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=[0, 2],
        modules_to_save=["lm_head"],
    )
    per_block = [{"trained": 0, "frozen": 0} for _ in range(3)]
    shell = {"trained": 0, "frozen": 0}
    for n, p in model.named_parameters():
        where = per_block[int(n.split("layers.")[1].split(".")[0])] if "layers." in n else shell
        where["trained" if p.requires_grad else "frozen"] += p.numel()
    engine = zerofit.initialize(model, {**CFG, "gradient_clipping": clip})
    plan = engine.plan
    for u, want in zip(engine.blocks, per_block):
        assert (u.numel, u.frozen_numel) == (want["trained"], want["frozen"]), u.name
        assert u.master.numel() == u.exp_avg.numel() == u.exp_avg_sq.numel() == want["trained"]
        assert u.frozen_host.dtype == torch.bfloat16
    assert (engine.shell.numel, engine.shell.frozen_numel) == (shell["trained"], shell["frozen"])
    assert shell["trained"] > 0  # lm_head's trained copy (modules_to_save): a full parameter with its state
    frozen_block = engine.blocks[1]
    assert not frozen_block.trains and frozen_block.grads.tensor is None
    assert id(frozen_block) not in engine.grads.host_grads
    host_trained = [u for u in engine.units if not u.optimizer_on_device and u.trains]
    assert host_trained and all(
        u.optimizer_on_device is (u.index < plan.resident_blocks and u.index >= 0) for u in engine.blocks
    )
    # staging and host gradients: the largest trained unit's gradient, never a frozen weight's worth
    assert len(engine.grads.staging) == plan.staging_buffers
    assert all(s.numel() == max(u.numel for u in host_trained) for s in engine.grads.staging)
    assert set(engine.grads.host_grads) == ({id(u) for u in host_trained} if clip else set())
    assert all(engine.grads.host_grads[id(u)].numel() == u.numel for u in host_trained if clip)
    # gradient slots: a trained block's gradient; weight slots: its trained and frozen weights (the plan's bytes)
    streamed = [u for u in engine.blocks if u.home.name == "STREAMED"]
    assert len(engine.grads.pool.slots) == plan.grad_slots
    assert engine.grads.pool.slots[0].tensor.numel() == max(u.numel for u in streamed)
    assert engine.grads.pool.nbytes == plan.host_bytes["device:grad_slots"]
    assert engine.streamer.pool.slots[0].tensor.numel() == max(u.numel + u.frozen_numel for u in streamed)
    assert engine.streamer.pool.nbytes == plan.host_bytes["device:weight_slots"]
    engine.train_batch(tm.batches(1, G)[0])
    downloads = [e["label"] for e in engine.trace() if e["lane"] == "download"]
    assert downloads and not any(lab.startswith(frozen_block.name) for lab in downloads), downloads
    assert f"{frozen_block.name}(frozen)" in tm.upload_labels(engine)  # its weights went up, as they are
    engine.wait()  # deferred updates: applied on the worker after the step
    assert float(frozen_block.step) == 0.0 and all(float(u.step) == 1.0 for u in engine.units if u.trains)
    engine.close()


@pytest.mark.parametrize("precision,per_param", [("bf16", 2), ("fp32", 4)])
def test_the_planners_host_bytes_for_a_frozen_base_are_what_the_engine_allocates(precision, per_param):
    """The plan's host bytes (frozen weights at their stored dtype, master and moments of the adapters only,
    staging, host gradients) against the host buffers the engine allocated: equal to within 1% + 4 KiB (the
    arenas' one-element minimum)."""
    model = _lora()
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    engine = zerofit.initialize(model, {**CFG, "precision": precision, "gradient_clipping": 1.0})
    plan = engine.plan
    assert plan.host_bytes["frozen_weights"] == base * per_param
    stored = sum(u.frozen_host.numel() * u.frozen_host.element_size() for u in engine.units if u.frozen is not None)
    assert stored == base * per_param  # measured: per_param bytes per base parameter
    # the host's own buffers (on the CPU the device's buffers are host memory too: the plan's "device:" entries)
    planned = sum(v for k, v in plan.host_bytes.items() if not k.startswith("device:"))
    seen = set()

    def nbytes(ts):
        out = 0
        for t in ts:
            if t is not None and (t.data_ptr(), t.numel()) not in seen:
                seen.add((t.data_ptr(), t.numel()))
                out += t.numel() * t.element_size()
        return out

    host_state = nbytes(
        t for u in engine.units if not u.optimizer_on_device for t in (u.master, u.exp_avg, u.exp_avg_sq, u.host16)
    )
    allocated = host_state + stored + nbytes(engine.grads.staging) + nbytes(engine.grads.host_grads.values())
    assert abs(planned - allocated) <= 0.01 * allocated + 4096, (planned, allocated, plan.host_bytes)
    # no optimizer state or gradient buffer of the base anywhere: the trained bytes are the adapters'
    trained = sum(u.numel for u in engine.units)
    assert trained == sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine.close()


@pytest.mark.parametrize("every", [2, 3])
def test_recomputed_blocks_with_a_frozen_base_give_the_zero_initialized_adapters_their_gradients(every):
    """Checkpoints every k blocks (the backward recomputes the others from a frozen embedding's output, whose
    input needs no gradient): no "does not require grad", and every block's lora_B, PEFT's zeros at first, gets its
    gradient and moves: bitwise plain PyTorch (fp32)."""
    model = _lora(zero_b=True)
    ref = copy.deepcopy(model)
    names_b = [n for n, p in model.named_parameters() if "lora_B" in n]
    assert all(not dict(model.named_parameters())[n].any() for n in names_b)
    cfg = {**CFG, "precision": "fp32", "offload": {"checkpoint_every": every}}
    engine = zerofit.initialize(model, cfg)
    assert engine.plan.checkpoint_every == every
    data = tm.batches(2, G)
    assert [engine.train_batch(mbs) for mbs in data] == _plain(ref, data, lr=1e-2, wd=0.01)
    got, want = dict(engine.module.named_parameters()), dict(ref.named_parameters())
    for n in names_b:
        assert got[n].detach().any(), f"{n} got no gradient"
    for n, p in want.items():
        assert torch.equal(got[n].detach(), p.detach()), n
    engine.close()


def test_a_model_directorys_bf16_tensors_become_the_frozen_host_copy_as_they_are(tmp_path):
    """Read from the files into the bf16 host copy directly (no fp32 copy of the base), bitwise the files'."""
    from safetensors.torch import load_file

    from tests.support.model_dirs import make_model_dir

    d = make_model_dir(tmp_path / "m", dtype=torch.bfloat16, layers=3)
    files = {}
    for f in d.glob("*.safetensors"):
        files.update(load_file(f))
    engine = zerofit.initialize(str(d), CFG, param_groups=[{"params": [n for n in files if "mlp" in n]}])
    assert engine.frozen and all("mlp" not in n for n in engine.frozen)
    module = dict(engine.module.named_parameters())
    for n in engine.frozen:
        assert module[n].dtype == torch.bfloat16 and torch.equal(module[n].detach(), files[n]), n
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 50, (2, 8), generator=g) for _ in range(G)]
    engine.train_batch([{"input_ids": i, "labels": i} for i in ids])
    for n in engine.frozen:
        assert torch.equal(module[n].detach(), files[n]), n
    engine.close()


def test_estimate_of_a_lora_model_plans_what_the_engine_allocates():
    """``zerofit estimate --lora`` (estimate(lora=...)): the base frozen at 2 B/param in bf16, no state for it; the
    same plan the engine makes for that PEFT model, and a 13B shape's host bytes are its bf16 base and the adapters'
    state."""
    from zerofit.estimate import estimate, meta_model, with_lora

    lora = dict(r=4, alpha=8, targets="all-linear")
    cfg = {**CFG, "max_host_memory": "8GiB"}
    with torch.device("meta"):
        meta = tm.llama(tied=False)
    est = estimate(meta, cfg, measure=False, gpu=False, lora=lora)
    torch.manual_seed(0)
    model = with_lora(tm.llama(tied=False), **lora)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert est.shape.frozen_numel == base and est.plan.host_bytes["frozen_weights"] == 2 * base
    engine = zerofit.initialize(model, cfg)
    assert est.plan.host_bytes == engine.plan.host_bytes
    engine.close()
    big = estimate(
        meta_model(shape="llama-2-13b"),
        {
            "precision": "bf16",
            "max_gpu_memory": "24GiB",
            "max_host_memory": "108GiB",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 4,
        },
        measure=False,
        gpu=True,
        lora=True,
    )
    sh = big.shape
    trained = sh.shell_numel + sum(sh.block_numels)
    assert 60e6 < trained < 65e6 and sh.frozen_numel > 12.9e9  # r 16 on every linear: 62.6 M (design/LORA.md)
    host = big.plan.host_bytes
    assert host["frozen_weights"] == 2 * sh.frozen_numel
    assert host["master_and_moments"] <= 12 * trained and host.get("grad_buffers", 0) <= 4 * trained
    assert "13.1 B parameters (62.6 M trained; 13 B frozen" in big.render()


def test_bf16_frozen_base_through_a_checkpoint_and_an_export(tmp_path):
    """Checkpoints keep the frozen weights (as fp32 entries, the stored bf16 values exactly) and resume bitwise;
    an export writes the stored values in the export's dtype."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = tm.llama(tied=False)
    frozen = [n for n, p in model.named_parameters() if "embed_tokens" in n or "layers.1." in n or "q_proj" in n]
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    twin = copy.deepcopy(model)
    engine = zerofit.initialize(model, CFG)
    data = tm.batches(3, G)
    engine.train_batch(data[0])
    engine.save_checkpoint(tmp_path / "ck", tag="one")
    rest = [engine.train_batch(mbs) for mbs in data[1:]]
    final = engine.master_state_dict()
    engine.save_pretrained(tmp_path / "out", dtype="bf16")
    engine.close()
    exported = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        exported.update(load_file(f))
    for n in frozen:
        assert final[n].dtype == torch.bfloat16 and torch.equal(exported[n], final[n]), n
        assert torch.equal(final[n], twin.get_parameter(n).detach().to(torch.bfloat16)), n
    e2 = zerofit.initialize(twin, CFG)
    e2.load_checkpoint(tmp_path / "ck", tag="one")
    assert [e2.train_batch(mbs) for mbs in data[1:]] == rest
    for n, v in e2.master_state_dict().items():
        assert v.dtype == final[n].dtype and torch.equal(v, final[n]), n
    e2.close()


@pytest.mark.parametrize("weights", [True, False], ids=["master-and-moments", "moments"])
def test_the_disk_tier_holds_the_adapters_state_beside_a_frozen_base_in_host_memory(tmp_path, weights):
    """A model with frozen parameters on the NVMe tier (refused before): the last blocks' trained state on the disk,
    their frozen weights in host memory; bitwise the in-memory engine. (The frozen weights themselves do not go to
    the disk yet.)"""
    model = _lora()
    ref = zerofit.initialize(copy.deepcopy(model), CFG)
    eng = zerofit.initialize(
        model,
        {
            **CFG,
            "offload": {
                "optimizer_device": "nvme",
                "nvme_path": str(tmp_path),
                "disk_blocks": 2,
                "disk_weights": weights,
            },
        },
    )
    assert [u.swap for u in eng.blocks] == [None] + ["all" if weights else "moments"] * 2
    assert all(u.frozen_host.dtype == torch.bfloat16 and u.frozen_host.device.type == "cpu" for u in eng.blocks)
    data = tm.batches(3, G)
    assert [eng.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]
    assert eng.tier.bytes_read > 0
    a, b = eng.master_state_dict(), ref.master_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in b)
    eng.close()
    ref.close()


@pytest.mark.parametrize("every", [1, 2])
def test_no_backward_below_the_lowest_trained_block(every):
    """[Note: no backward below the lowest trained block]: adapters on the last block only and a frozen embedding:
    blocks 0 and 1 run their forward and nothing in the backward (no upload, no compute), and the step is bitwise
    plain PyTorch's (fp32)."""
    model = _lora(targets=["q_proj", "v_proj", "down_proj"], layers_to_transform=[2])
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, {**CFG, "precision": "fp32", "offload": {"checkpoint_every": every}})
    assert [u.trains for u in engine.blocks] == [False, False, True]
    data = tm.batches(2, G)
    assert [engine.train_batch(mbs) for mbs in data] == _plain(ref, data, lr=1e-2, wd=0.01)
    got = dict(engine.module.named_parameters())
    for n, p in ref.named_parameters():
        assert torch.equal(got[n].detach(), p.detach()), n
    computed = [e["label"] for e in engine.trace() if e["lane"] == "compute"]
    uploads = tm.upload_labels(engine)
    for u in engine.blocks[:2]:
        assert computed.count(u.name) == 1, (u.name, computed)  # its forward only
    # block 0's input recomputed for block 1 (every 2) only where block 1's backward runs: not here
    assert not any(lab.startswith(engine.blocks[0].name) and "inputs" in lab for lab in computed)
    assert uploads.count(f"{engine.blocks[2].name}") + uploads.count(f"{engine.blocks[2].name}(16)") >= 1
    assert sum(lab.startswith(engine.blocks[0].name) for lab in uploads) <= 2  # the forward's (weights, frozen)
    engine.close()
