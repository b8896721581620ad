"""[Note: a block over sequence tiles] (engine/model/tiling.py): whole decoder layers over sequence tiles against
their own forward, through the model's own forward and loss, on the CPU in fp32: the loss, the logits and every
trained parameter's gradient within the tiled MLP's measured tolerance (the note of [Note: MLP over sequence
tiles]: torch's CPU GEMM over fewer rows rounds otherwise), for Llama, Qwen2, Qwen3, Mistral with a sliding
window, Mixtral and Qwen3-MoE (their sparse MLP whole), full fine-tuning and LoRA, packed documents, and LoRA
dropout replayed in the backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support import tiny_models as tm
from zerofit.engine.model import tiling

TOL = 2e-6  # of the tensor's largest entry, as the tiled MLP's


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def _close(a: torch.Tensor, b: torch.Tensor, what: str, exact: torch.Tensor | None = None) -> None:
    """``b`` (tiled) within TOL of ``a`` (untiled), or, where a sum's terms cancel, within four times ``a``'s own
    fp32 rounding (its distance from ``exact``, the untiled run in float64)."""
    err = _err(a, b)
    bound = TOL if exact is None else max(TOL, 4 * _err(exact, a))
    assert err <= bound, f"{what} differs by {err:.3g} of its largest entry (bound {bound:.3g})"


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _mistral_window() -> nn.Module:
    return tm.mistral(window=8)


def _lora_dropout() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        tm.llama(tied=False),
        LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.3, init_lora_weights=False),
    )


BUILDS = {
    "llama": tm.llama,
    "qwen2": tm.qwen2,
    "qwen3": tm.qwen3,
    "mistral-window": _mistral_window,
    "mixtral": tm.mixtral,
    "qwen3-moe": tm.qwen3_moe,
    "lora": tm.llama_lora,
}


def _run(model: nn.Module, batch: dict, seed: int):
    torch.manual_seed(seed)
    out = model(**batch)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, [p for _, p in params], allow_unused=True)
    return out, dict(zip((n for n, _ in params), grads))


@pytest.mark.parametrize("name", list(BUILDS))
@pytest.mark.parametrize("tile", [6, 32])
def test_a_tiled_block_is_the_block(name, tile):
    torch.manual_seed(0)
    model = BUILDS[name]()
    model.train()
    twin = copy.deepcopy(model)
    assert tiling.install(_blocks(twin), lambda: tile) == len(_blocks(twin))
    ids = torch.randint(0, tm.VOCAB, (2, 37))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    calls = []
    own = tiling._block_over_tiles

    def counted(*a, **k):
        calls.append(a[3])
        return own(*a, **k)

    tiling._block_over_tiles = counted
    try:
        out1, g1 = _run(twin, batch, seed=5)
    finally:
        tiling._block_over_tiles = own
    out0, g0 = _run(model, batch, seed=5)
    moe = name in ("mixtral", "qwen3-moe")  # their grouped GEMM has no float64
    g64 = {n: None for n in g0} if moe else _run(model.double(), batch, seed=5)[1]
    assert calls and set(calls) == {tile // 2}  # every layer over tiles of tile // batch positions
    _close(out0.loss, out1.loss, "the loss")
    _close(out0.logits, out1.logits, "the logits")
    assert g0.keys() == g1.keys()
    for n in g0:
        assert (g0[n] is None) == (g1[n] is None), n
        if g0[n] is not None:
            _close(g0[n], g1[n], n, g64[n])


def _region_outputs(monkeypatch) -> dict[tuple, list[torch.Tensor]]:
    """Every tiled region's outputs, tile by tile, keyed by (region, the tile's input): the forward's, then the
    backward's recompute's."""
    seen: dict[tuple, list[torch.Tensor]] = {}
    made = tiling._Region.__init__

    def recording(self, fn, *a, **k):
        def fn_seen(*xs):
            ys = fn(*xs)
            seen.setdefault((id(self), xs[0].data_ptr()), []).append(torch.cat([y.detach().flatten() for y in ys]))
            return ys

        made(self, fn_seen, *a, **k)

    monkeypatch.setattr(tiling._Region, "__init__", recording)
    return seen


def test_lora_dropout_is_replayed_in_the_backward(monkeypatch):
    """LoRA dropout in training: a tile's masks differ from the untiled draw (another order of the same random
    stream), but the backward's recompute of each tile draws the forward's own masks: its outputs are bitwise the
    forward's, so the gradient is that of the function the forward computed."""
    torch.manual_seed(0)
    model = _lora_dropout()
    model.train()
    tiling.install(_blocks(model), lambda: 6)
    seen = _region_outputs(monkeypatch)
    ids = torch.randint(0, tm.VOCAB, (2, 19))
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert len(seen) == 3 * 2 * 7  # 3 layers, two regions each, 7 tiles of 3 positions (tile 6, batch 2)
    for key, outs in seen.items():
        assert len(outs) == 2 and torch.equal(outs[0], outs[1]), key  # forward, then the backward's recompute
    torch.manual_seed(8)
    assert model(input_ids=ids, labels=ids, use_cache=False).loss.item() != loss.item()  # other masks


def test_packed_documents_keep_their_own_attention():
    """Position ids that restart per document: the mask transformers builds from them reaches the core whole."""
    torch.manual_seed(0)
    model = tm.llama()
    twin = copy.deepcopy(model)
    tiling.install(_blocks(twin), lambda: 4)
    ids = torch.randint(0, tm.VOCAB, (1, 30))
    pos = torch.cat([torch.arange(12), torch.arange(18)])[None]
    batch = {"input_ids": ids, "labels": ids, "position_ids": pos, "use_cache": False}
    out0, g0 = _run(model, batch, seed=1)
    out1, g1 = _run(twin, batch, seed=1)
    _close(out0.logits, out1.logits, "the logits")
    for n in g0:
        _close(g0[n], g1[n], n)
    # the second document does not see the first: its logits are those of the document alone
    alone = model(input_ids=ids[:, 12:]).logits
    _close(alone, out1.logits[:, 12:], "the second document's logits")


def test_no_tile_or_a_short_call_runs_the_layer_itself():
    torch.manual_seed(0)
    model = tm.llama()
    twin = copy.deepcopy(model)
    tile = [None]
    tiling.install(_blocks(twin), lambda: tile[0])
    ids = torch.randint(0, tm.VOCAB, (2, 10))
    ref = model(input_ids=ids).logits
    assert torch.equal(ref, twin(input_ids=ids).logits)
    tile[0] = 20  # no more tokens (2 x 10) than the tile
    assert torch.equal(ref, twin(input_ids=ids).logits)
    with torch.no_grad():  # generation with a KV cache: the layer's own forward
        assert torch.equal(model.generate(ids[:1], max_new_tokens=3), twin.generate(ids[:1], max_new_tokens=3))
    tiling.uninstall(_blocks(twin))
    assert all("forward" not in b.__dict__ and "forward" not in b.mlp.__dict__ for b in _blocks(twin))


def test_other_layers_keep_their_own_forward_and_tile_their_mlp():
    model = tm.gpt2()
    blocks = [m for n, m in model.named_modules() if n.endswith((".h.0", ".h.1"))]
    assert blocks and all(tiling.block_tileable(b) is not None for b in blocks)
    assert "GPT2Block" in (tiling.block_tileable(blocks[0]) or "")
    assert tiling.install(blocks, lambda: 4) == 2  # their MLPs alone ([Note: MLP over sequence tiles])
    assert all("forward" not in b.__dict__ and "forward" in b.mlp.__dict__ for b in blocks)


def test_the_config_is_untouched():
    """The capture goes through a copy of the attention's config: the model's config keeps its attention."""
    torch.manual_seed(0)
    model = tm.llama()
    tiling.install(_blocks(model), lambda: 4)
    ids = torch.randint(0, tm.VOCAB, (1, 16))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert model.config._attn_implementation == "sdpa"
    assert all(b.self_attn.config is model.config for b in _blocks(model))


DOCS_BUILDS = {"llama": tm.llama, "qwen3": tm.qwen3, "mistral-window": _mistral_window, "lora": tm.llama_lora}


@pytest.mark.parametrize("name", list(DOCS_BUILDS))
def test_packed_documents_over_tiles_need_no_mask(name, monkeypatch):
    """[Note: documents without a mask]: with the stand-in, the model builds no batch x T x T mask, the tiled core
    attends document by document, and the loss, logits and gradients are those of the model with its own mask."""
    import transformers.masking_utils as mu

    torch.manual_seed(0)
    model = DOCS_BUILDS[name]()
    twin = copy.deepcopy(model)
    tiling.install(_blocks(twin), lambda: 8)
    hook = tiling.documents_hook(_blocks(twin), lambda: 8)
    assert hook is not None
    ids = torch.randint(0, tm.VOCAB, (2, 30))
    pos = torch.stack([torch.cat([torch.arange(12), torch.arange(18)]), torch.cat([torch.arange(5), torch.arange(25)])])
    batch = {"input_ids": ids, "labels": ids, "position_ids": pos, "use_cache": False}
    out0, g0 = _run(model, batch, seed=1)
    _, g64 = _run(copy.deepcopy(model).double(), batch, seed=1)

    def no_mask(*a, **k):
        raise AssertionError("a T x T mask was built")

    for fn in ("sdpa_mask", "eager_mask"):
        monkeypatch.setitem(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, fn.split("_")[0], no_mask)
    calls = []
    real = tiling._documents_attention
    monkeypatch.setattr(tiling, "_documents_attention", lambda *a: calls.append(1) or real(*a))
    given = hook(dict(batch))
    assert getattr(given["attention_mask"], tiling.DOCUMENTS) is not None
    assert given["attention_mask"].shape == (2, 1, 30, 30) and given["attention_mask"].untyped_storage().nbytes() == 1
    out1, g1 = _run(twin, given, seed=1)
    assert len(calls) == len(_blocks(twin))
    _close(out0.loss, out1.loss, "the loss")
    _close(out0.logits, out1.logits, "the logits")
    for n in g0:
        _close(g0[n], g1[n], n, g64[n])


def test_the_stand_in_only_where_it_applies():
    ids = torch.zeros(1, 16, dtype=torch.long)
    packed = torch.cat([torch.arange(6), torch.arange(10)])[None]
    base = {"input_ids": ids, "position_ids": packed}
    assert "attention_mask" in tiling.documents_in(base, 8)
    assert tiling.documents_in(base, None) is base  # no tile
    assert tiling.documents_in(base, 16) is base  # no more tokens than the tile: the layers' own forward
    one = {"input_ids": ids, "position_ids": torch.arange(16)[None]}
    assert tiling.documents_in(one, 8) is one  # one document: causal needs no mask
    padded = {**base, "attention_mask": torch.cat([torch.zeros(1, 2), torch.ones(1, 14)], 1).long()}
    assert tiling.documents_in(padded, 8) is padded  # padding: the model's own mask
    ones = {**base, "attention_mask": torch.ones(1, 16, dtype=torch.long)}
    assert getattr(tiling.documents_in(ones, 8)["attention_mask"], tiling.DOCUMENTS, None) is not None
    assert tiling.documents_hook([tm.gpt2().transformer.h[0]], lambda: 8) is None  # not tiled whole


@pytest.mark.parametrize("build", [tm.mixtral, tm.qwen3_moe], ids=["mixtral", "qwen3-moe"])
def test_a_moe_layers_sparse_mlp_runs_over_tiles_unless_router_logits_are_recorded(build):
    torch.manual_seed(0)
    model = build()
    twin = copy.deepcopy(model)
    tiling.install(_blocks(twin), lambda: 8)
    sizes: list[int] = []
    for b in _blocks(twin):
        b.mlp.register_forward_pre_hook(lambda m, a: sizes.append(a[0].shape[0] * a[0].shape[1]))
    ids = torch.randint(0, tm.VOCAB, (2, 20))
    out, _ = _run(twin, {"input_ids": ids, "labels": ids, "use_cache": False}, seed=1)
    assert sizes and max(sizes) <= 8  # tiles of 4 positions of 2 rows, forward and recompute
    sizes.clear()
    recorded = twin(input_ids=ids, use_cache=False, output_router_logits=True)
    plain = model(input_ids=ids, use_cache=False, output_router_logits=True)
    assert set(sizes) == {40}  # recorded: the sparse MLP whole
    assert len(recorded.router_logits) == len(plain.router_logits) == len(_blocks(twin))
    for a, b in zip(plain.router_logits, recorded.router_logits):
        assert a.shape == b.shape
        _close(a, b, "router logits")
    _close(plain.aux_loss, recorded.aux_loss, "the balancing loss")


def test_router_jitter_is_replayed_in_the_backward(monkeypatch):
    """Mixtral's router jitter in training draws fresh noise per call: the backward's recompute of each tile draws
    the forward's (outputs bitwise the forward's)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = tm.mixtral().config
    model = MixtralForCausalLM(MixtralConfig(**{**cfg.to_dict(), "router_jitter_noise": 0.1}))
    model.train()
    tiling.install(_blocks(model), lambda: 6)
    seen = _region_outputs(monkeypatch)
    ids = torch.randint(0, tm.VOCAB, (2, 12))
    torch.manual_seed(3)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert seen and all(len(v) == 2 and torch.equal(v[0], v[1]) for v in seen.values())
