"""[Note: MLP over sequence tiles] (engine/model/tiling.py): the tiled MLP against the untiled one, on the CPU in
fp32: outputs, input gradients and parameter gradients within the measured tolerance (not bitwise: torch's CPU
GEMM over fewer rows rounds otherwise), for Llama, Qwen3, Mistral and LoRA MLPs; MoE blocks excluded."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from tests.support import tiny_models as tm
from zerofit.engine.model import tiling
from zerofit.engine.plan.plan import BatchShape
from zerofit.engine.plan.search import activation_bytes, tiles_for

TOL = 2e-6  # of the tensor's largest entry; measured at most 5.2e-7 (the note)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.detach(), b.detach()
    err = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
    assert err <= TOL, f"differs by {err:.3g} of the largest entry"


def _mlp(model: nn.Module) -> nn.Module:
    return next(m for n, m in model.named_modules() if n.endswith("layers.0")).mlp


def _grads(mlp: nn.Module, x: torch.Tensor, g: torch.Tensor, call):
    x = x.detach().requires_grad_(True)
    params = [p for p in mlp.parameters() if p.requires_grad]
    y = call(x)
    return y.detach(), torch.autograd.grad(y, [x, *params], g)


BUILDS = {"llama": tm.llama, "qwen3": tm.qwen3, "mistral": tm.mistral, "lora": tm.llama_lora}


@pytest.mark.parametrize("name", list(BUILDS))
@pytest.mark.parametrize("tile", [1, 5, 16, 73])
def test_tiled_mlp_is_the_mlp(name, tile):
    torch.manual_seed(0)
    mlp = _mlp(BUILDS[name]())
    x = torch.randn(2, 37, 32)
    g = torch.randn(2, 37, 32)
    y0, gr0 = _grads(mlp, x, g, mlp)
    y1, gr1 = _grads(mlp, x, g, lambda t: tiling.tiled_call(mlp, mlp.forward, t, tile))
    _close(y0, y1)
    assert len(gr0) == len(gr1) == 1 + sum(p.requires_grad for p in mlp.parameters())
    if name == "lora":
        assert len(gr0) == 1 + 6  # the LoRA A and B of gate, up and down take gradients; the base is frozen
    for a, b in zip(gr0, gr1):
        _close(a, b)


def test_installed_forward_under_functional_call():
    """The engine's way: the wrapped forward inside ``functional_call`` of the block reads the substituted
    tensors and hands their gradients back (to the leaves, not to the module's own parameters)."""
    torch.manual_seed(0)
    model = tm.llama()
    block = next(m for n, m in model.named_modules() if n.endswith("layers.0"))
    tile = [None]
    assert tiling.install([block], lambda: tile[0]) == 1
    assert tiling.install([block], lambda: tile[0]) == 0  # once
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in block.mlp.named_parameters()}
    x = torch.randn(2, 12, 32)
    g = torch.randn(2, 12, 32)

    def run():
        ls = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
        y = functional_call(block.mlp, ls, (x,))
        gr = torch.autograd.grad(y, list(ls.values()), g)
        return y, gr

    y0, gr0 = run()
    tile[0] = 24  # no more tokens (2 x 12) than the tile: its own forward, bitwise
    y1, gr1 = run()
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(gr0, gr1))
    tile[0] = 5
    y2, gr2 = run()
    _close(y0, y2)
    for a, b in zip(gr0, gr2):
        _close(a, b)
    assert all(p.grad is None for p in block.mlp.parameters())
    tiling.uninstall([block])
    assert "forward" not in block.mlp.__dict__


def test_backward_after_functional_call_ended():
    """The recompute in the backward uses the tensors the forward ran with, though the functional_call is over."""
    torch.manual_seed(0)
    mlp = _mlp(tm.llama())
    tiling.install([nn.Module()], lambda: 4)  # a block without an MLP: left alone
    holder = nn.Module()
    holder.mlp = mlp
    tiling.install([holder], lambda: 4)
    leaves = {n: (p.detach() * 2).requires_grad_(True) for n, p in mlp.named_parameters()}
    x = torch.randn(1, 10, 32)
    y = functional_call(mlp, leaves, (x,))
    (y.sum()).backward()
    ref = {n: (p.detach() * 2).requires_grad_(True) for n, p in mlp.named_parameters()}
    tiling.uninstall([holder])
    functional_call(mlp, ref, (x,)).sum().backward()
    for n in leaves:
        _close(ref[n].grad, leaves[n].grad)


def test_lora_dropout_replays_its_masks():
    """LoRA dropout in training: the backward's recompute draws the forward's masks (the same RNG state),
    so the gradient is the one of the output the forward made."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        tm.llama(tied=False), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.5, init_lora_weights=False)
    )
    model.train()
    mlp = _mlp(model)
    x = torch.randn(1, 9, 32)
    params = [p for p in mlp.parameters() if p.requires_grad]
    torch.manual_seed(3)
    y = tiling.tiled_call(mlp, mlp.forward, x, 3)
    grads = torch.autograd.grad(y.sum(), params)
    # the same masks, untiled tile by tile from the same RNG state
    torch.manual_seed(3)
    ys = [mlp(x[:, s : s + 3]) for s in range(0, 9, 3)]
    _close(torch.cat(ys, 1).detach(), y.detach())
    ref = torch.autograd.grad(torch.cat(ys, 1).sum(), params)
    for a, b in zip(ref, grads):
        _close(a, b)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=tm.VOCAB,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=tm.VOCAB,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )


@pytest.mark.parametrize("build", [_mixtral, _qwen3_moe], ids=["mixtral", "qwen3-moe"])
def test_moe_blocks_are_not_tiled(build, caplog):
    model = build()
    blocks = [m for n, m in model.named_modules() if n.endswith(("layers.0", "layers.1"))]
    why = tiling.tileable(_mlp(model))
    assert why is not None and "MoE" in why
    with caplog.at_level("INFO", logger="zerofit.engine.model.tiling"):
        assert tiling.install(blocks, lambda: 4) == 0
    assert "MoE block's sparse MLP" in caplog.text
    assert "forward" not in _mlp(model).__dict__


def test_planner_counts_the_tile():
    """activation_bytes: the intermediate-sized part of a block's working set scales with min(tile, tokens)."""
    from zerofit.engine.plan.plan import ModelShape

    shape = ModelShape(shell_numel=10, block_numels=(10,) * 4, hidden=5120, intermediate=13824, vocab=32000)
    b = BatchShape(1, 65536, 1)
    full = activation_bytes(shape, b, 4, 2)["block_working_set"]
    tiled = activation_bytes(shape, b, 4, 2, tile=4096)["block_working_set"]
    assert full == 65536 * (48 * 5120 + 16 * 13824)
    assert tiled == (65536 * 48 * 5120 + 4096 * 16 * 13824)
    assert activation_bytes(shape, b, 4, 2, tile=1 << 20)["block_working_set"] == full
    assert tiles_for(b) == [32768, 16384, 8192, 4096, 2048, 1024]
    assert tiles_for(BatchShape(1, 1024, 1)) == []


def test_a_13b_lora_at_65536_tokens_plans_under_24_gib_with_tiles():
    """``zerofit estimate --shape llama-2-13b --lora --max-gpu-memory 24GiB --seq-len 65536``: refused without
    tiles (the device would need 37.4 GiB, 28.5 of it one block's working set); with the MLP over tiles of 4096
    tokens it fits."""
    from zerofit.estimate import estimate, meta_model

    cfg = {
        "max_gpu_memory": "24GiB",
        "max_host_memory": "200GiB",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "seq_len": 65536,
    }
    est = estimate(meta_model(shape="llama-2-13b"), cfg, measure=False, gpu=True, lora=True)
    assert est.plan is not None, est.refusal
    plan = est.plan
    assert plan.sequence_tile == 4096 and plan.device_total <= 24 << 30
    assert "MLP over tiles of 4096 tokens" in plan.describe()
    # the hidden-sized part of the working set (attention, norms) is still the whole sequence's
    assert plan.device_bytes["block_working_set"] == 65536 * 48 * 5120 + 4096 * 16 * 13824
    untiled = estimate(
        meta_model(shape="llama-2-13b"), cfg | {"offload": {"sequence_tile": 65536}}, measure=False, gpu=True, lora=True
    )
    assert untiled.plan is None and "device needs" in (untiled.refusal or "")


def test_an_8b_lora_at_262144_tokens_plans_under_80_gib_with_tiles():
    """``zerofit estimate --shape llama-3.1-8b --lora --max-gpu-memory 80GiB --seq-len 262144``: the MLP over
    tiles, the plan under the cap."""
    from zerofit.estimate import estimate, meta_model

    cfg = {
        "max_gpu_memory": "80GiB",
        "max_host_memory": "200GiB",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "seq_len": 262144,
    }
    est = estimate(meta_model(shape="llama-3.1-8b"), cfg, measure=False, gpu=True, lora=True)
    assert est.plan is not None, est.refusal
    assert est.plan.sequence_tile is not None and est.plan.sequence_tile < 262144
    assert est.plan.device_total <= 80 << 30


def test_a_deep_copy_of_a_wrapped_mlp_runs_its_own_weights():
    import copy

    torch.manual_seed(0)
    holder = nn.Module()
    holder.mlp = _mlp(tm.llama())
    tiling.install([holder], lambda: 4)
    twin = copy.deepcopy(holder)
    with torch.no_grad():
        for p in twin.mlp.parameters():
            p.mul_(2)
    x = torch.randn(1, 10, 32)
    y, y2 = holder.mlp(x), twin.mlp(x)
    tiling.uninstall([holder, twin])
    _close(holder.mlp(x).detach(), y.detach())
    _close(twin.mlp(x).detach(), y2.detach())
    assert not torch.allclose(y, y2)
