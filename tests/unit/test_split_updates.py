"""[Note: moments after the forward] (engine/update/split_adamw.py): deferred host updates in two passes, the master on
the next forward's path and the moments after it, give bitwise the fused kernel's results. On the CPU; the
kernel is built at first use (a C++ compiler is on every machine this project tests on)."""

from __future__ import annotations

import copy

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.update import split_adamw
from zerofit.engine.update.adamw import adamw_flat
from zerofit.optim.hyper import Hyper

pytestmark = pytest.mark.skipif(
    not split_adamw.available(),
    reason=f"no C++ toolchain here to build the split kernel: {split_adamw.why_unavailable()}",
)


@pytest.mark.parametrize("n", [1000, 1003, 4096, 100_001, 300_007])
@pytest.mark.parametrize("factor,wd", [(1.0, 0.0), (1.0, 0.01), (0.127, 0.0), (0.127, 0.01)])
@pytest.mark.parametrize("cast", [None, torch.bfloat16], ids=["master", "bf16"])
def test_the_two_passes_are_the_fused_step_bitwise(n, factor, wd, cast):
    """Master, moments and step count equal the fused kernel's bit for bit (the vector loop's elements and the
    scalar tail's, n % 8 or 16 of them, over several of the kernel's chunks); the first pass leaves moments and
    gradient alone; the gradient is left unscaled (the fused kernel scales it in place). [Note: the master
    behind its cast]: the cast pass writes the fused step's new master, cast as torch casts it, and leaves the
    master as it was; the rest pass then writes it."""
    torch.manual_seed(n)
    h = Hyper(1e-3, 0.9, 0.999, 1e-8, wd)
    p, g, m, v = torch.randn(n), torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01
    fused = [t.clone() for t in (p, g, m, v)] + [torch.tensor(4.0)]
    adamw_flat(*fused, h, factor)
    split = [t.clone() for t in (p, g, m, v)] + [torch.tensor(4.0)]
    out = None if cast is None else torch.full((n,), 7.0, dtype=cast)
    split_adamw.master_pass(*split, h, factor, out16=out)
    assert torch.equal(split[1], g) and torch.equal(split[2], m) and torch.equal(split[3], v)
    if cast is not None:
        assert torch.equal(split[0], p)  # the master waits for the rest pass
        assert torch.equal(out.view(torch.int16), fused[0].to(cast).view(torch.int16))
    assert float(split[4]) == 5.0
    split_adamw.rest_pass(*split, h, factor, with_master=cast is not None)
    for name, a, b in zip(
        ("master", "exp_avg", "exp_avg_sq", "step"),
        (fused[0], fused[2], fused[3], fused[4]),
        (split[0], split[2], split[3], split[4]),
    ):
        assert torch.equal(a, b), name
    assert torch.equal(split[1], g)


def test_the_cast_rounds_as_torch_does():
    """The cast pass's rounding is torch's (to nearest, ties to even) on ties, subnormals, overflow and
    infinities, and a NaN stays a NaN: a zero step (lr 0) makes the pass a pure cast of the master."""
    cast = torch.bfloat16
    bits = torch.randint(
        -(2**31), 2**31 - 1, (200_003,), dtype=torch.int64, generator=torch.Generator().manual_seed(3)
    ).to(torch.int32)
    p = bits.view(torch.float32).clone()
    special = torch.tensor(
        [
            0.0,
            -0.0,
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
            65504.0,
            65520.0,
            1e5,
            -1e5,
            6e-8,
            3e-8,
            1e-40,
            -1e-40,
            3.4e38,
            float("inf"),
            float("-inf"),
        ]
    )
    p[: special.numel()] = special
    n = p.numel()
    g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=cast)
    split_adamw.master_pass(p, g, m, v, torch.tensor(0.0), Hyper(0.0, 0.9, 0.999, 1e-8, 0.0), 1.0, out16=out)
    nan = p.isnan()
    assert 0 < int(nan.sum()) < n and torch.equal(out.isnan(), nan)  # NaN's bits differ between torch's kernels
    assert torch.equal(out[~nan].view(torch.int16), p[~nan].to(cast).view(torch.int16))


def _cfg(**kw):
    base = {
        "device": "cpu",
        "precision": "fp32",
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        "gradient_clipping": 0.05,
    }
    base.update(kw)
    return base


def _state(engine):
    engine.wait()
    return {
        u.name: (u.master.clone(), u.exp_avg.clone(), u.exp_avg_sq.clone(), float(u.step))
        for u in engine.units
        if not u.optimizer_on_device
    }


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "param-groups"])
@pytest.mark.parametrize("speculate", [False, True])
def test_deferred_updates_in_two_passes_are_bitwise_the_one_pass_engine(groups, speculate):
    """Every step clipped (clip 0.05): the engine with split updates gives the same losses, master weights,
    moments and step counts as the engine with the fused kernel, bit for bit, with parameter groups (segments
    per unit) and with speculation (its first step rolled back); its moments passes ran for every host block
    not updated on the device, and ran after the step's updates."""
    torch.manual_seed(0)
    model = tm.llama(layers=4)

    def groups_of(m):
        named = list(m.named_parameters())
        return [
            {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
            {"params": [p for n, p in named if "norm" not in n]},
        ]

    engines = []
    for split in (False, True):
        m = copy.deepcopy(model)
        kw = {"param_groups": groups_of(m)} if groups else {}
        engines.append(
            zerofit.initialize(m, _cfg(offload={"split_updates": split, "speculative_updates": speculate}), **kw)
        )
    one, two = engines
    assert not one.host_updates.split and two.host_updates.split
    labels = []
    worker = two.worker
    submit = worker.submit
    worker.submit = lambda fn, priority=0, label=None, ready=None: (
        labels.append(label),
        submit(fn, priority, label, ready),
    )
    data = tm.batches(6, 2)
    for mbs in data:
        assert one.train_batch(mbs) == two.train_batch(mbs)
    a, b = _state(one), _state(two)
    assert a.keys() == b.keys()
    for name in a:
        for what, x, y in zip(("master", "exp_avg", "exp_avg_sq", "step"), a[name], b[name]):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f"{name} {what}"
    moments = [lab[len("moments[") : -1] for lab in labels if lab and lab.startswith("moments[")]
    host = [u.name for u in two.units if not u.optimizer_on_device and not two.device_updates.assisted(u)]
    assert host and set(moments) == set(host)
    assert len(moments) == len(host) * (5 if speculate else 6)  # speculation's first step: its own updates
    for e in engines:
        e.close()


def test_a_unit_waits_for_its_moments_before_its_next_gradient_comes_down():
    """The moments pass reads the gradient buffer the next backward writes: held back, the backward waits for
    it (and the results stay the one-pass engine's)."""
    torch.manual_seed(0)
    model = tm.llama(layers=3)
    ref = zerofit.initialize(copy.deepcopy(model), _cfg(offload={"split_updates": False}))
    engine = zerofit.initialize(model, _cfg(offload={"split_updates": True, "speculative_updates": False}))
    import threading

    gate = threading.Event()
    task = engine.host_updates.task_moments
    ran = []

    def slow(unit, grad, hypers, factor, **kw):
        inner = task(unit, grad, hypers, factor, **kw)

        def run():
            gate.wait(5.0)
            ran.append(unit.name)
            inner()

        return run

    engine.host_updates.task_moments = slow
    data = tm.batches(3, 2)
    ref.train_batch(data[0])
    engine.train_batch(data[0])
    waits = []
    awaited = engine.host_updates.await_moments
    engine.host_updates.await_moments = lambda u: (waits.append(u.updates.moments_done.is_set()), awaited(u))
    threading.Timer(0.3, gate.set).start()
    for mbs in data[1:]:
        assert ref.train_batch(mbs) == engine.train_batch(mbs)
    assert False in waits and ran  # some unit's gradient came while its moments were still pending
    a, b = _state(ref), _state(engine)
    assert all(torch.equal(x, y) for n in a for x, y in zip(a[n][:3], b[n][:3]))
    ref.close()
    engine.close()


def test_split_updates_default_on_a_gpu_and_give_the_device_a_smaller_share():
    """offload.split_updates None: two passes on a GPU with deferred updates only; then, unless the config sets
    assisted_fraction, the device's share is SPLIT_FRACTION."""
    from zerofit.config import load_config
    from zerofit.engine.plan.engine_plan import assisted_fraction, split_updates
    from zerofit.engine.plan.search import SPLIT_FRACTION

    cfg = load_config(_cfg()).config
    assert split_updates(cfg, on_cuda=True, deferred=True)
    assert not split_updates(cfg, on_cuda=False, deferred=True) and not split_updates(cfg, True, deferred=False)
    assert assisted_fraction(cfg, True, True) == SPLIT_FRACTION != cfg.offload.assisted_fraction
    assert assisted_fraction(cfg, False, True) == cfg.offload.assisted_fraction
    set_ = load_config(_cfg(offload={"assisted_fraction": 0.5})).config
    assert assisted_fraction(set_, True, True) == 0.5
    off = load_config(_cfg(offload={"split_updates": False})).config
    assert not split_updates(off, True, True) and assisted_fraction(off, True, True) == off.offload.assisted_fraction


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_master_behind_its_cast_is_the_one_pass_engine_bitwise(precision):
    """[Note: the master behind its cast]: bf16, every step clipped, split updates: the engine makes 16-bit
    host copies of the streamed blocks, each host block's first pass writes only its copy, and from the second
    step on every forward and backward upload of a host-updated block reads that copy (none reads the fp32
    master). fp16 (its loss scaler defers every update) keeps the master pass and fp32 uploads. Losses,
    masters, moments and step counts equal the one-pass engine's bit for bit."""
    torch.manual_seed(0)
    model = tm.llama(layers=4)
    cfg = _cfg(precision=precision, offload={"prefetch_depth": 1, "speculative_updates": False})
    one = zerofit.initialize(copy.deepcopy(model), cfg | {"offload": cfg["offload"] | {"split_updates": False}})
    two = zerofit.initialize(model, cfg | {"offload": cfg["offload"] | {"split_updates": True}})
    assert two.host_updates.split
    parts = []
    apply = two.host_updates.apply
    two.host_updates.apply = lambda unit, grad, ops, part=None: (parts.append(part), apply(unit, grad, ops, part))
    data = tm.batches(5, 2)
    host = None
    cast = precision == "bf16"
    for i, mbs in enumerate(data):
        assert one.train_batch(mbs) == two.train_batch(mbs), i
        if i == 0:
            host = {u.name for u in two.blocks if u.home.name == "STREAMED" and not two.device_updates.assisted(u)}
            assert host and all((u.host16 is not None) == cast for u in two.blocks if u.name in host)
        else:
            uploads = [x for x in tm.upload_labels(two) if x.split("(")[0] in host]
            assert uploads and all(x.endswith("(16)") == cast for x in uploads), uploads
    a, b = _state(one), _state(two)
    first, second = ("cast", "rest") if cast else ("master", "moments")
    assert parts.count(first) == parts.count(second) == len(host) * len(data)
    assert set(parts) <= {first, second, None}
    for name in a:
        for what, x, y in zip(("master", "exp_avg", "exp_avg_sq", "step"), a[name], b[name]):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f"{name} {what}"
    one.close()
    two.close()


def test_an_fp32_upload_of_a_master_behind_its_cast_waits_for_the_rest_pass():
    """[Note: the master behind its cast]: when the 16-bit copies go stale before the rest pass ran (here: the
    weights epoch moved, as a rollback or a load moves it), the upload of the fp32 master waits for that pass,
    and the step's results stay the one-pass engine's."""
    import threading

    torch.manual_seed(0)
    model = tm.llama(layers=3)
    cfg = _cfg(precision="bf16", offload={"prefetch_depth": 1, "speculative_updates": False})
    ref = zerofit.initialize(copy.deepcopy(model), cfg | {"offload": cfg["offload"] | {"split_updates": False}})
    engine = zerofit.initialize(model, cfg | {"offload": cfg["offload"] | {"split_updates": True}})
    gate = threading.Event()
    task = engine.host_updates.task_moments
    data = tm.batches(3, 2)
    assert ref.train_batch(data[0]) == engine.train_batch(data[0])
    engine.wait()  # the first step's rest passes ran; the second step's are held back
    engine.host_updates.task_moments = lambda *a, **k: (lambda inner: lambda: (gate.wait(5.0), inner()))(task(*a, **k))
    assert ref.train_batch(data[1]) == engine.train_batch(data[1])
    behind = [u for u in engine.blocks if u.updates.master_behind and not u.updates.moments_done.is_set()]
    assert behind  # the rest passes are held back
    engine.copies16.weights_changed()
    waited = []
    awaited = engine.host_updates.await_moments
    engine.host_updates.await_moments = lambda u: (waited.append((u.name, u.updates.moments_done.is_set())), awaited(u))
    threading.Timer(0.3, gate.set).start()
    assert ref.train_batch(data[2]) == engine.train_batch(data[2])
    assert (behind[0].name, False) in waited
    a, b = _state(ref), _state(engine)
    assert all(torch.equal(x, y) for n in a for x, y in zip(a[n][:3], b[n][:3]))
    ref.close()
    engine.close()


def test_the_calibration_tells_the_ways_of_rounding_apart():
    """[Note: the fused kernel's rounding]: the modes the kernel chose at load reproduce the fused kernel on its
    calibration cases, and every other way of rounding the vector loop or the tail fails on them: the cases
    would catch a build that rounds another way (as torch 2.11's AVX-512 tail does)."""
    module = split_adamw._load()
    cases = split_adamw._calibration_cases()
    (body, tail), w = split_adamw._modes, split_adamw._tail_width
    assert split_adamw._matches(module, cases, body, tail, w)
    assert not any(split_adamw._matches(module, cases, body, t, w) for t in range(6) if t != tail)
    assert not any(split_adamw._matches(module, cases, b, tail, w) for b in range(6) if b != body)
    assert not any(split_adamw._matches(module, cases, body, tail, x) for x in (8, 16, 32) if x != w)
