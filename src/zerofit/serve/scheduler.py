"""The continuous batcher: one thread runs the model, step after step, over every request in flight.

    sched = Scheduler(engine, slots=8, context=2048)
    seq = Sequence(prompt_ids, Sampling(max_tokens=64, temperature=0.0), emit=events.append)
    sched.submit(seq)            # Busy when the queue is full
    ...                          # events: Delta(text) pieces, then Done(finish, prompt_tokens, completion_tokens)
    sched.close()                # the requests in flight finish first

[Note: one forward per step for the whole batch]
Every forward runs each block once, so a streamed block crosses to the GPU
once per forward whatever the batch ([Note: the upload cycle],
zerofit/infer/engine.py): requests that arrive together share each upload.
Where blocks stream, a step is one forward: the prompts of the requests that
joined since the last step and the next token of every other request in
flight, as rows of different widths (the cache takes each row's new tokens at
its own columns, [Note: a row per sequence]), while that forward's padded
tokens fit the plan's prefill. Otherwise (every block resident: no upload to
share, and the decoding rows would be padded to the prompts' width; or a
forward too wide) a step is at most two forwards: the joiners' prefill, then
one token for the others. A request takes a slot of
the KV cache when it joins and gives it back when it finishes or its client
leaves; a waiting request joins at the next step. Rows are independent
sequences of the cache ([Note: a row per sequence], cache.py), so a request's
greedy tokens do not depend on what it is batched with.

[Note: a plan that follows the batch]
The GPU memory a KV cache row takes is memory a streamed block could stay
resident in, and a decode step's time is the bytes it streams. So the cache
holds rows for the requests in flight, not for ``slots`` (``--max-batch``):
a power of two of them, from one, each row's slot the lowest free one. A step
whose requests need more rows first grows the cache (the placement planned
again for the rows: resident blocks go back to streaming to make room; the
rows in flight kept through host memory, as the cache is allocated anew); a
step that starts from an idle server (every request a joiner) shrinks it to
what they need, and the blocks it frees stay resident again. The placement
for ``slots`` rows is planned at start, so a server that cannot hold its full
batch is refused then, not when the batch comes. A request's tokens do not
depend on the rows (each row is its own sequence; a block computes the same
whether resident or streamed).

[Note: a generator per request]
Sampling draws from the request's own ``torch.Generator`` (seeded by its
``seed``, else at random), on the CPU, one row at a time: the draws of one
request are the same whatever else is in the batch, so a seed reproduces its
tokens. Temperature 0 is greedy: the argmax of the fp32 logits, as
``generate``'s greedy search takes it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zerofit.errors import ZerofitError
from zerofit.infer.plan import row_prefill
from zerofit.serve.adapters import BASE
from zerofit.serve.cache import SlotCache

log = logging.getLogger("zerofit.serve")


class Busy(ZerofitError):
    """The queue of waiting requests is full (the server answers 503)."""


@dataclass(frozen=True)
class Sampling:
    """How one sequence is decoded."""

    max_tokens: int  # new tokens at most (finish "length" there)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # the request's generator ([Note: a generator per request]); None: at random
    stop: tuple[str, ...] = ()  # the text ends before the first of these (finish "stop")


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish: str  # "stop" (end-of-sequence token or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str


Event = Delta | Done | Failed


@dataclass(eq=False)
class Sequence:
    """One choice being generated: its prompt, how it samples, where its events go (``emit``, called from the
    scheduler's thread), and its state while it runs."""

    prompt: list[int]
    sampling: Sampling
    emit: Callable[[Event], None]
    adapter: str | None = None  # a served adapter's name; None: the base
    slot: int | None = None  # its row of the KV cache while it runs
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (up to a stop string)
    sent: int = 0  # characters of ``text`` emitted
    cancelled: bool = False  # the client left: dropped at the next step
    finish: str | None = None
    generator: torch.Generator | None = None
    submitted: float = 0.0
    first_token: float | None = None


class Scheduler:
    """Continuous batching over an :class:`~zerofit.infer.engine.InferenceEngine` ([Note: one forward per step for
    the whole batch]). ``slots``: requests decoded together at most (the KV cache's rows); ``context``: tokens per
    request, prompt and answer; ``prefill_tokens``: the padded tokens of one prefill forward at most (joining
    requests beyond it wait a step); ``max_waiting``: requests queued beyond the slots before :class:`Busy`;
    ``adapters``: the adapter names the engine's model holds (zerofit/serve/adapters.py)."""

    def __init__(
        self,
        engine,
        *,
        slots: int,
        context: int,
        prefill_tokens: int | None = None,
        max_waiting: int = 256,
        adapters: tuple[str, ...] = (),
    ):
        self.engine = engine
        self.tok = engine.tokenizer
        self.slots, self.context = int(slots), int(context)
        self.prefill_tokens = int(prefill_tokens or context)
        self.max_waiting = int(max_waiting)
        self.adapters = tuple(adapters)
        self.eos = _eos_ids(engine)
        self.pad = _pad_id(self.tok, self.eos)
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._free = list(range(self.slots))
        self._cond = threading.Condition()
        self._stopping = False
        self.steps = 0  # steps run: one or two forwards each
        self.forwards = 0  # model forwards run (prefills and decodes)
        self.rows = 0  # rows over all forwards: rows / forwards is the mean batch
        self.max_rows = 0
        self.resizes = 0  # placements made for the rows in flight ([Note: a plan that follows the batch])
        self.cache: SlotCache | None = None
        self._prepare()
        self._thread = threading.Thread(target=self._loop, name="zerofit-serve-scheduler", daemon=True)
        self._thread.start()

    def _prepare(self) -> None:
        """The placement for the full batch checked (refused now if ``slots`` x ``context`` cannot fit: the plan
        counts that cache and the largest forward, a prefill of prefill_tokens), then the one of a single row
        ([Note: a plan that follows the batch])."""
        self.full_plan = self.engine.plan_for(self.slots, self.context, self._prefill(self.slots))
        self._resize(1)
        self.attn = getattr(_text_config(self.engine.model), "_attn_implementation", None) or "sdpa"

    def _prefill(self, rows: int) -> int:
        return row_prefill(self.context, self.prefill_tokens, rows)

    def _resize(self, rows: int) -> None:
        """[Note: a plan that follows the batch]: the placement and the KV cache for ``rows`` rows; the rows of the
        requests in flight kept."""
        engine, old = self.engine, self.cache
        kept = None
        if old is not None:
            used = max((s.slot for s in self._active if s.slot is not None and s.slot < old.slots), default=-1) + 1
            if used and any(old.lengths[:used]):  # through host memory: the cache is allocated anew
                kept = old.rows_to_host(used)
            old.release()  # its device memory free before the new placement takes it
            self.cache = old = None
            if torch.device(engine.device).type == "cuda":
                torch.cuda.empty_cache()
        self.plan = engine.prepare(rows, self.context, self._prefill(rows), grow_only=False)
        s = engine.shape
        self.cache = SlotCache(
            layers=s.layers,
            slots=rows,
            context=self.context,
            kv_heads=s.kv_heads,
            head_dim=s.head_dim,
            dtype=engine.dtype,
            device=engine.device,
        )
        if kept is not None:
            self.cache.rows_from_host(kept)
        self.resizes += 1

    # ------------------------------------------------------------------ the server's side

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``; it joins the batch at the next step with a free slot. :class:`Busy` when the queue is
        full; RuntimeError after :meth:`close`."""
        if len(seq.prompt) + seq.sampling.max_tokens > self.context:
            raise ValueError(
                f"{len(seq.prompt)} prompt tokens + max_tokens {seq.sampling.max_tokens} > the context of "
                f"{self.context} tokens"
            )
        seed = seq.sampling.seed if seq.sampling.seed is not None else random.SystemRandom().getrandbits(63)
        seq.generator = torch.Generator().manual_seed(seed)
        seq.submitted = time.perf_counter()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise Busy(f"{len(self._waiting)} requests are waiting already (--max-waiting {self.max_waiting})")
            self._waiting.append(seq)
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        """The client left: ``seq`` is dropped at the next step and its slot given back."""
        with self._cond:
            seq.cancelled = True
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Finish the requests in flight and queued, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._waiting) + len(self._active)

    def stats(self) -> dict:
        cache = self.cache  # (the scheduler's thread may be placing a new one)
        return {
            "slots": self.slots,
            "rows": cache.slots if cache is not None else 0,
            "resizes": self.resizes,
            "context": self.context,
            "forwards": self.forwards,
            "mean_batch": round(self.rows / self.forwards, 2) if self.forwards else 0.0,
            "max_batch": self.max_rows,
            "waiting": len(self._waiting),
            "running": len(self._active),
        }

    # ------------------------------------------------------------------ the thread's side

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._active or self._stopping):
                    self._cond.wait()
                if self._stopping and not (self._waiting or self._active):
                    return
                joiners = self._admit()
            try:
                self._step(joiners)
            except Exception as e:  # noqa: BLE001 - the requests of this step fail; the server keeps serving
                log.exception("a step failed")
                with self._cond:
                    for seq in list(self._active):
                        self._finish(seq, None)
                        seq.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))

    def _admit(self) -> list[Sequence]:
        """(under the lock) Drop the cancelled; give free slots to waiting requests, in order, while their padded
        prefill fits ``prefill_tokens`` (the first always joins)."""
        for seq in [s for s in self._active if s.cancelled]:
            self._finish(seq, None)
        self._waiting = deque(s for s in self._waiting if not s.cancelled)
        joiners: list[Sequence] = []
        longest = 0
        while self._waiting and self._free:
            seq = self._waiting[0]
            width = max(longest, len(seq.prompt))
            if joiners and width * (len(joiners) + 1) > self.prefill_tokens:
                break
            self._waiting.popleft()
            seq.slot = self._free.pop(0)
            self._active.append(seq)
            joiners.append(seq)
            longest = width
        return joiners

    def _step(self, joiners: list[Sequence]) -> None:
        self.steps += 1
        with self._cond:
            decoding = [s for s in self._active if s not in joiners and s.finish is None and not s.cancelled]
            need = max((s.slot for s in joiners + decoding if s.slot is not None), default=-1) + 1
        rows = min(self.slots, 1 << max(0, need - 1).bit_length())  # [Note: a plan that follows the batch]
        have = self.cache.slots if self.cache is not None else 0  # (none: a resize that failed, tried again)
        if rows > have or (rows < have and joiners and not decoding):
            self._resize(rows)
        assert self.cache is not None  # (_resize)
        width = max((len(s.prompt) for s in joiners), default=1)
        if (
            joiners
            and decoding
            and self.plan.streamed
            and width * (len(joiners) + len(decoding)) <= self.prefill_tokens
        ):
            # [Note: one forward per step for the whole batch]: the prompts and the next tokens in one forward
            self._forward(
                joiners + decoding,
                [s.prompt for s in joiners] + [[s.tokens[-1]] for s in decoding],
                [0] * len(joiners) + [self.cache.lengths[s.slot] for s in decoding],
            )
            return
        if joiners:
            self._forward(joiners, [s.prompt for s in joiners], [0] * len(joiners))
        if decoding:
            self._forward(decoding, [[s.tokens[-1]] for s in decoding], [self.cache.lengths[s.slot] for s in decoding])

    def _forward(self, seqs: list[Sequence], inputs: list[list[int]], starts: list[int]) -> None:
        """One forward over ``seqs`` (their rows of the cache), then one token sampled for each."""
        cache, eng = self.cache, self.engine
        new = [len(x) for x in inputs]
        T = cache.begin([s.slot for s in seqs], starts, new)
        ids = torch.full((len(seqs), T), self.pad, dtype=torch.long)  # (B, T), right-padded
        for i, x in enumerate(inputs):
            ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        keep = sorted(set(n - 1 for n in new))  # the positions whose logits are needed
        kw = {}
        if self.adapters:  # [Note: one base, several adapters]
            kw["adapter_names"] = [s.adapter or BASE for s in seqs]
        out = eng(
            input_ids=ids.to(eng.device),
            position_ids=cache.position_ids(),
            attention_mask=cache.mask(self.attn, eng.dtype),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1 if T == 1 else torch.tensor(keep, device=eng.device),
            **kw,
        )
        cache.commit()
        self.forwards += 1
        self.rows += len(seqs)
        self.max_rows = max(self.max_rows, len(seqs))
        at = torch.tensor([keep.index(n - 1) for n in new], device=eng.device)
        logits = out.logits[torch.arange(len(seqs), device=eng.device), at].float()  # (B, vocab)
        tokens = self._sample(seqs, logits)
        now = time.perf_counter()
        with self._cond:
            for seq, token in zip(seqs, tokens):
                if seq.cancelled or seq.finish is not None:
                    continue
                if seq.first_token is None:
                    seq.first_token = now
                self._advance(seq, token)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per row ([Note: a generator per request])."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, seq in enumerate(seqs):
            sp = seq.sampling
            if sp.temperature == 0:
                out.append(greedy[i])
                continue
            row = logits[i].cpu() / sp.temperature
            if sp.top_p < 1.0:
                srt, idx = torch.sort(row, descending=True)
                probs = torch.softmax(srt, dim=-1)
                drop = probs.cumsum(-1) - probs >= sp.top_p  # the tokens after the nucleus reached top_p
                row = row.index_fill(0, idx[drop], float("-inf"))
            probs = torch.softmax(row, dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
        return out

    def _advance(self, seq: Sequence, token: int) -> None:
        """(under the lock) Take ``token``: emit the text it completes; finish at the end-of-sequence token, a
        stop string or max_tokens."""
        seq.tokens.append(token)
        if token in self.eos:
            self._flush(seq, len(seq.text))
            self._done(seq, "stop")
            return
        text = self.tok.decode(seq.tokens, skip_special_tokens=True)
        stops = seq.sampling.stop
        if stops:
            start = max(0, seq.sent - max(map(len, stops)))
            hits = [p for p in (text.find(s, start) for s in stops) if p >= 0]
            if hits:
                seq.text = text[: min(hits)]
                self._flush(seq, len(seq.text))
                self._done(seq, "stop")
                return
        seq.text = text
        if len(seq.tokens) >= seq.sampling.max_tokens:
            self._flush(seq, len(text))
            self._done(seq, "length")
            return
        safe = len(text) - _held_back(text, stops)
        if text.endswith("\ufffd"):  # a character cut between tokens: wait for the rest of it
            safe = min(safe, len(text) - 1)
        self._flush(seq, safe)

    def _flush(self, seq: Sequence, upto: int) -> None:
        if upto > seq.sent:
            seq.emit(Delta(seq.text[seq.sent : upto]))
            seq.sent = upto

    def _done(self, seq: Sequence, finish: str) -> None:
        self._finish(seq, finish)
        seq.emit(Done(finish, len(seq.prompt), len(seq.tokens)))

    def _finish(self, seq: Sequence, finish: str | None) -> None:
        """(under the lock) ``seq`` leaves the batch; its slot is free for the next step."""
        seq.finish = finish or "cancelled"
        if seq in self._active:
            self._active.remove(seq)
        if seq.slot is not None:
            if self.cache is not None:
                self.cache.free(seq.slot)
            self._free.append(seq.slot)
            self._free.sort()
            seq.slot = None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """The characters at the end of ``text`` that could begin a stop string (not emitted until they don't)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _text_config(model):
    cfg = getattr(model, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _eos_ids(engine) -> set[int]:
    """The end-of-sequence tokens, as zerofit generate takes them: the generation config's, else the
    tokenizer's."""
    gen = getattr(engine.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None and engine.tokenizer is not None:
        eos = engine.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def _pad_id(tok, eos: set[int]) -> int:
    pad = getattr(tok, "pad_token_id", None)
    return pad if pad is not None else (min(eos) if eos else 0)
