"""What one row of the user's data is: plain text, a prompt and its completion, or a chat.

=======================  =====================================================  ======================
fields of the row        kind                                                   trained on (loss)
=======================  =====================================================  ======================
``text``                 :class:`TextRow`                                       every token
``prompt``+``completion``  :class:`CompletionRow`                               the completion and EOS
``messages``             :class:`ChatRow`: a list of ``{"role", "content"}``    the assistant turns
``input``+``target``     :class:`PairRow`: an encoder-decoder's source and      the target and EOS
                         target (``prompt``+``completion`` is one too there)
=======================  =====================================================  ======================

A row must carry exactly one of these (fields that are missing or null do not count; other fields are ignored).
A row with two of them (``text`` and ``messages``, say) is refused rather than guessed at, as is a row with none:
the error names the file, the row (counting from 1) and the fields found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofit.data.sources import DataError


@dataclass(frozen=True)
class TextRow:
    text: str


@dataclass(frozen=True)
class CompletionRow:
    prompt: str
    completion: str


@dataclass(frozen=True)
class ChatRow:
    messages: tuple[dict[str, Any], ...]  # each with a str "role" and a str "content", plus any extra keys


@dataclass(frozen=True)
class PairRow:
    input: str
    target: str


Row = TextRow | CompletionRow | ChatRow | PairRow
KINDS = {TextRow: "text", CompletionRow: "prompt/completion", ChatRow: "messages", PairRow: "input/target"}


def _present(row: dict[str, Any], key: str) -> bool:
    return row.get(key) is not None


def _string(row: dict[str, Any], key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, found {type(value).__name__} ({str(value)[:60]!r})")
    return value


def _message(m: Any, where: str, i: int) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise DataError(f"{where}: messages[{i}] must be an object with 'role' and 'content', found {type(m).__name__}")
    # Arrow fills the keys other messages have with None; a chat template must not see them as set.
    m = {k: v for k, v in m.items() if v is not None}
    for key in ("role", "content"):
        if not isinstance(m.get(key), str):
            found = "nothing" if key not in m else type(m[key]).__name__
            raise DataError(f"{where}: messages[{i}].{key} must be a string, found {found}")
    return m


def parse_row(row: dict[str, Any], where: str) -> Row:
    """The row's kind, checked; ``where`` (``"file.jsonl, row 3"``) prefixes every error."""
    kinds = []
    if _present(row, "text"):
        kinds.append("text")
    if _present(row, "prompt") or _present(row, "completion"):
        kinds.append("prompt/completion")
    if _present(row, "messages"):
        kinds.append("messages")
    if _present(row, "input") or _present(row, "target"):
        kinds.append("input/target")
    if not kinds:
        found = ", ".join(repr(k) for k, v in row.items() if v is not None) or "no non-null field"
        raise DataError(
            f"{where}: no 'text', 'prompt'+'completion', 'messages' or 'input'+'target' field (found {found});"
            " every row needs one of them (rename the field, or drop the row)"
        )
    if len(kinds) > 1:
        raise DataError(
            f"{where}: the row mixes formats ({' and '.join(kinds)}), which cannot be combined in one"
            " row: keep one of them per row"
        )
    if kinds[0] == "text":
        return TextRow(_string(row, "text", where))
    if kinds[0] == "prompt/completion":
        missing = [k for k in ("prompt", "completion") if not _present(row, k)]
        if missing:
            raise DataError(f"{where}: a prompt/completion row needs both fields; {missing[0]!r} is missing")
        return CompletionRow(_string(row, "prompt", where), _string(row, "completion", where))
    if kinds[0] == "input/target":
        missing = [k for k in ("input", "target") if not _present(row, k)]
        if missing:
            raise DataError(f"{where}: an input/target row needs both fields; {missing[0]!r} is missing")
        return PairRow(_string(row, "input", where), _string(row, "target", where))
    messages = row["messages"]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(
            f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects,"
            f" found {type(messages).__name__} {str(messages)[:60]!r}"
        )
    return ChatRow(tuple(_message(m, where, i) for i, m in enumerate(messages)))
