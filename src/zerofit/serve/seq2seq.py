"""An encoder-decoder's requests for ``zerofit serve``: a batch of requests at a time through transformers' own
``generate`` in the hooked mode (zerofit/infer/seq2seq.py), behind the same queue, events and HTTP face as the
continuous batcher (scheduler.py).

[Note: an encoder-decoder's requests, a batch at a time]
The continuous batcher steps one forward of a decoder over a key/value cache of one row per request ([Note: one
forward per step for the whole batch], scheduler.py); an encoder-decoder runs its encoder once per prompt and its
decoder over its own cache and the encoder's output, which that cache does not hold. So its requests run as
``generate`` calls, one after another: the waiting greedy requests (temperature 0) together, up to ``slots`` of them
(and their padded prompts within ``prefill_tokens``), the prompts padded on the right; a request that samples alone,
transformers' sampling (its ``temperature`` and ``top_p``, no top-k) drawn after seeding torch with its seed, so a
seed reproduces its tokens. Requests that arrive meanwhile wait for the call to end. Each new token goes through
the batcher's own bookkeeping (``Scheduler._advance``: the text, the stop strings, the events) from a streamer
that ``generate`` calls once per token for the whole batch, and a stopping criterion ends each row when its
request finished or its client left; ``generate`` returns when every row has ended. A row's greedy tokens do not
depend on the others (an encoder reads each row within its mask, the decoder's rows are independent), so a
request's greedy answer is the one it gets alone, and transformers' ``generate``'s.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from zerofit.infer.text import padded
from zerofit.serve.scheduler import Scheduler, Sequence


class Seq2SeqScheduler(Scheduler):
    """Requests to an encoder-decoder (a :class:`~zerofit.infer.seq2seq.Seq2SeqEngine`), a batch at a time:
    [Note: an encoder-decoder's requests, a batch at a time]. ``slots``: greedy requests in one ``generate`` at
    most; the rest as :class:`~zerofit.serve.scheduler.Scheduler`'s."""

    def __init__(self, engine, *, slots: int, context: int, prefill_tokens: int | None = None, max_waiting: int = 256):
        super().__init__(engine, slots=slots, context=context, prefill_tokens=prefill_tokens, max_waiting=max_waiting)

    def _prepare(self) -> None:
        """Nothing to place or allocate ahead: the engine planned its units when it was built, and ``generate``
        makes the model's own cache for each call."""
        self.plan = None

    def _admit(self) -> list[Sequence]:
        """(under the lock) Drop the cancelled; the next call's requests: the waiting greedy ones at the front of
        the queue, up to ``slots`` with their padded prompts within ``prefill_tokens`` (the first always), or the
        first alone where it samples."""
        self._waiting = deque(s for s in self._waiting if not s.cancelled)
        batch: list[Sequence] = []
        longest = 0
        while self._waiting and len(batch) < self.slots:
            seq = self._waiting[0]
            greedy = seq.sampling.temperature == 0
            if batch and (not greedy or max(longest, len(seq.prompt)) * (len(batch) + 1) > self.prefill_tokens):
                break
            self._waiting.popleft()
            self._active.append(seq)
            batch.append(seq)
            longest = max(longest, len(seq.prompt))
            if not greedy:
                break
        return batch

    def _step(self, batch: list[Sequence]) -> None:
        """One ``generate`` over ``batch``; its events emitted token by token."""
        if not batch:
            return
        self.steps += 1
        eng = self.engine
        ids, mask = padded([s.prompt for s in batch], self.pad, left=False)
        sp = batch[0].sampling
        kw: dict = {"pad_token_id": self.pad, "eos_token_id": sorted(self.eos) or None}
        if sp.temperature == 0:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:  # alone in its call ([Note: an encoder-decoder's requests, a batch at a time])
            assert batch[0].generator is not None  # (submit seeds every request)
            torch.manual_seed(batch[0].generator.initial_seed())
            kw.update(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=0)
        eng.generate(
            ids,
            mask,
            max_new_tokens=max(s.sampling.max_tokens for s in batch),
            streamer=_Rows(self, batch),
            stopping_criteria=StoppingCriteriaList([_Ended(batch)]),
            **kw,
        )
        self.forwards += 1
        self.rows += len(batch)
        self.max_rows = max(self.max_rows, len(batch))
        with self._cond:
            for seq in batch:
                if seq.finish is None:  # cancelled, or a row generate ended by a token outside self.eos
                    if seq.cancelled:
                        self._finish(seq, None)
                    else:
                        self._flush(seq, len(seq.text))
                        self._done(seq, "stop" if seq.tokens and seq.tokens[-1] in self.eos else "length")


class _Rows:
    """transformers' streamer protocol over a batch: ``put`` gets the decoder's start tokens, then each step's new
    token of every row, handed to its request (the scheduler's ``_advance``, under its lock)."""

    def __init__(self, sched: Seq2SeqScheduler, batch: list[Sequence]):
        self.sched, self.batch, self.started = sched, batch, False

    def put(self, value: torch.Tensor) -> None:
        if not self.started:  # the first call carries the decoder's start tokens
            self.started = True
            return
        tokens = value.reshape(-1).tolist()
        now = time.perf_counter()
        sched = self.sched
        with sched._cond:
            for seq, token in zip(self.batch, tokens):
                if seq.cancelled or seq.finish is not None:
                    continue
                if seq.first_token is None:
                    seq.first_token = now
                sched._advance(seq, token)

    def end(self) -> None:
        pass


class _Ended(StoppingCriteria):
    """A stopping criterion: a row ends when its request finished (its end-of-sequence token, a stop string, its
    max_tokens) or its client left."""

    def __init__(self, batch: list[Sequence]):
        self.batch = batch

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        ended = [s.finish is not None or s.cancelled for s in self.batch]
        return torch.tensor(ended, dtype=torch.bool, device=input_ids.device)
