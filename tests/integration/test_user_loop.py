"""The user's own loop on zerofit ([Note: the user's loop drives the engine], src/zerofit/userloop):
FSDP1-shaped (``zerofit.fsdp.FullyShardedDataParallel``) and FSDP2-shaped (``zerofit.fsdp.fully_shard``) code as
the tutorials write it, with only the import changed, against the same loop on plain PyTorch without any wrapper,
bitwise in fp32 on the CPU: gradient accumulation (``loss / G`` per micro-batch), clipping (the model's
``clip_grad_norm_`` and torch's), an lr scheduler; bf16 against the engine's own train_batch; checkpoints; the
refusals.

The models here have untied embeddings: with a tied head and G > 1 the engine adds the head's and the embedding's
gradients of the step in another order than autograd does (each micro-batch's head gradient as it comes, the
embedding's after the blocks), equal to rounding, not bitwise (docs/fsdp.md)."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch.distributed.fsdp import CPUOffload, MixedPrecision
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import zerofit
from tests.support import tiny_models as tm
from zerofit.fsdp import FullyShardedDataParallel as FSDP
from zerofit.fsdp import fully_shard
from zerofit.userloop import UserLoopError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LR = 1e-2


def _model():
    torch.manual_seed(0)
    return tm.llama(layers=3, tied=False)


def _loop(model, data, clip=None, sched: bool = False, sync=None) -> list[tuple[float, float]]:
    """The tutorial's loop: per micro-batch ``(loss / G).backward()``, then clip, ``optimizer.step()``, the
    scheduler's step, ``zero_grad()``. ``clip``: a function (model, max_norm) -> norm; ``sync``: FSDP2's
    ``set_requires_gradient_sync`` around the micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if sched else None
    out = []
    for mbs in data:
        total = 0.0
        for i, mb in enumerate(mbs):
            if sync is not None:
                sync(model, i == len(mbs) - 1)
            result = model(**mb)
            loss = result if isinstance(result, torch.Tensor) else result.loss
            (loss / len(mbs)).backward()
            total += loss.item()
        norm = float(clip(model, 0.5)) if clip is not None else 0.0
        opt.step()
        if lrs is not None:
            lrs.step()
        opt.zero_grad()
        out.append((total / len(mbs), norm))
    return out


def _torch_clip(model, max_norm):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _assert_weights(wrapped_state: dict, ref) -> None:
    for n, p in ref.named_parameters():
        assert torch.equal(wrapped_state[n], p.detach()), n


@pytest.mark.parametrize("G,window", [(1, 1), (3, 1), (3, 3)], ids=["G1", "G3-window1", "G3-window3"])
def test_fsdp1_shaped_loop_is_plain_pytorch_bitwise(G, window):
    """FSDP(model, auto_wrap_policy, cpu_offload=CPUOffload(True)); model.clip_grad_norm_; LambdaLR. A window of
    1 (the default) takes any number of micro-batches; a window of the loop's G runs their blocks backward
    together."""
    ref = _model()
    base = copy.deepcopy(ref)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        base,
        auto_wrap_policy=policy,
        cpu_offload=CPUOffload(offload_params=True),
        zerofit_config={"gradient_accumulation_steps": window},
    )
    assert all(u.home.name == "STREAMED" for u in model.zerofit_engine.blocks)
    data = tm.batches(4, G)
    got = _loop(model, data, clip=lambda m, c: m.clip_grad_norm_(c), sched=True)
    want = _loop(ref, data, clip=_torch_clip, sched=True)
    assert got == want and all(n > 0.5 for _, n in want)  # every step clipped
    _assert_weights(model.state_dict(), ref)


def _clipped_steps(model, data) -> tuple[list[float], list]:
    """The FSDP1-shaped loop over ``data`` (each step's micro-batches), clipping at 0.5: each step's norm and the
    window's hold after it."""
    eng = model.zerofit_engine
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    got, holds = [], []
    for mbs in data:
        for mb in mbs:
            (model(**mb).loss / len(mbs)).backward()
        got.append(float(model.clip_grad_norm_(0.5)))
        opt.step()
        opt.zero_grad()
        holds.append(eng.window.hold)
    return got, holds


def test_the_default_window_learns_the_loops_micro_batches_from_its_first_step():
    """[Note: the window learns the loop's G]: FSDP(model) with no zerofit_config, 3 micro-batches per step: from
    the second step the window holds 3 (one blocks' backward per step); a step of 2 runs its held backward at the
    step; a step of 4 runs the 3 held ones' backward together and the 4th at its own backward(), and the window
    still holds 3 after it. Every step bitwise plain PyTorch's."""
    ref = _model()
    model = FSDP(copy.deepcopy(ref), cpu_offload=CPUOffload(offload_params=True))
    data = tm.batches(6, 4)
    data = [mbs[:3] for mbs in data[:3]] + [data[3][:2]] + [data[4]] + [data[5][:3]]
    got, holds = _clipped_steps(model, data)
    want = [n for _, n in _loop(ref, data, clip=_torch_clip)]
    assert holds == [3, 3, 3, 3, 3, 3], holds
    assert got == want
    _assert_weights(model.state_dict(), ref)


def test_the_learnt_window_holds_the_most_that_fit_and_takes_the_rest_one_at_a_time(monkeypatch):
    """[Note: the window learns the loop's G]: where the plan keeps the checkpoints of 2 micro-batches only (here
    Planning.hold_for refuses more), a loop of 4 per step holds the first 2 and runs each later one's blocks'
    backward at its own backward(): bitwise plain PyTorch's, the sums in autograd's order. The default plan keeps
    room for LEARN_WINDOW micro-batches where blocks stream ([Note: room for a learnt window])."""
    from zerofit.engine.plan.engine_plan import LEARN_WINDOW, Planning
    from zerofit.engine.plan.search import PlanError

    real = Planning.hold_for

    def hold_for(self, G):
        if G > 2:
            raise PlanError(f"checkpoints of {G} micro-batches do not fit (the test's)")
        return real(self, G)

    monkeypatch.setattr(Planning, "hold_for", hold_for)
    ref = _model()
    model = FSDP(copy.deepcopy(ref), cpu_offload=CPUOffload(offload_params=True))
    eng = model.zerofit_engine
    assert eng.planning.plan_batch.grad_accum == LEARN_WINDOW
    data = tm.batches(4, 4)
    got, holds = _clipped_steps(model, data)
    assert holds == [2, 2, 2, 2], holds
    assert got == [n for _, n in _loop(ref, data, clip=_torch_clip)]
    _assert_weights(model.state_dict(), ref)


def test_torchs_clip_grad_norm_over_the_wrapped_models_parameters_clips_the_engines_gradients():
    ref = _model()
    model = FSDP(copy.deepcopy(ref), cpu_offload=CPUOffload(offload_params=True))
    data = tm.batches(3, 2)
    assert _loop(model, data, clip=_torch_clip) == _loop(ref, data, clip=_torch_clip)
    _assert_weights(model.state_dict(), ref)
    # torch's function is untouched for other parameters
    lin = torch.nn.Linear(3, 3)
    lin.weight.grad = torch.ones(3, 3)
    assert float(torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0)) == pytest.approx(3.0)


def test_a_window_of_the_loops_micro_batches_takes_the_norms_on_the_device_and_clips_as_torch_twice():
    """[Note: the user's clip on the device]: with the window held, each streamed block's parameter norms are taken
    as its gradient is handed over and its multiply waits for its update; a second clip (or an unscale) before
    the step reads the gradients the first one clipped, as torch's do."""
    ref = _model()
    model = FSDP(
        copy.deepcopy(ref),
        cpu_offload=CPUOffload(offload_params=True),
        zerofit_config={"gradient_accumulation_steps": 2},
    )
    clip = model.zerofit_engine.stepper.torch_clip
    streamed = {id(u) for u in model.zerofit_engine.blocks if u.home.name == "STREAMED" and u.trains}
    assert streamed
    seen = []

    def twice(m, c):
        first = m.clip_grad_norm_(c) if m is model else _torch_clip(m, c)
        if m is model:
            seen.append((set(clip.waiting), set(clip.norms)))
        second = m.clip_grad_norm_(c / 2) if m is model else _torch_clip(m, c / 2)
        return first + second

    data = tm.batches(3, 2)
    got = _loop(model, data, clip=twice)
    want = _loop(ref, data, clip=twice)
    assert got == want
    _assert_weights(model.state_dict(), ref)
    # after the first clip: every streamed block's multiply waits for its update, the device norms are used up
    assert all(waiting >= streamed and not norms for waiting, norms in seen), seen
    assert not clip.waiting and not clip.norms


@pytest.mark.parametrize("window", [1, 3], ids=["window1", "window3"])
def test_frozen_parameters_in_the_users_loop_stay_as_they_are_and_the_rest_is_plain_pytorch(window):
    """requires_grad=False on the embedding, a whole block and every q_proj ([Note: frozen parameters]), the
    optimizer over all of model.parameters() as the tutorials build it (torch skips those without a gradient):
    the frozen weights bitwise unchanged, no gradient or moment for them, the rest bitwise the plain loop's with
    the model's clip over the trained parameters."""
    frozen = ("embed_tokens", "layers.1.", "q_proj")
    ref = _model()
    for n, p in ref.named_parameters():
        if any(f in n for f in frozen):
            p.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        copy.deepcopy(ref),
        auto_wrap_policy=policy,
        cpu_offload=CPUOffload(offload_params=True),
        zerofit_config={"gradient_accumulation_steps": window},
    )
    data = tm.batches(3, 3)
    got = _loop(model, data, clip=lambda m, c: m.clip_grad_norm_(c))
    want = _loop(
        ref, data, clip=lambda m, c: torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], c)
    )
    assert got == want
    state = model.state_dict()
    _assert_weights(state, ref)
    assert all(torch.equal(state[n], v) for n, v in before.items()) and len(before) >= 4
    eng = model.zerofit_engine
    held = {n for u in eng.units for n in u.layout.names}  # what the engine trains (has state for)
    assert not any("q_proj" in n or "embed_tokens" in n for n in held), held
    assert not eng.blocks[1].trains and eng.blocks[0].trains  # the frozen block: no state, no gradient


def test_fsdp2_shaped_loop_is_plain_pytorch_bitwise():
    """fully_shard(layer) for each block, then fully_shard(model); set_requires_gradient_sync(False) on the
    micro-batches before the last; torch's clip_grad_norm_."""
    ref = _model()
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        fully_shard(layer)
    out = fully_shard(model, offload_policy=torch.distributed.fsdp.CPUOffloadPolicy())
    assert out is model and type(model).__name__ == "FSDPLlamaForCausalLM"
    assert isinstance(model, type(ref))
    data = tm.batches(3, 2)
    got = _loop(model, data, clip=_torch_clip, sched=True, sync=lambda m, last: m.set_requires_gradient_sync(last))
    assert got == _loop(ref, data, clip=_torch_clip, sched=True)
    _assert_weights(model.zerofit_engine.master_state_dict(), ref)


def test_bf16_mixed_precision_is_the_engines_own_bf16():
    """MixedPrecision(param_dtype=torch.bfloat16): bf16 compute over fp32 masters, the same arithmetic as the
    engine's train_batch in bf16 (torch's autocast rounds elsewhere: to rounding against it)."""
    ref = zerofit.initialize(
        _model(),
        {
            "device": "cpu",
            "precision": "bf16",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"lr": LR, "weight_decay": 0.01},
        },
    )
    model = FSDP(
        _model(),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        cpu_offload=CPUOffload(offload_params=True),
        zerofit_config={"gradient_accumulation_steps": 2},
    )
    data = tm.batches(3, 2)
    got = [loss for loss, _ in _loop(model, data)]
    want = [ref.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)  # (item() means)
    mine, theirs = model.zerofit_engine.master_state_dict(), ref.master_state_dict()
    assert all(torch.equal(mine[n], v) for n, v in theirs.items())
    ref.close()


@pytest.mark.parametrize("scaler_cls", ["GradScaler", "ShardedGradScaler"])
def test_fp16_with_a_grad_scaler_and_overflowing_steps_is_the_engines_own_fp16(scaler_cls):
    """MixedPrecision(param_dtype=torch.float16) and torch's GradScaler (or FSDP's ShardedGradScaler): the loss
    scaled by the scaler, the engine's gradients unscaled and checked by torch's own kernel at unscale_, the
    overflowing steps skipped by the scaler (its optimizer.step() never called) and its scale halved: bitwise
    the engine's own fp16 with the same scale schedule (train_batch: DeepSpeed's dynamic loss scaling, hysteresis
    1), whose first steps overflow too."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    G = 2
    ref = zerofit.initialize(
        _model(),
        {
            "device": "cpu",
            "precision": "fp16",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": G,
            "optimizer": {"lr": LR, "weight_decay": 0.01},
            "fp16": {"initial_scale_power": 24, "hysteresis": 1, "loss_scale_window": 1000},
        },
    )
    model = FSDP(
        _model(),
        mixed_precision=MixedPrecision(param_dtype=torch.float16),
        cpu_offload=CPUOffload(offload_params=True),
        zerofit_config={"gradient_accumulation_steps": G},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    kw = dict(init_scale=2.0**24, growth_interval=1000)
    scaler = torch.amp.GradScaler("cpu", **kw) if scaler_cls == "GradScaler" else ShardedGradScaler(device="cpu", **kw)
    data = tm.batches(6, G)
    got = []
    for mbs in data:
        total = 0.0
        for mb in mbs:
            loss = model(**mb).loss
            scaler.scale(loss / G).backward()
            total += loss.item()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        got.append(total / G)
    want = [ref.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)  # (item() means)
    eng = model.zerofit_engine
    model(**data[0][0])  # (a forward settles the last step: applied or skipped)
    assert eng.skipped_steps == ref.skipped_steps > 0 and eng.global_step == ref.global_step > 0
    assert scaler.get_scale() == ref.scaler.scale
    mine, theirs = eng.master_state_dict(), ref.master_state_dict()
    assert all(torch.equal(mine[n], v) for n, v in theirs.items())
    ref.close()


def test_the_fsdp_tutorials_fp16_snippet_with_autocast_runs_as_written():
    """The FSDP tutorial's loop: MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32), the forward
    under ``torch.autocast(dtype=torch.float16)``, a GradScaler. The autocast over a wrapper of its own dtype is
    FSDP's recipe (the blocks' recompute and backward run under it again): it trains, bitwise the same loop
    without the autocast on this model (whose ops autocast keeps in fp16 here); the same first steps overflow."""

    def run(amp: bool):
        model = FSDP(
            _model(),
            cpu_offload=CPUOffload(offload_params=True),
            mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
            zerofit_config={"gradient_accumulation_steps": 2},
        )
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=1000)
        losses = []
        for mbs in tm.batches(5, 2):
            for mb in mbs:
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                    loss = model(**mb).loss
                scaler.scale(loss / 2).backward()
                losses.append(loss.item())
            scaler.unscale_(opt)
            model.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        model(**tm.batches(1, 1)[0][0])  # (a forward settles the last step: applied or skipped)
        return losses, model.zerofit_engine.skipped_steps, model.state_dict()

    got, skipped, mine = run(True)
    want, skipped_ref, theirs = run(False)
    assert all(math.isfinite(x) for x in got) and skipped == skipped_ref > 0
    assert got == want and all(torch.equal(mine[n], v) for n, v in theirs.items())


def test_a_checkpoint_resumes_bitwise(tmp_path):
    data = tm.batches(4, 2, seed=5)
    ref = _model()
    want = _loop(ref, data)
    a = FSDP(_model(), cpu_offload=CPUOffload(offload_params=True))
    opt = torch.optim.AdamW(a.parameters(), lr=LR, weight_decay=0.01, fused=True)
    for mbs in data[:2]:
        for mb in mbs:
            (a(**mb).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    a.save_checkpoint(tmp_path, tag="t")
    b = FSDP(_model(), cpu_offload=CPUOffload(offload_params=True))
    b.load_checkpoint(tmp_path, tag="t")
    got = _loop_from(b, data[2:], steps_done=2)
    assert got == [loss for loss, _ in want[2:]]
    _assert_weights(b.state_dict(), ref)


def test_a_sharded_state_dict_saved_with_torch_distributed_checkpoint_resumes_bitwise(tmp_path):
    """FSDP's DCP recipe: under ``state_dict_type(SHARDED_STATE_DICT)``, ``dcp.save`` of the model's state dict and
    ``FSDP.optim_state_dict``, then a new wrapper and optimizer (no step taken yet) ``dcp.load`` into theirs,
    ``load_state_dict`` and ``optim_state_dict_to_load``: the next steps bitwise the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import StateDictType

    def wrapped():
        model = FSDP(_model(), cpu_offload=CPUOffload(offload_params=True))
        return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)

    def steps(model, opt, data):
        for mbs in data:
            for mb in mbs:
                (model(**mb).loss / len(mbs)).backward()
            model.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()

    data = tm.batches(5, 2)
    first, opt = wrapped()
    steps(first, opt, data[:3])
    with FSDP.state_dict_type(first, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": first.state_dict(), "optim": FSDP.optim_state_dict(first, opt)}, checkpoint_id=tmp_path)
    second, opt2 = wrapped()
    with FSDP.state_dict_type(second, StateDictType.SHARDED_STATE_DICT):
        state = {"model": second.state_dict(), "optim": FSDP.optim_state_dict(second, opt2)}
        assert len(state["optim"]["state"]) == len(list(second.parameters()))  # zero moments at step 0
        dcp.load(state, checkpoint_id=tmp_path)
        second.load_state_dict(state["model"])
        FSDP.optim_state_dict_to_load(second, opt2, state["optim"], load_directly=True)
    steps(first, opt, data[3:])
    steps(second, opt2, data[3:])
    a, b = first.state_dict(), second.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(UserLoopError, match="LOCAL_STATE_DICT"):
        with FSDP.state_dict_type(first, StateDictType.LOCAL_STATE_DICT):
            pass


def test_fsdps_optim_state_dict_by_names_round_trips():
    """FSDP.optim_state_dict (keyed by the model's parameter names, the engine's moments) and
    FSDP.optim_state_dict_to_load into a new wrapper's optimizer: its next steps are the first run's, bitwise."""
    data = tm.batches(4, 2, seed=5)
    a = FSDP(_model(), cpu_offload=CPUOffload(offload_params=True))
    opt_a = torch.optim.AdamW(a.parameters(), lr=LR, weight_decay=0.01, fused=True)
    for k, mbs in enumerate(data):
        for mb in mbs:
            (a(**mb).loss / 2).backward()
        opt_a.step()
        opt_a.zero_grad()
        if k == 1:
            osd = FSDP.optim_state_dict(a, opt_a)
            weights = a.state_dict()
    assert "model.layers.0.mlp.up_proj.weight" in osd["state"]
    b = FSDP(_model(), cpu_offload=CPUOffload(offload_params=True))
    b.load_state_dict(weights)
    opt_b = torch.optim.AdamW(b.parameters(), lr=LR, weight_decay=0.01, fused=True)
    FSDP.optim_state_dict_to_load(b, opt_b, osd, load_directly=True)
    for mbs in data[2:]:
        for mb in mbs:
            (b(**mb).loss / 2).backward()
        opt_b.step()
        opt_b.zero_grad()
    mine, theirs = b.state_dict(), a.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in theirs.items())


def _loop_from(model, data, steps_done: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
    out = []
    for mbs in data:
        total = 0.0
        for mb in mbs:
            loss = model(**mb).loss
            (loss / len(mbs)).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        out.append(total / len(mbs))
    return out


def test_what_the_engine_cannot_stand_in_for_is_refused_by_name():
    mb = tm.batches(1, 1)[0][0]
    with pytest.raises(UserLoopError, match="param_init_fn"):
        FSDP(_model(), param_init_fn=lambda m: m)
    with torch.device("meta"):
        base = _model()
    early = torch.optim.AdamW(base.parameters(), lr=LR)  # built before the wrap, over parameters with no storage
    FSDP(base, cpu_offload=CPUOffload(offload_params=True))(**mb).loss.backward()
    with pytest.raises(UserLoopError, match="before it was wrapped"):
        early.step()
    base = _model()
    held = list(base.parameters())
    early = torch.optim.AdamW(held, lr=LR)  # built before the wrap over a real model's: still the model's own
    model = FSDP(base, cpu_offload=CPUOffload(offload_params=True))
    assert [id(p) for p in model.parameters()] == [id(p) for p in held]  # [Note: the model's parameter objects]
    model(**mb).loss.backward()
    before = held[0].detach().clone()
    early.step()
    assert not torch.equal(held[0].detach(), before)
    early.zero_grad()
    model(**mb).loss.backward()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserLoopError, match="SGD: zerofit's engine steps AdamW"):
        sgd.step()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    opt.step()  # the gradient of the backward above
    with pytest.raises(UserLoopError, match="without a backward"):
        opt.step()
    state = opt.state_dict()["state"]  # torch's AdamW format, from the engine's moments
    params = list(model.parameters())
    eng = model.zerofit_engine
    u = eng.blocks[0]
    name = eng.adapter.block_prefix(0) + "." + u.layout.names[0]
    i = [n for n, _ in model.module.named_parameters()].index(name)
    assert torch.equal(state[i]["exp_avg"], u.layout.views(u.exp_avg)[u.layout.names[0]])
    assert float(state[i]["step"]) == 2.0 and len(state) == len(params)  # the engine's steps: early's, then this one
    held = FSDP(
        _model(), cpu_offload=CPUOffload(offload_params=True), zerofit_config={"gradient_accumulation_steps": 2}
    )
    for _ in range(2):
        held(**mb).loss.backward()
    with pytest.raises(UserLoopError, match="micro-batch 3 of a step"):
        held(**mb)


class _NoBlocks(torch.nn.Module):
    """No repeated blocks: the engine holds it as one resident unit (the generic path)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(tm.VOCAB, 16)
        self.up = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, tm.VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.out(torch.relu(self.up(self.embed(input_ids))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("kind", ["blocks", "no-blocks"])
def test_a_model_that_returns_its_loss_with_or_without_repeated_blocks(kind):
    """Not a Hugging Face model (the output is the loss tensor): its repeated blocks streamed, or with none the
    whole model one resident unit; bitwise plain PyTorch either way, torch's clip included."""
    torch.manual_seed(0)
    ref = tm.PlainLM() if kind == "blocks" else _NoBlocks()
    model = FSDP(copy.deepcopy(ref), cpu_offload=CPUOffload(offload_params=True))
    assert model.zerofit_engine.adapter.streaming is (kind == "blocks")
    data = tm.batches(3, 2)
    assert _loop(model, data, clip=_torch_clip) == _loop(ref, data, clip=_torch_clip)
    _assert_weights(model.state_dict(), ref)


def _fsdp2(model):
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model, offload_policy=torch.distributed.fsdp.CPUOffloadPolicy())


@pytest.mark.parametrize("shape", ["fsdp1", "fsdp2", "frozen"])
def test_an_unclipped_loop_updates_each_block_in_the_backward_inside_its_step_bitwise_plain_pytorch(shape):
    """[Note: updates in the backward of the user's loop]: from the second step (the learnt window holds the
    loop's micro-batches) a step that ``optimizer.step()`` prepares, with no clip or unscale before it, updates
    every streamed block as its gradient comes down in that step's blocks' backward, before the step's end queues
    any other update; the steps bitwise the plain loop's (FSDP1 and FSDP2 shapes, frozen parameters, an lr
    scheduler, ``set_requires_gradient_sync`` on FSDP2's micro-batches before the last)."""
    from zerofit.engine.step.optimizer_step import Step

    ref = _model()
    if shape == "frozen":
        for n, p in ref.named_parameters():
            if "layers.1." in n or "q_proj" in n:
                p.requires_grad_(False)
    if shape == "fsdp2":
        model = _fsdp2(copy.deepcopy(ref))
    else:
        model = FSDP(copy.deepcopy(ref), cpu_offload=CPUOffload(offload_params=True))
    eng = model.zerofit_engine
    events: list[str] = []
    submit, apply = eng.worker.submit, Step.apply

    def recording_submit(task, *args, label: str = "", **kwargs):
        events.append(label)
        return submit(task, *args, label=label, **kwargs)

    def recording_apply(self, prepared):
        events.append("apply")
        return apply(self, prepared)

    data = tm.batches(4, 3)
    sync = (lambda m, last: m.set_requires_gradient_sync(last)) if shape == "fsdp2" else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eng.worker, "submit", recording_submit)
        mp.setattr(Step, "apply", recording_apply)
        got = _loop(model, data, sched=True, sync=sync)
    assert got == _loop(ref, data, sched=True)
    _assert_weights(model.zerofit_engine.master_state_dict(), ref)
    assert eng.speculator.known_steps == len(data) - 1  # the first step learns the window
    steps = "|".join(events).split("apply")
    trained = [u for u in eng.blocks if u.trains]
    assert len(trained) == (2 if shape == "frozen" else 3)
    for before in steps[1:-1]:  # each later step: every trained block's update submitted before the step's end
        assert {f"speculate[{u.name}]" for u in trained} <= set(before.split("|")), before
    assert not any(s.startswith("speculate") for s in steps[0].split("|"))  # the first: deferred, as before


def test_a_clipped_loop_keeps_its_deferred_updates_and_a_tail_forward_runs_the_held_backward_first():
    """A loop that clips prepares its step in the clip: no update before the norm ([Note: updates in the backward
    of the user's loop]); a step longer than the learnt window runs the held micro-batches' blocks backward at the
    tail micro-batch's forward, in their order: bitwise the plain loop's."""
    ref = _model()
    model = FSDP(copy.deepcopy(ref), cpu_offload=CPUOffload(offload_params=True))
    data = tm.batches(2, 2) + tm.batches(2, 3, seed=3)  # two steps of 2 (the window learns 2), then steps of 3
    got = _loop(model, data, clip=lambda m, c: m.clip_grad_norm_(c))
    assert got == _loop(ref, data, clip=_torch_clip)
    _assert_weights(model.zerofit_engine.master_state_dict(), ref)
    assert model.zerofit_engine.speculator.known_steps == 0


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("G", [1, 3])
def test_assisted_updates_in_the_users_loop_are_plain_pytorch_bitwise(clip, G, monkeypatch):
    """The device takes a share of the streamed blocks' updates ([Note: assisted updates]) under the user's loop as
    under train_batch, with the step's settings from the user's optimizer and scheduler: bitwise torch's loop,
    clipped or not (on the CPU the device's AdamW is the same kernel; ``assisted_updates`` forces the share)."""
    from zerofit.engine.update.assisted import DeviceUpdates

    ran = []
    real = DeviceUpdates.device_adamw
    monkeypatch.setattr(
        DeviceUpdates, "device_adamw", lambda self, unit, *a, **k: ran.append(unit) or real(self, unit, *a, **k)
    )
    ref = _model()
    model = FSDP(
        copy.deepcopy(ref),
        cpu_offload=CPUOffload(offload_params=True),
        zerofit_config={"offload": {"assisted_updates": True}},
    )
    plan = model.zerofit_engine.plan
    assert plan.assisted_updates and plan.assisted_blocks
    data = tm.batches(4, G)
    got = _loop(model, data, clip=(lambda m, c: m.clip_grad_norm_(c)) if clip else None, sched=True)
    want = _loop(ref, data, clip=_torch_clip if clip else None, sched=True)
    assert got == want
    _assert_weights(model.state_dict(), ref)
    assert ran, "the device updated its share of the blocks"


def _wide():
    """A Llama of 256 wide (untied): the optimizer thread's AdamW of a block takes long enough to race a read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=tm.VOCAB,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    )


@pytest.mark.parametrize("door", ["zerofit.fsdp", "zerofit.initialize"])
def test_the_users_own_model_read_right_after_each_step_has_that_steps_weights(door):
    """A stress test of [Note: a read of the user's model] (engine/faces/user_model.py): many short runs whose
    blocks' AdamW runs on the optimizer thread after a clipped step, the user's own object evaluated (or its
    state_dict read) the moment each step returns. Without the wait its read raced the thread writing the masters
    (about half of such reads were 1e-3 to 2e-2 away); with it every read is plain PyTorch's weights, bitwise."""
    import zerofit

    reads = 0
    for run in range(4):
        torch.manual_seed(run)
        ref = _wide()
        mine = copy.deepcopy(ref)
        data = tm.batches(3, 2, seed=run + 1)
        x = data[0][0]["input_ids"]
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01, fused=True)
        if door == "zerofit.fsdp":
            outer = FSDP(mine, cpu_offload=CPUOffload(offload_params=True), zerofit_config={"device": "cpu"})
            engine = outer.zerofit_engine
            outer_opt = torch.optim.AdamW(outer.parameters(), lr=LR, weight_decay=0.01, fused=True)
        else:
            engine = zerofit.initialize(
                mine,
                {
                    "device": "cpu",
                    "precision": "fp32",
                    "micro_batch_size": 2,
                    "gradient_accumulation_steps": 2,
                    "gradient_clipping": 1e9,
                    "optimizer": {"lr": LR, "weight_decay": 0.01},
                },
            )
        assert engine.deferred  # the blocks' updates run on the optimizer thread, after the step returns
        for mbs in data:
            for mb in mbs:
                (ref(**mb).loss / len(mbs)).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            opt.step()
            opt.zero_grad()
            if door == "zerofit.fsdp":
                for mb in mbs:
                    (outer(**mb).loss / len(mbs)).backward()
                outer.clip_grad_norm_(1e9)
                outer_opt.step()
                outer_opt.zero_grad()
            else:
                engine.train_batch(mbs)
            # the moment the step returned: its state_dict (copied: its tensors are views of the weights), or
            state = {k: v.clone() for k, v in mine.state_dict().items()} if run % 2 else None
            with torch.no_grad():
                got = mine(input_ids=x).logits  # its forward
                assert torch.equal(got, ref(input_ids=x).logits)
            if state is not None:
                assert all(torch.equal(state[n], p.detach()) for n, p in ref.named_parameters())
            reads += 1
        engine.close()
    assert reads == 12
