"""[Note: MLP over sequence tiles] (engine/model/tiling.py): the tiled MLP against the untiled one, on the CPU in
fp32: outputs, input gradients and parameter gradients within the measured tolerance (not bitwise: torch's CPU
GEMM over fewer rows rounds otherwise), for Llama, Qwen3, Mistral and LoRA MLPs; MoE blocks excluded."""

from __future__ import annotations

import dataclasses

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


@pytest.mark.parametrize("build", [tm.mixtral, tm.qwen3_moe], ids=["mixtral", "qwen3-moe"])
def test_moe_blocks_sparse_mlp_is_not_tiled(build, caplog):
    """Their layers run over tiles ([Note: a block over sequence tiles]); their sparse MLP does not, alone or in
    the layer."""
    model = build()
    blocks = [m for n, m in model.named_modules() if n.endswith(("layers.0", "layers.1"))]
    why = tiling.tileable(_mlp(model))
    assert why is not None and "MoE" in why
    with caplog.at_level("INFO", logger="zerofit.engine.model.tiling"):
        assert tiling.install(blocks, lambda: 4) == 2
    assert "MoE block's sparse MLP" in caplog.text
    assert "forward" not in _mlp(model).__dict__ and all("forward" in b.__dict__ for b in blocks)


def test_planner_counts_the_tile():
    """activation_bytes: the intermediate-sized part of a block's working set scales with min(tile, tokens); where
    blocks run over tiles whole ([Note: a block over sequence tiles]), the hidden-sized part too, and the whole
    sequence keeps q, k, v, the attention's output and their gradients."""
    from zerofit.engine.plan.plan import ModelShape

    shape = ModelShape(shell_numel=10, block_numels=(10,) * 4, hidden=5120, intermediate=13824, vocab=32000)
    b = BatchShape(1, 65536, 1)
    full = activation_bytes(shape, b, 4, 2)["block_working_set"]
    tiled = activation_bytes(shape, b, 4, 2, tile=4096)["block_working_set"]
    assert full == 65536 * (48 * 5120 + 16 * 13824)
    assert tiled == (65536 * 48 * 5120 + 4096 * 16 * 13824)
    assert activation_bytes(shape, b, 4, 2, tile=1 << 20)["block_working_set"] == full
    whole = dataclasses.replace(shape, attention=4 * 5120)
    assert activation_bytes(whole, b, 4, 2)["block_working_set"] == full  # no tile: the whole block as before
    assert activation_bytes(whole, b, 4, 2, tile=4096)["block_working_set"] == 2 * (
        65536 * (2 * 4 * 5120 + 6 * 5120) + 4096 * (24 * 5120 + 8 * 13824)
    )
    assert tiles_for(b) == [32768, 16384, 8192, 4096, 2048, 1024]
    assert tiles_for(BatchShape(1, 1024, 1)) == []


def _estimate(shape: str, seq_len: int, gib: int, **kw):
    from zerofit.estimate import estimate, meta_model

    cfg = {
        "max_gpu_memory": f"{gib}GiB",
        "max_host_memory": "200GiB",
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 1,
        "seq_len": seq_len,
    } | kw.pop("cfg", {})
    return estimate(meta_model(shape=shape), cfg, measure=False, gpu=True, **kw)


def test_a_13b_lora_at_65536_tokens_plans_under_24_gib_with_tiles():
    """``zerofit estimate --shape llama-2-13b --lora --max-gpu-memory 24GiB --seq-len 65536``: refused without
    tiles (the device would need 37.4 GiB, 28.5 of it one block's working set); with the blocks over tiles it
    fits, the attention's q, k, v and output the only sequence-long part of a block's working set."""
    est = _estimate("llama-2-13b", 65536, 24, lora=True)
    assert est.plan is not None, est.refusal
    plan = est.plan
    assert plan.sequence_tile is not None and plan.sequence_tile < 65536 and plan.device_total <= 24 << 30
    assert f"sequence tiles of {plan.sequence_tile} tokens" in plan.describe()
    assert plan.device_bytes["block_working_set"] == 2 * (
        65536 * (2 * 4 * 5120 + 6 * 5120) + plan.sequence_tile * (24 * 5120 + 8 * 13824)
    )
    untiled = _estimate("llama-2-13b", 65536, 24, lora=True, cfg={"offload": {"sequence_tile": 65536}})
    assert untiled.plan is None and "device needs" in (untiled.refusal or "")


@pytest.mark.parametrize(
    "shape, seq_len, gib, kind",
    [
        ("llama-3.1-8b", 131072, 24, "lora"),
        ("llama-3.1-8b", 32768, 24, "full"),
        ("llama-3-70b", 32768, 24, "qlora"),
        ("llama-3.1-8b", 262144, 80, "lora"),
    ],
)
def test_long_context_plans_fit_their_cap(shape, seq_len, gib, kind):
    """The long-context plans of docs/long-context.md, at micro-batch 1: each under its cap with its blocks over
    sequence tiles."""
    kw = {"lora": kind != "full"} | ({"cfg": {"quantize_base": "nf4"}} if kind == "qlora" else {})
    est = _estimate(shape, seq_len, gib, **kw)
    assert est.plan is not None, est.refusal
    assert est.plan.sequence_tile is not None and est.plan.sequence_tile < seq_len
    assert est.plan.device_total <= gib << 30
    assert (kind == "qlora") == (est.plan.device_bytes.get("nf4_stage", 0) > 0)  # the base in NF4 for QLoRA


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
