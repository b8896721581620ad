"""The engine keeps RELIABILITY.md's promises on the CPU: fp16 overflow, memory budgets, meta-device
materialization, the timeline, the DeepSpeed-style API, DeepSpeed configs, non-sequential models.

Faults are injected through one seam of the engine, ``Compute.accumulate`` (every gradient of every unit,
shell and blocks, device- and host-optimized, goes through it on its way into the fp32 gradient buffer):
the tests wrap it on the engine *instance* and write an inf/NaN into the buffer after it ran. Every
injecting test asserts that the seam was hit, so a renamed seam fails loudly instead of passing silently.


"""

from __future__ import annotations

import copy
import json
import math
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import zerofit
from tests.support import tiny_models as tm
from zerofit.config import ConfigError, load_config
from zerofit.engine.engine import Engine
from zerofit.engine.model.adapter import NonSequentialModel
from zerofit.engine.plan.search import (
    SPARSE_EVERY,
    BatchShape,
    ModelShape,
    PlanError,
    activation_bytes,
    make_plan,
    tiles_for,
)
from zerofit.optim.loss_scaler import DynamicLossScaler, LossScaleUnderflowError

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
G = 2


# ---------------------------------------------------------------------------------------------- helpers


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


def _fp16_cfg(**fp16) -> dict:
    # a small initial scale: the tiny model's fp16 gradients never overflow by themselves, so every
    # overflow in these tests is one the test injected
    return _cfg(
        precision="fp16",
        fp16={"initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1, **fp16},
    )


def _host_weights(unit) -> torch.Tensor:
    """The unit's host weights the module's parameters view (``host``; ``host16`` in older layouts)."""
    t = getattr(unit, "host", None)
    return t if t is not None else unit.host16


def _snapshot(engine) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    engine.wait()
    return [
        (u.name, u.master.detach().clone(), u.exp_avg.clone(), u.exp_avg_sq.clone(), u.step.clone())
        for u in engine.units
    ]


def _assert_bitwise_equal(before, after) -> None:
    for (name, *a), (_, *b) in zip(before, after, strict=True):
        for what, x, y in zip(("master", "exp_avg", "exp_avg_sq", "step"), a, b):
            assert torch.equal(x, y), f"{name}.{what} changed"


def _module_params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


class _Inject:
    """While armed, the first element of ``unit``'s fp32 gradient buffer becomes ``value`` after every
    accumulation into it (the seam: the engine's ``compute.accumulate``)."""

    def __init__(self, engine, unit, value: float, nth: int | None = None):
        self.unit, self.value, self.armed, self.hits, self.nth, self.calls = unit, value, False, 0, nth, 0
        original = engine.grads.accumulate

        def accumulate(u, dst, grads, names):
            original(u, dst, grads, names)
            if self.armed and u is self.unit:
                self.calls += 1
                if self.nth is not None and self.calls != self.nth + 1:
                    return  # only the nth accumulation while armed (0-based)
                dst.view(-1)[0] = self.value
                self.hits += 1

        engine.grads.accumulate = accumulate

    def __call__(self, fn):
        self.armed, hits, self.calls = True, self.hits, 0
        try:
            return fn()
        finally:
            self.armed = False
            assert self.hits > hits, "the injection seam (engine.grads.accumulate) was never called for the unit"


_ds_step = tm.ds_step


def _train(engine, mbs, api: str) -> float:
    return engine.train_batch(mbs) if api == "train_batch" else _ds_step(engine, mbs)


def _pick_unit(engine, on_device: bool):
    unit = next((u for u in engine.units if u.optimizer_on_device == on_device), None)
    if unit is None:
        pytest.skip(f"this plan has no unit with its optimizer on the {'device' if on_device else 'host'}")
    return unit


# ---------------------------------------------------------------------------------------------- 1. fp16 overflow


@pytest.mark.parametrize("api", ["train_batch", "deepspeed"])
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("where", ["device-optimizer", "host-optimizer"])
def test_fp16_overflow_skips_the_step_and_leaves_no_trace(where, value, api):
    """An overflow skips the step with every unit's master, moments and step counter bitwise unchanged,
    and leaves no trace: the run equals one that never saw the overflowing batch, bit for bit."""
    data = tm.batches(4, G)
    torch.manual_seed(0)
    model = tm.llama()
    clean_model = copy.deepcopy(model)
    engine = zerofit.initialize(model, _fp16_cfg())
    inject = _Inject(engine, _pick_unit(engine, on_device=where == "device-optimizer"), value)

    for mbs in data[:2]:
        _train(engine, mbs, api)
    assert (engine.global_step, engine.skipped_steps) == (2, 0)
    before, params_before, scale = _snapshot(engine), _module_params(engine), engine.scaler.scale

    inject(lambda: _train(engine, data[2], api))

    assert (engine.global_step, engine.skipped_steps) == (2, 1)
    _assert_bitwise_equal(before, _snapshot(engine))
    for n, p in _module_params(engine).items():
        assert torch.equal(p, params_before[n]), f"module parameter {n} changed on a skipped step"
    assert engine.scaler.scale == scale, "hysteresis 2: the first overflow keeps the scale"
    assert engine.scaler.cur_hysteresis == 1

    _train(engine, data[3], api)  # the next clean step applies, from clean gradients
    assert (engine.global_step, engine.skipped_steps) == (3, 1)
    after = _snapshot(engine)
    for (name, m0, *_), (_, m1, *_) in zip(before, after):
        assert torch.isfinite(m1).all(), f"{name}: the overflow leaked into the next step"
        assert not torch.equal(m0, m1), f"{name}: the clean step after an overflow was not applied"

    clean = zerofit.initialize(clean_model, _fp16_cfg())
    for mbs in (data[0], data[1], data[3]):
        _train(clean, mbs, api)
    a, b = engine.master_state_dict(), clean.master_state_dict()
    for n in b:
        assert torch.equal(a[n], b[n]), f"{n}: the skipped step left a trace"
    engine.close()
    clean.close()


@pytest.mark.parametrize("micro", [0, G - 1], ids=["first-micro", "last-micro"])
def test_fp16_overflow_in_one_micro_batch_skips_the_step(micro):
    """DeepSpeed-style accumulation: an inf in one micro-batch's share of a host-optimized unit's gradient is
    caught at the boundary. The blocks' backward runs at the boundary over the window's micro-batches
    ([Note: the block backward waits for the boundary]), so the inf goes in while the boundary's backward
    accumulates that micro-batch (the first written, or the last added)."""
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _fp16_cfg())
    inject = _Inject(engine, _pick_unit(engine, on_device=False), math.inf, nth=micro)
    data = tm.batches(3, G)
    _ds_step(engine, data[0])
    before = _snapshot(engine)
    for i, mb in enumerate(data[1]):
        out = engine(**mb)
        if i == G - 1:
            inject(lambda out=out: engine.backward(out.loss))
        else:
            engine.backward(out.loss)
        engine.step()
    assert (engine.global_step, engine.skipped_steps) == (1, 1)
    _assert_bitwise_equal(before, _snapshot(engine))
    _ds_step(engine, data[2])
    assert engine.global_step == 2
    assert all(torch.isfinite(v).all() for v in engine.master_state_dict().values())
    engine.close()


def test_fp16_loss_scale_follows_hysteresis_and_window():
    """DeepSpeed's dynamic scale: kept on the first overflow (hysteresis 2), halved on the second, doubled
    again after loss_scale_window clean steps; every overflow is skipped."""
    window = 3
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _fp16_cfg(loss_scale_window=window, hysteresis=2))
    inject = _Inject(engine, engine.units[-1], math.inf)
    reference = DynamicLossScaler(2.0**8, window, 1.0, 2)
    pattern = [False, True, True] + [False] * (window + 2)
    scales, ref_scales = [], []
    for overflow, mbs in zip(pattern, tm.batches(len(pattern), G)):
        if overflow:
            inject(lambda mbs=mbs: engine.train_batch(mbs))
        else:
            engine.train_batch(mbs)
        reference.update(overflow)
        scales.append(engine.scaler.scale)
        ref_scales.append(reference.scale)
    assert scales == ref_scales
    assert scales[:3] == [256.0, 256.0, 128.0]  # clean, overflow (hysteresis left), overflow (halves)
    assert 256.0 in scales[3 : 3 + window + 1], "the scale did not grow back after loss_scale_window clean steps"
    assert engine.skipped_steps == 2
    assert engine.global_step == pattern.count(False)
    engine.close()


def test_fp16_overflow_at_min_loss_scale_raises_named_error():
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _fp16_cfg(initial_scale_power=3, min_loss_scale=2, hysteresis=1))
    inject = _Inject(engine, engine.units[-1], math.inf)
    data = tm.batches(4, G)
    engine.train_batch(data[0])
    for mbs, expect in zip(data[1:3], (4.0, 2.0)):
        inject(lambda mbs=mbs: engine.train_batch(mbs))
        assert engine.scaler.scale == expect
    before = _snapshot(engine)
    with pytest.raises(LossScaleUnderflowError, match="min_loss_scale"):
        inject(lambda: engine.train_batch(data[3]))
    _assert_bitwise_equal(before, _snapshot(engine))  # no half-applied step
    assert (engine.global_step, engine.skipped_steps) == (1, 2)
    engine.close()


def test_fp16_trains_and_tracks_fp32_master_fp16_compute_reference():
    """fp16 compute, fp32 master weights, the same dynamic loss scale (which grows during the run)."""
    steps, lr, window = 14, 3e-3, 4
    torch.manual_seed(0)
    model = tm.llama()
    master = copy.deepcopy(model)
    before = tm.initial_weights(model)
    engine = zerofit.initialize(
        model,
        _fp16_cfg(initial_scale_power=10, loss_scale_window=window) | {"optimizer": {"lr": lr, "weight_decay": 0.01}},
    )
    mbs = tm.batches(1, G)[0]  # one fixed batch: the loss must fall
    losses, scales = [], []
    for _ in range(steps):
        scales.append(engine.scaler.scale)
        losses.append(engine.train_batch(mbs))
    assert engine.streamer.pool.slots[0].tensor.dtype == torch.float16, "blocks must compute in fp16"

    ref_losses, ref_scales = tm.fp16_reference_train(master, mbs, steps, lr, DynamicLossScaler(2.0**10, window, 1.0, 2))

    assert engine.skipped_steps == 0
    assert scales == ref_scales and scales[-1] > scales[0], "the scale must grow over the run"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
    tm.assert_updates_close(engine, before, master, rtol=0.1)
    assert losses[-1] < losses[0] - 0.5
    engine.close()


# ---------------------------------------------------------------------------------------------- 2. memory budgets


def _optimizer_threads() -> int:
    return sum(t.name == "zerofit-cpu-optimizer" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("on_meta", [False, True], ids=["real", "meta"])
def test_host_budget_refused_before_anything_is_allocated(on_meta):
    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            model = tm.llama()
    else:
        model = tm.llama()
    params = {n: (p, p.data_ptr(), p.clone() if not on_meta else None) for n, p in model.named_parameters()}
    threads = _optimizer_threads()
    with pytest.raises(PlanError) as err:
        zerofit.initialize(model, _cfg(max_host_memory="1MB"))
    msg = str(err.value)
    assert "host needs" in msg and "budget" in msg and "max_host_memory" in msg, msg
    assert _optimizer_threads() <= threads, "the CPU optimizer thread was started before the plan was accepted"
    for n, p in model.named_parameters():
        orig, ptr, value = params[n]
        assert p is orig, f"{n} was replaced although the plan was refused"
        if on_meta:
            assert p.is_meta, f"{n} was materialized although the plan was refused"
        else:
            assert p.data_ptr() == ptr and torch.equal(p, value), f"{n} was touched although the plan was refused"


def test_plan_error_names_predicted_and_available_bytes():
    torch.manual_seed(0)
    with pytest.raises(PlanError) as err:
        zerofit.initialize(tm.llama(), _cfg(max_host_memory="1MB"))
    size = r"([0-9.]+) ?([KMGT]i?B|B|bytes)?"
    m = re.search(rf"host needs {size} > budget {size}", str(err.value))
    assert m, str(err.value)
    units = {
        None: 1,
        "B": 1,
        "bytes": 1,
        "KB": 1e3,
        "MB": 1e6,
        "GB": 1e9,
        "TB": 1e12,
        "KiB": 2**10,
        "MiB": 2**20,
        "GiB": 2**30,
        "TiB": 2**40,
    }
    need, budget = float(m[1]) * units[m[2]], float(m[3]) * units[m[4]]
    assert budget == pytest.approx(1e6, rel=0.05), str(err.value)
    assert need > budget, str(err.value)


_BIG = ModelShape(50_000_000, (100_000_000,) * 8, 2048, 8192, 32000)
_BATCH = BatchShape(1, 1024, 1)
_GPU = dict(
    compute_dtype=torch.bfloat16,
    on_cuda=True,
    host_budget=None,
    deferred_updates=False,
    checkpointing=True,
    stream_params=True,
    prefetch_depth=None,
)


def _candidate(shape, batch, r, shell_dev, **kw):
    """The placement's own plan: with immediate updates, without the assisted updates' buffers, which the
    planner only adds beside a plan that fits (tests/integration/test_engine_parity.py checks those)."""
    if not kw.get("deferred_updates"):
        kw.setdefault("assisted_updates", False)
    return make_plan(shape, batch, device_budget=None, resident_blocks=r, shell_on_device=shell_dev, **kw)


def test_make_plan_device_budget():
    GiB = 2**30
    smallest = _candidate(_BIG, _BATCH, 0, False, **_GPU).device_total
    shell_dev_0 = _candidate(_BIG, _BATCH, 0, True, **_GPU).device_total
    largest = _candidate(_BIG, _BATCH, 8, True, **_GPU).device_total
    assert smallest < shell_dev_0 < largest

    # below the smallest plan the floor's measures (chunked loss, offloaded checkpoints, a lean pipeline) get in
    floor = make_plan(_BIG, _BATCH, device_budget=smallest - 1, resident_blocks=None, **_GPU)
    assert floor.loss_chunks > 1 and floor.device_total < smallest
    leanest = _candidate(_BIG, _BATCH, 0, False, floor=(True, True, True), **_GPU).device_total
    with pytest.raises(PlanError, match="device needs") as err:
        make_plan(_BIG, _BATCH, device_budget=leanest - 1, resident_blocks=None, **_GPU)
    assert "max_gpu_memory" in str(err.value)

    big = make_plan(_BIG, _BATCH, device_budget=100 * GiB, resident_blocks=None, **_GPU)
    assert big.resident_blocks == 8 and big.shell_optimizer_on_device and big.weight_slots == 0

    # more budget, more resident blocks (never fewer); every accepted plan fits
    residents = []
    for i in range(25):
        budget = smallest + (largest - smallest) * i // 24
        plan = make_plan(_BIG, _BATCH, device_budget=budget, resident_blocks=None, **_GPU)
        assert plan.device_total <= budget
        residents.append(plan.resident_blocks)
    assert residents == sorted(residents) and residents[0] == 0 and residents[-1] == 8

    # the shell's optimizer goes on the device before any block does: with room for either the shell's
    # optimizer or one resident block (shell on the host), the shell wins ...
    one_block = _candidate(_BIG, _BATCH, 1, False, **_GPU).device_total
    assert shell_dev_0 <= one_block < _candidate(_BIG, _BATCH, 1, True, **_GPU).device_total
    at = make_plan(_BIG, _BATCH, device_budget=one_block, resident_blocks=None, **_GPU)
    assert at.shell_optimizer_on_device and at.resident_blocks == 0
    # ... and to the host only when it does not fit there
    below = make_plan(_BIG, _BATCH, device_budget=shell_dev_0 - 1, resident_blocks=None, **_GPU)
    assert not below.shell_optimizer_on_device and below.resident_blocks == 0

    # a batch that needs more than the plan was made for is refused (what Planning.ensure checks)
    with pytest.raises(PlanError, match="device needs"):
        make_plan(
            _BIG,
            BatchShape(8, 8192, 4),
            device_budget=at.device_total,
            resident_blocks=at.resident_blocks,
            shell_on_device=at.shell_optimizer_on_device,
            **_GPU,
        )


@settings(max_examples=60, deadline=None)
@given(
    shell=st.integers(1_000, 10**8),
    block=st.integers(1_000, 10**8),
    n=st.integers(1, 6),
    hidden=st.sampled_from([64, 512, 4096]),
    tokens=st.sampled_from([128, 2048]),
    deferred=st.booleans(),
    frac=st.floats(0.0, 1.2),
)
def test_make_plan_picks_the_preferred_fitting_placement(shell, block, n, hidden, tokens, deferred, frac):
    """Accepted plans fit; the choice is the shell on the device with the most resident blocks, else the
    shell on the host with the most; PlanError exactly when nothing fits."""
    shape = ModelShape(shell, (block,) * n, hidden, 4 * hidden, 32000)
    batch = BatchShape(1, tokens, 1)
    kw = {**_GPU, "deferred_updates": deferred}
    cands = {(s, r): _candidate(shape, batch, r, s, **kw).device_total for s in (True, False) for r in range(n + 1)}
    lo, hi = min(cands.values()), max(cands.values())
    budget = int(lo * 0.8 + frac * (hi - lo * 0.8))
    # [Note: a smaller GPU floor]: the first level of the floor where anything fits decides, then the preference;
    # then checkpoints every k blocks ([Note: checkpoints every k blocks]); after them each level again with the
    # blocks' MLP over sequence tiles ([Note: MLP over sequence tiles])
    base = [(False, False, False, 1), (True, False, False, 1), (True, True, False, 1), (True, True, True, 1)]
    base += [(True, True, False, k) for k in SPARSE_EVERY]
    for level in base + [lv + (t,) for t in tiles_for(batch) for lv in base]:
        fitting = [
            (s, r)
            for s in (True, False)
            for r in range(n + 1)
            if _candidate(shape, batch, r, s, floor=level, **kw).device_total <= budget
        ]
        if fitting:
            break
    if not fitting:
        with pytest.raises(PlanError, match="device needs"):
            make_plan(shape, batch, device_budget=budget, resident_blocks=None, **kw)
        return
    plan = make_plan(shape, batch, device_budget=budget, resident_blocks=None, **kw)
    assert plan.device_total <= budget
    assert (plan.shell_optimizer_on_device, plan.resident_blocks) == max(fitting)
    assert (plan.offload_checkpoints, bool(plan.stage_numel), plan.checkpoint_every) == level[1:4]
    assert plan.sequence_tile == (level[4] if len(level) > 4 else None)
    assert plan.loss_chunks > 1 or not level[0] or tokens <= 512


def test_device_refusal_names_the_smallest_plan():
    smallest = _candidate(_BIG, _BATCH, 0, False, floor=(True, True, True), **_GPU)
    with pytest.raises(PlanError) as err:
        make_plan(_BIG, _BATCH, device_budget=2**29, resident_blocks=None, **_GPU)
    need = float(re.search(r"device needs ([0-9.]+) GiB", str(err.value))[1]) * 2**30
    assert need == pytest.approx(smallest.device_total, abs=0.01 * 2**30), str(err.value)


def _engine_buffer_bytes(engine) -> int:
    """Bytes of the distinct storages behind the engine's own buffers: every unit's flat tensors
    (master, moments, step, host weights, device weights, gradient), the device slots, the upload and
    gradient staging buffers, the host gradient buffers and the host arenas."""
    tensors = []
    for u in engine.units:
        tensors += [v for v in vars(u).values() if isinstance(v, torch.Tensor)]
    for pool in (engine.streamer.pool, engine.grads.pool):
        if pool is not None:
            tensors += [s.tensor for s in pool.slots]
    tensors += list(engine.grads.staging)
    tensors += list(engine.grads.host_grads.values())
    tensors += [a.tensor for a in engine.lifecycle.resources.arenas]
    stage = engine.streamer.stage
    if stage is not None:
        tensors.append(stage)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _static_prediction(plan) -> int:
    """The plan's host bytes without the activation allowance (transient, per batch shape)."""
    transient = set(activation_bytes(ModelShape(1, (1,), 1, 1, 1), BatchShape(1, 1, 1), 1, 2)) | {"allocator_reserve"}
    return sum(v for k, v in plan.host_bytes.items() if k.removeprefix("device:") not in transient)


def _slack(engine) -> int:
    return 64 * len(engine.units)  # the units' step counters (4 bytes each) are not planned


@pytest.mark.parametrize("precision,clip", [("fp32", 0.0), ("fp32", 1.0), ("bf16", 0.0), ("fp16", 0.0)])
def test_engine_buffers_stay_under_the_host_prediction(precision, clip):
    torch.manual_seed(0)
    engine = zerofit.initialize(
        tm.llama(), _fp16_cfg() | {"precision": precision, "gradient_clipping": clip, "seq_len": 16}
    )
    for mbs in tm.batches(2, G):
        engine.train_batch(mbs)
    engine.wait()
    used = _engine_buffer_bytes(engine)
    assert used <= _static_prediction(engine.plan) + _slack(engine), (used, engine.plan.host_bytes)
    assert used <= engine.plan.host_total
    engine.close()


def test_deepspeed_api_buffers_stay_under_the_host_prediction():
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _cfg(seq_len=16))
    for mbs in tm.batches(2, G):
        _ds_step(engine, mbs)
    engine.wait()
    used = _engine_buffer_bytes(engine)
    assert used <= _static_prediction(engine.plan) + _slack(engine), (used, engine.plan.host_bytes)
    engine.close()


def test_batch_larger_than_planned_is_refused_at_first_step():
    torch.manual_seed(0)
    probe = zerofit.initialize(tm.llama(), _cfg(seq_len=16))
    budget = probe.plan.host_total + 4096
    probe.close()
    engine = zerofit.initialize(tm.llama(), _cfg(seq_len=16, max_host_memory=budget))
    before = _snapshot(engine)
    with pytest.raises(PlanError, match="host needs"):
        engine.train_batch(tm.batches(1, G, B=16, T=64)[0])  # ~8x the planned activations
    _assert_bitwise_equal(before, _snapshot(engine))


# ---------------------------------------------------------------------------------------------- 3. meta device


def test_meta_model_is_materialized_once_with_hf_init_and_trains():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = tm.llama()
    engine = zerofit.initialize(model, _cfg(gradient_accumulation_steps=1, optimizer={"lr": 3e-3}))
    module = engine.module
    std = module.config.initializer_range
    for name, p in module.named_parameters():
        assert not p.is_meta and p.device.type == "cpu", name
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), f"{name}: RMSNorm weights must initialize to ones"
        else:
            assert p.dim() == 2, name
            assert abs(p.std().item() - std) < 0.2 * std, f"{name}: std {p.std().item():.4f}, expected {std}"
            assert abs(p.mean().item()) < 0.2 * std, name
    assert module.lm_head.weight is module.model.embed_tokens.weight, "tied weights must stay one parameter"
    real = tm.llama()
    for (n, b), (_, rb) in zip(module.named_buffers(), real.named_buffers(), strict=True):
        assert not b.is_meta and torch.equal(b, rb), f"buffer {n} differs from a real model's"

    # one copy of the model on the host: every parameter is a view into its unit's host buffer
    ranges = []
    for u in engine.units:
        h = _host_weights(u)
        ranges.append((h.data_ptr(), h.data_ptr() + h.numel() * h.element_size()))
    for name, p in module.named_parameters():
        ptr = p.data_ptr()
        assert any(lo <= ptr and ptr + p.numel() * p.element_size() <= hi for lo, hi in ranges), (
            f"{name} is not a view of the engine's host buffers"
        )
    unit_storages = {_host_weights(u).untyped_storage().data_ptr() for u in engine.units}
    assert {p.untyped_storage().data_ptr() for p in module.parameters()} <= unit_storages

    mbs = tm.batches(1, 1)[0]
    losses = [engine.train_batch(mbs) for _ in range(30)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    assert losses[0] == pytest.approx(math.log(tm.VOCAB), rel=0.05)  # a freshly initialized model
    engine.close()


# ---------------------------------------------------------------------------------------------- 4. timeline


@pytest.mark.parametrize("api", ["train_batch", "deepspeed"])
def test_timeline_phases(api):
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _cfg(gradient_clipping=1.0))
    for mbs in tm.batches(2, G):
        _train(engine, mbs, api)
    tl = engine.timeline()
    keys = {"step", "compute", "upload", "download", "optimizer", "wait"}
    assert keys <= set(tl), tl
    for k in keys:
        assert isinstance(tl[k], float) and tl[k] >= 0.0, (k, tl)
    assert tl["step"] > 0.0 and tl["compute"] > 0.0
    assert tl["compute"] <= tl["step"], tl
    # on the CPU the engine's own phases run one after another on the main thread
    assert tl["compute"] + tl["upload"] + tl["download"] + tl["wait"] <= tl["step"] * 1.05 + 1e-3, tl
    tl["step"] = -1.0
    assert engine.timeline()["step"] > 0.0, "timeline() must return a copy"
    engine.close()


# ---------------------------------------------------------------------------------------------- 5. DeepSpeed API


def test_deepspeed_step_is_a_noop_before_the_boundary():
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _cfg(gradient_accumulation_steps=3))
    mbs = tm.batches(1, 3)[0]
    before = _snapshot(engine)
    assert not engine.is_gradient_accumulation_boundary()
    for i, mb in enumerate(mbs):
        out = engine(**mb)
        engine.backward(out.loss)
        assert engine.is_gradient_accumulation_boundary() == (i == 2)
        if i < 2:
            engine.step()
            assert engine.global_step == 0
            _assert_bitwise_equal(before, _snapshot(engine))
    engine.step()
    assert engine.global_step == 1 and not engine.is_gradient_accumulation_boundary()
    assert not torch.equal(before[0][1], _snapshot(engine)[0][1])
    engine.step()  # nothing accumulated: a no-op again
    assert engine.global_step == 1
    engine.close()


def test_deepspeed_api_misuse_raises():
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _cfg())
    mbs = tm.batches(2, G)
    with pytest.raises(RuntimeError, match="backward"):
        engine.backward(torch.tensor(1.0, requires_grad=True))
    stale = engine(**mbs[0][0])
    engine(**mbs[0][1])  # a forward no backward() followed is dropped, as DeepSpeed drops its graph
    with pytest.raises(RuntimeError, match="does not depend on the engine's last forward"):
        engine.backward(stale.loss)
    out = engine(**mbs[0][0])
    engine.backward(out.loss)
    engine.step()  # not at the boundary yet
    with pytest.raises(RuntimeError, match="accumulation"):
        engine.train_batch(mbs[1])
    out = engine(**mbs[0][1])
    engine.backward(out.loss)
    engine.step()
    assert engine.global_step == 1
    assert math.isfinite(engine.train_batch(mbs[1]))  # usable again at the boundary
    assert engine.global_step == 2
    engine.close()


def test_train_batch_after_a_pending_forward_drops_it():
    """A forward no backward() followed holds nothing of a step: train_batch drops it, and trains exactly as
    without it."""
    torch.manual_seed(0)
    engine = zerofit.initialize(tm.llama(), _cfg())
    torch.manual_seed(0)
    clean = zerofit.initialize(tm.llama(), _cfg())
    mbs = tm.batches(1, G)[0]
    engine(**mbs[0])
    assert engine.train_batch(mbs) == clean.train_batch(mbs)
    a, b = engine.master_state_dict(), clean.master_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


# ---------------------------------------------------------------------------------------------- 6. DeepSpeed configs

_FIXTURE_FILES = sorted(FIXTURES.glob("*.json")) if FIXTURES.is_dir() else []


@pytest.mark.skipif(not _FIXTURE_FILES, reason=f"no DeepSpeed config fixtures under {FIXTURES}")
@pytest.mark.parametrize("path", _FIXTURE_FILES, ids=[p.stem for p in _FIXTURE_FILES])
def test_deepspeed_fixture_config_trains(path):
    ds = json.loads(path.read_text())
    torch.manual_seed(0)
    model = tm.llama()
    engine = zerofit.initialize(model, path, device="cpu")
    cfg = engine.config
    assert engine.device.type == "cpu"
    if "train_micro_batch_size_per_gpu" in ds:
        assert cfg.micro_batch_size == ds["train_micro_batch_size_per_gpu"]
    if "gradient_accumulation_steps" in ds:
        assert cfg.gradient_accumulation_steps == ds["gradient_accumulation_steps"]
    if "train_batch_size" in ds:
        assert cfg.train_batch_size == ds["train_batch_size"]
    assert cfg.gradient_clipping == ds.get("gradient_clipping", 1.0)  # DeepSpeed 0.19.8's default
    fp16 = ds.get("fp16", {})
    if fp16.get("enabled"):
        assert cfg.precision == "fp16" and engine.scaler is not None
        assert engine.scaler.scale == 2.0 ** fp16.get("initial_scale_power", 16)
        assert engine.scaler.scale_window == fp16.get("loss_scale_window", 1000)
        assert engine.scaler.delayed_shift == fp16.get("hysteresis", 2)
    start = engine.master_state_dict()
    data = tm.batches(3, cfg.gradient_accumulation_steps, B=cfg.micro_batch_size)
    losses = [engine.train_batch(mbs) for mbs in data]
    assert all(math.isfinite(x) for x in losses), losses
    assert engine.global_step + engine.skipped_steps == 3 and engine.global_step >= 1
    end = engine.master_state_dict()
    assert all(torch.isfinite(v).all() for v in end.values())
    assert any(not torch.equal(start[n], end[n]) for n in start), "three steps changed no weight"
    engine.close()


# ---------------------------------------------------------------------------------------------- 7. model shapes


class _SkipLM(tm.PlainLM):
    """A residual *around* each block: block i+1 receives block i's output plus its input."""

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x) + x
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class _ReversedLM(tm.PlainLM):
    """Blocks called last to first."""

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in reversed(self.blocks):
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_generic_model_without_blocks_trains():
    torch.manual_seed(0)
    model = tm.MLPRegressor()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(optimizer={"lr": 1e-2, "weight_decay": 0.0}))
    assert not engine.adapter.streaming
    mbs = tm.batches(1, G)[0]
    losses = [engine.train_batch(mbs) for _ in range(10)]
    assert losses[-1] < losses[0] - 0.1, losses
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(10):
        opt.zero_grad()
        for mb in mbs:
            (ref(**mb) / G).backward()
        opt.step()
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(master[n], p.detach(), msg=lambda m, n=n: f"{n}: {m}")
    engine.close()


@pytest.mark.parametrize(
    "cls,match",
    [(_SkipLM, r"block 1 did not receive block 0's output"), (tm.EarlyExitLM, "without calling its last block")],
    ids=["skip-connection", "early-exit"],
)
def test_non_sequential_model_is_refused_at_first_step(cls, match):
    """adapter='blocks' refuses (adapter='auto' falls back: test_engine_lifecycle.py)."""
    torch.manual_seed(0)
    model = cls()
    blocks = model.blocks
    engine = zerofit.initialize(model, _cfg(adapter="blocks"))  # the adapter cannot tell before the forward
    assert engine.adapter.streaming
    before = _snapshot(engine)
    with pytest.raises(NonSequentialModel, match=match) as err:
        engine.train_batch(tm.batches(1, G)[0])
    if cls is _SkipLM:
        assert "generic" in str(err.value)
    assert model.blocks is blocks, "the model's block list must be restored after the refused pass"
    assert engine.global_step == 0
    _assert_bitwise_equal(before, _snapshot(engine))
    engine.close()


def _generic_engine(model, cfg):
    """adapter='generic', as NonSequentialModel's message advises: through zerofit.initialize when it takes
    the option, else through the Engine constructor (the only place that takes it today)."""
    try:
        return zerofit.initialize(model, cfg, adapter="generic")
    except (ConfigError, TypeError):
        return Engine(model, load_config(cfg).config, adapter="generic")


def test_generic_adapter_trains_a_non_sequential_model_exactly():
    torch.manual_seed(0)
    model = _SkipLM()
    ref = copy.deepcopy(model)
    engine = _generic_engine(model, _cfg())
    assert not engine.adapter.streaming
    data = tm.batches(4, G)
    losses = [engine.train_batch(mbs) for mbs in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(tm.reference_train(ref, data)))
    engine.close()


def test_blocks_called_out_of_order_are_refused():
    torch.manual_seed(0)
    engine = zerofit.initialize(_ReversedLM(), _cfg(adapter="blocks"))
    with pytest.raises(NonSequentialModel):
        engine.train_batch(tm.batches(1, G)[0])


def test_blocks_called_twice_are_refused_or_exact():
    torch.manual_seed(0)
    model = tm.LoopedLM()
    ref = copy.deepcopy(model)
    engine = zerofit.initialize(model, _cfg(adapter="blocks"))
    mbs = tm.batches(1, 1)[0]
    try:
        loss = engine.train_batch(mbs)
    except NonSequentialModel:
        return
    assert loss == pytest.approx(ref(**mbs[0]).item(), rel=1e-5)
