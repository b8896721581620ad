"""A training engine's ``generate`` ([Note: generation over the engine's weights], engine/step/hooked.py): the model's
own generate with every streamed block uploaded at its call from the engine's host state, on the CPU in fp32, each
block through the weight slots as on a GPU. Its tokens are transformers' own over the engine's current weights (after
a step, the updated ones); with a device budget set, the blocks the pool's slots cannot hold stay in slots of their
own for the call ([Note: generation keeps blocks], engine/plan/generation.py): each crosses once instead of once per
token, and the slots are given back after; a batch whose cache cannot fit is refused by name before anything moves."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.memory.streamer import Streamer
from zerofit.engine.plan.generation import GenerationTooLarge

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
LAYERS, NEW = 6, 5


@pytest.fixture
def uploads(monkeypatch):
    seen: list[str] = []
    original = Streamer.upload

    def upload(self, unit, dst):
        seen.append(unit.name)
        return original(self, unit, dst)

    monkeypatch.setattr(Streamer, "upload", upload)
    return seen


def _engine(model, **cfg):
    config = {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 1}
    config |= {"optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "kernels": "exact"}
    return zerofit.initialize(model, config | cfg)


def _greedy(model, ids):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize("cap", [None, "1GiB"])
def test_generate_is_transformers_over_the_current_weights(uploads, cap):
    torch.manual_seed(0)
    model = tm.llama(tied=False, layers=LAYERS)
    ref = copy.deepcopy(model)
    engine = _engine(model, **({"max_gpu_memory": cap} if cap else {}), offload={"resident_blocks": 0})
    slots = engine.plan.weight_slots
    assert all(u.home.name == "STREAMED" for u in engine.blocks) and slots < LAYERS
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tm.VOCAB, (2, 6), generator=g)
    engine.train_batch([{"input_ids": ids, "labels": ids}])  # the weights move: generation must read the new ones
    ref.load_state_dict(engine.master_state_dict(), strict=False)
    uploads.clear()
    got = _greedy(engine, ids)
    assert torch.equal(got, _greedy(ref.eval(), ids))
    blocks = [n for n in uploads if n != "shell"]
    if cap is None:  # the pool's slots rotate: every block crosses for every forward (the prompt's, then a token's),
        # and the last forward prefetches the first blocks of a next one that does not come
        assert LAYERS * NEW <= len(blocks) < LAYERS * NEW + slots
    else:  # kept in slots of their own, or left in the pool's: each crosses once
        assert sorted(blocks) == sorted(u.name for u in engine.blocks)
    assert engine.streamer.kept == {}  # the call's slots given back
    engine.close()


def test_a_cache_that_takes_the_room_keeps_nothing(uploads):
    """At the smallest budget the plan fits, the step's activations leave room for some blocks beside a short
    generation's cache; a larger batch's cache takes that room, and the pool's slots rotate as without a budget."""
    torch.manual_seed(0)
    free = _engine(tm.llama(tied=False, layers=LAYERS), offload={"resident_blocks": 0})
    need = sum(v for k, v in free.plan.host_bytes.items() if k.startswith("device:"))  # the plan's device bytes
    free.close()
    engine = _engine(tm.llama(tied=False, layers=LAYERS), max_gpu_memory=need, offload={"resident_blocks": 0})
    short = torch.randint(0, tm.VOCAB, (1, 4))
    assert engine.schedule._generation_room((), {"input_ids": short, "max_new_tokens": NEW}) > 0
    long = torch.randint(0, tm.VOCAB, (16, 35))
    assert engine.schedule._generation_room((), {"input_ids": long, "max_new_tokens": NEW}) == 0
    uploads.clear()
    _greedy(engine, long)
    assert len([n for n in uploads if n != "shell"]) >= LAYERS * NEW
    engine.close()


def test_a_cache_that_cannot_fit_is_refused_by_name_before_it_generates(uploads):
    """[Note: generation keeps blocks]: a batch whose key/value cache exceeds the budget beside what stays of the
    plan is refused in one line, nothing uploaded; a smaller one then generates."""
    torch.manual_seed(0)
    free = _engine(tm.llama(tied=False, layers=LAYERS), offload={"resident_blocks": 0})
    need = sum(v for k, v in free.plan.host_bytes.items() if k.startswith("device:"))
    free.close()
    engine = _engine(tm.llama(tied=False, layers=LAYERS), max_gpu_memory=need, offload={"resident_blocks": 0})
    uploads.clear()
    with pytest.raises(GenerationTooLarge, match=r"generation: the KV cache of 64 sequences x 35 tokens"):
        _greedy(engine, torch.randint(0, tm.VOCAB, (64, 30)))
    assert [n for n in uploads if n != "shell"] == []
    _greedy(engine, torch.randint(0, tm.VOCAB, (2, 4)))
    engine.close()
