"""[Note: fast kernels] (engine/model/kernels.py) on the GPU in bf16: the compiled block and the fused linear
cross-entropy against the model's own code, each measured against an fp32 run of the same weights: the fast
path's distance from fp32 is held to at most twice the exact path's own (bf16's rounding, per op), for the output
and every gradient; and the engine trains with ``kernels: "fast"`` as with ``"exact"``, compiling the blocks once
per grad mode for all blocks."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.model import kernels as kernels_mod
from zerofit.engine.model.linear_loss import linear_cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(lora: bool):
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=4096,
            max_position_embeddings=512,
            attn_implementation="sdpa",
        )
    )
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=16,
                lora_alpha=32,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                init_lora_weights=False,
            ),
        )
    return model.cuda()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _block_run(layer, x, kw, upstream, fn):
    x = x.detach().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    y = fn(layer, x, (), kw)
    y = y[0] if isinstance(y, tuple) else y
    grads = torch.autograd.grad(y, [x, *params], upstream.to(y.dtype))
    return [y.detach(), *grads]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_compiled_block_is_within_bf16_rounding_of_fp32(lora):
    model = _model(lora)
    inner = kernels_mod._inner(model)
    ref_layer = inner.model.layers[0]
    layer16 = copy.deepcopy(ref_layer).to(torch.bfloat16)
    B, T, d = 2, 256, 512
    torch.manual_seed(1)
    x = torch.randn(B, T, d, device="cuda")
    up = torch.randn(B, T, d, device="cuda")
    pos = torch.arange(T, device="cuda")[None].expand(B, T)
    cos, sin = inner.model.rotary_emb(x, pos)

    def kw(dtype):
        return {"position_embeddings": (cos.to(dtype), sin.to(dtype)), "attention_mask": None, "position_ids": pos}

    ref = _block_run(ref_layer, x, kw(torch.float32), up, kernels_mod._call_block)
    exact = _block_run(layer16, x.bfloat16(), kw(torch.bfloat16), up, kernels_mod._call_block)
    fast = _block_run(layer16, x.bfloat16(), kw(torch.bfloat16), up, torch.compile(kernels_mod._call_block))
    assert len(ref) == len(fast) >= 3
    for i, (r, e, f) in enumerate(zip(ref, exact, fast)):
        err_e, err_f = _rel(e, r), _rel(f, r)
        assert err_f <= 2 * err_e + 1e-3, f"tensor {i}: fast {err_f:.2e} from fp32, exact {err_e:.2e}"


def test_fused_loss_is_within_bf16_rounding_of_fp32():
    torch.manual_seed(2)
    N, d, V = 1000, 512, 4096
    h32 = torch.randn(N, d, device="cuda")
    w32 = torch.randn(V, d, device="cuda") * 0.05
    labels = torch.randint(0, V, (N,), device="cuda")
    labels[::9] = -100
    count = (labels != -100).sum()
    runs = []
    for dtype, fused in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        h = h32.to(dtype).requires_grad_(True)
        w = w32.to(dtype).requires_grad_(True)
        if fused:
            loss = linear_cross_entropy(h, w, labels, count, rows=256)
        else:  # the model's own: transformers' loss over the head's logits, upcast
            logits = (h @ w.t()).float()
            loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / count
        gh, gw = torch.autograd.grad(loss * 0.5, [h, w])
        runs.append([loss.detach(), gh, gw])
    ref, exact, fast = runs
    for i, (r, e, f) in enumerate(zip(ref, exact, fast)):
        err_e, err_f = _rel(e, r), _rel(f, r)
        assert err_f <= 2 * err_e + 1e-4, f"tensor {i}: fast {err_f:.2e} from fp32, exact {err_e:.2e}"


@pytest.mark.parametrize("build", [tm.llama, tm.llama_lora], ids=["full", "lora"])
def test_engine_trains_alike_with_fast_kernels(build):
    torch.manual_seed(0)
    model = build(layers=4) if build is tm.llama else build()
    twin = copy.deepcopy(model)
    data = tm.batches(3, 2, B=2, T=32)
    losses = {}
    for kind, m in (("exact", model), ("fast", twin)):
        cfg = {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "seq_len": 32, "kernels": kind}
        engine = zerofit.initialize(m, cfg)
        losses[kind] = [engine.train_batch(mbs) for mbs in data]
        if kind == "fast":
            assert engine.kernels.describe().startswith("kernels: fast; blocks compiled")
            assert "fused linear cross-entropy" in engine.kernels.describe()
            # one graph per grad mode serves every block (the forward under no_grad, the recompute with grad)
            assert sorted(k.split()[0] for k in engine.kernels.compile_seconds) == ["grad", "no_grad"]
        engine.close()
    torch.testing.assert_close(torch.tensor(losses["fast"]), torch.tensor(losses["exact"]), rtol=1e-2, atol=0)
