"""Rows to token documents with the model's own tokenizer, each token marked as a loss target or not.

[Note: document tokens] Every document is ``BOS? + body + EOS``:

- ``BOS`` only when the tokenizer itself adds one to an encoded text (Llama, Mistral, Gemma do; GPT-2 and Qwen
  do not), so that training sees what the model's own pipeline feeds it; never twice.
- ``EOS`` (``tokenizer.eos_token_id``) closes every document so that the model learns where a text ends; a chat
  whose rendering already ends with EOS (Qwen's ``<|im_end|>``, Llama 3's ``<|eot_id|>``) gets no second one.
  The closing EOS is a target when the token before it is one.
- text rows: every token is a target.
- prompt/completion rows (and input/target rows, the same to a causal LM): ``BOS? + tokens(prompt) +
  tokens(completion) + EOS``, each part tokenized on its own,
  so the completion's tokens are exactly those the model would generate after the prompt; targets are the
  completion and the EOS.
- chat rows: the tokenizer's chat template renders the conversation (``add_special_tokens=False`` when tokenizing
  it, the template writes its own BOS); targets are the tokens of the assistant turns (see
  :func:`assistant_spans`), including each turn's end-of-turn marker, so the model learns to stop.

Whether the *first* token of a document is a target does not matter here: packing makes it context only (see
[Note: packed targets] in :mod:`zerofit.data.packing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zerofit.data.formats import KINDS, ChatRow, CompletionRow, PairRow, Row, TextRow
from zerofit.data.sources import DataError


@dataclass(frozen=True, eq=False)
class Document:
    """One tokenized row."""

    input_ids: np.ndarray  # (L,) int32, host
    targets: np.ndarray  # (L,) bool, host: True where the token is a prediction target (its label is itself)
    kind: str  # "text" | "prompt/completion" | "messages"
    source: str  # "file, row N": where it came from, for messages

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _doc(ids: list[int], targets: list[bool], kind: str, source: str) -> Document:
    return Document(np.asarray(ids, dtype=np.int32), np.asarray(targets, dtype=bool), kind, source)


class Encoder:
    """Turns parsed rows into :class:`Document` s with one tokenizer (see [Note: document tokens])."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self.eos: int | None = tokenizer.eos_token_id
        if self.eos is None:
            raise DataError(
                f"the tokenizer {name} has no eos_token: documents need one to end with (set"
                " 'eos_token' in the model directory's tokenizer_config.json)"
            )
        bos = tokenizer.bos_token_id
        with_specials = list(tokenizer("x", add_special_tokens=True)["input_ids"])
        bare = list(tokenizer("x", add_special_tokens=False)["input_ids"])
        adds_bos = bos is not None and bool(with_specials) and with_specials[0] == bos and bare[:1] != [bos]
        self.prefix: list[int] = [bos] if adds_bos else []  # what starts every document
        self.name = name

    def _tokenize(self, texts, **kw):
        """The tokenizer on whole documents. ``verbose=False``: transformers warns "Token indices sequence length
        is longer than the specified maximum sequence length" for any text longer than ``model_max_length``;
        here that is expected and harmless, since packing cuts the documents into ``seq_len`` windows itself
        (zerofit.data.packing), so no sequence that long ever reaches the model. The flag silences only that
        warning and the padding ones (nothing is padded here)."""
        return self.tokenizer(texts, verbose=False, **kw)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self._tokenize(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, rows: Sequence[Row], sources: Sequence[str]) -> list[Document]:
        """The rows' documents, in order; rows that leave nothing to learn (empty text, a chat without an
        assistant turn) give none."""
        # an input/target row (an encoder-decoder's pair) is a prompt and its completion to a causal LM
        rows = [CompletionRow(r.input, r.target) if isinstance(r, PairRow) else r for r in rows]
        out: list[Document | None] = [None] * len(rows)
        texts = [(i, r.text) for i, r in enumerate(rows) if isinstance(r, TextRow) and r.text]
        for (i, _), ids in zip(texts, self._encode([t for _, t in texts])):
            body = self.prefix + ids + [self.eos]
            out[i] = _doc(body, [True] * len(body), KINDS[TextRow], sources[i])
        pcs = [(i, r) for i, r in enumerate(rows) if isinstance(r, CompletionRow)]
        prompts = self._encode([r.prompt for _, r in pcs])
        completions = self._encode([r.completion for _, r in pcs])
        for (i, _), p, c in zip(pcs, prompts, completions):
            ids = self.prefix + p + c + [self.eos]
            out[i] = _doc(
                ids, [False] * (len(self.prefix) + len(p)) + [True] * (len(c) + 1), KINDS[CompletionRow], sources[i]
            )
        for i, r in enumerate(rows):
            if isinstance(r, ChatRow):
                out[i] = self._chat(r, sources[i])
        return [d for d in out if d is not None and d.targets[1:].any()]

    def _chat(self, row: ChatRow, source: str) -> Document | None:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise DataError(
                f"{source}: a chat ('messages') row, but the tokenizer {self.name} has no chat"
                " template; give the model directory one (chat_template.jinja), or use"
                " prompt/completion rows"
            )
        if not getattr(tok, "is_fast", False):
            raise DataError(
                f"{source}: chat rows need a fast tokenizer (for its offset mapping); {self.name}"
                f" loads as {type(tok).__name__}"
            )
        full, spans = assistant_spans(tok, row.messages, source)
        if not spans:
            return None
        enc = self._tokenize(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)  # (L,) char offsets
        targets = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            targets |= (starts >= a) & (starts < b)
        targets_l = targets.tolist()
        if self.prefix and ids[:1] != self.prefix:
            ids, targets_l = self.prefix + ids, [False] + targets_l
        # The last token that is not trailing whitespace: a template that ends with EOS gets no second one.
        body_end = len(full.rstrip())
        last = max((k for k, s in enumerate(starts.tolist()) if s < body_end), default=None)
        last_id = ids[last + len(ids) - len(starts)] if last is not None else None
        if last_id != self.eos:
            ids, targets_l = ids + [self.eos], targets_l + [targets_l[-1] if targets_l else False]
        return _doc(ids, targets_l, KINDS[ChatRow], source)


def _render(tok: Any, messages: Sequence[dict[str, Any]], generation_prompt: bool, source: str) -> str:
    try:
        text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template error names the row
        raise DataError(
            f"{source}: the chat template cannot render this conversation ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(text, str):
        raise DataError(f"{source}: the chat template rendered {type(text).__name__}, expected a string")
    return text


def _span_by_prefix(
    tok: Any, messages: Sequence[dict[str, Any]], i: int, full: str, cursor: int, source: str
) -> tuple[int, int] | None:
    """Turn ``i``'s characters as the difference of two renderings, when the template is prefix-stable."""
    if i == 0:
        return _first_turn_span(tok, messages[0], full, source)
    try:
        before = _render(tok, messages[:i], True, source)  # ends with the assistant header
        before_plain = _render(tok, messages[:i], False, source)
        through = _render(tok, messages[: i + 1], False, source)
    except DataError:
        return None  # e.g. a template that cannot render an empty conversation, or one ending on a turn
    if before == before_plain:
        return None  # the template ignores add_generation_prompt: the header would count as the answer
    a, b = len(before), len(through)
    if a < cursor or a > b or not through.startswith(before) or not full.startswith(through):
        return None
    if messages[i]["content"] not in full[a:b]:
        return None
    return a, b


def _first_turn_span(tok: Any, message: dict[str, Any], full: str, source: str) -> tuple[int, int] | None:
    """An opening assistant turn: chat templates cannot render an empty conversation, so its start is where the
    rendering of the turn differs from that of the same turn with empty content (``header + footer``)."""
    try:
        through = _render(tok, [message], False, source)
        empty = _render(tok, [{**message, "content": ""}], False, source)
    except DataError:
        return None
    content = message["content"]
    if not full.startswith(through) or len(through) != len(empty) + len(content):
        return None
    common = next((k for k, (x, y) in enumerate(zip(through, empty)) if x != y), len(empty))
    for a in range(common, -1, -1):  # the longest header that fits
        if through[a : a + len(content)] == content and through[a + len(content) :] == empty[a:]:
            return a, len(through)
    return None


def _span_by_search(tok: Any, content: str, full: str, cursor: int) -> tuple[int, int] | None:
    """Turn's content found in the rendering after ``cursor``, plus an EOS string that directly follows it."""
    a = full.find(content, cursor)
    if a < 0 or not content:
        return None
    b = a + len(content)
    eos = tok.eos_token
    if eos and full.startswith(eos, b):
        b += len(eos)
    return a, b


def assistant_spans(tok: Any, messages: Sequence[dict[str, Any]], source: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[a, b)`` of its assistant turns.

    Method: for assistant message ``i``, ``a`` is the length of the rendering of ``messages[:i]`` with the
    generation prompt (it ends where the model starts to write) and ``b`` the length of the rendering of
    ``messages[:i+1]`` (the answer and its end-of-turn marker), both checked to be prefixes of the whole
    rendering (an opening assistant turn, ``i = 0``, is compared with its rendering with empty content
    instead). Templates for which that fails (they rewrite earlier turns depending on later ones, like Qwen3's
    that drops old reasoning, or ignore ``add_generation_prompt``) fall back to finding the message's content in
    the rendering after the previous turn, extended by an EOS string that directly follows it. A turn found by
    neither method is an error naming the row.
    """
    full = _render(tok, messages, False, source)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        span = _span_by_prefix(tok, messages, i, full, cursor, source) or _span_by_search(
            tok, m["content"], full, cursor
        )
        if span is None:
            raise DataError(
                f"{source}: cannot find assistant message {i} ({m['content'][:40]!r}) in the chat"
                " template's rendering of the conversation; the template may rewrite or drop it"
            )
        spans.append(span)
        cursor = span[1]
    return full, spans
