"""``engine.offload_states()`` / ``engine.reload_states()`` ([Note: offloaded device state],
engine/faces/offload_states.py).

On the CPU the "device" is the host, so memory cannot drop there; these tests check the rest: every device
storage of the kinds asked for is emptied (0 bytes) by the offload and comes back byte for byte, the units' state
after the round trip equals the state before it, and training after it is bitwise that of an engine that never
offloaded (losses, master weights, moments), for an engine whose units all stay on the device with their
optimizer (a DeepSpeed ZeRO-3 config without offload) and for one that streams blocks through slots with
assisted updates (slot pools, upload stage, assist buffers); also between the boundary's backward() and its
step(). The refusals DeepSpeed 0.19.8 makes (nvme, an offload_param config), and zerofit's own (calls while
offloaded, mid-window). The GPU test (skipped without CUDA) checks that the accelerator's allocated memory drops
after the offload and rises after the reload, as DeepSpeedExamples' offload_states.py asserts.
"""

from __future__ import annotations

import logging

import pytest
import torch

import zerofit
import zerofit.deepspeed as deepspeed
from tests.support import tiny_models as tm
from zerofit.deepspeed.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from zerofit.engine.faces.offload_states import KINDS

CUDA = torch.cuda.is_available()


class SimpleModel(torch.nn.Module):
    """DeepSpeedExamples' offload_states SimpleModel: every parameter inside one ModuleList."""

    def __init__(self, hidden_dim, nlayers=1):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return self.cross_entropy_loss(x, y)


def _ds_config(precision: str = "fp32", **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3},
        **extra,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _data(n: int, dim: int = 8, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, dim, generator=g).to(dtype), torch.randint(0, dim, (2,), generator=g)) for _ in range(n)]


def _simple_engine(precision: str = "fp32", device: str = "cpu", **extra):
    torch.manual_seed(0)
    model = SimpleModel(8, nlayers=3)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(precision, **extra), device=device
    )
    return engine


def _state(engine) -> dict[str, torch.Tensor]:
    """Every unit's training state (device and host), copied to the host."""
    out = {}
    for u in engine.units:
        for name in ("dev16", "frozen_dev", "master", "exp_avg", "exp_avg_sq", "step", "grad", "host"):
            t = u.grads.tensor if name == "grad" else getattr(u, name)
            if t is not None:
                out[f"{u.name}.{name}"] = t.detach().to("cpu", copy=True)
        for b, t in u.buffers.items():
            out[f"{u.name}.buffer.{b}"] = t.detach().to("cpu", copy=True)
    for i, s in enumerate(engine.streamer.pool.slots if engine.streamer.pool is not None else ()):
        if s.tenant is not None:
            out[f"slot{i}.{s.tenant.name}"] = s.tensor.detach().to("cpu", copy=True)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _simple_run(engine, data, offload_after=(), **offload_args) -> list[float]:
    losses = []
    for i, (x, y) in enumerate(data):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        if i in offload_after:
            before = _state(engine)
            engine.offload_states(**offload_args)
            engine.reload_states()
            _assert_same(before, _state(engine))
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_round_trip_on_a_device_resident_engine_is_bitwise(precision):
    """A DeepSpeed ZeRO-3 config without offload: every unit on the device with its optimizer. An offload empties
    every storage of its state; the reload restores it; training after it equals training without it."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    data = _data(5, dtype=dtype)
    plain = _simple_engine(precision)
    want = _simple_run(plain, data)
    want_master = plain.master_state_dict()
    want_state = _state(plain)
    plain.close()

    engine = _simple_engine(precision)
    x, y = data[0]
    engine.backward(engine(x, y))
    engine.step()
    assert all(u.optimizer_on_device for u in engine.units)
    before = _state(engine)
    engine.offload_states(include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False)
    # the optimizer's state is out of the "device" (the CPU here: 0-byte storages). (A tensor of a freed storage
    # must not be printed: the assertions compare plain numbers.)
    sizes = {
        u.name: [_nbytes(t) for t in (u.exp_avg, u.exp_avg_sq, u.step, u.dev16, u.master)]
        for u in engine.units
        if u.numel
    }
    assert len(sizes) == 3
    for name, (m, v, step, dev16, master) in sizes.items():
        assert (m, v, step) == (0, 0, 0), name
        # fp32 on the CPU: dev16 is the master, which is the module's own parameter (host memory): it stays
        assert (dev16, master > 0) == ((master, True) if precision == "fp32" else (0, True)), name
    with pytest.raises(RuntimeError, match=r"reload_states\(\)"):
        engine(x, y)
    with pytest.raises(RuntimeError, match=r"reload_states\(\)"):
        engine.save_checkpoint("/nonexistent")
    engine.reload_states()
    _assert_same(before, _state(engine))
    got = [want[0]] + _simple_run(engine, data[1:], offload_after=(0, 2))
    assert got == want
    master = engine.master_state_dict()
    assert all(torch.equal(master[k], want_master[k]) for k in want_master)
    _assert_same(want_state, _state(engine))
    engine.close()


def test_include_moves_only_the_kinds_asked_for_and_calls_add_up():
    engine = _simple_engine("bf16")
    _simple_run(engine, _data(1, dtype=torch.bfloat16))
    u = engine.units[1]
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    assert [_nbytes(t) > 0 for t in (u.exp_avg, u.step, u.master, u.dev16)] == [False, False, True, True]
    engine.offload_states(include=["hp_params", OffloadStateTypeEnum.lp_params])  # a second call adds kinds
    assert _nbytes(u.dev16) == 0
    with pytest.raises(RuntimeError, match=r"\['hp_params', 'lp_params', 'optim_states'\]"):
        _ = engine.module
    before_reload = engine.offloaded.current.moved.copy()
    engine.reload_states()
    assert all(m.storage.nbytes() == m.nbytes for m in before_reload.values())
    engine.reload_states()  # nothing offloaded: a no-op, as in DeepSpeed
    engine.close()


def _streaming_engine():
    """Blocks streamed through device slots, the shell's optimizer on the host, assisted updates on the CPU:
    weight and gradient slot pools, the upload stage and the assist buffers all exist."""
    torch.manual_seed(0)
    return zerofit.initialize(
        tm.llama(layers=3),
        {
            "precision": "bf16",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0,
            "offload": {"resident_blocks": 1, "assisted_updates": True, "assisted_fraction": 0.5},
        },
        device="cpu",
    )


def _poison_scratch(engine) -> None:
    """Fill the buffers whose contents never outlive a step with NaN: training after must not see them."""
    for t in (
        [s.tensor for s in engine.grads.pool.slots]
        + [engine.streamer.stage]
        + [s.tensor for s in engine.streamer.pool.slots if s.tenant is None]
        + [c for s in (engine.device_updates.buffers or ()) for c in s]
        + list(engine.device_updates.cast or ())
    ):
        t.fill_(float("nan"))


def test_round_trip_of_a_streaming_engine_is_bitwise_also_between_backward_and_step():
    data = tm.batches(4, 2, T=8)
    plain = _streaming_engine()
    want = [tm.ds_step(plain, mbs) for mbs in data]
    want_master = plain.master_state_dict()
    plain.close()

    engine = _streaming_engine()
    assert (
        engine.streamer.pool is not None and engine.grads.pool is not None and engine.device_updates.buffers is not None
    )
    assert engine.streamer.stage is not None
    got = []
    for i, mbs in enumerate(data):
        losses = []
        for j, mb in enumerate(mbs):
            out = engine(**mb)
            if j == 0 and i == 1:  # mid-window: the first micro-batch's activations are held
                with pytest.raises(RuntimeError, match="middle of an accumulation window"):
                    engine.offload_states()
            engine.backward(out.loss)
            if j == 1 and i == 2:  # the boundary's backward done, its step() pending
                before = _state(engine)
                engine.offload_states(pin_memory=False)
                engine.reload_states()
                _assert_same(before, _state(engine))
            engine.step()
            losses.append(out.loss.item())
        got.append(sum(losses) / len(losses))
        if i in (0, 2):
            stored = engine.streamer.pool.slots[0].tensor.untyped_storage()
            engine.offload_states()
            assert (
                stored.nbytes(),
                _nbytes(engine.device_updates.buffers[0][0]),
                _nbytes(engine.grads.pool.slots[0].tensor),
            ) == (0, 0, 0)
            engine.reload_states()
            _poison_scratch(engine)
    assert got == want
    master = engine.master_state_dict()
    assert all(torch.equal(master[k], want_master[k]) for k in want_master)
    engine.close()


def test_close_and_destroy_reload_first():
    for finish in ("close", "destroy"):
        plain = _simple_engine()
        _simple_run(plain, _data(2))
        want = plain.master_state_dict()
        plain.close()
        engine = _simple_engine()
        _simple_run(engine, _data(2))
        engine.offload_states()
        getattr(engine, finish)()
        got = dict(engine.module.named_parameters())
        assert all(torch.equal(got[k].detach(), want[k]) for k in want)


def test_refusals_as_deepspeed_makes_them(caplog):
    engine = _simple_engine()
    _simple_run(engine, _data(1))
    with pytest.raises(ValueError, match="NVMe offload is not supported for offloading states"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match="include="):
        engine.offload_states(include=["moments"])
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        engine.offload_states(device=OffloadDeviceEnum.none)
    assert "No device specified for offloading states." in caplog.text
    assert engine.offloaded.current is None
    engine.close()

    torch.manual_seed(0)
    model = SimpleModel(8)
    cfg = _ds_config(
        zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, device="cpu")
    with pytest.raises(
        AssertionError, match="Moving states across devices is not supported for offloaded parameters.*offload_param"
    ):
        engine.offload_states()
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: on the CPU the device is the host")
@pytest.mark.parametrize("pin_memory,non_blocking", [(True, False), (False, False), (True, True)])
def test_gpu_memory_drops_after_offload_and_rises_after_reload(pin_memory, non_blocking):
    from zerofit.deepspeed.accelerator import get_accelerator

    data = [(x.cuda(), y.cuda()) for x, y in _data(4, dim=256, dtype=torch.bfloat16)]

    def engine_of():
        torch.manual_seed(0)
        model = SimpleModel(256, nlayers=4)
        e, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_ds_config("bf16"), device="cuda"
        )
        return e

    plain = engine_of()
    want = _simple_run(plain, data)
    plain.close()
    engine = engine_of()
    got = []
    for kinds in (None, [OffloadStateTypeEnum.optim_states], None, [OffloadStateTypeEnum.lp_params]):
        got += _simple_run(engine, data[len(got) : len(got) + 1])
        before = get_accelerator().memory_allocated()
        engine.offload_states(include=kinds, pin_memory=pin_memory, non_blocking=non_blocking)
        after = get_accelerator().memory_allocated()
        assert after < before, (kinds, before, after)
        if kinds is None:  # everything the engine holds: its weights, moments and masters at least
            held = sum(u.numel for u in engine.units) * (4 * 3 + 2)
            assert before - after >= held, (before, after, held)
        engine.reload_states()
        assert get_accelerator().memory_allocated() > after
    assert got == want
    engine.close()


def test_every_kind_is_named():
    assert set(KINDS) == {e.value for e in OffloadStateTypeEnum}
