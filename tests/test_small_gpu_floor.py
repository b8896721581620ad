"""A smaller GPU floor ([Note: a smaller GPU floor], planner.py): the head and loss over token chunks and the
blocks' checkpoints in host memory change where memory goes, not the math."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests import tiny_models as tm
from zerofit.engine.planner import BatchShape, ModelShape, make_plan

G = 2


def _cfg(**offload):
    return {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": G,
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01}, "offload": offload}


@pytest.mark.parametrize("build", [lambda: tm.llama(layers=5), tm.qwen2, tm.qwen3, tm.mistral, tm.gpt2],
                         ids=["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_chunked_loss_and_offloaded_checkpoints_keep_the_math(build):
    torch.manual_seed(0)
    model = build()
    ref = zerofit.initialize(copy.deepcopy(model), _cfg())
    eng = zerofit.initialize(model, _cfg(loss_chunks=4, offload_checkpoints=True))
    if build is tm.gpt2:       # reshapes the hidden state by the input's length after its blocks: not chunked
        assert not eng._chunk_loss_ok and eng.plan.loss_chunks == 1
    else:
        assert eng._chunk_loss_ok and eng.plan.loss_chunks == 4
    assert eng.plan.offload_checkpoints
    data = tm.batches(6, G)
    a = [ref.train_batch(m) for m in data]
    b = [eng.train_batch(m) for m in data]
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-6, atol=1e-6)
    ma, mb = ref.master_state_dict(), eng.master_state_dict()
    for n in ma:
        torch.testing.assert_close(mb[n], ma[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    if len(eng.blocks) > 3:     # blocks 1 .. L-3 keep their inputs on the host between forward and backward
        assert eng._ckpt_arena is not None and eng._ckpt_arena.tensor.abs().sum() > 0, "checkpoints went to the host"


def test_offloaded_checkpoints_alone_are_bitwise():
    torch.manual_seed(0)
    model = tm.llama(layers=5)
    ref = zerofit.initialize(copy.deepcopy(model), _cfg())
    eng = zerofit.initialize(model, _cfg(loss_chunks=1, offload_checkpoints=True))
    data = tm.batches(4, G)
    assert [eng.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]
    ma, mb = ref.master_state_dict(), eng.master_state_dict()
    assert all(torch.equal(ma[n], mb[n]) for n in ma)


def test_chunked_loss_with_padding_and_ignored_labels():
    """Labels of -100 (padding, prompt tokens) count as in the model's own loss: the chunks share one count."""
    torch.manual_seed(0)
    model = tm.llama()
    ref = zerofit.initialize(copy.deepcopy(model), _cfg())
    eng = zerofit.initialize(model, _cfg(loss_chunks=3))
    data = tm.batches(3, G)
    for mbs in data:
        for mb in mbs:
            mb["labels"] = mb["labels"].clone()
            mb["labels"][:, :5] = -100
            mb["labels"][0, -3:] = -100
    a = [ref.train_batch(m) for m in data]
    b = [eng.train_batch(m) for m in data]
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-6, atol=1e-6)


def test_a_model_without_a_chunkable_loss_is_not_chunked():
    eng = zerofit.initialize(tm.PlainLM(), _cfg(loss_chunks=4))
    assert not eng.adapter.chunkable_loss and not eng._chunk_loss_ok
    data = tm.batches(2, G)
    for m in data:
        eng.train_batch(m)     # the plan says 4 chunks; the engine computes the loss whole


def test_planner_uses_the_floor_only_when_the_device_needs_it():
    # the W1 shape: 28 blocks of 113 M parameters, a 394 M shell (tied), vocab 128,256; 2 x 2048 tokens, G 4
    shape = ModelShape(394_002_432, (113_256_448,) * 28, 3072, 8192, 128256)
    batch = BatchShape(2, 2048, 4)
    kw = dict(compute_dtype=torch.bfloat16, on_cuda=True, host_budget=None, deferred_updates=False,
              checkpointing=True, stream_params=True, resident_blocks=None, prefetch_depth=None)
    roomy = make_plan(shape, batch, device_budget=24 * 2**30, **kw)
    assert roomy.loss_chunks == 1 and not roomy.offload_checkpoints
    small = make_plan(shape, batch, device_budget=8 * 2**30, **kw)
    assert small.loss_chunks > 1 and small.offload_checkpoints and small.device_total <= 8 * 2**30
    assert small.host_bytes["checkpoint_copies"] == 25 * 4 * 4096 * 3072 * 2
    mid = make_plan(shape, batch, device_budget=int(10.5 * 2**30), **kw)
    assert mid.loss_chunks > 1 and not mid.offload_checkpoints, mid.describe()
    # a model whose loss cannot be chunked: only the checkpoints move
    no_chunk = make_plan(shape, batch, device_budget=12 * 2**30, chunkable_loss=False, **kw)
    assert no_chunk.loss_chunks == 1 and no_chunk.offload_checkpoints
    assert "loss in" in small.describe() and "block checkpoints in host memory" in small.describe()


def test_lean_pipeline_is_bitwise(monkeypatch):
    """Two weight slots, one gradient slot, uploads (the host-updated shell's too) staged in quarter-block pieces,
    checkpoints on the host: the same updates, bitwise, as the default pipeline."""
    import zerofit.engine.engine as engine_mod

    torch.manual_seed(0)
    model = tm.llama(layers=5)
    cfg = _cfg(shell_optimizer="host") | {"precision": "bf16"}
    ref = zerofit.initialize(copy.deepcopy(model), cfg)
    real = engine_mod.plan_args
    monkeypatch.setattr(engine_mod, "plan_args", lambda *a: real(*a) | {"floor": (False, True, True)})
    eng = zerofit.initialize(model, cfg)
    p = eng.plan
    assert (p.weight_slots, p.grad_slots, p.offload_checkpoints) == (2, 1, True) and 0 < p.stage_numel < eng.shell.numel
    assert eng._upload_stage.numel() == p.stage_numel
    data = tm.batches(4, G)
    assert [eng.train_batch(m) for m in data] == [ref.train_batch(m) for m in data]
    ma, mb = ref.master_state_dict(), eng.master_state_dict()
    assert all(torch.equal(ma[n], mb[n]) for n in ma)
