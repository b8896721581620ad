"""[Note: MLP over sequence tiles] (engine/model/tiling.py) through the engine, on the CPU in fp32: with
``offload.sequence_tile`` below the micro-batch's tokens each streamed block's MLP runs over tiles, and training
matches plain PyTorch within fp32 rounding (the tiles' GEMMs round otherwise than the whole sequence's; measured
over 4 steps of tiny models, T = 32, tiles of 8: the losses equal; the weights within 5.6e-6 of their largest
entry for Llama, 1.8e-7 with LoRA, within 1.6e-6 absolute for Qwen3 and Mistral; held to rtol 1e-6 for the
losses and torch's fp32 defaults for the weights) for full fine-tuning and LoRA; with a tile of at least the
micro-batch's tokens, training is bitwise the engine's without one."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.model.tiling import TILED

STEPS, G, B, T = 4, 2, 2, 32

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _cfg(tile: int | None) -> dict:
    cfg = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": B,
        "gradient_accumulation_steps": G,
        "seq_len": T,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    if tile is not None:
        cfg["offload"] = {"sequence_tile": tile}
    return cfg


def _reference(model, data) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    out = []
    for mbs in data:
        opt.zero_grad()
        total = 0.0
        for mb in mbs:
            loss = model(**mb).loss
            (loss / len(mbs)).backward()
            total += loss.item()
        opt.step()
        out.append(total / len(mbs))
    return out


@pytest.mark.parametrize(
    "build", [tm.llama, tm.qwen3, tm.mistral, tm.llama_lora], ids=["llama", "qwen3", "mistral", "lora"]
)
def test_tiled_blocks_train_like_plain_pytorch(build, monkeypatch):
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    before = {n: q.detach().clone() for n, q in ref.named_parameters() if q.requires_grad}
    calls = []
    from zerofit.engine.model import tiling

    real = tiling._block_over_tiles
    monkeypatch.setattr(tiling, "_block_over_tiles", lambda *a: calls.append(a[3]) or real(*a))
    engine = zerofit.initialize(model, _cfg(8))
    assert engine.plan.sequence_tile == 8
    assert "sequence tiles of 8 tokens" in engine.plan.describe()
    data = tm.batches(STEPS, G, B=B, T=T)
    losses = [engine.train_batch(mbs) for mbs in data]
    assert calls and set(calls) == {8 // B}, "the blocks ran over tiles of 8 tokens (4 positions of 2 sequences)"
    ref_losses = _reference(ref, data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    got = dict(engine.module.named_parameters())
    for n, q in ref.named_parameters():
        torch.testing.assert_close(got[n].detach(), q.detach(), msg=lambda m, n=n: f"{n}: {m}")
    assert all(not torch.equal(got[n].detach(), w) for n, w in before.items()), "the trained parameters moved"
    engine.close()


@pytest.mark.parametrize("build", [tm.llama, tm.llama_lora], ids=["full", "lora"])
def test_a_tile_of_the_whole_micro_batch_is_todays(build):
    torch.manual_seed(0)
    model = build()
    other = copy.deepcopy(model)
    data = tm.batches(STEPS, G, B=B, T=T)
    a = zerofit.initialize(model, _cfg(B * T))
    b = zerofit.initialize(other, _cfg(None))
    assert a.plan.sequence_tile is None and b.plan.sequence_tile is None
    la = [a.train_batch(mbs) for mbs in data]
    lb = [b.train_batch(mbs) for mbs in data]
    assert la == lb
    pb = dict(b.module.named_parameters())
    for n, p in a.module.named_parameters():
        assert torch.equal(p.detach(), pb[n].detach()), n
    a.close()
    b.close()


def test_the_planner_leaves_short_sequences_untiled():
    engine = zerofit.initialize(tm.llama(), _cfg(None))
    assert engine.plan.sequence_tile is None
    blocks = engine.adapter.blocks
    assert all(TILED in blk.mlp.__dict__ for blk in blocks)  # wrapped, and its own forward runs (no tile)
    engine.close()


def test_packed_windows_over_tiles_train_like_plain_pytorch(monkeypatch):
    """[Note: documents without a mask]: packed windows through the engine with blocks over tiles attend document by
    document (no batch x T x T mask), and train as plain PyTorch does with the model's own mask."""
    import numpy as np

    from zerofit.data.encode import Document
    from zerofit.data.packing import pack
    from zerofit.engine.model import tiling

    torch.manual_seed(0)
    model = tm.llama()
    model.config.use_cache = False
    ref = copy.deepcopy(model)
    calls = []
    real = tiling._documents_attention
    monkeypatch.setattr(tiling, "_documents_attention", lambda *a: calls.append(1) or real(*a))
    g = np.random.default_rng(1)
    docs = [
        Document(g.integers(0, tm.VOCAB, n, dtype=np.int32), np.ones(n, dtype=bool), "text", f"doc {i}")
        for i, n in enumerate([11, 3, 20, 7, 16, 5, 9, 30, 4, 12, 25, 8])
    ]
    data = pack(docs, seq_len=T, pad_id=0)
    steps = [[data.batch([2 * s, 2 * s + 1])] for s in range(2)]
    engine = zerofit.initialize(model, {**_cfg(8), "gradient_accumulation_steps": 1})
    losses = [engine.train_batch(mbs) for mbs in steps]
    assert calls, "the blocks attended document by document"
    ref_losses = tm.reference_train(ref, steps)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    got = dict(engine.module.named_parameters())
    for n, q in ref.named_parameters():
        torch.testing.assert_close(got[n].detach(), q.detach(), msg=lambda m, n=n: f"{n}: {m}")
    engine.close()
