"""[Note: attention's backend] (engine/model/attention.py) on the GPU in bf16: each of SDPA's kernels the card has
trains the same model to bf16's rounding of the flash kernel's losses, whole and over sequence tiles; timed times
them at the first call of a shape and runs the one it found fastest."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zerofit
from zerofit.engine.model import attention as att

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _losses(cfg: dict, seq: int = 1024) -> list[float]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=1024,
            max_position_embeddings=seq,
            attn_implementation="sdpa",
        )
    )
    eng = zerofit.initialize(model, {"optimizer": {"lr": 1e-3}, "seq_len": seq, **cfg})
    ids = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(1))
    return [float(eng.train_batch([{"input_ids": ids, "labels": ids}])) for _ in range(3)]


def test_every_kernel_trains_as_flash_does(caplog):
    flash = _losses({"attention_backend": "flash"})
    # a kernel this card or build lacks falls back in the order (the run still trains)
    for name in ("cudnn", "efficient"):
        assert _losses({"attention_backend": name}) == pytest.approx(flash, rel=2e-2), name
    with caplog.at_level(logging.INFO, logger="zerofit"):
        timed = _losses({"attention_backend": "timed"})
    assert "attention for 1 x 1,024 tokens:" in caplog.text
    assert timed == pytest.approx(flash, rel=2e-2)


def test_over_sequence_tiles_the_core_runs_on_the_named_kernel(monkeypatch):
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch._C._get_sdp_priority_order()[0])
        return sdpa(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    tiled = _losses({"attention_backend": "efficient", "offload": {"sequence_tile": 256}}, seq=2048)
    assert seen and set(seen) == {att.BACKENDS["efficient"].value}
    whole = _losses({"attention_backend": "flash"}, seq=2048)
    assert tiled == pytest.approx(whole, rel=2e-2)
