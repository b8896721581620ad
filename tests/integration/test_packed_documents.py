"""Packed windows train each document apart ([Note: one document's attention], zerofit/data/packing.py): the
``position_ids`` that restart at every document make the model mask attention across them, through the engine as
in plain PyTorch called without a key/value cache (the engine's calls never make one)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.data.encode import Document
from zerofit.data.packing import pack

BUILDS = [tm.llama, tm.qwen3, tm.mistral, tm.gpt2]
IDS = ["llama", "qwen3", "mistral", "gpt2"]


def _documents(lengths: list[int], seed: int = 0) -> list[Document]:
    g = np.random.default_rng(seed)
    return [
        Document(g.integers(0, tm.VOCAB, n, dtype=np.int32), np.ones(n, dtype=bool), "text", f"doc {i}")
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("build", BUILDS, ids=IDS)
def test_each_document_of_a_window_computes_as_if_alone(build):
    """A window holding the tail of one document, two whole ones and the head of a fourth: each piece's logits are
    those of the piece run alone (the model sees no token of another document)."""
    torch.manual_seed(0)
    model = build().eval()
    model.config.use_cache = False
    data = pack(_documents([30, 5, 9, 40]), seq_len=24, pad_id=0)
    window = data.batch([1])  # stream tokens 23..46: the last 7 of the first document, 5, 9, then 3 of the fourth
    assert window["position_ids"][0].tolist() == [*range(7), *range(5), *range(9), *range(3)]
    with torch.no_grad():
        packed = model(input_ids=window["input_ids"], position_ids=window["position_ids"]).logits[0]
        at = 0
        for n in (7, 5, 9, 3):
            alone = model(input_ids=window["input_ids"][:, at : at + n]).logits[0]
            torch.testing.assert_close(packed[at : at + n], alone, rtol=1e-5, atol=1e-5)
            at += n


@pytest.mark.parametrize("build", [tm.llama, tm.gpt2], ids=["llama", "gpt2"])
def test_packed_windows_train_through_the_engine_as_in_plain_pytorch(build):
    """Steps over packed micro-batches (``input_ids``, ``labels``, ``position_ids``): the engine's losses and
    weights are plain PyTorch's over the same batches, bitwise as every fp32 parity test on the CPU."""
    torch.manual_seed(0)
    model = build()
    model.config.use_cache = False  # the reference as the engine calls the model: no cache, so packed sequences
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(
        model,
        {"device": "cpu", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 2,
         "optimizer": {"lr": 1e-3, "weight_decay": 0.01}},
    )  # fmt: skip
    data = pack(_documents([11, 3, 20, 7, 16, 5, 9, 30, 4, 12], seed=1), seq_len=16, pad_id=0)
    steps = [[data.batch([2 * s, 2 * s + 1]), data.batch([2 * s + 2, 2 * s + 3])] for s in range(2)]
    assert any(int((mb["position_ids"] == 0).sum()) > 2 for mbs in steps for mb in mbs), "no window packs two"
    losses = [engine.train_batch(mbs) for mbs in steps]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(tm.reference_train(ref, steps)))
    master = engine.master_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(master[name], p.detach(), msg=lambda m, name=name: f"{name}: {m}")
    engine.close()
