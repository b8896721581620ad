"""The schedule's backward order (step/schedule.py ``Schedule``) and the planner's sets for it (plan/search.py
``recomputed_blocks``, ``device_checkpoints``).

[Note: checkpoints every k blocks]: with plan.checkpoint_every = k the forward keeps the inputs of blocks 0, k,
2k, ... only; the backward takes the segments from the last, first running the forward of each segment's blocks
but its last (for their successors' inputs), then the segment's backward in reverse, each block recomputed from
its input. The backward's block order, and so the updates' order, is every block's in reverse, as with k = 1.
The spies below wrap the parts' methods and record what the schedule asked of them.
"""

from __future__ import annotations

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm
from zerofit.engine.plan.search import device_checkpoints, recomputed_blocks

pytestmark = pytest.mark.usefixtures("one_thread")


def _segments(n: int, k: int) -> list[list[int]]:
    return [list(range(s, min(s + k, n))) for s in range(0, n, k)]


def _engine(layers: int, every: int, dropout: float = 0.0, param_groups=None):
    torch.manual_seed(0)
    return zerofit.initialize(
        tm.llama(layers=layers, dropout=dropout),
        {
            "device": "cpu",
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"lr": 1e-2},
            "offload": {"resident_blocks": 0, "checkpoint_every": every},
        },
        param_groups=param_groups,
    )


class _Record:
    """What a step's backward did, block by block: ("recompute" | "backward", index) per compute.block call (a
    block's forward under no_grad is a recompute of its successor's input; one with autograd on is the block's
    backward), the units handed to the step, and the checkpoints each micro-batch holds at each block backward."""

    def __init__(self, engine):
        self.calls: list[tuple[str, int]] = []
        self.done: list[int] = []
        self.held: list[int] = []
        self.kept_after_forward: list[list[int]] = []
        self.left: list[list[int]] = []  # the checkpoints each micro-batch still holds after the backward
        self.in_backward = False
        sched, compute, stepper = engine.schedule, engine.compute, engine.stepper
        block, unit_done, block_backward = compute.block, stepper.unit_done, sched._block_backward
        forward, backward_blocks = sched.forward, sched.backward_blocks

        def on_block(unit, *a, **kw):
            if self.in_backward:
                self.calls.append(("backward" if torch.is_grad_enabled() else "recompute", unit.index))
            return block(unit, *a, **kw)

        def on_done(unit):
            if unit.index >= 0:
                self.done.append(unit.index)
            return unit_done(unit)

        def on_block_backward(unit, micro, *a):
            self.held.append(sum(c is not None for c in micro.ckpts))
            return block_backward(unit, micro, *a)

        def on_forward(*a, **kw):
            micros = forward(*a, **kw)
            self.kept_after_forward = [[i for i, c in enumerate(m.ckpts) if c is not None] for m in micros]
            return micros

        def on_backward_blocks(micros):
            self.in_backward = True
            try:
                return backward_blocks(micros)
            finally:
                self.in_backward = False
                self.left = [[i for i, c in enumerate(m.ckpts) if c is not None] for m in micros]

        compute.block, stepper.unit_done, sched._block_backward = on_block, on_done, on_block_backward
        sched.forward, sched.backward_blocks = on_forward, on_backward_blocks


@pytest.mark.parametrize("n,k", [(7, 1), (7, 2), (7, 3), (6, 3), (8, 4), (3, 5)])
def test_recomputed_blocks_are_every_block_but_each_segments_last(n, k):
    """recomputed_blocks(n, k) (what the estimate counts as forwards run twice) is each segment's blocks but its
    last, and none with k = 1; device_checkpoints without offloading is every block's with k = 1, else the peak of
    a segment's recomputed inputs beside the kept inputs of it and every earlier segment."""
    want = [] if k == 1 else [i for seg in _segments(n, k) for i in seg[:-1]]
    assert recomputed_blocks(n, k) == want
    if k == 1:
        assert device_checkpoints(n, k, False) == n
    else:
        assert device_checkpoints(n, k, False) == max(j + 1 + len(seg) - 1 for j, seg in enumerate(_segments(n, k)))


@pytest.mark.parametrize("every", [2, 3])
def test_the_backward_recomputes_each_segment_then_walks_it_in_reverse(every):
    """Seven blocks: the forward keeps the inputs of blocks 0, k, 2k, ... only; the backward, segment by segment
    from the last, first recomputes the segment's blocks but its last in order, then runs its blocks' backward in
    reverse, each over both micro-batches; the blocks' gradients reach the step 6, 5, ..., 0 (the order of
    k = 1); the recomputed blocks are recomputed_blocks(7, k); no checkpoint outlives the backward, and the most a
    micro-batch holds at once is device_checkpoints(7, k)."""
    L = 7
    engine = _engine(L, every)
    assert engine.plan.checkpoint_every == every
    rec = _Record(engine)
    engine.train_batch(tm.batches(1, 2)[0])
    engine.wait()
    assert engine.activations.every == every
    assert rec.kept_after_forward == [list(range(0, L, every))] * 2
    want = []
    for seg in reversed(_segments(L, every)):
        want += [("recompute", i) for i in seg[:-1] for _ in range(2)]
        want += [("backward", i) for i in reversed(seg) for _ in range(2)]
    assert rec.calls == want
    assert rec.done == list(reversed(range(L)))
    assert sorted({i for kind, i in rec.calls if kind == "recompute"}) == recomputed_blocks(L, every)
    assert max(rec.held) == device_checkpoints(L, every, False)
    assert rec.left == [[], []]
    engine.close()


def test_every_block_checkpointed_walks_the_blocks_in_reverse_without_recompute():
    """k = 1: every block's input is kept; the backward is each block in reverse, recomputed from its own input
    only (no forward for another block's input), and hands each gradient to the step as it completes."""
    L = 4
    engine = _engine(L, 1)
    rec = _Record(engine)
    engine.train_batch(tm.batches(1, 2)[0])
    engine.wait()
    assert rec.kept_after_forward == [list(range(L))] * 2
    assert rec.calls == [("backward", i) for i in reversed(range(L)) for _ in range(2)]
    assert rec.done == list(reversed(range(L)))
    assert max(rec.held) == device_checkpoints(L, 1, False) == L
    assert rec.left == [[], []]
    engine.close()


def test_checkpoints_every_k_blocks_give_the_same_updates_bitwise():
    """The recomputed inputs are the forward's bitwise (same kernels, same inputs, the block's RNG state replayed:
    attention dropout on), so two steps with checkpoints every 3 blocks leave every master and moment bitwise equal
    to those of every block's checkpoints, and the losses equal."""
    data = tm.batches(2, 2)
    runs = []
    for every in (1, 3):
        engine = _engine(5, every, dropout=0.1)
        losses = [engine.train_batch(mbs) for mbs in data]
        engine.wait()
        runs.append((losses, [[t.clone() for t in (u.master, u.exp_avg, u.exp_avg_sq)] for u in engine.units]))
        engine.close()
    (l1, s1), (l3, s3) = runs
    assert l1 == l3
    for a, b in zip(s1, s3):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_no_backward_below_the_lowest_trained_block():
    """[Note: no backward below the lowest trained block]: only blocks 3.. train (the embedding is frozen), so with
    k = 2 the backward stops at block 3: segment [4, 5] recomputes 4 then runs 5, 4; segment [2, 3] recomputes 2
    (block 3's input) and runs 3 only; segment [0, 1] is never touched (its blocks are neither recomputed nor
    handed to the step, and only the inputs of blocks 0 and 2 are left unconsumed)."""
    L = 6
    names = [n for n, _ in tm.llama(layers=L).named_parameters() if any(f"layers.{i}." in n for i in range(3, L))]
    engine = _engine(L, 2, param_groups=[{"params": names}])
    rec = _Record(engine)
    engine.train_batch(tm.batches(1, 2)[0])
    engine.wait()
    want = [("recompute", 4)] * 2 + [("backward", 5)] * 2 + [("backward", 4)] * 2
    want += [("recompute", 2)] * 2 + [("backward", 3)] * 2
    assert rec.calls == want
    assert rec.done == [5, 4, 3]
    assert rec.left == [[0, 2]] * 2, "only the inputs of the blocks below the lowest trained one are left"
    engine.close()


def _long_plan(**kw):
    """A plan of 32 blocks of 10 M parameters (hidden 512), all streamed, for one micro-batch of 32,768 tokens (a
    block's checkpoint 32 MiB in bf16, its weights 19 MiB) or, ``tokens``, another length."""
    from zerofit.engine.plan.search import BatchShape, ModelShape, make_plan

    shape = ModelShape(
        shell_numel=1_000_000, block_numels=(10_000_000,) * 32, hidden=512, intermediate=1376, vocab=32000
    )
    tokens = kw.pop("tokens", 32_768)
    args = dict(
        compute_dtype=torch.bfloat16,
        on_cuda=True,
        device_budget=None,
        host_budget=None,
        deferred_updates=False,
        checkpointing=True,
        stream_params=True,
        resident_blocks=0,
        prefetch_depth=None,
        assisted_fraction=0.0,
    )
    return make_plan(shape, BatchShape(1, tokens, 1), **(args | kw))


def test_offloaded_checkpoints_come_back_one_block_ahead_where_they_outweigh_a_blocks_other_uploads(monkeypatch):
    """[Note: one checkpoint ahead]: a block's checkpoints larger than its weights come back one block ahead, and
    the device counts one checkpoint less (three: block 0's, the one computing, the next); smaller ones two ahead
    (four). Under a device budget that holds three but not four, the planner keeps every block's checkpoint in
    host memory with the full pipeline, where two ahead would have needed a slower level (the lean pipeline or
    checkpoints every k blocks)."""
    import zerofit.engine.plan.search as search
    from zerofit.engine.plan.search import checkpoint_ahead, device_checkpoints

    assert checkpoint_ahead(2, 1) == checkpoint_ahead(1, 1) == 1 and checkpoint_ahead(1, 2) == 2
    assert (device_checkpoints(32, 1, True, 1), device_checkpoints(32, 1, True, 2)) == (3, 4)
    ckpt = 32_768 * 512 * 2
    long = _long_plan(floor=(True, True, False, 1))
    short = _long_plan(floor=(True, True, False, 1), tokens=4096)
    assert (long.checkpoint_ahead, short.checkpoint_ahead) == (1, 2)
    assert long.device_bytes["checkpoints"] == 3 * ckpt
    assert short.device_bytes["checkpoints"] == 4 * 4096 * 512 * 2
    assert "back one block ahead" in long.describe() and "ahead" not in short.describe()

    budget = long.device_total  # three checkpoints fit, a fourth does not
    chosen = _long_plan(device_budget=budget)
    assert (chosen.offload_checkpoints, chosen.checkpoint_every, chosen.checkpoint_ahead) == (True, 1, 1)
    assert chosen.stage_numel == 0 and chosen.sequence_tile is None  # not the lean pipeline, no tiles
    monkeypatch.setattr(search, "checkpoint_ahead", lambda c, o: 2)
    two = _long_plan(device_budget=budget)
    assert two.stage_numel > 0 or two.checkpoint_every > 1 or two.sequence_tile is not None, two.describe()


def test_the_backward_brings_checkpoints_back_as_many_blocks_ahead_as_the_plan_says(monkeypatch):
    """Offloaded checkpoints (on the CPU the uploads are no-ops, their order is what the backward asks): with the
    plan's two ahead, each block's backward asks for its own and the two before it; with one ahead ([Note: one
    checkpoint ahead]), its own and the one before; the losses and weights bitwise the same."""
    import zerofit.engine.plan.search as search

    def run(ahead: int):
        monkeypatch.setattr(search, "checkpoint_ahead", lambda ckpt, other: ahead)
        torch.manual_seed(0)
        engine = zerofit.initialize(
            tm.llama(layers=6),
            {
                "device": "cpu",
                "precision": "fp32",
                "micro_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "optimizer": {"lr": 1e-2},
                "offload": {"resident_blocks": 0, "offload_checkpoints": True, "checkpoint_every": 1},
            },
        )
        assert engine.plan.checkpoint_ahead == ahead
        asked: list[int] = []
        up = engine.activations.up
        engine.activations.up = lambda micros, index: (asked.append(index), up(micros, index))[1]
        losses = [engine.train_batch(mbs) for mbs in tm.batches(2, 2)]
        assert engine.activations.ahead == ahead
        weights = engine.master_state_dict()
        engine.close()
        return losses, weights, asked[: len(asked) // 2]  # the first step's

    losses1, weights1, asked1 = run(1)
    losses2, weights2, asked2 = run(2)
    assert losses1 == losses2 and all(torch.equal(weights1[n], weights2[n]) for n in weights2)
    assert asked2 == [i for b in reversed(range(6)) for i in [b] + [b - k for k in (1, 2) if b - k >= 0]]
    assert asked1 == [i for b in reversed(range(6)) for i in [b] + ([b - 1] if b >= 1 else [])]
