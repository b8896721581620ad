"""A non-finite step is never applied silently ([Note: non-finite gradients without a norm],
engine/step/optimizer_step.py).

Without clipping the CPU updates each block during the backward, as its gradient comes down. A step whose
gradients are not finite (a huge learning rate blew the weights up; NaN activations) is refused with
FloatingPointError, every weight and moment bitwise as before it, the engine usable, as a clipped step with a
non-finite norm is; a gradient that goes non-finite only after blocks took the step's update leaves the state
torn, and the engine fails, saying so.
"""

from __future__ import annotations

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.lifecycle import EngineFailedError, EngineState

G = 2


def _cfg(**kw) -> dict:
    base = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    base.update(kw)
    return base


def _state(engine) -> dict[str, torch.Tensor]:
    from zerofit.checkpoint.state import optimizer_entries, weight_entries

    engine.wait()
    return {
        e.name: e.base[e.offset : e.offset + e.numel].clone()
        for e in weight_entries(engine) + optimizer_entries(engine)
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("placement", ["streamed", "assisted-in-backward", "resident"])
def test_a_huge_learning_rate_is_refused_and_leaves_the_state(placement):
    """lr 1e10: the first step is finite and blows the weights up; every later step's gradients are not finite."""
    off = {
        "streamed": {},
        "assisted-in-backward": {"assisted_updates": True, "assisted_fraction": 1.0},
        "resident": {"optimizer_device": "none", "param_device": "none"},
    }[placement]
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _cfg(optimizer={"lr": 1e10, "weight_decay": 0.0}, offload=off))
    if placement == "assisted-in-backward":
        assert engine.plan.assisted_updates and engine.plan.assisted_blocks
    data = tm.batches(3, G)
    engine.train_batch(data[0])
    before, steps = _state(engine), [float(u.step) for u in engine.units]
    for mbs in data[1:]:
        with pytest.raises(FloatingPointError, match=r"non-finite gradients at step 1 .*not applied"):
            engine.train_batch(mbs)
        assert engine.state is EngineState.OPEN
        _assert_same(_state(engine), before)
        assert [float(u.step) for u in engine.units] == steps
    assert engine.global_step == 1
    engine.close()


def test_nan_activations_are_refused_and_training_goes_on():
    """A batch whose forward makes NaN (a hook poisons the embedding's output) is refused; the next good batch
    trains exactly as if the bad one had never been seen."""
    torch.manual_seed(0)
    model = tm.llama()
    engine = zerofit.initialize(model, _cfg())
    torch.manual_seed(0)
    clean = zerofit.initialize(tm.llama(), _cfg())
    data = tm.batches(3, G)
    for e in (engine, clean):
        e.train_batch(data[0])
    poison = {"on": True}
    handle = model.model.embed_tokens.register_forward_hook(
        lambda mod, args, out: out * float("nan") if poison["on"] else out
    )
    before = _state(engine)
    with pytest.raises(FloatingPointError, match="not applied"):
        engine.train_batch(data[1])
    _assert_same(_state(engine), before)
    poison["on"] = False
    handle.remove()
    assert engine.train_batch(data[2]) == clean.train_batch(data[2])
    _assert_same(_state(engine), _state(clean))
    for e in (engine, clean):
        e.close()


def test_the_deepspeed_loop_refuses_a_non_finite_step_at_its_boundary():
    import zerofit.deepspeed as deepspeed

    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": G,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e10, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=tm.llama(), config=ds, device="cpu")
    data = tm.batches(2, G)
    tm.ds_step(engine, data[0])
    before = _state(engine)
    with pytest.raises(FloatingPointError, match="not applied"):
        tm.ds_step(engine, data[1])
    _assert_same(_state(engine), before)
    assert engine.global_steps == 1 and engine.state is EngineState.OPEN
    engine.close()


def test_a_gradient_that_turns_non_finite_after_updates_began_fails_the_engine():
    """The loss and the last blocks' gradients are finite; block 0's weight gradient is not (a hook on its
    output's gradient poisons what flows into block 0's weights). The last blocks were updated already: the
    state is torn, and the engine says so and fails rather than go on."""
    torch.manual_seed(0)
    model = tm.llama()
    engine = zerofit.initialize(model, _cfg())
    data = tm.batches(2, G)
    engine.train_batch(data[0])

    def poison(mod, grad_output):
        return tuple(g * float("inf") if g is not None else g for g in grad_output)

    model.model.layers[0].mlp.down_proj.register_full_backward_pre_hook(poison)
    with pytest.raises(EngineFailedError, match="torn"):
        engine.train_batch(data[1])
    assert engine.state is EngineState.FAILED


def test_a_micro_batch_that_scores_no_token_is_left_out_of_the_reported_loss():
    """A window inside a prompt longer than the window: labels all -100, a loss of 0/0 (NaN) with no gradient.
    The step's loss is over the micro-batches that score tokens; the update is plain PyTorch's."""
    import copy

    torch.manual_seed(0)
    model = tm.llama()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg())
    mbs = tm.batches(1, G)[0]
    mbs[1] = {**mbs[1], "labels": torch.full_like(mbs[1]["labels"], -100)}
    with torch.no_grad():
        scored = ref(**mbs[0]).loss.item()  # the one micro-batch that scores tokens, before the step
    loss = engine.train_batch(mbs)
    ref_losses = tm.reference_train(ref, [mbs])
    assert loss == pytest.approx(scored, rel=1e-6)
    assert not torch.isfinite(torch.tensor(ref_losses[0]))  # plain PyTorch's mean of the two is NaN
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), msg=lambda m, n=n: f"{n}: {m}")
    engine.close()


def test_metrics_lines_are_valid_json_with_non_finite_values(tmp_path):
    import json

    from zerofit.train.metrics import Metrics

    m = Metrics(tmp_path, tensorboard=False)
    m.log(1, loss=float("nan"), lr=1e-3, grad_norm=float("inf"))
    m.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert rec["loss"] is None and rec["grad_norm"] is None and rec["lr"] == 1e-3


def test_windows_inside_long_prompts_are_counted_and_warned_about(caplog):
    import logging

    import numpy as np

    from zerofit.data.build import _warn_long_prompts
    from zerofit.data.encode import Document
    from zerofit.data.packing import pack

    T = 8
    prompt = Document(
        np.arange(1, 21, dtype=np.int32), np.r_[np.zeros(17, bool), np.ones(3, bool)], "prompt/completion", "row 1"
    )  # 17 prompt tokens: two windows of it score nothing
    short = Document(
        np.arange(1, 7, dtype=np.int32), np.r_[np.zeros(2, bool), np.ones(4, bool)], "prompt/completion", "row 2"
    )
    packed = pack([prompt, short], T, 0)
    assert packed.windows_without_targets() == 2
    assert sum(int((packed[k]["labels"] != -100).any()) for k in range(len(packed))) == len(packed) - 2
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        _warn_long_prompts([prompt, short], packed, T)
    assert "1 documents have a prompt longer than --seq-len 8" in caplog.text and "2 of 4 windows" in caplog.text
