"""[Note: fast kernels] (engine/model/kernels.py) through the engine, on the CPU in fp32 (torch.compile's C++
code): ``kernels: "fast"`` trains like ``"exact"`` within fp32 rounding (measured over 3 steps of tiny Llama
models: the losses within 3e-7 relative, the weights within 6e-5 of their largest entry for full fine-tuning,
5e-6 with LoRA: AdamW's first steps divide each gradient by its own magnitude, so the rounding of the smallest
gradients shows in the weights; held to 1e-6 and 2e-4), compiling one graph per grad mode for all the blocks; the
default on the CPU is exact and compiles nothing, bitwise the engine as it was; the DeepSpeed-shaped loop keeps the
model's own head (its logits come back) with compiled blocks, as does the user's own FSDP-shaped loop; QLoRA
(an NF4 base) trains as exact's; and a block whose compilation fails runs its own code from then on."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.model import kernels as K

STEPS, G, B, T = 3, 2, 2, 32

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _cfg(kernels: str | None) -> dict:
    cfg = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": B,
        "gradient_accumulation_steps": G,
        "seq_len": T,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    if kernels is not None:
        cfg["kernels"] = kernels
    return cfg


def _train(model, kernels, data):
    engine = zerofit.initialize(model, _cfg(kernels))
    losses = [engine.train_batch(mbs) for mbs in data]
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return engine, losses, weights


@pytest.mark.parametrize("build", [tm.llama, tm.llama_lora], ids=["full", "lora"])
def test_fast_kernels_train_like_exact(build):
    torch.manual_seed(0)
    model = build()
    twin = copy.deepcopy(model)
    data = tm.batches(STEPS, G, B=B, T=T)
    exact, l_exact, w_exact = _train(model, "exact", data)
    exact.close()
    fast, l_fast, w_fast = _train(twin, "fast", data)
    assert fast.kernels.blocks_why is None and fast.kernels.fused_loss
    # one graph per grad mode served all three blocks: the forward under no_grad, the recompute with grad
    assert sorted(k.split()[0] for k in fast.kernels.compile_seconds) == ["grad", "no_grad"]
    fast.close()
    torch.testing.assert_close(torch.tensor(l_fast), torch.tensor(l_exact), rtol=1e-6, atol=0)
    for n, w in w_exact.items():
        scale = float(w.abs().max())
        torch.testing.assert_close(w_fast[n], w, rtol=0, atol=2e-4 * scale, msg=lambda m, n=n: f"{n}: {m}")


def test_exact_is_the_cpu_default_and_compiles_nothing(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("torch.compile called with exact kernels")

    monkeypatch.setattr(torch, "compile", refuse)
    torch.manual_seed(0)
    model = tm.llama()
    twin = copy.deepcopy(model)
    data = tm.batches(2, G, B=B, T=T)
    default, l_default, w_default = _train(model, None, data)
    assert default.kernels.describe() == "kernels: exact (the model's own code, op by op)"
    default.close()
    exact, l_exact, w_exact = _train(twin, "exact", data)
    exact.close()
    assert l_default == l_exact
    assert all(torch.equal(w_default[n], w) for n, w in w_exact.items())


def test_the_deepspeed_shaped_loop_keeps_the_models_own_head():
    torch.manual_seed(0)
    model = tm.llama()
    twin = copy.deepcopy(model)
    data = tm.batches(2, G, B=B, T=T)
    runs = []
    for m, kernels in ((model, "exact"), (twin, "fast")):
        engine = zerofit.initialize(m, _cfg(kernels))
        losses = []
        for mbs in data:
            for mb in mbs:
                out = engine(**mb)
                assert out.logits is not None and out.logits.shape == (B, T, tm.VOCAB)
                engine.backward(out.loss)
                engine.step()
                losses.append(out.loss.item())
        if kernels == "fast":
            assert engine.kernels.compile_seconds, "the blocks ran compiled"
        engine.close()
        runs.append(losses)
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-6, atol=0)


def test_a_block_that_fails_to_compile_runs_its_own_code(monkeypatch):
    def broken(module, x, args, kwargs):
        raise RuntimeError("inductor: no kernel for this op\nmore detail")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken if fn is K._call_block else fn)
    torch.manual_seed(0)
    model = tm.llama()
    twin = copy.deepcopy(model)
    data = tm.batches(2, G, B=B, T=T)
    engine = zerofit.initialize(model, {**_cfg("fast")})
    losses = [engine.train_batch(mbs) for mbs in data]
    assert engine.kernels.blocks_why == "compiling the block failed (RuntimeError: inductor: no kernel for this op)"
    assert "blocks: their own code (compiling the block failed" in engine.kernels.describe()
    engine.close()
    exact, l_exact, _ = _train(twin, "exact", data)
    exact.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(l_exact), rtol=1e-6, atol=0)


def test_the_users_own_loop_trains_like_exact():
    """The FSDP-shaped loop (``zerofit.fsdp``, the tutorial's ``(loss / G).backward()`` and ``optimizer.step()``)
    with ``kernels`` in its ``zerofit_config``: compiled blocks, the model's own head, losses as exact's."""
    from torch.distributed.fsdp import CPUOffload

    from zerofit.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = tm.llama(tied=False)
    twin = copy.deepcopy(model)
    data = tm.batches(2, G, B=B, T=T)
    runs = []
    for m, kernels in ((model, "exact"), (twin, "fast")):
        wrapped = FSDP(m, cpu_offload=CPUOffload(offload_params=True), zerofit_config={"kernels": kernels})
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, weight_decay=0.01)
        losses = []
        for mbs in data:
            for mb in mbs:
                loss = wrapped(**mb).loss
                (loss / len(mbs)).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        assert bool(wrapped.zerofit_engine.kernels.compile_seconds) == (kernels == "fast")
        runs.append(losses)
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-6, atol=0)


def test_qlora_trains_like_exact():
    """LoRA over a base held in NF4 (``quantize_base: nf4``): the compiled blocks dequantize as the exact ones
    do, and the linear the recompute leaves unread is ``down_proj``'s dequantized base."""
    pytest.importorskip("bitsandbytes")
    from zerofit.engine.model.nf4 import DequantizedLinear

    torch.manual_seed(0)
    model = tm.llama_lora()
    twin = copy.deepcopy(model)
    data = tm.batches(2, G, B=B, T=T)
    runs = []
    for m, kernels in ((model, "exact"), (twin, "fast")):
        engine = zerofit.initialize(m, {**_cfg(kernels), "quantize_base": "nf4"})
        assert all(u.nf4 is not None for u in engine.blocks)
        runs.append([engine.train_batch(mbs) for mbs in data])
        if kernels == "fast":
            assert engine.kernels.blocks_why is None and engine.kernels.compile_seconds
            assert all(isinstance(K.unread_linear(b), DequantizedLinear) for b in engine.adapter.blocks)
        engine.close()
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-6, atol=0)
