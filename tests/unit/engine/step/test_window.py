"""The DeepSpeed-shaped loop's accumulation window (step/window.py ``Window``), driven as the loop drives it:
``out = engine(**batch); engine.backward(out.loss); engine.step()``, with ``forward_window``,
``set_gradient_accumulation_boundary`` and the loader's offer, asserting on the window's own state:
``micro_steps``, ``pending``, ``held``, ``announced``, ``offered``, ``boundary``, ``stats``.

[Note: the block backward waits for the boundary]: backward() runs the post pass's backward only and holds the
micro-batch; the G-th runs the blocks' backward over the G held ones, once; step() steps at the boundary only.
"""

from __future__ import annotations

import logging

import pytest
import torch

import zerofit
from tests.support import tiny_models as tm

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(G: int, **config):
    torch.manual_seed(0)
    return zerofit.initialize(
        tm.llama(layers=3),
        {
            "device": "cpu",
            "precision": "fp32",
            "micro_batch_size": 2,
            "gradient_accumulation_steps": G,
            "optimizer": {"lr": 1e-3},
            "offload": {"resident_blocks": 0},
            **config,
        },
    )


def _spy_block_backward(engine) -> list[int]:
    """The number of micro-batches each run of the blocks' backward went over."""
    runs: list[int] = []
    inner = engine.schedule.backward_blocks

    def spy(micros):
        runs.append(len(micros))
        return inner(micros)

    engine.schedule.backward_blocks = spy
    return runs


def test_a_window_counts_backwards_holds_them_and_steps_at_the_gth():
    """G = 3: a forward sets ``pending`` and counts nothing; each backward() clears it, counts one micro-step and
    holds the micro-batch; the blocks' backward runs once, at the third, over all three; step() before the boundary
    is a no-op, at it the optimizer steps and a new window begins (micro_steps 0, nothing in progress)."""
    G = 3
    engine = _engine(G)
    w = engine.window
    runs = _spy_block_backward(engine)
    assert (w.micro_steps, w.pending, w.held, w.in_progress(), w.position()) == (0, None, [], None, None)
    for i, mb in enumerate(tm.batches(1, G)[0]):
        out = engine(**mb)
        assert w.pending is not None and w.micro_steps == i
        assert w.position() == {"micro_batches": i, "forward_pending": True, "held": i > 0}
        engine.backward(out.loss)
        assert w.pending is None and w.micro_steps == i + 1
        if i + 1 < G:
            assert len(w.held) == i + 1 and runs == [] and not w.at_boundary()
            engine.step()
            assert engine.global_steps == 0 and w.micro_steps == i + 1, "step() before the boundary stepped"
        else:
            assert w.held == [] and runs == [G] and w.at_boundary()
            engine.step()
    assert engine.global_steps == 1
    assert (w.micro_steps, w.pending, w.held, w.in_progress(), w.position()) == (0, None, [], None, None)
    engine.close()


def test_a_forward_without_backward_is_dropped_and_a_backward_needs_a_forward():
    """[Note: a forward records for backward as autograd says]: a second forward replaces the first one's pending
    micro-batch without counting it; a backward() with no forward pending raises and counts nothing."""
    G = 2
    engine = _engine(G)
    w = engine.window
    a, b = tm.batches(1, G)[0]
    engine(**a)
    first = w.pending
    out = engine(**b)
    assert w.pending is not first and w.micro_steps == 0
    engine.backward(out.loss)
    with pytest.raises(RuntimeError, match="without a forward"):
        engine.backward(out.loss)
    assert w.micro_steps == 1 and w.pending is None and len(w.held) == 1
    engine.backward(engine(**a).loss)
    assert w.micro_steps == G and w.at_boundary()
    engine.step()
    assert engine.global_steps == 1 and w.micro_steps == 0
    engine.close()


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["immediate-updates", "deferred-updates"])
def test_a_forward_past_g_is_refused_and_changes_nothing(clip):
    """A (G+1)-th forward before step() is refused before the step's guard: without clipping the G-th backward has
    begun the blocks' updates, with clipping they wait for the norm; either way the window stays as it was (its G
    micro-batches held, the engine usable), and the step() the message asks for steps, as an unrefused run would."""
    G = 2
    engine = _engine(G, gradient_clipping=clip)
    ref = _engine(G, gradient_clipping=clip)
    w = engine.window
    a, b = tm.batches(1, G)[0]
    for mb in (a, b):
        engine.backward(engine(**mb).loss)
        ref.backward(ref(**mb).loss)
    with pytest.raises(RuntimeError, match="call engine.step"):
        engine(**a)
    assert w.micro_steps == G and w.at_boundary()
    engine.step()
    ref.step()
    assert engine.global_steps == ref.global_steps == 1 and w.micro_steps == 0
    mine, theirs = engine.master_state_dict(), ref.master_state_dict()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    engine.close()
    ref.close()


def test_the_boundary_override_ends_the_window_early_or_holds_the_step():
    """set_gradient_accumulation_boundary(True) before the second of G = 3 forwards ends the window with it: its
    backward runs the blocks' backward over the two held micro-batches and step() steps. False holds the step even
    at G micro-batches (their blocks' backward still runs at the G-th: the window stays at most G long); None counts
    G again and the held step is taken."""
    G = 3
    engine = _engine(G)
    w = engine.window
    runs = _spy_block_backward(engine)
    data = tm.batches(2, G)
    engine.backward(engine(**data[0][0]).loss)
    engine.set_gradient_accumulation_boundary(True)
    assert w.boundary is True and engine.is_gradient_accumulation_boundary()
    engine.backward(engine(**data[0][1]).loss)
    assert runs == [2] and w.held == [] and w.at_boundary()
    engine.step()
    assert engine.global_steps == 1 and w.micro_steps == 0

    engine.set_gradient_accumulation_boundary(False)
    for mb in data[1]:
        engine.backward(engine(**mb).loss)
        engine.step()
    assert runs == [2, G] and w.micro_steps == G and not w.at_boundary()
    assert engine.global_steps == 1, "False held the step"
    engine.set_gradient_accumulation_boundary(None)
    assert w.boundary is None and w.at_boundary()
    engine.step()
    assert engine.global_steps == 2 and w.micro_steps == 0
    engine.close()


def test_announced_forwards_are_taken_in_order_and_a_mismatch_drops_the_rest(caplog):
    """[Note: a window's forwards at once]: forward_window(G batches) makes G forwards (``announced``, stats 1);
    each matching engine(**batch) takes the next one, labels aside; a call whose inputs differ drops what is left
    (a warning, stats["mismatched"] 1) and is forwarded on its own. After a mismatch the engine's loader is no
    longer offered windows."""
    G = 3
    engine = _engine(G)
    w = engine.window
    first, second = tm.batches(2, G)
    engine.forward_window(first)
    assert len(w.announced) == G and w.stats == {"announced": 1, "mismatched": 0}
    relabelled = {"input_ids": first[0]["input_ids"], "labels": torch.zeros_like(first[0]["labels"])}
    engine.backward(engine(**relabelled).loss)
    assert len(w.announced) == G - 1
    with caplog.at_level(logging.WARNING, logger="zerofit"):
        out = engine(**second[1])
    assert w.announced == [] and w.stats == {"announced": 1, "mismatched": 1}
    assert "forward_window" in caplog.text
    engine.backward(out.loss)
    engine.backward(engine(**first[2]).loss)
    engine.step()
    assert engine.global_steps == 1 and w.micro_steps == 0
    assert not w.can_offer(), "a window dropped once: the loader's windows are not announced again"
    engine.close()


def test_forward_window_is_refused_inside_a_window_or_beyond_g():
    """forward_window is for a window's start: after a backward() it raises; more than G batches raise; neither
    changes the window's counters."""
    G = 2
    engine = _engine(G)
    w = engine.window
    data = tm.batches(2, G)
    with pytest.raises(ValueError, match="at most"):
        engine.forward_window(data[0] + data[1])
    assert w.announced == [] and w.stats["announced"] == 0
    engine.backward(engine(**data[0][0]).loss)
    with pytest.raises(RuntimeError, match="start of an accumulation window"):
        engine.forward_window(data[1])
    assert w.micro_steps == 1 and w.announced == []
    engine.close()


def test_the_loaders_offer_becomes_announced_forwards_when_its_first_batch_is_called():
    """[Note: the loader reads the window ahead]: at a window's start (G > 1) the window can be offered; an offer
    of one batch is ignored; an offered window is announced by the first engine(**batch) with its inputs (the rest
    wait as announced forwards), while an offer whose first batch is not the one called is dropped unused. With
    G = 1 nothing is offered."""
    G = 2
    engine = _engine(G)
    w = engine.window
    first, second = tm.batches(2, G)
    assert w.can_offer()
    w.offer(first[:1])
    assert w.offered is None
    w.offer(first)
    assert w.offered is not None and len(w.offered) == G
    out = engine(**first[0])
    assert w.offered is None and len(w.announced) == 1 and w.stats["announced"] == 1
    assert not w.can_offer(), "inside a window"
    engine.backward(out.loss)
    engine.backward(engine(**first[1]).loss)
    engine.step()
    assert w.announced == [] and w.can_offer()
    w.offer(second)
    engine(**first[0])  # not the offered window's first batch
    assert w.offered is None and w.announced == [] and w.stats["announced"] == 1
    engine.close()
    assert not _engine(1).window.can_offer()


def test_a_failed_forward_in_a_window_resets_it_and_the_next_window_steps():
    """A forward that fails mid-window (the second of G = 3) discards the step in progress ([Note: failure
    semantics]): Window.reset() leaves no micro-step, pending forward, held micro-batch or announced forward, so the
    engine is usable and the next full window steps once."""
    G = 3
    engine = _engine(G)
    w = engine.window
    data = tm.batches(2, G)
    engine.forward_window(data[0])
    engine.backward(engine(**data[0][0]).loss)
    block = engine.compute.block

    def failing(*a, **kw):
        raise RuntimeError("injected")

    engine.compute.block = failing
    with pytest.raises(RuntimeError, match="injected"):
        engine(**data[1][1])  # not announced: it drops the window and runs its own forward, which fails
    engine.compute.block = block
    assert (w.micro_steps, w.pending, w.held, w.announced, w.offered) == (0, None, [], [], None)
    assert w.in_progress() is None and engine.global_steps == 0
    for mb in data[1]:
        engine.backward(engine(**mb).loss)
        engine.step()
    assert engine.global_steps == 1 and w.micro_steps == 0
    engine.close()
