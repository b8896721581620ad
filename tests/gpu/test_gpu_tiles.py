"""[Note: a block over sequence tiles] (engine/model/tiling.py) on the GPU in bf16: a tiled layer against its own
forward (the loss and gradients within bf16's rounding), and its memory: one Llama layer's peak over its forward
and backward at a long sequence, against the planner's count of a block's working set (plan/activations.py) and
against the untiled layer's."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support import tiny_models as tm
from zerofit.engine.model import tiling
from zerofit.engine.plan.activations import block_working_set
from zerofit.engine.plan.plan import ModelShape

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _blocks(model):
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def test_tiled_layers_match_their_own_forward_in_bf16():
    torch.manual_seed(0)
    model = tm.llama_lora().to("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    tiling.install(_blocks(twin), lambda: 16)
    ids = torch.randint(0, tm.VOCAB, (2, 64), device="cuda")
    out = []
    for m in (model, twin):
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        params = [p for p in m.parameters() if p.requires_grad]
        grads = [g.float() for g in torch.autograd.grad(loss, params)]
        out.append((loss.detach().float(), grads))
    (l0, g0), (l1, g1) = out
    assert abs(float(l0 - l1)) <= 1e-2 * abs(float(l0))
    for a, b in zip(g0, g1):
        assert float((a - b).norm() / a.norm().clamp_min(1e-12)) <= 3e-2


def test_a_long_sequence_layer_keeps_within_the_planners_count():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hidden, inter, heads, kv, T, tile = 1024, 3584, 16, 4, 32768, 2048
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=T,
        attn_implementation="sdpa",
    )
    layer = LlamaDecoderLayer(cfg, 0).to("cuda", torch.bfloat16)
    for p in layer.parameters():
        p.requires_grad_(False)  # LoRA-like: the base frozen, the gradient flows to the input
    rot = LlamaRotaryEmbedding(cfg).to("cuda")
    x = torch.randn(1, T, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(T, device="cuda")[None]
    cos, sin = rot(x, pos)
    g = torch.randn_like(x)

    def peak(tile_of) -> int:
        tiling.uninstall([layer])
        tiling.install([layer], tile_of)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
        (gx,) = torch.autograd.grad(y, x, g)
        torch.cuda.synchronize()
        del y, gx
        return torch.cuda.max_memory_allocated() - base

    tiled, untiled = peak(lambda: tile), peak(lambda: None)
    shape = ModelShape(0, (0,), hidden, inter, 0, attention=(2 * heads + 2 * kv) * (hidden // heads))
    counted = block_working_set(shape, T, tile) * 2  # bf16
    print(f"tiled {tiled / 2**30:.2f} GiB, untiled {untiled / 2**30:.2f} GiB, counted {counted / 2**30:.2f} GiB")
    assert tiled <= counted
    assert tiled <= untiled / 2


@pytest.mark.parametrize("build", [tm.llama, tm.qwen3_moe], ids=["llama", "qwen3-moe"])
def test_packed_documents_over_tiles_in_bf16(build):
    """[Note: documents without a mask] on the GPU: document-by-document SDPA against the model's own mask, the loss
    and the gradients within bf16's rounding."""
    torch.manual_seed(0)
    model = build().to("cuda", torch.bfloat16)
    twin = copy.deepcopy(model)
    tiling.install(_blocks(twin), lambda: 16)
    hook = tiling.documents_hook(_blocks(twin), lambda: 16)
    assert hook is not None
    ids = torch.randint(0, tm.VOCAB, (1, 64), device="cuda")
    pos = torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)]).to("cuda")[None]
    batch = {"input_ids": ids, "labels": ids, "position_ids": pos, "use_cache": False}
    out = []
    for m, b in ((model, batch), (twin, hook(dict(batch)))):
        loss = m(**b).loss
        params = [p for p in m.parameters() if p.requires_grad]
        grads = [g.float() for g in torch.autograd.grad(loss, params)]
        out.append((loss.detach().float(), grads))
    (l0, g0), (l1, g1) = out
    assert abs(float(l0 - l1)) <= 1e-2 * abs(float(l0))
    for a, b in zip(g0, g1):
        assert float((a - b).norm() / a.norm().clamp_min(1e-12)) <= 3e-2
