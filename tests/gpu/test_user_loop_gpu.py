"""The user's own loop on the GPU ([Note: the user's loop drives the engine], src/zerofit/userloop): the
FSDP1-shaped loop on ``zerofit.fsdp`` with real streams and pinned buffers, against the same loop on plain
PyTorch in the GPU (fp32, TF32 off), at fp32 tolerance: the engine's CPU AdamW and torch's CUDA one round
differently. The window of the loop's micro-batches takes each streamed block's parameter norms on the device
and leaves the clip's multiplies to the updates ([Note: the user's clip on the device], engine/step/torch_clip.py).
Skipped without CUDA."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from tests.support import tiny_models as tm
from zerofit.fsdp import FullyShardedDataParallel as FSDP

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _loop(model, data, clip: float, scaler=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    out = []
    for mbs in data:
        total = 0.0
        for mb in mbs:
            mb = {k: v.cuda() for k, v in mb.items()}
            loss = model(**mb).loss
            (loss / len(mbs)).backward()
            total += loss.item()
        norm = (
            model.clip_grad_norm_(clip)
            if hasattr(model, "zerofit_engine")
            else torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        )
        opt.step()
        lrs.step()
        opt.zero_grad()
        out.append((total / len(mbs), float(norm)))
    return out


@pytest.mark.parametrize("window", [1, 3], ids=["window1", "window3"])
def test_the_fsdp1_shaped_loop_on_the_gpu_is_plain_pytorch_in_the_gpu(window):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    ref = tm.llama(layers=4, tied=False)
    base = copy.deepcopy(ref)
    ref = ref.cuda()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        base,
        auto_wrap_policy=policy,
        cpu_offload=CPUOffload(offload_params=True),
        device_id=0,
        zerofit_config={
            "gradient_accumulation_steps": window,
            "micro_batch_size": 2,
            "seq_len": 16,
            "offload": {"resident_blocks": 0},
        },
    )
    eng = model.zerofit_engine
    assert eng.device.type == "cuda" and all(u.home.name == "STREAMED" for u in eng.blocks)
    data = tm.batches(5, 3)
    got = _loop(model, data, clip=0.5)
    want = _loop(ref, data, clip=0.5)
    assert all(n > 0.5 for _, n in want)  # every step clipped
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    state = model.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(
            state[n].float().cpu(), p.detach().cpu(), rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}"
        )
    tl = eng.timeline()
    assert tl["upload"] > 0 and tl["download"] > 0
    clip = eng.stepper.torch_clip
    assert not clip.waiting and not clip.norms
