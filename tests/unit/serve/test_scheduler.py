"""The continuous batcher (zerofit/serve/scheduler.py) on tiny models: greedy tokens batched with others, joining
half-way, equal those of ``generate`` alone; each forward streams every block once for the whole batch; several
LoRA adapters in one batch equal PEFT's model with each alone; a seed reproduces its draws in any batch; stop
strings, cancellation and a full queue."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from peft import LoraConfig, PeftModel

from tests.support import tiny_models as tm
from tests.support.tiny_tokenizer import build_tokenizer
from zerofit.infer import InferenceEngine
from zerofit.serve.scheduler import Busy, Delta, Done, Sampling, Scheduler, Sequence, _held_back

TOK = build_tokenizer()
GREEDY = Sampling(max_tokens=12, temperature=0.0)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, tm.VOCAB, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def _reference(model, prompt: list[int], max_new: int) -> list[int]:
    """HF ``generate`` on the model held whole, the prompt alone (its tokens up to and with end-of-sequence)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                         eos_token_id=2, cache_implementation="static", disable_compile=True)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _run(sched: Scheduler, seqs: list[Sequence], stagger: int = 0, timeout: float = 60.0) -> None:
    """Submit ``seqs`` (the later ones after the first has ``stagger`` tokens: they join a running batch) and
    wait until all are done."""
    for i, s in enumerate(seqs):
        if i and stagger:
            while len(seqs[0].tokens) < stagger and seqs[0].finish is None:
                time.sleep(0.001)
        sched.submit(s)
    t0 = time.time()
    while any(s.finish is None for s in seqs):
        assert time.time() - t0 < timeout, "the scheduler did not finish"
        time.sleep(0.005)


def _seq(prompt, sampling=GREEDY, adapter=None) -> tuple[Sequence, list]:
    events: list = []
    return Sequence(list(prompt), sampling, events.append, adapter=adapter), events


@pytest.fixture
def streamed():
    """A tiny llama in fp32 whose every block streams through one slot (as on a GPU too small for any), and the
    model held whole beside it."""
    torch.manual_seed(0)
    model = tm.llama(layers=3).eval()
    eng = InferenceEngine(copy.deepcopy(model), dtype=torch.float32, device="cpu", tokenizer=TOK, slots=1)
    s = eng.shape
    eng.cap = s.shell_bytes + s.kv_bytes(4, 48) + s.work_bytes(4, 12, 48) + max(s.block_bytes) * 3 // 2
    yield model, eng
    eng.close()


def test_batched_greedy_tokens_are_generate_s_alone_and_share_each_upload(streamed):
    model, eng = streamed
    sched = Scheduler(eng, slots=4, context=48)
    try:
        assert sched.full_plan.resident == [] and len(sched.full_plan.streamed) == 3
        prompts = _prompts(7)
        seqs = [_seq(p)[0] for p in prompts]
        _run(sched, seqs, stagger=3)  # six join a running request, four at a time: the rest wait for slots
        for p, s in zip(prompts, seqs):
            assert s.tokens == _reference(model, p, GREEDY.max_tokens), p
        st = sched.stats()
        assert st["max_batch"] == 4 and st["mean_batch"] > 1.5
        # every forward streamed the three blocks once, whatever its rows: uploads follow forwards, not requests
        assert st["rows"] == 4 and sched.plan.resident == []  # the cache grew to the batch ([Note: a plan that
        assert eng.uploads <= 3 * (sched.forwards + 1)  # follows the batch]), its blocks streamed
        assert sched.forwards < sum(len(s.tokens) for s in seqs) * 0.6
        # with the blocks streaming, joiners' prompts and the others' next tokens went in one forward a step
        assert sched.forwards == sched.steps
    finally:
        sched.close()


def test_several_adapters_in_one_batch_are_peft_s_model_with_each_alone():
    torch.manual_seed(0)
    peft = PeftModel(tm.llama(tied=False), _lora(0), adapter_name="a").eval()
    peft.add_adapter("b", _lora(1))
    torch.manual_seed(5)
    for n, p in peft.named_parameters():  # B random: each adapter changes the answers
        if ".lora_" in n:
            p.data.normal_(0, 0.5)
    eng = InferenceEngine(copy.deepcopy(peft), dtype=torch.float32, device="cpu", tokenizer=TOK)
    sched = Scheduler(eng, slots=4, context=48, adapters=("a", "b"))
    try:
        prompts = _prompts(6, seed=11)
        which = ["a", None, "b", "a", "b", None]
        seqs = [_seq(p, adapter=w)[0] for p, w in zip(prompts, which)]
        _run(sched, seqs, stagger=2)
        assert sched.max_rows > 1
        answers = {}
        for p, w, s in zip(prompts, which, seqs):
            if w is None:
                with peft.disable_adapter():
                    want = _reference(peft, p, GREEDY.max_tokens)
            else:
                peft.set_adapter(w)
                want = _reference(peft, p, GREEDY.max_tokens)
            assert s.tokens == want, (w, p)
            answers[w] = s.tokens
        # the three answers of one prompt differ: each row went through its own adapter
        alone = [_seq(prompts[0], adapter=w)[0] for w in ("a", "b", None)]
        _run(sched, alone)
        assert len({tuple(s.tokens) for s in alone}) == 3
    finally:
        sched.close()
        eng.close()


def _lora(seed: int) -> LoraConfig:
    targets = ["q_proj", "v_proj"] if seed == 0 else ["k_proj", "o_proj", "up_proj"]
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)


@pytest.fixture
def engine():
    torch.manual_seed(0)
    eng = InferenceEngine(tm.llama(layers=2).eval(), dtype=torch.float32, device="cpu", tokenizer=TOK)
    yield eng
    eng.close()


def test_a_seed_reproduces_its_draws_in_any_batch(engine):
    sched = Scheduler(engine, slots=4, context=48)
    try:
        prompt = _prompts(1, seed=7)[0]
        hot = Sampling(max_tokens=16, temperature=1.5, top_p=0.95, seed=1234)
        alone = _seq(prompt, hot)[0]
        _run(sched, [alone])
        others = [_seq(p, Sampling(max_tokens=16, temperature=1.0))[0] for p in _prompts(3, seed=8)]
        again = _seq(prompt, hot)[0]
        _run(sched, [others[0], again, *others[1:]], stagger=2)
        assert again.tokens == alone.tokens
        reseeded = [_seq(prompt, Sampling(max_tokens=16, temperature=1.5, top_p=0.95, seed=s))[0] for s in (1, 2, 3)]
        _run(sched, reseeded)
        assert any(s.tokens != alone.tokens for s in reseeded)
    finally:
        sched.close()


def test_a_stop_string_ends_the_text_before_it_and_is_never_streamed(engine):
    sched = Scheduler(engine, slots=2, context=48)
    try:
        prompt = _prompts(1, seed=9)[0]
        free, events = _seq(prompt, Sampling(max_tokens=20, temperature=0.0))
        _run(sched, [free])
        text = free.text
        assert len(text) > 8
        stop = text[5:8]
        cut = text.find(stop)
        stopped, ev = _seq(prompt, Sampling(max_tokens=20, temperature=0.0, stop=("\x00never", stop)))
        _run(sched, [stopped])
        assert stopped.text == text[:cut] and stopped.finish == "stop"
        assert "".join(e.text for e in ev if isinstance(e, Delta)) == text[:cut]
        assert isinstance(ev[-1], Done) and ev[-1].finish == "stop" and ev[-1].completion_tokens <= 20
        # without the stop: the pieces streamed are the whole text, and max_tokens ends it
        assert "".join(e.text for e in events if isinstance(e, Delta)) == text
        assert free.finish == "length" and len(free.tokens) == 20
    finally:
        sched.close()


def test_held_back_is_the_longest_end_that_could_begin_a_stop():
    assert _held_back("hello wor", ("world",)) == 3
    assert _held_back("hello", ("xyz",)) == 0
    assert _held_back("ab", ("b!", "ab?")) == 2


def test_a_full_queue_is_busy_and_a_cancelled_request_frees_its_slot(engine):
    sched = Scheduler(engine, slots=1, context=48, max_waiting=1)
    try:
        long = _seq([5, 6, 7], Sampling(max_tokens=40, temperature=0.0))[0]
        sched.submit(long)
        while not long.tokens:
            time.sleep(0.001)
        waiting = _seq(_prompts(1, seed=4)[0], Sampling(max_tokens=3, temperature=0.0))[0]
        sched.submit(waiting)  # the one slot is taken: it waits
        with pytest.raises(Busy):
            sched.submit(_seq([5, 6, 7])[0])
        sched.cancel(long)
        _run(sched, [])
        t0 = time.time()
        while waiting.finish is None:
            assert time.time() - t0 < 30
            time.sleep(0.005)
        assert long.finish == "cancelled" and len(long.tokens) < 40
        assert waiting.finish == "length" and len(waiting.tokens) == 3
        assert sched.stats()["running"] == 0 and sched.cache.lengths == [0]
        with pytest.raises(ValueError, match="context of 48"):
            sched.submit(_seq([5] * 40, Sampling(max_tokens=9))[0])
    finally:
        sched.close()


def test_the_cache_holds_the_rows_in_flight_and_one_request_keeps_every_block_resident(streamed):
    """[Note: a plan that follows the batch]: the placement for four rows streams every block; the server starts
    with one row, where every block stays resident (no upload for a request alone); four requests grow the cache
    (one, two, four rows: every block streamed again), the rows in flight kept; once the server is idle, the next
    request alone shrinks it back. Every request's tokens are generate's alone."""
    model, eng = streamed
    sched = Scheduler(eng, slots=4, context=48)
    try:
        assert sched.full_plan.resident == [] and sched.plan.resident == [0, 1, 2] and sched.cache.slots == 1
        prompts = _prompts(6, seed=11)
        alone = _seq(prompts[0])[0]
        _run(sched, [alone])
        assert alone.tokens == _reference(model, prompts[0], GREEDY.max_tokens)
        assert eng.uploads == 0 and sched.resizes == 1  # the start's placement only
        together = [_seq(p)[0] for p in prompts[1:5]]
        _run(sched, together, stagger=2)  # three join the first mid-answer: the rows it holds are kept
        for p, s in zip(prompts[1:5], together):
            assert s.tokens == _reference(model, p, GREEDY.max_tokens), p
        assert sched.cache.slots == 4 and sched.plan.resident == [] and eng.uploads > 0
        assert sched.resizes in (2, 3)  # to two rows then four, or to four at once
        uploads = eng.uploads
        last = _seq(prompts[5])[0]
        _run(sched, [last])
        assert last.tokens == _reference(model, prompts[5], GREEDY.max_tokens)
        assert sched.cache.slots == 1 and sched.plan.resident == [0, 1, 2] and eng.uploads == uploads
    finally:
        sched.close()


def test_a_grown_cache_holds_the_rows_in_flight_as_they_were():
    """[Note: a plan that follows the batch]: the rows a growing cache keeps come back into the new one bitwise, up
    to the longest of them, with their lengths; the new rows are empty."""
    from zerofit.serve.cache import SlotCache

    def cache(rows: int) -> SlotCache:
        return SlotCache(layers=2, slots=rows, context=16, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")

    old = cache(2)
    g = torch.Generator().manual_seed(0)
    for la in old.layers:
        la.keys.copy_(torch.randn(la.keys.shape, generator=g))
        la.values.copy_(torch.randn(la.values.shape, generator=g))
    old.lengths[:] = [5, 9]
    kept = old.rows_to_host(2)
    new = cache(4)
    new.rows_from_host(kept)
    assert new.lengths == [5, 9, 0, 0]
    for a, b in zip(old.layers, new.layers):
        assert torch.equal(a.keys[:, :, :9], b.keys[:2, :, :9]) and torch.equal(a.values[:, :, :9], b.values[:2, :, :9])
        assert not b.keys[2:].any() and not b.values[2:].any() and not b.keys[:, :, 9:].any()
    old.release()
    assert all(la.keys.numel() == 0 and la.values.numel() == 0 for la in old.layers)
