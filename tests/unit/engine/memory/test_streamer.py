"""The weight slots' state machine: ``SlotPool`` (memory/store.py) and ``Streamer`` (memory/streamer.py).

A streamed unit goes ON_HOST -> UPLOADING (``begin_upload`` took a slot) -> ON_DEVICE (``acquire``: the compute
stream waited for the upload) and back to ON_HOST when its slot is taken for another unit, when the backward
``evict``s it, or when a failed step empties every slot ([Note: slot reuse]). A window of DeepSpeed-shaped forwards
keeps some blocks in slots carved from the idle gradient buffers until its boundary ([Note: a window keeps some
blocks]). The CPU device runs the same code with every copy done at once.
"""

from __future__ import annotations

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.device import Device
from zerofit.engine.memory.store import FlatLayout, Home, SlotPool, Unit, WeightState
from zerofit.engine.memory.streamer import Streamer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 6


def _unit(name: str, index: int) -> Unit:
    return Unit(name, index, FlatLayout.of([("w", torch.Size([4]))]), Home.STREAMED, False)


def _tenant(slot, unit: Unit) -> None:
    """What Streamer.begin_upload and acquire do to a slot and its unit once the copy is enqueued and waited for."""
    slot.tenant, unit.streamed.slot, unit.streamed.state = unit, slot, WeightState.ON_DEVICE


def _engine(G: int = 1, slots: int = 2, **offload):
    torch.manual_seed(0)
    return zerofit.initialize(
        tm.llama(layers=LAYERS),
        {
            "device": "cpu",
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": G,
            "optimizer": {"lr": 1e-3},
            "offload": {"resident_blocks": 0, "prefetch_depth": slots - 1, **offload},
        },
    )


def _check_slots(engine) -> None:
    """The state machine's invariants over every streamed block: ON_HOST holds no slot; UPLOADING and ON_DEVICE
    hold one whose tenant is the unit itself; no slot is held by two units; no more units sit in pool slots than
    the pool has."""
    pool = engine.streamer.pool
    held = []
    for u in engine.blocks:
        assert u.home is Home.STREAMED
        if u.streamed.state is WeightState.ON_HOST:
            assert u.streamed.slot is None, f"{u.name} is ON_HOST but holds a slot"
        else:
            assert u.streamed.slot is not None and u.streamed.slot.tenant is u, (
                f"{u.name} is {u.streamed.state.name} in a slot it is not in"
            )
            held.append(u.streamed.slot)
    assert len({id(s) for s in held}) == len(held), "one slot held by two units"
    in_pool = [s for s in held if any(s is p for p in pool.slots)]
    assert len(in_pool) <= len(pool.slots)


def test_pool_hands_slots_out_round_robin_and_evicts_the_previous_tenant():
    """Each take() gives the least recently taken slot; a slot's previous tenant goes back to ON_HOST without a
    slot (its weights are about to be overwritten), and no two units are ever given the same slot at once."""
    pool = SlotPool(Device.create(torch.device("cpu")), 2, 8, torch.float32, Streamer.evicted)
    assert pool.nbytes == 2 * 8 * 4
    a, b, c = (_unit(n, i) for i, n in enumerate("abc"))
    sa = pool.take()
    _tenant(sa, a)
    sb = pool.take()
    _tenant(sb, b)
    assert sa is not sb
    sc = pool.take()
    assert sc is sa, "the least recently taken slot"
    assert (a.streamed.state, a.streamed.slot, sc.tenant) == (WeightState.ON_HOST, None, None)
    assert b.streamed.state is WeightState.ON_DEVICE and b.streamed.slot is sb and sb.tenant is b
    _tenant(sc, c)
    assert {id(u.streamed.slot) for u in (b, c)} == {id(sb), id(sa)}


def test_pool_never_takes_a_protected_units_slot_and_refuses_when_all_are():
    """take(protect) skips the slots of units still needed (the window being computed and prefetched) and evicts
    another; when every slot holds a protected unit it raises and evicts nobody."""
    pool = SlotPool(Device.create(torch.device("cpu")), 2, 8, torch.float32, Streamer.evicted)
    a, b = _unit("a", 0), _unit("b", 1)
    _tenant(pool.take(), a)
    _tenant(pool.take(), b)
    s = pool.take(protect=(a,))  # round-robin would give a's slot: it is protected
    assert s.tenant is None and b.streamed.state is WeightState.ON_HOST and b.streamed.slot is None
    assert a.streamed.state is WeightState.ON_DEVICE and a.streamed.slot.tenant is a
    _tenant(s, b)
    with pytest.raises(RuntimeError, match="device slots"):
        pool.take(protect=(a, b))
    assert (
        a.streamed.state is b.streamed.state is WeightState.ON_DEVICE
        and a.streamed.slot.tenant is a
        and b.streamed.slot.tenant is b
    )
    pool.empty()
    assert all(s.tenant is None and s.free_event is None and s.read_event is None for s in pool.slots)


def test_a_step_walks_each_block_through_the_states_and_computes_only_on_device():
    """Through train_batch: every begin_upload moves an ON_HOST block to UPLOADING, every acquire leaves it ON_DEVICE,
    each block computes (forward and backward) only while ON_DEVICE in a slot it is the tenant of (a prefetch never
    took it away), the invariants hold at every transition, and at the step's end every block is ON_HOST (the
    backward evicts each block before its update)."""
    engine = _engine(slots=3)
    s = engine.streamer
    assert len(s.pool.slots) == engine.plan.weight_slots == 3
    log = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            unit = a[0] if name != "acquire" else a[0][a[1]]
            before = unit.streamed.state
            out = fn(*a, **kw)
            log.append((name, unit.index, before, unit.streamed.state))
            _check_slots(engine)
            return out

        return wrapped

    begin, acquire, evict = s.begin_upload, s.acquire, s.evict
    s.begin_upload, s.acquire, s.evict = spy("begin", begin), spy("acquire", acquire), spy("evict", evict)
    block = engine.compute.block
    computed = []

    def checked_block(unit, *a, **kw):
        assert unit.streamed.state is WeightState.ON_DEVICE and unit.streamed.slot.tenant is unit, unit.name
        computed.append(unit.index)
        return block(unit, *a, **kw)

    engine.compute.block = checked_block
    engine.train_batch(tm.batches(1, 2)[0])
    engine.wait()
    for name, _, before, after in log:
        if name == "begin" and before is WeightState.ON_HOST:
            assert after is WeightState.UPLOADING
        if name == "acquire":
            assert after is WeightState.ON_DEVICE
        if name == "evict":
            assert after is WeightState.ON_HOST
    acquired = [i for name, i, _, _ in log if name == "acquire"]
    order = list(range(LAYERS))
    assert acquired == order + order[::-1], "the forward in order, the backward in reverse"
    assert [i for name, i, _, _ in log if name == "evict"] == order[::-1]
    assert computed == [i for i in order for _ in range(2)] + [i for i in order[::-1] for _ in range(2)]
    assert all(u.streamed.state is WeightState.ON_HOST for u in engine.blocks)
    engine.close()


def test_device_weights_refuse_a_block_not_on_device():
    """Unit.device_weights (what the compute reads) raises while a streamed block is ON_HOST or UPLOADING: reading
    a slot before the compute stream waited for its upload would read another tenant's or half-copied weights."""
    pool = SlotPool(Device.create(torch.device("cpu")), 1, 4, torch.float32, Streamer.evicted)
    u = _unit("u", 0)
    with pytest.raises(RuntimeError, match="ON_HOST"):
        u.device_weights()
    slot = pool.take()
    slot.tenant, u.streamed.slot, u.streamed.state = u, slot, WeightState.UPLOADING
    with pytest.raises(RuntimeError, match="UPLOADING"):
        u.device_weights()
    u.streamed.state = WeightState.ON_DEVICE
    assert u.device_weights().data_ptr() == slot.tensor.data_ptr()


def test_a_failed_step_empties_every_slot_and_the_next_step_uploads_again():
    """A forward that fails mid-way (block 3) leaves blocks in slots; the step's discard (Streamer.reset) puts every
    streamed block ON_HOST and every slot without tenant or events, and the next step trains."""
    engine = _engine(slots=3)
    block = engine.compute.block

    def failing(unit, *a, **kw):
        if unit.index == 3:
            raise RuntimeError("injected")
        return block(unit, *a, **kw)

    engine.compute.block = failing
    data = tm.batches(2, 1)
    with pytest.raises(RuntimeError, match="injected"):
        engine.train_batch(data[0])
    assert all(
        u.streamed.state is WeightState.ON_HOST and u.streamed.slot is None and u.streamed.ready_event is None
        for u in engine.blocks
    )
    assert all(s.tenant is None for s in engine.streamer.pool.slots)
    assert engine.streamer.kept == {}
    engine.compute.block = block
    assert torch.isfinite(torch.tensor(engine.train_batch(data[1])))
    engine.close()


def _storage(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def test_a_window_keeps_blocks_in_the_gradient_buffers_until_its_boundary():
    """[Note: a window keeps some blocks]: at a window's first forward (G = 3) the streamed blocks just before the
    last weight_slots ones are kept, each in a slot carved from a gradient buffer (no new memory); the window's
    later forwards find them there and do not upload them again; at the boundary, before the blocks' backward
    takes the gradient buffers, nothing is kept and those blocks are ON_HOST (the backward uploads them again)."""
    G = 3
    engine = _engine(G=G, slots=2)
    s, grad_slots = engine.streamer, engine.grads.pool.slots
    uploads: list[list[int]] = []
    upload = s.upload

    def counted(unit, dst):
        uploads[-1].append(unit.index)
        return upload(unit, dst)

    s.upload = counted
    at_backward = []
    backward_blocks = engine.schedule.backward_blocks

    def before_backward(micros):
        at_backward.append((dict(s.kept), [(u.streamed.state, u.streamed.slot) for u in engine.blocks]))
        return backward_blocks(micros)

    engine.schedule.backward_blocks = before_backward
    mbs = tm.batches(1, G)[0]
    for i, mb in enumerate(mbs):
        uploads.append([])
        out = engine(**mb)
        if i == 0:
            # fp32: a gradient buffer holds one block's weights; blocks[:L - weight_slots], the last len(grad) of them
            candidates = engine.blocks[: LAYERS - engine.plan.weight_slots]
            kept = candidates[len(candidates) - len(grad_slots) :]
            assert sorted(s.kept) == sorted(id(u) for u in kept)
            spans = [_storage(g.tensor) for g in grad_slots]
            for u in kept:
                slot = s.kept[id(u)]
                assert u.streamed.slot is slot and slot.tenant is u and u.streamed.state is not WeightState.ON_HOST
                assert any(a <= slot.tensor.data_ptr() < b for a, b in spans), "carved from a gradient buffer"
        else:
            assert not set(uploads[-1]) & {u.index for u in kept}, "a kept block was uploaded again"
        _check_slots(engine)
        uploads.append([])  # the backward's (the blocks' at the boundary)
        engine.backward(out.loss)
        engine.step()
    forwards = uploads[0::2]
    assert set(forwards[0]) == set(range(LAYERS))
    # the later forwards upload the other blocks (the first ones prefetched at the end of the forward before)
    assert set().union(*forwards[1:]) == set(range(LAYERS)) - {u.index for u in kept}
    # the boundary's backward uploads the kept blocks again; the last weight_slots ones are still in the pool's slots
    assert sorted(uploads[-1]) == list(range(LAYERS - engine.plan.weight_slots))
    assert engine.global_steps == 1
    assert len(at_backward) == 1
    kept_then, states = at_backward[0]
    assert kept_then == {}
    for u, (state, slot) in zip(engine.blocks, states):
        if any(u is k for k in kept):
            assert state is WeightState.ON_HOST and slot is None, u.name
    engine.close()
