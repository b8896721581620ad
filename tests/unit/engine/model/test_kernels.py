"""[Note: fast kernels] (engine/model/kernels.py) on the CPU: which mode a config means where, what each model's
blocks and loss can run and why not, and [Note: a recompute's unread output]: a Llama-family layer recomputed with
its MLP's down_proj GEMM skipped gives every gradient bitwise (eager, fp32; full fine-tuning and LoRA), while the
other classes keep theirs."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from tests.support import tiny_models as tm
from zerofit.engine.model import kernels as K
from zerofit.engine.model.adapter import Adapter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_auto_is_fast_on_a_gpu_only():
    assert K.resolve("auto", on_cuda=True) and not K.resolve("auto", on_cuda=False)
    assert K.resolve("fast", on_cuda=False) and not K.resolve("exact", on_cuda=True)


def _kernels(model, mode="fast", tile=None):
    return K.Kernels(model, Adapter(model), mode, on_cuda=False, tile_of=lambda: tile)


def test_what_runs_and_why():
    k = _kernels(tm.llama())
    assert k.blocks_why is None and k.loss_why is None and k.fused_loss
    assert k.describe().startswith("kernels: fast; blocks compiled")
    assert _kernels(tm.llama(), "exact").describe() == "kernels: exact (the model's own code, op by op)"
    assert not _kernels(tm.llama(), "exact").compiled(torch.zeros(2, 8, 32))
    lora = _kernels(tm.llama_lora())
    assert lora.blocks_why is None and lora.loss_why is None  # PEFT's wrapper: its transformers model's head
    drop = _kernels(tm.llama(dropout=0.1))
    assert drop.blocks_why is not None and "dropout" in drop.blocks_why
    gpt2 = _kernels(tm.gpt2())
    assert gpt2.loss_why is not None and "gpt2" in gpt2.loss_why
    routed = tm.mixtral()
    routed.config.output_router_logits = True
    assert "router" in (_kernels(routed).loss_why or "")


def test_calls_over_sequence_tiles_run_their_own_code():
    k = _kernels(tm.llama(), tile=16)
    assert k.compiled(torch.zeros(2, 8, 32))  # 16 tokens: within one tile
    assert not k.compiled(torch.zeros(2, 16, 32))  # 32 tokens over tiles of 16: the tiled code, eager


def test_unread_linear_is_the_mlps_down_proj_of_llama_family_layers_only():
    llama = tm.llama()
    assert K.unread_linear(llama.model.layers[0]) is llama.model.layers[0].mlp.down_proj
    lora = tm.llama_lora()
    layer = lora.base_model.model.model.layers[0]
    assert K.unread_linear(layer) is layer.mlp.down_proj.base_layer
    assert K.unread_linear(tm.mixtral().model.layers[0]) is None  # a MoE layer
    assert K.unread_linear(tm.gpt2().transformer.h[0]) is None
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(tm.llama(tied=False), LoraConfig(r=4, target_modules=["down_proj"], use_dora=True))
    assert K.unread_linear(dora.base_model.model.model.layers[0]) is None  # DoRA reads the base output


@pytest.mark.parametrize("build", [tm.llama, tm.llama_lora, tm.qwen3], ids=["full", "lora", "qwen3"])
def test_a_recompute_without_the_unread_gemm_gives_the_same_gradients(build):
    torch.manual_seed(0)
    model = build()
    inner = K._inner(model)
    layer = inner.model.layers[1]
    twin = copy.deepcopy(layer)
    B, T, d = 2, 12, inner.config.hidden_size
    x = torch.randn(B, T, d)
    up = torch.randn(B, T, d)
    pos = torch.arange(T)[None].expand(B, T)
    kw = {"position_embeddings": inner.model.rotary_emb(x, pos), "attention_mask": None, "position_ids": pos}
    skip = K.unread_linear(twin)
    assert skip is not None
    calls = []
    real = K._OutputUnread.apply
    skip.__dict__["forward"] = types.MethodType(lambda s, a: calls.append(1) or real(a, s.weight, s.bias), skip)
    grads = []
    for m in (layer, twin):
        xi = x.clone().requires_grad_(True)
        params = [p for p in m.parameters() if p.requires_grad]
        y = m(xi, **kw)
        y = y[0] if isinstance(y, tuple) else y
        grads.append(torch.autograd.grad(y, [xi, *params], up))
    assert calls == [1], "the twin's down_proj ran as the unread linear"
    assert len(grads[0]) > 2
    for a, b in zip(*grads):
        assert torch.equal(a, b)
