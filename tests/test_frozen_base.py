"""A frozen base costs what it must and no more ([Note: frozen parameters], engine/store.py; issue 29, item 2).

A frozen parameter is held once, in host memory, in the compute dtype (2 B/param in bf16, 4 in fp32), and is
uploaded as it is; it has no master, moments, gradient slot, staging buffer or host gradient; the planner counts
it so. The math is what it was: in bf16 the device computed with the bf16 rounding of the fp32 frozen weights,
now with the stored bf16 copy, which is that rounding (the reference here: the same engine training the base at
lr 0, whose fp32 masters are then cast on the device as the frozen weights were before).
"""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests import tiny_models as tm

G = 2
CFG = {"device": "cpu", "precision": "bf16", "micro_batch_size": 2, "gradient_accumulation_steps": G,
       "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}

peft = pytest.importorskip("peft")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _lora(zero_b: bool = False, **kw):
    """PEFT LoRA over a tiny Llama: every linear of the blocks adapted; ``zero_b``: PEFT's default init (B = 0)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = tm.llama(tied=False)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                     init_lora_weights=True if zero_b else False, **kw)
    return get_peft_model(base, cfg)


def _trained(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _host_bytes(engine) -> int:
    """What the engine holds in host memory for the units, by distinct storage: every unit's host tensors (master,
    moments, the host mirror, frozen weights, 16-bit copies), the gradient staging buffers and host gradients."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is None or t.device.type != "cpu":
            return
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    for u in engine.units:
        for t in (u.master, u.exp_avg, u.exp_avg_sq, u.host, u.frozen_host, u.host16):
            add(t)
    for t in engine.grads.staging:
        add(t)
    for t in engine.grads.host_grads.values():
        add(t)
    return total


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
    for p in twin.parameters():
        lora = p.requires_grad
        p.requires_grad_(True)
        p._zf_lora = lora
    groups = [{"params": [p for p in twin.parameters() if p._zf_lora]},
              {"params": [p for p in twin.parameters() if not p._zf_lora], "lr": 1e-30, "weight_decay": 0.0}]
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
        else:     # the module's frozen parameters view the stored bf16 copy: the rounding of the fp32 weights
            assert p.dtype == torch.bfloat16, n
            assert torch.equal(p.detach(), base_before[n].to(torch.bfloat16)), n
            assert torch.equal(theirs[n].detach(), base_before[n]), n     # the reference's base did not move
    # master_state_dict: the frozen weights in their stored dtype
    msd = engine.master_state_dict()
    assert all(msd[n].dtype == torch.bfloat16 for n in base_before)
    engine.close()
    ref.close()
