"""TRL's trainers over PEFT models, with zerofit's mixin in front (``with_zerofit``, docs/hf_trainer.md), against
the same trainers run stock, on the CPU in fp32: SFTTrainer with ``peft_config`` (LoRA; and QLoRA over a
BitsAndBytesConfig 4-bit model, as QLoRA recipes write it), DPOTrainer with ``peft_config`` (its reference
pass is the same model with the adapters disabled, under no_grad). Every trained weight bitwise; the losses as
logged equal."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tests.support.tiny_tokenizer import build_tokenizer  # noqa: E402
from zerofit.hf import with_zerofit  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOK = build_tokenizer()
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
COMMON = dict(
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
    max_length=32,
    bf16=False,
)


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=len(TOK),
            max_position_embeddings=64,
            pad_token_id=TOK.pad_token_id,
        )
    )


def _run_both(trainer_cls, config_cls, tmp_path, dataset, make_model=_model, fp32_adapters=False, **kw):
    """``fp32_adapters``: the stock run's adapters back in fp32 before it trains (TRL casts a QLoRA model's to
    bf16; zerofit keeps fp32 masters of every trained parameter, so its math is that of fp32 adapters)."""
    out = []
    for i, cls in enumerate((trainer_cls, with_zerofit(trainer_cls))):
        t = cls(
            model=make_model(),
            args=config_cls(output_dir=str(tmp_path / str(i)), **COMMON, **kw),
            train_dataset=dataset,
            processing_class=TOK,
            peft_config=LoraConfig(**LORA),
        )
        if fp32_adapters and i == 0:
            for p in t.model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        t.train()
        out.append(t)
    stock, zf = out
    a = [e["loss"] for e in stock.state.log_history if "loss" in e]
    b = [e["loss"] for e in zf.state.log_history if "loss" in e]
    assert len(a) == 2 and a == b
    want = {n: p for n, p in stock.model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in zf.zerofit_engine.module.named_parameters() if p.requires_grad}
    assert want and want.keys() == got.keys()
    for n, p in want.items():
        assert torch.equal(got[n].detach(), p.detach()), n
    assert not any(torch.equal(p.detach(), torch.zeros_like(p)) for n, p in got.items() if "lora_B" in n)  # trained
    return zf


def _sft_data():
    return Dataset.from_dict(
        {"text": ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine, they said."] * 4}
    )


def test_sft_trainer_with_peft_config(tmp_path):
    zf = _run_both(trl.SFTTrainer, trl.SFTConfig, tmp_path, _sft_data(), packing=False)
    # its compute_loss adds use_cache and TRL's fused-head flag: the window's forwards are still used
    assert zf.zerofit_engine.window.stats["mismatched"] == 0


def test_sft_trainer_qlora_over_a_4bit_model(tmp_path, caplog):
    """TRL casts the adapters of a 4-bit model to bf16 (QLoRA's paper); zerofit trains fp32 masters of them (its
    rule for every trained parameter: docs/lora.md), and says so at start-up; against the stock run with the
    adapters back in fp32, bitwise."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _model().save_pretrained(tmp_path / "base")

    def make():
        cfg = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        m = AutoModelForCausalLM.from_pretrained(
            tmp_path / "base", quantization_config=cfg, device_map="cpu", dtype=torch.float32
        )
        torch.manual_seed(1)
        return m

    zf = _run_both(
        trl.SFTTrainer, trl.SFTConfig, tmp_path, _sft_data(), make_model=make, packing=False, fp32_adapters=True
    )
    assert all(u.nf4 is not None for u in zf.zerofit_engine.blocks)
    assert "trained parameters are bfloat16 in the model: the engine keeps fp32 master weights" in caplog.text


def test_dpo_trainer_with_peft_config(tmp_path):
    data = Dataset.from_dict(
        {
            "prompt": ["The quick brown fox", "A stitch in time"] * 4,
            "chosen": [" jumps over the lazy dog.", " saves nine."] * 4,
            "rejected": [" sleeps.", " is late."] * 4,
        }
    )
    _run_both(trl.DPOTrainer, trl.DPOConfig, tmp_path, data)
