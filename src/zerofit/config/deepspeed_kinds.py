"""The DeepSpeed key tables' records: what zerofit did with a key, the value kinds, a key and a section.

Each value kind checks one JSON value and returns it normalised; a :class:`Key` is one leaf of the tables in
:mod:`zerofit.config.deepspeed_keys` (the top level) and :mod:`zerofit.config.deepspeed_params` (the optimizer's
and the schedulers' ``params``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from zerofit.errors import InputError

Status = Literal["honoured", "mapped", "not-applicable"]
HONOURED: Status = "honoured"
MAPPED: Status = "mapped"
NA: Status = "not-applicable"


@dataclass(frozen=True)
class KeyReport:
    """What zerofit did with one DeepSpeed key."""

    key: str
    """dotted path as written in the config, e.g. ``zero_optimization.overlap_comm``"""
    status: Status
    """honoured (same meaning), mapped (translated) or not-applicable (zerofit decides)"""
    note: str = ""
    """what it became, or why it does not apply"""

    def __str__(self) -> str:
        return f"{self.key} [{self.status}]" + (f": {self.note}" if self.note else "")


# ----------------------------------------------------------------------------
# Value kinds: each checks one JSON value and returns it normalised
# ----------------------------------------------------------------------------


class BadValue(InputError):
    """A value does not fit its kind (turned into ConfigError by the walker, which knows the path)."""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int | None = None
    nullable: bool = False

    @property
    def expected(self) -> str:
        rng = f">= {self.lo}" if self.hi is None else f"in [{self.lo}, {self.hi}]"
        return f"an integer {rng}" + (" or null" if self.nullable else "")

    def check(self, v: Any) -> Any:
        if v is None and self.nullable:
            return None
        # JSON writes big counts as 5e8: accept floats with no fractional part.
        if not _is_number(v) or (isinstance(v, float) and not v.is_integer()):
            raise BadValue
        v = int(v)
        if v < self.lo or (self.hi is not None and v > self.hi):
            raise BadValue
        return v


@dataclass(frozen=True)
class Float:
    lo: float = 0.0
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    @property
    def expected(self) -> str:
        lo = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        hi = "" if self.hi is None else f" and {'<' if self.hi_open else '<='} {self.hi:g}"
        return f"a number {lo}{hi}"

    def check(self, v: Any) -> Any:
        if not _is_number(v):
            raise BadValue
        if (
            v < self.lo
            or (self.lo_open and v == self.lo)
            or (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))
        ):
            raise BadValue
        return float(v)


@dataclass(frozen=True)
class Bool:
    nullable: bool = False
    expected = "true or false"

    def check(self, v: Any) -> Any:
        if isinstance(v, bool) or (v is None and self.nullable):
            return v
        raise BadValue


@dataclass(frozen=True)
class Choice:
    values: tuple[Any, ...]
    fold_case: bool = False

    @property
    def expected(self) -> str:
        return "one of " + ", ".join(repr(x) for x in self.values)

    def check(self, v: Any) -> Any:
        for x in self.values:
            if v == x and type(v) is type(x):
                return x
            if self.fold_case and isinstance(v, str) and isinstance(x, str) and v.lower() == x.lower():
                return x
        raise BadValue


@dataclass(frozen=True)
class Text:
    nullable: bool = False

    @property
    def expected(self) -> str:
        return "a string" + (" or null" if self.nullable else "")

    def check(self, v: Any) -> Any:
        if isinstance(v, str) or (v is None and self.nullable):
            return v
        raise BadValue


@dataclass(frozen=True)
class Betas:
    expected = "a list of two numbers, each in [0, 1)"

    def check(self, v: Any) -> Any:
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(b) and 0 <= b < 1 for b in v):
            return (float(v[0]), float(v[1]))
        raise BadValue


@dataclass(frozen=True)
class Anything:
    expected = "any JSON value"

    def check(self, v: Any) -> Any:
        return v


_Kind = Int | Float | Bool | Choice | Text | Betas | Anything


class _NoDefault:
    """``Key.default`` when zerofit has no use for DeepSpeed's default (the key is not-applicable)."""

    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()


# ----------------------------------------------------------------------------
# The key table
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One DeepSpeed leaf key."""

    kind: _Kind
    status: Status
    note: str = ""
    auto: bool = False
    """``"auto"`` accepted (resolved by :func:`translate`)"""
    aliases: tuple[str, ...] = ()
    """other spellings DeepSpeed accepts (its pydantic field names vs. aliases)"""
    hint: str = ""
    """what to do when the value is refused"""
    default: Any = NO_DEFAULT
    """DeepSpeed's default (:data:`DEEPSPEED_VERSION`): what an absent key means, and what zerofit takes then.
    Set for every key zerofit honours or maps; ``tests/unit/test_deepspeed_defaults.py`` compares each one with
    DeepSpeed's own source"""


@dataclass(frozen=True)
class Section:
    """A DeepSpeed object. ``keys=None``: its contents are not checked (a feature zerofit does not use)."""

    keys: Mapping[str, Key | Section] | None
    status: Status = NA
    note: str = ""
    aliases: tuple[str, ...] = ()
    nullable: bool = False


def na(kind: _Kind, note: str, **kw: Any) -> Key:
    """A not-applicable key."""
    return Key(kind, NA, note, **kw)
