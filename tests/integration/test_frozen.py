"""Frozen parameters stay frozen ([Note: frozen parameters], engine/memory/store.py), through every door.

A parameter with ``requires_grad=False``, or one no parameter group holds, is not trained: its weights stay
bitwise as they were, it holds no optimizer state and no gradient buffer, and the trained parameters follow
``torch.optim.AdamW`` over them alone. The reference is plain PyTorch with the fused AdamW (the kernel zerofit's
CPU updates run), so fp32 weights are compared bitwise.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import zerofit
from tests.support import tiny_models as tm

G = 2
CFG = {
    "device": "cpu",
    "precision": "fp32",
    "micro_batch_size": 2,
    "gradient_accumulation_steps": G,
    "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _reference(model: nn.Module, data, clip: float = 0.0, params=None) -> list[float]:
    """Plain PyTorch: loss / G accumulated, clipping over the trained parameters, fused AdamW over them. Returns
    each step's mean loss, averaged as the engine averages it (in fp32)."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    out = []
    for mbs in data:
        opt.zero_grad()
        losses = []
        for mb in mbs:
            loss = model(**mb)
            loss = loss if isinstance(loss, torch.Tensor) else loss.loss
            (loss / len(mbs)).backward()
            losses.append(loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        out.append(torch.stack(losses).float().mean().item())
    return out


def _freeze(model: nn.Module, *fragments: str) -> list[str]:
    names = [n for n, p in model.named_parameters() if any(f in n for f in fragments)]
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)
    return names


def _assert_bitwise(engine, ref: nn.Module, before: dict[str, torch.Tensor]) -> None:
    got = dict(engine.module.named_parameters())
    for n, q in ref.named_parameters():
        assert torch.equal(got[n].detach(), q.detach()), f"{n} differs from plain PyTorch"
        if not q.requires_grad:
            assert torch.equal(got[n].detach(), before[n]), f"frozen {n} moved"
        else:
            assert not torch.equal(got[n].detach(), before[n]), f"trained {n} did not move"


def _trained_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


CASES = {
    # a frozen embedding (the shell's input side), one projection of every block, and a whole block
    "llama": (lambda: tm.llama(tied=False), ("embed_tokens", "q_proj", "layers.1.")),
    # tied embedding and head frozen with the final norm: the shell trains nothing
    "llama-frozen-shell": (tm.llama, ("embed_tokens", "model.norm")),
    "qwen2-biases": (tm.qwen2, ("bias",)),
    "gpt2": (tm.gpt2, ("wte", "wpe", "h.0.attn")),
    "generic": (tm.MLPRegressor, ("0.weight",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_batch_leaves_frozen_parameters_and_equals_adamw_over_the_rest(case):
    build, fragments = CASES[case]
    torch.manual_seed(0)
    model = build()
    frozen = _freeze(model, *fragments)
    assert frozen
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = zerofit.initialize(model, CFG)
    assert engine.frozen == frozenset(frozen) - {"lm_head.weight"}  # tied: counted under its first name
    # no optimizer state and no gradient buffer for a frozen parameter
    assert sum(u.exp_avg.numel() for u in engine.units) == _trained_numel(ref)
    assert sum(u.numel for u in engine.units) == _trained_numel(ref)
    for u in engine.units:
        if u.grads.tensor is not None:
            assert u.grads.tensor.numel() == u.numel
    if engine.grads.pool is not None:
        assert engine.grads.pool.slots[0].tensor.numel() == max(u.numel for u in engine.blocks)
    data = tm.batches(4, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    assert losses == _reference(ref, data)
    _assert_bitwise(engine, ref, before)
    engine.close()


def test_a_frozen_block_trains_nothing_and_passes_gradients_through():
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    _freeze(model, "layers.1.")
    engine = zerofit.initialize(model, CFG)
    block = engine.blocks[1]
    assert not block.trains and block.frozen_numel == sum(p.numel() for p in model.model.layers[1].parameters())
    ref = copy.deepcopy(model)
    data = tm.batches(2, G)
    assert [engine.train_batch(mbs) for mbs in data] == _reference(ref, data)
    # the blocks before the frozen one got their gradients through it
    for n, p in ref.named_parameters():
        if "layers.0." in n:
            assert torch.equal(dict(engine.module.named_parameters())[n].detach(), p.detach())
    assert float(block.step) == 0.0
    engine.close()


@pytest.mark.parametrize("clip", [0.05, 1e3], ids=["clipped", "not-clipped"])
def test_clipping_takes_the_norm_of_the_trained_parameters(clip):
    torch.manual_seed(0)
    model = tm.qwen2()
    _freeze(model, "embed_tokens", "layers.0.mlp")
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = zerofit.initialize(model, {**CFG, "gradient_clipping": clip})
    data = tm.batches(3, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    ref_losses = _reference(ref, data, clip=clip)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    got = dict(engine.module.named_parameters())
    for n, q in ref.named_parameters():
        if q.requires_grad:  # a clipped step's speculative update is rolled back: fp32 rounding, not bitwise
            torch.testing.assert_close(got[n].detach(), q.detach())
        else:
            assert torch.equal(got[n].detach(), before[n])
    engine.close()


def test_parameters_in_no_group_are_frozen_as_torch_optim_leaves_them(caplog):
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    chosen = [p for n, p in model.named_parameters() if "mlp" in n]
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        engine = zerofit.initialize(model, CFG, param_groups=[{"params": chosen}])
    assert "in no parameter group: they are not trained" in caplog.text
    data = tm.batches(2, G)
    ref_params = [p for n, p in ref.named_parameters() if "mlp" in n]
    assert [engine.train_batch(mbs) for mbs in data] == _reference(ref, data, params=ref_params)
    got = dict(engine.module.named_parameters())
    for n, q in ref.named_parameters():
        assert torch.equal(got[n].detach(), q.detach()), n
        if "mlp" not in n:
            assert torch.equal(got[n].detach(), before[n]), n
    engine.close()


def test_nothing_to_train_is_refused():
    model = tm.llama()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(zerofit.config.ConfigError, match="at least one parameter to train"):
        zerofit.initialize(model, CFG)


def test_checkpoint_round_trip_and_exclude_frozen_parameters(tmp_path):
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    _freeze(model, "embed_tokens", "layers.2.")
    twin = copy.deepcopy(model)
    engine = zerofit.initialize(model, CFG)
    data = tm.batches(4, G)
    for mbs in data[:2]:
        engine.train_batch(mbs)
    engine.save_checkpoint(tmp_path, tag="full")
    engine.save_checkpoint(tmp_path, tag="lean", exclude_frozen_parameters=True)
    rest = [engine.train_batch(mbs) for mbs in data[2:]]
    final = engine.master_state_dict()
    engine.close()
    for tag in ("full", "lean"):
        fresh = copy.deepcopy(twin)
        e2 = zerofit.initialize(fresh, CFG)
        e2.load_checkpoint(tmp_path, tag=tag)
        assert [e2.train_batch(mbs) for mbs in data[2:]] == rest
        for n, v in e2.master_state_dict().items():
            assert torch.equal(v, final[n]), (tag, n)
        e2.close()
    full = sum(f.stat().st_size for f in (tmp_path / "full").iterdir())
    lean = sum(f.stat().st_size for f in (tmp_path / "lean").iterdir())
    frozen_bytes = sum(p.numel() * 4 for n, p in twin.named_parameters() if not p.requires_grad)
    assert full - lean >= frozen_bytes


# ---------------------------------------------------------------------------------------------- PEFT


def _peft_model(**lora):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(tm.llama(tied=False), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora))


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_peft_lora_trains_only_the_adapter_and_its_saved_adapter_reloads(tmp_path, targets):
    pytest.importorskip("peft")
    from peft import PeftModel

    model = _peft_model(target_modules=targets, lora_dropout=0.0)
    ref = copy.deepcopy(model)
    base_copy = copy.deepcopy(model.get_base_model())  # the base with PEFT's layers; its own weights inside
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = zerofit.initialize(model, CFG)
    data = tm.batches(3, G)
    assert [engine.train_batch(mbs) for mbs in data] == _reference(ref, data)
    _assert_bitwise(engine, ref, before)
    trained = engine.module
    trained.save_pretrained(tmp_path / "adapter")
    ids = data[0][0]["input_ids"]
    with torch.no_grad():
        want = trained(input_ids=ids).logits
    engine.close()
    # the adapter on a fresh copy of the original base gives the trained model's logits
    from peft.tuners.tuners_utils import BaseTunerLayer

    fresh = copy.deepcopy(tm.llama(tied=False))
    fresh.load_state_dict(
        {k.replace("base_layer.", ""): v for k, v in base_copy.state_dict().items() if "lora_" not in k}
    )
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    assert any(isinstance(m, BaseTunerLayer) for m in loaded.modules())
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- the other doors


def test_deepspeed_door_trains_requires_grad_and_model_parameters_subsets():
    import zerofit.deepspeed as deepspeed

    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    data = tm.batches(3, G)
    # requires_grad=False, passed as DeepSpeed scripts do: filter(lambda p: p.requires_grad, ...)
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    _freeze(model, "embed_tokens", "layers.0.")
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=filter(lambda p: p.requires_grad, model.parameters()), config=ds, device="cpu"
    )
    losses = [tm.ds_step(engine, mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data)))
    _assert_bitwise(engine, ref, before)
    engine.close()
    # every parameter trainable, but model_parameters holds only some: DeepSpeed leaves the others untouched
    torch.manual_seed(0)
    model = tm.llama(tied=False)
    ref = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    subset = [p for n, p in model.named_parameters() if "self_attn" in n]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=subset, config=ds, device="cpu")
    losses = [tm.ds_step(engine, mbs) for mbs in data]
    ref_params = [p for n, p in ref.named_parameters() if "self_attn" in n]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data, params=ref_params)))
    got = dict(engine.module.named_parameters())
    for n, q in ref.named_parameters():
        assert torch.equal(got[n].detach(), q.detach()), n
        assert ("self_attn" in n) != torch.equal(got[n].detach(), before[n]), n
    engine.close()


def test_hf_trainer_with_a_peft_model_matches_the_plain_trainer(tmp_path):
    pytest.importorskip("peft")
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

    model = _peft_model(target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
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
        torch.testing.assert_close(p.detach(), want[n].detach(), msg=lambda m, n=n: f"{n}: {m}")
        if "lora_" not in n:
            assert torch.equal(p.detach(), want[n].detach()), f"frozen {n} moved"
