"""PEFT LoRA models through every door, bitwise in fp32 on the CPU against PEFT on plain PyTorch
(``torch.optim.AdamW``, fused, over the trainable parameters): ``zerofit.initialize``/``train_batch``,
``zerofit.deepspeed.initialize`` and ``zerofit.hf.Trainer``; ``modules_to_save``, rsLoRA, dropout, and the
Llama, Qwen2 and GPT-2 families (each family's ``target_modules``, and ``"all-linear"``). Adapters out
(``engine.save_pretrained``: a PEFT adapter folder, or merged), and checkpoints that hold only the trainable
state beside a fingerprint of the base. See docs/lora.md.

LoRA dropout is bitwise with one micro-batch per step only: with G > 1 the engine runs each block over every
micro-batch before the next block (block-major), so the masks are drawn in another order than plain PyTorch's
(micro-batch after micro-batch); they are as random, not the same draws (test below).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

G = 2
CFG = {
    "device": "cpu",
    "precision": "fp32",
    "micro_batch_size": 2,
    "gradient_accumulation_steps": G,
    "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _reference(model, data) -> list[float]:
    """PEFT on plain PyTorch: loss / G accumulated, fused AdamW over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
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


def _assert_bitwise(engine, ref, before) -> None:
    got = dict(engine.module.named_parameters())
    for n, q in ref.named_parameters():
        assert torch.equal(got[n].detach(), q.detach()), f"{n} differs from PEFT on plain PyTorch"
        assert q.requires_grad != torch.equal(got[n].detach(), before[n]), f"{n}: trained={q.requires_grad}"


CASES = {
    "llama-modules_to_save": (
        lambda: tm.llama(tied=False),
        dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    ),
    "llama-rslora-all-linear": (lambda: tm.llama(tied=False), dict(target_modules="all-linear", use_rslora=True)),
    "qwen2": (
        tm.qwen2,
        dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ),
    "qwen2-all-linear": (tm.qwen2, dict(target_modules="all-linear")),
    "gpt2": (tm.gpt2, dict(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)),
    "gpt2-all-linear": (tm.gpt2, dict(target_modules="all-linear")),
}


def _peft(case: str, **more):
    build, lora = CASES[case]
    torch.manual_seed(0)
    return get_peft_model(build(), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **{**lora, **more}))


@pytest.mark.parametrize("case", list(CASES))
def test_train_batch_equals_peft_on_plain_pytorch(case):
    model = _peft(case)
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = zerofit.initialize(model, CFG)
    assert sum(u.numel for u in engine.units) == sum(p.numel() for p in ref.parameters() if p.requires_grad)
    data = tm.batches(3, G)
    assert [engine.train_batch(mbs) for mbs in data] == _reference(ref, data)
    _assert_bitwise(engine, ref, before)
    engine.close()


@pytest.mark.parametrize("case", ["llama-modules_to_save", "gpt2-all-linear"])
def test_deepspeed_door_equals_peft_on_plain_pytorch(case):
    import zerofit.deepspeed as deepspeed

    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    model = _peft(case)
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=filter(lambda p: p.requires_grad, model.parameters()), config=ds, device="cpu"
    )
    data = tm.batches(3, G)
    losses = [tm.ds_step(engine, mbs) for mbs in data]
    ref_losses = _reference(ref, data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-6)  # mean of items
    _assert_bitwise(engine, ref, before)
    engine.close()


def test_lora_dropout_is_bitwise_with_one_micro_batch_per_step_and_drawn_block_major_with_more():
    for g, same in ((1, True), (2, False)):
        model = _peft("llama-rslora-all-linear", lora_dropout=0.1)
        ref = copy.deepcopy(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = zerofit.initialize(model, {**CFG, "gradient_accumulation_steps": g})
        data = tm.batches(2, g)
        torch.manual_seed(5)
        losses = [engine.train_batch(mbs) for mbs in data]
        torch.manual_seed(5)
        ref_losses = _reference(ref, data)
        assert (losses == ref_losses) == same
        if same:
            _assert_bitwise(engine, ref, before)
        engine.close()


@pytest.mark.parametrize("case", ["llama-modules_to_save", "qwen2-all-linear"])
def test_hf_trainer_equals_the_plain_trainer(tmp_path, case):
    from transformers import Trainer as PlainTrainer
    from transformers import TrainingArguments, default_data_collator

    import zerofit.hf

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

    model = _peft(case)
    plain = PlainTrainer(
        model=copy.deepcopy(model),
        args=args(tmp_path / "plain"),
        train_dataset=train,
        data_collator=default_data_collator,
    )
    plain.train()
    zf = zerofit.hf.Trainer(
        model=model, args=args(tmp_path / "zf"), train_dataset=train, data_collator=default_data_collator
    )
    zf.train()
    a = [e["loss"] for e in plain.state.log_history if "loss" in e]
    b = [e["loss"] for e in zf.state.log_history if "loss" in e]
    assert len(a) == len(b) == 2
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a))
    want = dict(plain.model.named_parameters())
    for n, p in zf.zerofit_engine.module.named_parameters():
        assert torch.equal(p.detach(), want[n].detach()), f"{n} differs from the plain Trainer's"


# ---------------------------------------------------------------------------------------------- adapters out


def _base(case: str):
    torch.manual_seed(0)
    return CASES[case][0]()


@pytest.mark.parametrize("case", ["llama-modules_to_save", "gpt2-all-linear"])
def test_save_pretrained_writes_an_adapter_peft_loads_and_a_merged_model(tmp_path, case):
    from transformers import AutoModelForCausalLM

    model = _peft(case)
    engine = zerofit.initialize(model, CFG)
    data = tm.batches(2, G)
    for mbs in data:
        engine.train_batch(mbs)
    engine.save_pretrained(tmp_path / "adapter")
    engine.save_pretrained(tmp_path / "merged", merge=True)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    trained = engine.module
    ids = data[0][0]["input_ids"]
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        peft_merged = copy.deepcopy(trained).merge_and_unload()
    engine.close()
    loaded = PeftModel.from_pretrained(_base(case), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    # the merged weights are PEFT's merge_and_unload's, bitwise
    ref = dict(peft_merged.named_parameters())
    for n, p in merged.named_parameters():
        assert torch.equal(p, ref[n]), n
    # the logits of W + s*B@A against x@W + s*(x@A)@B: fp32 rounding of the sums only
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_merge_is_only_for_peft_models(tmp_path):
    engine = zerofit.initialize(_base("qwen2"), CFG)
    with pytest.raises(ValueError, match="not a PEFT model"):
        engine.save_pretrained(tmp_path / "m", merge=True)
    engine.close()


# ---------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_holds_the_trainable_state_and_the_base_by_reference(tmp_path):
    from zerofit.checkpoint import CheckpointMismatchError, export_checkpoint
    from zerofit.checkpoint.commit import CommitRecord

    data = tm.batches(4, G)
    engine = zerofit.initialize(_peft("qwen2-all-linear"), CFG)
    for mbs in data[:2]:
        engine.train_batch(mbs)
    folder = Path(engine.save_checkpoint(tmp_path / "ckpt"))
    engine.save_pretrained(tmp_path / "adapter-at-2")
    rest = [engine.train_batch(mbs) for mbs in data[2:]]
    final = engine.master_state_dict()
    engine.close()
    record = CommitRecord.read(folder).state
    assert record["frozen_excluded"] and len(record["lora_base"]["fingerprint"]) == 32
    trainable = sum(p.numel() for p in _peft("qwen2-all-linear").parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in _base("qwen2").parameters())
    assert record["parameters"]["numel"] == trainable and record["lora_base"]["frozen_numel"] == frozen
    import json

    names = json.loads((folder / "weights.safetensors.index.json").read_text())["weight_map"]
    assert names and all("lora_" in n for n in names)  # no frozen weight of the base
    # resume: bitwise the same steps
    e2 = zerofit.initialize(_peft("qwen2-all-linear"), CFG)
    e2.load_checkpoint(tmp_path / "ckpt")
    assert [e2.train_batch(mbs) for mbs in data[2:]] == rest
    for n, v in e2.master_state_dict().items():
        assert torch.equal(v, final[n]), n
    e2.close()
    # another base (same architecture, other weights): refused by name before anything is copied
    torch.manual_seed(1)
    other = get_peft_model(
        tm.qwen2(), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
    )
    e3 = zerofit.initialize(other, CFG)
    with pytest.raises(CheckpointMismatchError, match="trained over another base"):
        e3.load_checkpoint(tmp_path / "ckpt")
    e3.close()
    # zerofit export of the checkpoint: the adapter PEFT loads
    export_checkpoint(tmp_path / "ckpt", tmp_path / "adapter")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "adapter" / name).read_bytes() == (tmp_path / "adapter-at-2" / name).read_bytes()
    assert PeftModel.from_pretrained(_base("qwen2"), tmp_path / "adapter") is not None


def test_an_adapter_for_a_base_of_another_size_is_refused_from_the_headers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerofit.lora import LoraError
    from zerofit.lora.files import check_adapter_fits

    _peft("llama-rslora-all-linear").save_pretrained(tmp_path / "adapter")
    _base("llama-rslora-all-linear").save_pretrained(tmp_path / "same")
    check_adapter_fits(tmp_path / "same", tmp_path / "adapter")
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=tm.VOCAB,
            tie_word_embeddings=False,
        )
    ).save_pretrained(tmp_path / "wider")
    with pytest.raises(LoraError, match=r"takes \d+ -> \d+: the adapter was trained over another base \(shape"):
        check_adapter_fits(tmp_path / "wider", tmp_path / "adapter")
