"""A PEFT model built over a meta base without a model directory: zerofit initializes what is on meta only, and
PEFT's LoRA layers with PEFT's own init (materialize.py, _init_lora)."""

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm

peft = pytest.importorskip("peft")

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _meta_peft(materialize_adapters: bool):
    real = tm.llama()
    with torch.device("meta"):
        base = type(real)(real.config)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if materialize_adapters:
        torch.manual_seed(1)
        for mod in model.modules():
            if isinstance(getattr(mod, "lora_A", None), torch.nn.ModuleDict):
                for part in (mod.lora_A, mod.lora_B):
                    for lin in part.values():
                        lin.weight = torch.nn.Parameter(torch.randn(lin.weight.shape))
    return model


def test_meta_adapters_get_peft_init_lora_b_zero():
    torch.manual_seed(0)
    engine = zerofit.initialize(_meta_peft(materialize_adapters=False), CONFIG, device="cpu")
    state = engine.master_state_dict()
    a = {n: t for n, t in state.items() if "lora_A" in n}
    b = {n: t for n, t in state.items() if "lora_B" in n}
    assert a and b and len(a) == len(b)
    assert all(torch.count_nonzero(t) == 0 for t in b.values())  # the model starts as its base
    assert all(torch.count_nonzero(t) == t.numel() for t in a.values())
    engine.close()


def test_real_adapters_over_a_meta_base_keep_their_values():
    model = _meta_peft(materialize_adapters=True)
    want = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    engine = zerofit.initialize(copy.deepcopy(model), CONFIG, device="cpu")
    state = engine.master_state_dict()
    got = {n: t for n, t in state.items() if "lora_" in n}
    assert len(got) == len(want) > 0
    for n, t in want.items():
        key = n if n in state else next(k for k in state if k.endswith(n.split("base_model.model.")[-1]))
        assert torch.equal(state[key], t), n
    engine.close()
