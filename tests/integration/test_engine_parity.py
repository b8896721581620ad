"""The engine's math is plain PyTorch's: parity with torch.optim.AdamW training, on the CPU.

The engine streams every block through device slots, updates on its CPU worker
thread and accumulates gradients block-major; the reference is the same model
trained the textbook way. Per RELIABILITY.md: fp32 losses and final weights
equal at fp32 tolerances (rtol 1.3e-6, atol 1e-5) over 20 steps.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm

STEPS, G = 20, 2


def _cfg(**kw):
    base = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": G,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    }
    base.update(kw)
    return base


_reference = tm.reference_train


def _assert_same_weights(engine, ref):
    master = engine.master_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(master[name], p.detach(), msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    "build",
    [tm.llama, lambda: tm.llama(tied=False), tm.qwen2, tm.qwen3, tm.mistral, tm.gpt2, tm.PlainLM, tm.MLPRegressor],
    ids=["llama-tied", "llama", "qwen2", "qwen3", "mistral", "gpt2", "plain-module", "generic"],
)
def test_fp32_parity_with_plain_pytorch(build):
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg())
    data = tm.batches(STEPS, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    ref_losses = _reference(ref, data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    _assert_same_weights(engine, ref)
    # the module itself carries the current weights (fp32 training: exactly the master)
    for (_n, p), (_, q) in zip(engine.module.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
    if hasattr(engine.adapter, "streaming") and build not in (tm.MLPRegressor,):
        assert engine.adapter.streaming, "block models must take the block-streaming path"
    engine.close()


def test_gradient_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    model = tm.llama()
    big = copy.deepcopy(model)
    e_acc = zerofit.initialize(model, _cfg(gradient_accumulation_steps=4))
    e_big = zerofit.initialize(big, _cfg(micro_batch_size=8, gradient_accumulation_steps=1))
    for mbs in tm.batches(5, 4):
        l_acc = e_acc.train_batch(mbs)
        joined = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}
        l_big = e_big.train_batch([joined])
        assert l_acc == pytest.approx(l_big, rel=1e-6)
    a, b = e_acc.master_state_dict(), e_big.master_state_dict()
    for n in a:
        torch.testing.assert_close(a[n], b[n])


@pytest.mark.parametrize(
    "clip,speculate",
    [(0.05, True), (1e3, True), (1.16, True), (0.05, False)],
    ids=["always-clipped", "never-clipped", "mixed", "always-clipped-no-speculation"],
)
def test_global_norm_clipping_matches_clip_grad_norm(clip, speculate):
    """Clipping by the global norm, exactly, whichever way the engine schedules the host updates: speculative
    updates during the backward ([Note: speculative updates]) held when the step is not clipped, rolled back
    and redone when it is; after a clipped step, deferred updates with some streamed blocks updated on
    the device ([Note: assisted updates]). This model's norms lie between 1.08 and 1.26: clip 1.16 mixes."""
    torch.manual_seed(0)
    model = tm.qwen2()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(gradient_clipping=clip, offload={"speculative_updates": speculate}))
    assert engine.plan.deferred_updates and engine.plan.assisted_updates
    dev_block = f"model.layers.{min(engine.plan.assisted_blocks)}"  # one the device updates
    calls = []
    assisted = engine.device_updates.assisted_update
    engine.device_updates.assisted_update = lambda unit, dst: (calls.append(unit.name), assisted(unit, dst))
    data = tm.batches(STEPS, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data, clip=clip)))
    _assert_same_weights(engine, ref)  # reads the masters: applies the last step's pending updates
    stats = engine.speculation_stats
    assert "model.layers.0" not in calls
    if not speculate:
        assert stats == {"held": 0, "rolled_back": 0, "waited": 0}
        assert calls.count(dev_block) == STEPS
    elif clip == 0.05:  # the first step speculates and is rolled back; the others wait for the norm
        assert stats == {"held": 0, "rolled_back": 1, "waited": STEPS - 1}
        assert calls.count(dev_block) == STEPS - 1
    elif clip == 1e3:
        assert stats == {"held": STEPS, "rolled_back": 0, "waited": 0} and not calls
    else:
        assert stats["held"] >= 2 and stats["rolled_back"] >= 2, stats
        assert calls.count(dev_block) == stats["waited"]


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_assisted_fraction_keeps_the_math(fraction):
    """Clipped steps with no block or every streamed block updated on the device (in chunks smaller than a
    block): the same weights as clip_grad_norm_ + AdamW either way."""
    torch.manual_seed(0)
    model = tm.qwen2()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(
        model, _cfg(gradient_clipping=0.05, offload={"speculative_updates": False, "assisted_fraction": fraction})
    )
    streamed = {u.index for u in engine.blocks if u.home.name == "STREAMED"}
    assert engine.plan.assisted_blocks == (streamed if fraction else frozenset())
    assert engine.plan.assisted_updates == bool(fraction)
    steps = 6
    data = tm.batches(steps, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data, clip=0.05)))
    _assert_same_weights(engine, ref)


@pytest.mark.parametrize(
    "api,shell", [("train_batch", "auto"), ("deepspeed", "auto"), ("train_batch", "host"), ("deepspeed", "host")]
)
def test_assisted_updates_in_the_backward_keep_the_math(api, shell):
    """[Note: assisted updates in the backward]: immediate updates (no clipping) with a share of the streamed
    blocks updated on the device right after their gradient is complete (forced here: on the CPU the planner
    leaves them off), the others by the CPU worker; with the shell's optimizer on the host, the shell updated
    on the device too: the same losses and weights as torch.optim.AdamW, through train_batch and through the
    DeepSpeed-shaped loop; the device-updated units never reach the worker and never send their gradient
    down."""
    torch.manual_seed(0)
    model = tm.qwen2()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(
        model, _cfg(offload={"assisted_updates": True, "assisted_fraction": 0.5, "shell_optimizer": shell})
    )
    assert engine.plan.shell_optimizer_on_device == (shell != "host")
    plan = engine.plan
    assert not plan.deferred_updates and plan.assisted_updates and plan.assisted_blocks
    assert plan.device_bytes.get("assist_buffers", 0) == 0  # CPU: device memory is counted as host
    assert plan.host_bytes["device:assist_buffers"] > 0
    streamed = {u.index for u in engine.blocks if u.home.name == "STREAMED"}
    assert plan.assisted_blocks < streamed  # a share: the CPU keeps the others
    calls = []
    inner = engine.device_updates.device_adamw
    engine.device_updates.device_adamw = lambda unit, grad, *a, **kw: (
        calls.append((unit.name, grad is not None)),
        inner(unit, grad, *a, **kw),
    )[1]
    # the CPU worker's tasks, as submitted: the trace's cpu lane holds the tasks that ended within the step, and
    # the last update of a backward may still run when the step returns (on a loaded machine it did)
    tasks = set()
    submit = engine.worker.submit
    engine.worker.submit = lambda fn, priority=0, label=None, ready=None: (
        tasks.add(label),
        submit(fn, priority, label, ready),
    )[1]
    data = tm.batches(STEPS, G)
    if api == "train_batch":
        losses = [engine.train_batch(mbs) for mbs in data]
    else:
        losses = [tm.ds_step(engine, mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data)))
    _assert_same_weights(engine, ref)
    assisted = {f"model.layers.{i}" for i in plan.assisted_blocks} | ({"shell"} if shell == "host" else set())
    assert {n for n, _ in calls} == assisted and all(on_device for _, on_device in calls)
    assert len(calls) == STEPS * len(assisted)
    labels = {(e["lane"], e["label"]) for e in engine.trace()}
    assert "adamw[shell]" not in tasks and ("download", "shell") not in labels
    for u in engine.blocks:
        if u.index in streamed:
            cpu = f"adamw[{u.name}]" in tasks
            assert cpu == (u.name not in assisted), u.name
            assert (("download", u.name) in labels) == (u.name not in assisted), u.name
    engine.close()


def test_assisted_updates_in_the_backward_only_beside_the_plan():
    """The planner adds them on a GPU only when their buffers fit in what the plan leaves of the budget: never
    at the cost of a resident block; never with deferred updates' buffer for the gradient; off when asked."""
    from zerofit.engine.plan.search import BatchShape, ModelShape, make_plan

    shape = ModelShape(
        shell_numel=20_000_000, block_numels=(10_000_000,) * 8, hidden=512, intermediate=1376, vocab=32000
    )
    batch = BatchShape(1, 256, 2)
    kw = dict(
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        host_budget=None,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=None,
        prefetch_depth=None,
    )
    roomy = make_plan(shape, batch, device_budget=None, **kw)
    assert roomy.resident_blocks == 8 and not roomy.assisted_updates  # nothing streams
    base = make_plan(shape, batch, device_budget=None, **(kw | dict(resident_blocks=2, assisted_updates=False)))
    assert not base.assisted_updates
    wide = make_plan(shape, batch, device_budget=None, **(kw | dict(resident_blocks=2)))
    assert wide.assisted_updates and wide.assisted_blocks
    assert wide.device_bytes["assist_buffers"] == 2 * 3 * (-(-10_000_000 // (8 * 64)) * 64) * 4
    assert wide.device_total == base.device_total + wide.device_bytes["assist_buffers"]
    # a budget that fits the plan but not the buffers beside it: the plan, without them
    tight = make_plan(shape, batch, device_budget=base.device_total + 1000, **(kw | dict(resident_blocks=2)))
    assert not tight.assisted_updates and tight.resident_blocks == 2
    # the planner's own choice of resident blocks is the one without the buffers
    free = make_plan(shape, batch, device_budget=base.device_total + 1000, **kw)
    assert (
        free.resident_blocks
        == make_plan(
            shape, batch, device_budget=base.device_total + 1000, **(kw | dict(assisted_updates=False))
        ).resident_blocks
    )
    assert not make_plan(
        shape, batch, device_budget=None, **(kw | dict(resident_blocks=2, assisted_fraction=0.0))
    ).assisted_updates
    assert not make_plan(shape, batch, device_budget=None, **(kw | dict(resident_blocks=2, ranks=2))).assisted_updates
    deferred = make_plan(shape, batch, device_budget=None, **(kw | dict(resident_blocks=2, deferred_updates=True)))
    assert deferred.device_bytes["assist_buffers"] == wide.device_bytes["assist_buffers"] * 4 // 3


@pytest.mark.parametrize("precision,clip", [("bf16", 0.0), ("bf16", 0.05), ("fp32", 1.16)])
def test_announced_window_is_train_batch_bitwise_with_one_upload_per_block(precision, clip):
    """[Note: a window's forwards at once]: forward_window(batches), then the DeepSpeed-shaped loop over them:
    every micro-batch loss and every master equal train_batch's bitwise, and each streamed block goes up once
    for the window's forwards (not once per micro-batch, nor as 16-bit copies)."""
    G3, steps = 3, 4
    data = tm.batches(steps, G3)
    cfg = _cfg(
        precision=precision, gradient_accumulation_steps=G3, gradient_clipping=clip, offload={"prefetch_depth": 1}
    )  # 2 slots for 3 blocks: every pass over the blocks uploads them
    torch.manual_seed(0)
    a = zerofit.initialize(tm.qwen2(), cfg)
    torch.manual_seed(0)
    b = zerofit.initialize(tm.qwen2(), cfg)
    streamed = [u.name for u in a.blocks if u.home.name == "STREAMED"]
    for mbs in data:
        a.forward_window(mbs)
        losses = tm.ds_losses(a, mbs)
        uploads = tm.upload_labels(a)
        ref = b.train_batch(mbs)
        assert torch.stack(losses).mean().item() == ref
        assert not any(x.endswith("(16)") for x in uploads)
        assert uploads == tm.upload_labels(b), uploads  # train_batch's uploads: once per pass over the blocks
        assert len(uploads) < G3 * len(streamed)  # a forward per micro-batch would upload each block G3 times
    assert a.window_stats == {"announced": steps, "mismatched": 0}
    a.wait(), b.wait()
    for ua, ub in zip(a.units, b.units):
        assert torch.equal(ua.master.cpu(), ub.master.cpu()), ua.name
        assert torch.equal(ua.exp_avg.cpu(), ub.exp_avg.cpu()), ua.name


def test_announced_window_mismatch_falls_back_and_refusals(tmp_path, caplog):
    """A call whose inputs are not the next announced micro-batch's drops the rest of the window: the losses are
    those of the forwards the caller ran, the step equals train_batch over the micro-batches actually called.
    forward_window is refused mid-window, with too many micro-batches; train_batch is refused while announced
    forwards wait, and a checkpoint saved then changes nothing of them."""
    G3 = 3
    (mbs,), (other,) = tm.batches(1, G3), tm.batches(1, G3, seed=5)
    cfg = _cfg(precision="bf16", gradient_accumulation_steps=G3)
    torch.manual_seed(0)
    a = zerofit.initialize(tm.qwen2(), cfg)
    torch.manual_seed(0)
    b = zerofit.initialize(tm.qwen2(), cfg)
    called = [mbs[0], other[1], mbs[2]]  # the second call is not the announced one
    with pytest.raises(ValueError, match="at most"):
        a.forward_window(mbs + mbs[:1])
    a.forward_window(mbs)
    with pytest.raises(RuntimeError, match="start of an accumulation window"):
        a.forward_window(mbs)
    with pytest.raises(RuntimeError, match="middle of a DeepSpeed-style accumulation"):
        a.train_batch(mbs)
    a.save_checkpoint(tmp_path)  # mid-window: the last step's state; the announced forwards stay
    with caplog.at_level("WARNING", logger="zerofit"):
        losses = tm.ds_losses(a, called)
    assert "other inputs than the next micro-batch" in caplog.text
    assert a.window_stats == {"announced": 1, "mismatched": 1}
    assert torch.stack(losses).mean().item() == b.train_batch(called)
    a.wait(), b.wait()
    for ua, ub in zip(a.units, b.units):
        assert torch.equal(ua.master.cpu(), ub.master.cpu()), ua.name


def test_trace_shows_every_block_and_every_host_update():
    """engine.trace(): the last step interval by interval, each lane's intervals in order, ending by the
    step's wall time; every block computes, every host-updated block has its CPU task: in the trace of its step,
    or, where it still ran when its step returned (the backward's last update, on a loaded machine), in the
    next step's, with a negative start."""
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.qwen2(), _cfg())
    traces = []
    for mbs in tm.batches(3, G):
        engine.train_batch(mbs)
        traces.append(engine.trace())
    trace, tl = engine.trace(), engine.timeline()
    labels = {(e["lane"], e["label"]) for e in trace}
    cpu = {e["label"] for t in traces for e in t if e["lane"] == "cpu"}  # (any step's: a loaded machine's worker
    # may run a step's last update wholly between two steps)
    for u in engine.blocks:
        assert ("compute", u.name) in labels
        if not u.optimizer_on_device:
            assert f"adamw[{u.name}]" in cpu, u.name
    for e in trace:  # a CPU task of the previous step still running at the start begins before 0
        assert e["start"] <= e["end"] <= tl["step"] + 1e-3 and e["end"] >= 0.0, e
        assert e["start"] >= 0.0 or e["lane"] == "cpu", e
    busy = sum(e["end"] - e["start"] for e in trace if e["lane"] == "compute")
    assert busy == pytest.approx(tl["compute"], rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("precision,clip", [("bf16", 0.0), ("bf16", 0.05), ("bf16", 1.16), ("fp32", 0.0)])
def test_deepspeed_style_loop_is_train_batch_bitwise(precision, clip):
    """The DeepSpeed-shaped loop (forward, backward, step per micro-batch, G = 3) runs the blocks' backward
    block-major at the boundary ([Note: the block backward waits for the boundary]) and, in 16-bit, uploads the
    window's later forwards from 16-bit host copies ([Note: 16-bit copies for extra forwards]): every
    micro-batch loss and every master equal train_batch's bitwise, over steps that clip and steps that
    don't (the copies never outlive the weights they were taken from)."""
    G3, steps = 3, 5
    data = tm.batches(steps, G3)
    # 2 slots for 3 blocks and none kept in the gradient buffers: every forward uploads every block
    cfg = _cfg(
        precision=precision,
        gradient_accumulation_steps=G3,
        gradient_clipping=clip,
        offload={"prefetch_depth": 1, "window_keep_blocks": False},
    )
    torch.manual_seed(0)
    a = zerofit.initialize(tm.qwen2(), cfg)
    torch.manual_seed(0)
    b = zerofit.initialize(tm.qwen2(), cfg)
    sixteen, full = 0, []
    for mbs in data:
        losses = tm.ds_losses(a, mbs)
        uploads = tm.upload_labels(a)
        sixteen += sum(1 for x in uploads if x.endswith("(16)"))
        full.append(sum(1 for x in uploads if not x.endswith("(16)")))
        ref = b.train_batch(mbs)
        assert torch.stack(losses).mean().item() == ref
    assert a.global_step == b.global_step == steps
    a.wait(), b.wait()  # the last step's host and assisted updates applied
    for ua, ub in zip(a.units, b.units):
        assert torch.equal(ua.master.cpu(), ub.master.cpu()), ua.name
        assert torch.equal(ua.exp_avg.cpu(), ub.exp_avg.cpu()), ua.name
    streamed = sum(1 for u in a.blocks if u.home.name == "STREAMED")
    if precision == "bf16" and clip == 0.0:
        # [Note: 16-bit copies after the update]: the worker refreshes each copy after the update, so only the
        # very first forward uploads fp32
        assert full == [streamed] + [0] * (steps - 1) and sixteen >= 3 * steps, (full, sixteen)
        assert a.plan.host_bytes["host16_copies"] > 0
    elif precision == "bf16":
        # clipping: the updates wait for the norm; a step's first forward uploads fp32, but for the blocks the
        # device updates on the way (those refresh their copies from the device: [Note: 16-bit copies after the
        # update]; their "+adamw" uploads are not counted here)
        low = streamed - len(a.plan.assisted_blocks)
        assert full[0] == streamed and all(low <= f <= streamed for f in full), full
        assert sixteen >= 2 * steps, sixteen
        assert a.plan.host_bytes["host16_copies"] > 0
    else:
        assert sixteen == 0 and sum(full) > steps * streamed


def test_copies_after_the_update_serve_the_next_window_and_go_stale_on_a_load(tmp_path):
    """[Note: 16-bit copies after the update]: bf16, no clipping, a share of the streamed blocks updated on the
    device in the backward (forced: on the CPU the planner leaves it off) and the others by the worker. From the
    second window on, every upload of the DeepSpeed-shaped loop reads a 16-bit copy (the device-updated blocks'
    cast on the device and sent down, the others' cast by the worker), and the losses and masters are
    train_batch's bitwise. A checkpoint load makes the copies stale: the step after it uploads the loaded fp32
    masters and repeats the saved run's losses bitwise."""
    G3, steps = 3, 4
    data = tm.batches(steps, G3)
    cfg = _cfg(
        precision="bf16",
        gradient_accumulation_steps=G3,
        offload={"prefetch_depth": 1, "assisted_updates": True, "assisted_fraction": 0.5},
    )
    torch.manual_seed(0)
    a = zerofit.initialize(tm.qwen2(), cfg)
    torch.manual_seed(0)
    b = zerofit.initialize(tm.qwen2(), cfg)
    assisted = a.plan.assisted_blocks
    streamed = {u.name for u in a.blocks if u.home.name == "STREAMED"}
    assert assisted and {f"model.layers.{i}" for i in assisted} < streamed
    first = []
    for i, mbs in enumerate(data):
        losses = tm.ds_losses(a, mbs)
        uploads = tm.upload_labels(a)
        first.append(sum(1 for x in uploads if not x.endswith("(16)")))
        assert torch.stack(losses).mean().item() == b.train_batch(mbs)
        if i == 1:
            a.save_checkpoint(tmp_path, tag="after2")
            saved = [tm.ds_losses(a, mbs) for mbs in data[2:]]
            a.load_checkpoint(tmp_path, tag="after2")
            again = tm.ds_losses(a, data[2])
            assert sum(1 for x in tm.upload_labels(a) if not x.endswith("(16)")) == len(streamed)
            assert [x.item() for x in again] == [x.item() for x in saved[0]]
            a.load_checkpoint(tmp_path, tag="after2")
    n = len(streamed)
    assert first == [n, 0, n, 0], first  # fp32 uploads only in the first window and the one after the load
    a.wait(), b.wait()
    for ua, ub in zip(a.units, b.units):
        assert torch.equal(ua.master.cpu(), ub.master.cpu()), ua.name
        assert torch.equal(ua.exp_avg_sq.cpu(), ub.exp_avg_sq.cpu()), ua.name
    a.close(), b.close()


@pytest.mark.parametrize("clip,fraction", [(0.0, None), (0.0, 0.375), (0.05, None)])
def test_copies_after_the_update_give_the_device_a_larger_share(clip, fraction):
    """[Note: 16-bit copies after the update]: the CPU's cast after each update costs it about a third of an AdamW,
    so the DeepSpeed-shaped loop's plan has the device update more of the streamed blocks (copies_fraction of the
    configured share), unless the share was set in the config or the updates are deferred (no CPU casts)."""
    from zerofit.engine.plan.search import assisted_choice, copies_fraction

    off = {"assisted_updates": True} | ({"assisted_fraction": fraction} if fraction is not None else {})
    cfg = _cfg(precision="bf16", gradient_accumulation_steps=3, gradient_clipping=clip, offload=off)
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(layers=8), cfg)
    before = engine.plan.assisted_blocks
    assert before == assisted_choice(0, 8, 0.375)
    tm.ds_losses(engine, tm.batches(1, 3)[0])
    larger = fraction is None and clip == 0.0
    assert engine.plan.assisted_blocks == (assisted_choice(0, 8, copies_fraction(0.375)) if larger else before)
    assert len(assisted_choice(0, 8, copies_fraction(0.375))) > len(before)
    engine.close()


@pytest.mark.parametrize(
    "precision,clip,assisted", [("bf16", 0.0, None), ("bf16", 0.05, False), ("bf16", 0.05, None), ("fp32", 0.0, None)]
)
def test_a_window_keeps_blocks_in_the_gradient_buffers(precision, clip, assisted):
    """[Note: a window keeps some blocks]: in the DeepSpeed-shaped loop the first forward of a window puts some
    streamed blocks into slots carved from the idle gradient buffers, and the window's later forwards do not
    upload them again; the boundary's backward gets the buffers back. 8 blocks, 2 weight slots, 2 gradient
    buffers: 4 blocks kept in 16-bit (2 in fp32), those just before the last two. Losses and masters equal
    train_batch's bitwise, also with clipping and the device's deferred share of the updates (whose uploads
    the count leaves out)."""
    G3, steps = 3, 3
    data = tm.batches(steps, G3)
    cfg = _cfg(
        precision=precision,
        gradient_accumulation_steps=G3,
        gradient_clipping=clip,
        offload={"prefetch_depth": 1, "assisted_updates": assisted},
    )
    torch.manual_seed(0)
    a = zerofit.initialize(tm.llama(layers=8), cfg)
    torch.manual_seed(0)
    b = zerofit.initialize(tm.llama(layers=8), cfg)
    streamed = [u for u in a.blocks if u.home.name == "STREAMED"]
    assert len(streamed) == 8 and a.plan.weight_slots == 2 and a.plan.grad_slots == 2
    n_keep = 4 if precision == "bf16" else 2
    want = {u.name for u in streamed[8 - 2 - n_keep : 8 - 2]}
    grads = [(g.tensor.data_ptr(), g.tensor.data_ptr() + g.tensor.nbytes) for g in a.grads.pool.slots]
    for mbs in data:
        losses = []
        for i, mb in enumerate(mbs):
            out = a(**mb)
            if i == 0:
                kept = {s.tenant.name for s in a.streamer.kept.values()}
                assert kept == want, kept
                for s in a.streamer.kept.values():  # the slots are the gradient buffers' memory
                    assert any(lo <= s.tensor.data_ptr() < hi for lo, hi in grads)
            a.backward(out.loss)
            a.step()
            losses.append(out.loss.detach().float())
        assert not a.streamer.kept
        ups = Counter(x.removesuffix("(16)") for x in tm.upload_labels(a))
        for u in streamed if not a.plan.assisted_updates else ():
            # kept: the first forward and the backward; the others once per later forward too
            assert (ups[u.name] == 2) == (u.name in want), (u.name, ups)
        assert torch.stack(losses).mean().item() == b.train_batch(mbs)
    a.wait(), b.wait()
    for ua, ub in zip(a.units, b.units):
        assert torch.equal(ua.master.cpu(), ub.master.cpu()), ua.name
        assert torch.equal(ua.exp_avg.cpu(), ub.exp_avg.cpu()), ua.name
    a.close(), b.close()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_short_windows_with_the_boundary_override_are_train_batch_bitwise(precision):
    """Windows of 3, 2, 1 and 3 micro-batches where gradient_accumulation_steps is 3, each ended by
    set_gradient_accumulation_boundary(True) before its last forward (zerofit.hf's way at an epoch's end), the
    caller scaling each loss (backward(scale_wrt_gas=False)): losses and masters are train_batch's on the same
    windows, bitwise; in 16-bit the shorter windows still read the 16-bit copies their first forward made."""
    cfg = _cfg(
        precision=precision, gradient_accumulation_steps=3, gradient_clipping=0.05, offload={"prefetch_depth": 1}
    )
    data = tm.batches(1, 3) + tm.batches(1, 2, seed=4) + tm.batches(1, 1, seed=5) + tm.batches(1, 3, seed=6)
    torch.manual_seed(0)
    a = zerofit.initialize(tm.qwen2(), cfg)
    torch.manual_seed(0)
    b = zerofit.initialize(tm.qwen2(), cfg)
    sixteen = []
    for mbs in data:
        losses = []
        for i, mb in enumerate(mbs):
            a.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            out = a(**mb)
            losses.append(out.loss.detach().float())
            a.backward(out.loss * (1.0 / len(mbs)), scale_wrt_gas=False)
            a.step()
            assert a.global_step == b.global_step + (i == len(mbs) - 1)
        sixteen.append(sum(1 for e in a.trace() if e["lane"] == "upload" and e["label"].endswith("(16)")))
        assert torch.stack(losses).mean().item() == b.train_batch(mbs)
    a.wait(), b.wait()
    for ua, ub in zip(a.units, b.units):
        assert torch.equal(ua.master.cpu(), ub.master.cpu()), ua.name
        assert torch.equal(ua.exp_avg_sq.cpu(), ub.exp_avg_sq.cpu()), ua.name
    if precision == "bf16":
        assert sixteen[1] > 0 and sixteen[2] == 0, sixteen  # a window of 1 has no later forward to serve
    else:
        assert sixteen == [0, 0, 0, 0]
    a.close(), b.close()


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_deepspeed_style_api_matches(clip):
    torch.manual_seed(0)
    model = tm.llama()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(gradient_clipping=clip))
    data = tm.batches(8, G)
    losses = [tm.ds_step(engine, mbs) for mbs in data]
    assert engine.global_step == len(data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data, clip=clip)))
    _assert_same_weights(engine, ref)


def test_deepspeed_boundary_override_and_caller_scaled_loss():
    """What accelerate's DeepSpeed wrapper (and zerofit.hf) does: the caller divides each loss itself
    (backward(scale_wrt_gas=False)) and ends an accumulation where it wants (set_gradient_accumulation_boundary),
    here after 1 micro-batch where gradient_accumulation_steps is 3 (the short last step of an epoch)."""
    torch.manual_seed(0)
    model = tm.llama()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(gradient_accumulation_steps=3, gradient_clipping=0.05))
    data = tm.batches(2, 3) + tm.batches(1, 1, seed=5) + tm.batches(1, 3, seed=6)
    losses = []
    for mbs in data:
        total = 0.0
        for i, mb in enumerate(mbs):
            engine.set_gradient_accumulation_boundary(i == len(mbs) - 1)
            assert engine.is_gradient_accumulation_boundary() == (i == len(mbs) - 1)
            out = engine(**mb)
            engine.backward(out.loss / len(mbs), scale_wrt_gas=False)
            engine.step()
            total += out.loss.item()
        losses.append(total / len(mbs))
    assert engine.global_step == len(data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data, clip=0.05)))
    _assert_same_weights(engine, ref)
    engine.set_gradient_accumulation_boundary(None)  # back to counting: 3 micro-batches per step
    for i, mb in enumerate(tm.batches(1, 3, seed=7)[0]):
        engine.backward(engine(**mb).loss)
        engine.step()
        assert engine.global_step == len(data) + (i == 2)
    engine.close()


def test_lr_schedule_matches_lambda_lr():
    from zerofit.config.schema import SchedulerConfig
    from zerofit.optim.schedules import make_lambda

    torch.manual_seed(0)
    model = tm.llama()
    ref = copy.deepcopy(model)
    sched = {"type": "cosine", "warmup_steps": 3, "total_steps": 10, "min_lr_ratio": 0.1}
    engine = zerofit.initialize(model, _cfg(scheduler=sched))
    data = tm.batches(10, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    lam = make_lambda(1e-3, SchedulerConfig(**sched))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data, sched=lam)))
    _assert_same_weights(engine, ref)


def test_bf16_matches_fp32_master_reference():
    """bf16 compute with fp32 master weights: the reference casts the master to bf16 every step."""
    torch.manual_seed(0)
    model = tm.llama()
    master = copy.deepcopy(model)
    before = tm.initial_weights(model)
    engine = zerofit.initialize(model, _cfg(precision="bf16"))
    data = tm.batches(STEPS, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    work = copy.deepcopy(master).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3, weight_decay=0.01)
    ref_losses = []
    for mbs in data:
        with torch.no_grad():
            for p16, p32 in zip(work.parameters(), master.parameters()):
                p16.copy_(p32)
        work.zero_grad()
        total = 0.0
        for mb in mbs:
            loss = work(**mb).loss
            (loss / G).backward()
            total += loss.item()
        for p16, p32 in zip(work.parameters(), master.parameters()):
            p32.grad = p16.grad.float()
        opt.step()
        ref_losses.append(total / G)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1.6e-2, atol=0)
    tm.assert_updates_close(engine, before, master, rtol=0.1)
    # engine.module carries the fp32 master weights (compute runs in bf16 on copies)
    assert engine.module.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert losses[-1] < losses[0]


def test_checkpointing_changes_nothing_with_dropout():
    results = []
    for ckpt in (True, False):
        torch.manual_seed(0)
        model = tm.gpt2(dropout=0.1)
        engine = zerofit.initialize(model, _cfg(activation_checkpointing=ckpt, seed=0))
        torch.manual_seed(123)
        losses = [engine.train_batch(mbs) for mbs in tm.batches(5, G)]
        results.append((losses, engine.master_state_dict()))
    (l1, w1), (l2, w2) = results
    assert l1 == l2
    for n in w1:
        assert torch.equal(w1[n], w2[n]), n


def test_dropout_is_active_and_replayed():
    """Dropout changes the loss (it is on), and the recompute replays the forward's masks (parity with
    the plain model under the same RNG stream)."""
    torch.manual_seed(0)
    model = tm.gpt2(dropout=0.2)
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg())  # the first step's loss is computed before any update
    mbs = tm.batches(1, 1)[0]
    torch.manual_seed(7)
    l_engine = engine.train_batch(mbs)
    torch.manual_seed(7)
    l_ref = ref(**mbs[0]).loss.item()
    ref.eval()
    l_eval = ref(**mbs[0]).loss.item()
    assert l_engine == pytest.approx(l_ref, rel=1e-6)
    assert l_engine != pytest.approx(l_eval, rel=1e-3)


@pytest.mark.parametrize(
    "precision,clip,api",
    [
        ("fp32", 0.0, "train_batch"),
        ("fp32", 0.05, "train_batch"),
        ("fp32", 0.0, "deepspeed"),
        ("bf16", 0.0, "train_batch"),
    ],
)
def test_shell_optimizer_on_the_host(precision, clip, api):
    """The shell (embeddings, head) updated by the CPU worker and re-uploaded before the next step's
    pre pass: the planner's choice when the shell's optimizer state does not fit on the device."""
    torch.manual_seed(0)
    model = tm.llama()
    ref = copy.deepcopy(model)
    before = tm.initial_weights(model)
    engine = zerofit.initialize(
        model, _cfg(precision=precision, gradient_clipping=clip, offload={"shell_optimizer": "host"})
    )
    assert not engine.plan.shell_optimizer_on_device and not engine.shell.optimizer_on_device
    data = tm.batches(8, G)
    step = tm.ds_step if api == "deepspeed" else type(engine).train_batch
    losses = [step(engine, mbs) for mbs in data]
    ref_losses = _reference(ref, data, clip=clip)
    if precision == "fp32":
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        _assert_same_weights(engine, ref)
    else:  # the reference computes in fp32: bf16 compute moves the updates by a few percent
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1.6e-2, atol=0)
        tm.assert_updates_close(engine, before, ref, rtol=0.25)


@pytest.mark.parametrize("build", [tm.llama, tm.gpt2], ids=["llama", "gpt2"])
def test_padded_batches_with_attention_mask(build):
    """Right-padded sequences: the model's own mask (built in the pre pass and replayed for every block)
    and labels of -100 on the padding give plain PyTorch's losses and weights."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg())
    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(6):
        mbs = []
        for _ in range(G):
            ids = torch.randint(0, tm.VOCAB, (2, 16), generator=g)
            mask = torch.ones_like(ids)
            mask[0, 11:] = 0  # the first sequence is 11 tokens long
            labels = ids.masked_fill(mask == 0, -100)
            mbs.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        data.append(mbs)
    losses = [engine.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference(ref, data)))
    _assert_same_weights(engine, ref)
