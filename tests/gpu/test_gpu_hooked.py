"""The hooked mode on a GPU ([Note: the hooked mode], engine/model/hooked.py): every unit streamed through the upload
stream into slots (none resident) while the compute stream runs the model's own forward and each call's recompute in
its backward; plain PyTorch's losses and weights on the same GPU in fp32 (to cuBLAS's run-to-run rounding)."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.integration.test_hooked_mode import _pairs, _plain, _t5
from tests.support import any_models as am
from tests.support import tiny_models as tm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cfg(**kw):
    cfg = {"device": "cuda", "precision": "fp32", "micro_batch_size": 2, "gradient_accumulation_steps": 2}
    cfg |= {"optimizer": {"lr": 1e-3, "weight_decay": 0.01}, "kernels": "exact", "adapter": "hooked"}
    return cfg | {"offload": {"resident_blocks": 0, "prefetch_depth": 1}} | kw


@pytest.mark.parametrize("name", ["unet", "t5"])
def test_hooked_units_stream_on_the_gpu_with_plain_pytorchs_numbers(name):
    torch.manual_seed(0)
    if name == "t5":
        model, classes = _t5()
        data, cfg = _pairs(4, 2), _cfg(hooked_units=classes)
    else:
        model, data, cfg = am.UNet(p=0.0), tm.batches(4, 2, T=8), _cfg()
    ref = copy.deepcopy(model).cuda()
    engine = zerofit.initialize(model, cfg)
    assert engine.adapter.hooked and all(u.home.name == "STREAMED" for u in engine.blocks)
    torch.manual_seed(2)  # the same dropout draws on both sides (T5's)
    got = [engine.train_batch(mbs) for mbs in data]
    cuda = [[{k: v.cuda() for k, v in mb.items()} for mb in mbs] for mbs in data]
    torch.manual_seed(2)
    want = _plain(ref, cuda)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach().cpu(), rtol=0, atol=1e-5, msg=n)
    engine.close()


def test_an_encoder_decoder_generates_on_the_gpu_in_the_hooked_mode():
    """[Note: generation in the hooked mode] on the card: greedy tokens of a trained T5, each unit streamed, as
    transformers' own ``generate`` over the engine's masters on the same card."""
    torch.manual_seed(0)
    model, classes = _t5()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(hooked_units=classes))
    for mbs in _pairs(2, 2):
        engine.train_batch(mbs)
    engine.adapter.model.eval()
    prompt = _pairs(1, 1, seed=7)[0][0]["input_ids"]
    got = engine.generate(input_ids=prompt, max_new_tokens=6, min_new_tokens=4, do_sample=False)
    ref.load_state_dict(engine.master_state_dict(), strict=False)
    want = ref.cuda().eval().generate(input_ids=prompt.cuda(), max_new_tokens=6, min_new_tokens=4, do_sample=False)
    assert torch.equal(got.cpu(), want.cpu())
    engine.close()
