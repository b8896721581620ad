"""The one error type of a bad configuration, and pydantic's validation errors turned into it.

:class:`ConfigError` (a ``ValueError``) names the field by its dotted path, what was expected and what was
found; :func:`config_error_from` writes a pydantic ``ValidationError`` that way. (:mod:`zerofit.config.schema`
re-exports both.)
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from zerofit.errors import InputError

__all__ = ["ConfigError", "Problem", "show", "config_error_from", "close_match"]


# ----------------------------------------------------------------------------
# The one error type
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration."""

    field: str
    """dotted path of the offending key, e.g. ``zero_optimization.offload_param.device``"""
    expected: str
    """what a valid value looks like"""
    found: str
    """what the configuration holds, already formatted for display (see :func:`show`)"""
    hint: str = ""
    """what to do about it (may be empty)"""

    def __str__(self) -> str:
        text = f"{self.field}: expected {self.expected}, found {self.found}"
        return f"{text}. {self.hint}" if self.hint else text


class ConfigError(InputError, ValueError):
    """A configuration is invalid. The message names the field, what was expected and what was found.

    ``field`` is the dotted path of the first problem; ``problems`` lists all of them.
    """

    def __init__(self, field: str, expected: str, found: str, hint: str = "", *, more: Sequence[Problem] = ()) -> None:
        self.problems: tuple[Problem, ...] = (Problem(field, expected, found, hint), *more)
        super().__init__(self._message())

    @classmethod
    def from_problems(cls, problems: Sequence[Problem]) -> ConfigError:
        first, *rest = problems
        return cls(first.field, first.expected, first.found, first.hint, more=rest)

    @property
    def field(self) -> str:
        return self.problems[0].field

    def _message(self) -> str:
        if len(self.problems) == 1:
            return str(self.problems[0])
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"{len(self.problems)} configuration problems:\n{lines}"

    def __reduce__(self):
        # Exceptions cross process boundaries (multi-rank start-up); rebuild from problems.
        return (ConfigError.from_problems, (list(self.problems),))


def show(value: Any, limit: int = 80) -> str:
    """How a found value is written in an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def close_match(word: str, candidates: Sequence[str]) -> str | None:
    hits = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return hits[0] if hits else None


# ----------------------------------------------------------------------------
# pydantic -> ConfigError
# ----------------------------------------------------------------------------


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The sub-model class reached by following ``loc`` from ``model`` (None if not a model)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def config_error_from(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> ConfigError:
    """Readable :class:`ConfigError` for a pydantic ``ValidationError`` raised while building ``model``."""
    problems: list[Problem] = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        field = ".".join(([prefix] if prefix else []) + loc) or (prefix or "<config>")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):
            for p in cause.problems:
                full = field if field.endswith(p.field) else (f"{field}.{p.field}" if loc or prefix else p.field)
                problems.append(Problem(full, p.expected, p.found, p.hint))
            continue
        if err["type"] == "extra_forbidden":
            parent = _model_at(model, err["loc"][:-1])
            known = list(parent.model_fields) if parent else []
            guess = close_match(loc[-1], known)
            if not guess and len(loc) == 1 and not prefix:  # a misspelled DeepSpeed key reads as zerofit's
                from zerofit.config.deepspeed_keys import DEEPSPEED_KEYS

                ds = close_match(loc[-1], sorted(DEEPSPEED_KEYS))
                if ds:
                    problems.append(
                        Problem(field, "a known key", f"unknown key {loc[-1]!r}", f"did you mean DeepSpeed's {ds!r}?")
                    )
                    continue
            if guess:
                hint = f"did you mean {'.'.join(loc[:-1] + [guess])!r}?"
            else:
                hint = f"known keys here: {', '.join(known)}" if known else ""
            problems.append(Problem(field, "a known key", f"unknown key {loc[-1]!r}", hint))
            continue
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
            problems.append(Problem(field, "a valid value", show(err.get("input")), msg))
            continue
        expected = msg[len("Input should be ") :] if msg.startswith("Input should be ") else msg
        problems.append(Problem(field, expected, show(err.get("input"))))
    return ConfigError.from_problems(problems)
