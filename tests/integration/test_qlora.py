"""QLoRA ([Note: an NF4 base], src/zerofit/engine/model/nf4.py), on the CPU against bitsandbytes' own
QLoRA path: a model loaded with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)``, PEFT's LoRA over it, torch's fused AdamW over the adapters, in fp32.

Through ``zerofit.initialize`` that model trains bitwise so; ``quantize_base: nf4`` over the 16-bit model
directory (``zerofit train --qlora``) quantizes each linear weight as it is read, to the same bytes
bitsandbytes' loading makes, and trains bitwise so too. The base is held packed (~0.52 B/param, what the planner
counts), uploaded packed and dequantized where the block computes; adapters out are PEFT's, a merge writes them
into the dequantized base; refusals come before anything is allocated.
"""

from __future__ import annotations

import json

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bf  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from zerofit.models.nf4 import Packed, QuantError, nbytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

G = 2
LR = 1e-2
CFG = {
    "device": "cpu",
    "precision": "fp32",
    "micro_batch_size": 2,
    "gradient_accumulation_steps": G,
    "optimizer": {"lr": LR, "weight_decay": 0.01},
}
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qlora") / "model"
    torch.manual_seed(0)
    tm.llama(layers=3).save_pretrained(path)
    return path


def _bnb_model(path, seed: int = 1, checkpointing: bool = False):
    """bitsandbytes' QLoRA, as its users write it: the 4-bit model, prepare_model_for_kbit_training, PEFT.
    ``checkpointing``: prepare_model_for_kbit_training's default (the model checkpoints its layers, reentrant)."""
    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    q = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, device_map="cpu", dtype=torch.float32)
    q = prepare_model_for_kbit_training(q, use_gradient_checkpointing=checkpointing)
    torch.manual_seed(seed)
    q = get_peft_model(q, LoraConfig(**LORA))
    q.train()
    return q


def _reference(model, data) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01, fused=True)
    out = []
    for mbs in data:
        opt.zero_grad()
        losses = []
        for mb in mbs:
            loss = model(**mb).loss
            (loss / len(mbs)).backward()
            losses.append(loss.detach())
        opt.step()
        out.append(torch.stack(losses).float().mean().item())
    return out


def _codes(model) -> dict[str, torch.Tensor]:
    """Each Linear4bit's packed codes, by the PEFT model's parameter name."""
    return {
        n + ".weight": m.weight.data.reshape(-1).clone()
        for n, m in model.named_modules()
        if type(m).__name__ == "Linear4bit"
    }


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_adapters_equal(engine, ref) -> None:
    got = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    want = _adapters(ref)
    assert got.keys() == want.keys() and want
    for n, w in want.items():
        assert torch.equal(got[n].detach(), w), n


def test_a_bitsandbytes_4bit_peft_model_trains_bitwise_as_bitsandbytes_qlora(model_dir):
    """PEFT over a BitsAndBytesConfig model through zerofit.initialize: its Linear4bit codes and scales held as
    they are (packed, in host memory), the blocks' weights dequantized where they compute; losses and adapters
    bitwise bitsandbytes' QLoRA on plain PyTorch."""
    ref, mine = _bnb_model(model_dir), _bnb_model(model_dir)
    codes = _codes(mine)
    data = tm.batches(3, G)
    want = _reference(ref, data)
    engine = zerofit.initialize(mine, CFG)
    held = [u for u in engine.blocks if u.nf4 is not None]
    assert len(held) == 3 and engine.shell.nf4 is None  # bitsandbytes leaves lm_head in 16 bits
    for u in held:  # the packed codes are the Linear4bit's, byte for byte
        prefix = engine.adapter.block_prefix(u.index) + "."
        for i, n in enumerate(u.nf4.names):
            assert torch.equal(u.nf4.packed(i).data, codes[prefix + n]), n
    # outside a step the module's 4-bit weights have no 16-bit copy: on the meta device, never silently zeros
    q_base = engine.module.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(q_base).__name__ == "DequantizedLinear" and q_base.weight.is_meta
    got = [engine.train_batch(mbs) for mbs in data]
    assert got == want
    _assert_adapters_equal(engine, ref)
    # they were uploaded packed and dequantized, block by block
    assert any(lab.endswith("(nf4)") for lab in tm.upload_labels(engine))
    engine.close()


def _peft_in_memory(path, seed: int = 1):
    """PEFT over the 16-bit model in memory (its linears quantized by ``quantize_base: nf4`` at initialize), the
    same adapters as :func:`_bnb_model`'s (the same seed, the same modules)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(**LORA)).train()


def _base_entries(state: dict) -> dict:
    """The blocks' 4-bit layers' state_dict entries: the codes and bitsandbytes' quant state."""
    return {k: v for k, v in state.items() if ".base_layer.weight" in k and "layers." in k}


@pytest.mark.parametrize("door", ["initialize", "initialize, quantized in memory", "zerofit.fsdp"])
def test_the_users_own_4bit_model_gives_the_engines_numbers_at_every_point_and_after_close(model_dir, door):
    """After each step and after close, the user's own PEFT-over-4-bit object (and ``engine.module``, and the
    wrapper) computes the logits of bitsandbytes' QLoRA trained on plain PyTorch bitwise, generates its tokens,
    and its ``state_dict`` holds the ``Linear4bit`` entries bitsandbytes' model holds (the packed codes and quant
    state, not a dequantized copy) ([Note: the user's 4-bit layers outside a step], nf4.py)."""
    from zerofit.fsdp import FullyShardedDataParallel

    ref = _bnb_model(model_dir)
    mine = _peft_in_memory(model_dir) if "memory" in door else _bnb_model(model_dir)
    data = tm.batches(3, G)
    if door == "zerofit.fsdp":
        outer = FullyShardedDataParallel(mine, zerofit_config={"device": "cpu"})
        engine = outer.zerofit_engine
        opt = torch.optim.AdamW([p for p in outer.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
        objects = [mine, outer]
    else:
        engine = zerofit.initialize(mine, {**CFG, **({"quantize_base": "nf4"} if "memory" in door else {})})
        outer, opt = None, None
        objects = [mine, engine.module]
    ids = data[0][0]["input_ids"]
    prompt = ids[:1, :5]
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01, fused=True)
    for mbs in data:
        ref_opt.zero_grad()
        for mb in mbs:
            (ref(**mb).loss / len(mbs)).backward()
        ref_opt.step()
        if outer is not None:
            for mb in mbs:
                (outer(**mb).loss / len(mbs)).backward()
            opt.step()
            opt.zero_grad()
        else:
            engine.train_batch(mbs)
        with torch.no_grad():
            want = ref(input_ids=ids).logits
            for obj in objects:
                assert torch.equal(obj(input_ids=ids).logits, want)
    # (train mode: bitsandbytes' eval path on the CPU repacks its weights, and refuses layers this narrow)
    tokens = ref.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for obj in objects:
        assert torch.equal(obj.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), tokens)
    want_sd, got_sd = _base_entries(ref.state_dict()), _base_entries(mine.state_dict())
    assert want_sd.keys() == got_sd.keys() and len(want_sd) == 3 * 7 * 6
    for k, v in want_sd.items():
        assert torch.equal(got_sd[k], v), k
    engine.close()
    with torch.no_grad():
        assert torch.equal(mine(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert torch.equal(mine.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), tokens)


def test_the_models_own_checkpointing_is_turned_off_and_it_trains_as_bitsandbytes_qlora_with_it(model_dir):
    """prepare_model_for_kbit_training(model) as docs/lora.md writes it checkpoints the model's layers (reentrant),
    which cannot run under the engine's backward: the engine, which checkpoints every block itself, turns it off
    (once, said in the log), and the losses and adapters are bitsandbytes' QLoRA with it, bitwise."""
    ref, mine = _bnb_model(model_dir, checkpointing=True), _bnb_model(model_dir, checkpointing=True)
    assert mine.is_gradient_checkpointing
    data = tm.batches(2, G)
    want = _reference(ref, data)
    engine = zerofit.initialize(mine, CFG)
    assert not mine.is_gradient_checkpointing
    assert [engine.train_batch(mbs) for mbs in data] == want
    _assert_adapters_equal(engine, ref)
    engine.close()


def _engine_over_dir(model_dir, precision: str = "fp32", **cfg):
    """What `zerofit train --model DIR --qlora` builds: PEFT over the meta model, the base read from the files."""
    from zerofit.config import load_config
    from zerofit.engine.engine import Engine
    from zerofit.lora.model import from_model_dir
    from zerofit.lora.options import LoraOptions

    opts = LoraOptions(r=4, alpha=8, targets="all-linear", qlora=True)
    model, source = from_model_dir(model_dir, opts, seed=0)
    loaded = load_config({**CFG, "precision": precision, "quantize_base": "nf4", **cfg})
    return Engine(model, loaded.config, source=source)


def test_qlora_over_a_16bit_folder_quantizes_as_bitsandbytes_loading_does_and_trains_bitwise(model_dir):
    """quantize_base: nf4 over the model directory: each linear weight quantized as it is read, to the bytes
    bitsandbytes' own loading makes; with the same adapters to start from, the same losses and adapters as
    bitsandbytes' QLoRA, bitwise; master_state_dict gives the dequantized base."""
    engine = _engine_over_dir(model_dir)
    ref = _bnb_model(model_dir)
    codes = _codes(ref)
    with torch.no_grad():  # the reference starts from zerofit's adapters (PEFT's init, zerofit's seed)
        start = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
        for n, p in ref.named_parameters():
            if p.requires_grad:
                p.copy_(start[n])
    for u in engine.blocks:
        prefix = engine.adapter.block_prefix(u.index) + "."
        assert u.nf4 is not None and len(u.nf4.names) == 7  # q k v o gate up down
        for i, n in enumerate(u.nf4.names):
            assert torch.equal(u.nf4.packed(i).data, codes[prefix + n]), n
    msd = engine.master_state_dict()
    lin = ref.base_model.model.model.layers[1].mlp.down_proj.base_layer
    want_w = bf.dequantize_4bit(lin.weight.data, lin.weight.quant_state)
    assert torch.equal(msd["base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"], want_w)
    data = tm.batches(3, G, seed=4)
    assert [engine.train_batch(mbs) for mbs in data] == _reference(ref, data)
    _assert_adapters_equal(engine, ref)
    engine.close()


def test_the_host_holds_the_nf4_base_at_half_a_byte_a_parameter_as_planned(tmp_path):
    """A wider model (64 Ki-element weights): the NF4 weights take ~0.52 B/param of host memory, the 16-bit frozen
    ones 2 B (bf16); the planner's frozen_weights bytes are what the engine allocates, and zerofit estimate
    --qlora plans the same."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerofit.estimate import estimate

    torch.manual_seed(0)
    base = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=97,
            max_position_embeddings=64,
        )
    )
    base.save_pretrained(tmp_path / "wide")
    engine = _engine_over_dir(tmp_path / "wide", precision="bf16")
    q_numel = sum(s.numel for u in engine.units if u.nf4 is not None for s in u.nf4.specs)
    q_bytes = sum(u.nf4.nbytes for u in engine.units if u.nf4 is not None)
    assert q_numel == 2 * (4 * 256 * 256 + 3 * 256 * 512)
    assert 0.515 <= q_bytes / q_numel <= 0.535, q_bytes / q_numel
    # the planner's count per tensor is bitsandbytes' own pieces (codes, 8-bit scales, their scales and map), plus
    # at most 3 + 3 bytes of 4-byte alignment
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    p = Packed.quantize(w)
    pieces = p.data.numel() + p.absmax.numel() + 4 * p.absmax2.numel() + 4 * p.code2.numel()
    assert pieces <= nbytes(w.numel()) <= pieces + 6, (pieces, nbytes(w.numel()))
    plain = sum(u.frozen_host.numel() * u.frozen_host.element_size() for u in engine.units if u.frozen is not None)
    assert all(u.frozen_host.dtype == torch.bfloat16 for u in engine.units if u.frozen is not None)
    assert engine.plan.host_bytes["frozen_weights"] == plain + q_bytes
    est = estimate(
        str(tmp_path / "wide"),
        {**CFG, "precision": "bf16", "quantize_base": "nf4"},
        measure=False,
        gpu=False,
        lora=dict(r=4, alpha=8, targets="all-linear"),
    )
    assert est.plan.host_bytes["frozen_weights"] == plain + q_bytes
    assert sum(est.shape.nf4_numels) == q_numel and sum(est.shape.nf4_bytes) == q_bytes
    engine.close()


def test_the_adapter_out_loads_on_bitsandbytes_base_and_the_merge_is_into_the_dequantized_base(model_dir, tmp_path):
    """engine.save_pretrained: PEFT's adapter folder, which PeftModel.from_pretrained puts on a fresh 4-bit base to
    the trained model's logits (those of bitsandbytes' QLoRA trained alike); merge=True: each weight is the
    dequantized base plus PEFT's delta (not re-quantized: merging into 4-bit weights breaks models), and the
    config has no quantization_config."""
    ref, mine = _bnb_model(model_dir), _bnb_model(model_dir)
    data = tm.batches(2, G)
    _reference(ref, data)
    engine = zerofit.initialize(mine, CFG)
    for mbs in data:
        engine.train_batch(mbs)
    engine.save_pretrained(tmp_path / "adapter")
    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    fresh = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=cfg, device_map="cpu", dtype=torch.float32
    )
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    mb = tm.batches(1, 1, seed=9)[0][0]
    ref.eval()
    loaded.train()  # (bitsandbytes' CPU inference path repacks the weights: compare in training mode)
    ref.train()
    with torch.no_grad():
        assert torch.equal(loaded(**mb).logits, ref(**mb).logits)
    engine.save_pretrained(tmp_path / "merged", merge=True)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    layer = ref.base_model.model.model.layers[2].self_attn.o_proj
    want = bf.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state)
    want = want + layer.get_delta_weight("default")
    assert torch.equal(merged.model.layers[2].self_attn.o_proj.weight.detach(), want)
    assert torch.equal(merged.model.embed_tokens.weight, ref.base_model.model.model.embed_tokens.weight)
    engine.close()


def test_a_lean_checkpoint_resumes_bitwise_over_the_requantized_base(model_dir, tmp_path):
    """A QLoRA run's checkpoint holds the adapters and their moments beside the base's fingerprint (the NF4 codes
    sampled); a new engine over the same folder (quantized again as it is read) loads it and continues bitwise."""
    data = tm.batches(4, G, seed=2)
    a = _engine_over_dir(model_dir)
    want = [a.train_batch(mbs) for mbs in data]
    a.close()
    b = _engine_over_dir(model_dir)
    for mbs in data[:2]:
        b.train_batch(mbs)
    b.save_checkpoint(tmp_path / "ck", tag="t")
    b.close()
    names = json.loads((tmp_path / "ck" / "t" / "weights.safetensors.index.json").read_text())["weight_map"]
    assert names and all("lora_" in n for n in names)
    c = _engine_over_dir(model_dir)
    c.load_checkpoint(tmp_path / "ck", tag="t")
    assert [c.train_batch(mbs) for mbs in data[2:]] == want[2:]
    c.close()


def test_refusals_come_before_anything_is_allocated(model_dir, monkeypatch):
    """No frozen linear to quantize; a full checkpoint of an NF4 base; bitsandbytes missing: each a clear error
    naming what to do."""
    torch.manual_seed(0)
    with pytest.raises(QuantError, match="no frozen nn.Linear"):
        zerofit.initialize(tm.llama(), {**CFG, "quantize_base": "nf4"})  # everything trains
    model = tm.llama()
    for n, p in model.named_parameters():
        p.requires_grad_("layers.0." in n and "norm" in n)
    engine = zerofit.initialize(model, {**CFG, "quantize_base": "nf4"})
    assert all(u.nf4 is not None for u in engine.blocks)
    from zerofit.checkpoint.errors import CheckpointStateError

    with pytest.raises(CheckpointStateError, match="held in NF4"):
        engine.save_checkpoint("/tmp/never-written-zerofit", tag="x")
    engine.close()
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # an import of it now fails, as where it is absent
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(QuantError, match=r"needs bitsandbytes.*zerofit\[qlora\]"):
        _engine_over_dir(model_dir)


def test_a_meta_model_without_files_is_initialized_then_quantized():
    """A model on the meta device without its files (a benchmark's): each linear initialized by the model's own
    init (as the rest of such a model is), then held in NF4; it trains."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        base = tm.llama(tied=False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for n, p in list(model.named_parameters()):
        if p.is_meta and p.requires_grad:  # the adapters real (as bench/common.py's init_meta_adapters)
            mod, _, leaf = n.rpartition(".")
            model.get_submodule(mod)._parameters[leaf] = torch.nn.Parameter(torch.randn(p.shape) * 0.02)
    engine = zerofit.initialize(model, {**CFG, "quantize_base": "nf4"})
    w = engine.master_state_dict()["base_model.model.model.layers.0.mlp.up_proj.weight"]
    std = LlamaForCausalLM.config_class().initializer_range
    assert w.dtype == torch.float32 and 0.5 * std < float(w.std()) < 1.5 * std  # the model's init, dequantized
    losses = [engine.train_batch(mbs) for mbs in tm.batches(2, G)]
    assert all(torch.isfinite(torch.tensor(losses)))
    engine.close()


def test_the_deepspeed_door_and_the_hf_trainer_take_a_4bit_peft_model(model_dir, tmp_path):
    """The other doors, with a BitsAndBytesConfig PEFT model as written for them: zerofit.deepspeed.initialize
    (the tutorial's loop) bitwise bitsandbytes' QLoRA on plain PyTorch in its weights; zerofit.hf.Trainer against
    transformers' own Trainer over the same 4-bit model, every adapter bitwise."""
    from transformers import Trainer as PlainTrainer
    from transformers import TrainingArguments, default_data_collator

    import zerofit.deepspeed as deepspeed
    import zerofit.hf

    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    ref, mine = _bnb_model(model_dir), _bnb_model(model_dir)
    engine, *_ = deepspeed.initialize(
        model=mine, model_parameters=filter(lambda p: p.requires_grad, mine.parameters()), config=ds, device="cpu"
    )
    data = tm.batches(3, G)
    losses = [tm.ds_step(engine, mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data)), rtol=0, atol=1e-6)
    _assert_adapters_equal(engine, ref)
    engine.close()

    g = torch.Generator().manual_seed(3)
    train = [{"input_ids": (ids := torch.randint(0, tm.VOCAB, (16,), generator=g)), "labels": ids} for _ in range(8)]

    def args(out):
        return TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=2e-3,
            max_grad_norm=0.0,
            num_train_epochs=1,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=7,
        )

    plain = PlainTrainer(
        model=_bnb_model(model_dir),
        args=args(tmp_path / "plain"),
        train_dataset=train,
        data_collator=default_data_collator,
    )
    plain.train()
    zf = zerofit.hf.Trainer(
        model=_bnb_model(model_dir),
        args=args(tmp_path / "zf"),
        train_dataset=train,
        data_collator=default_data_collator,
    )
    zf.train()
    a = [e["loss"] for e in plain.state.log_history if "loss" in e]
    b = [e["loss"] for e in zf.state.log_history if "loss" in e]
    assert len(a) == len(b) == 2
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a))
    _assert_adapters_equal(zf.zerofit_engine, plain.model)
