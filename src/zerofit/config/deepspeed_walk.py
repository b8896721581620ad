"""A DeepSpeed config walked against the key tables: every value checked, by canonical dotted path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerofit.config.deepspeed_keys import AUTO, KNOWN_PATHS, BadValue, Key, Section
from zerofit.config.errors import close_match
from zerofit.config.schema import ConfigError, ZerofitConfig, show


class Values:
    """Checked values by canonical dotted path, plus the spelling the user wrote for each."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.written: dict[str, str] = {}  # canonical path -> path as written (aliases kept)
        self.spec: dict[str, Key | Section] = {}

    def __contains__(self, path: str) -> bool:
        return path in self.values

    def get(self, path: str, default: Any = None) -> Any:
        """The value, ``AUTO`` for ``"auto"``, or ``default`` when absent (or null)."""
        v = self.values.get(path)
        return default if v is None else v

    def name(self, path: str) -> str:
        """How to name ``path`` in a message: as the user wrote it if present."""
        if path in self.written:
            return self.written[path]
        parent, _, leaf = path.rpartition(".")
        return f"{self.name(parent)}.{leaf}" if parent else path


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _unknown_key(key: str, written_parent: str, spec: Mapping[str, Key | Section]) -> ConfigError:
    here = _join(written_parent, key)
    names = list(spec) + [a for item in spec.values() for a in item.aliases]
    guess = close_match(key, names)
    if guess is not None:
        hint = f"did you mean {_join(written_parent, guess)!r}?"
    else:
        # A known key in the wrong place, or a close one anywhere.
        leaves = {p.rpartition(".")[2]: p for p in KNOWN_PATHS}
        far = close_match(key, list(leaves))
        if far:
            hint = f"did you mean {leaves[far]!r}?"
        elif len(spec) <= 16:
            hint = f"known keys here: {', '.join(spec)}"
        else:
            hint = "see DeepSpeed's configuration reference for the keys of this section"
    if not written_parent and key in ZerofitConfig.model_fields:
        hint = (
            f"{key!r} is a zerofit field: this dict mixes DeepSpeed and zerofit keys; "
            "pass zerofit fields as overrides instead"
        )
    return ConfigError(here, "a key DeepSpeed defines", f"unknown key {key!r}", hint)


def walk(spec: Mapping[str, Key | Section], data: Any, canon: str, written: str, out: Values) -> None:
    """Check ``data`` (the object at ``written``) against ``spec``; record every value in ``out``."""
    if not isinstance(data, Mapping):
        raise ConfigError(written or "<config>", "an object {...}", show(data))
    alias_of = {a: name for name, item in spec.items() for a in item.aliases}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(_join(written, str(key)), "a string key", show(key))
        name = key if key in spec else alias_of.get(key)
        if name is None:
            raise _unknown_key(key, written, spec)
        here, path = _join(written, key), _join(canon, name)
        if path in out.written:
            raise ConfigError(
                here, "one spelling of this key", f"both {out.written[path]!r} and {here!r}", "remove one of them"
            )
        item = spec[name]
        out.written[path], out.spec[path] = here, item
        if isinstance(item, Section):
            if value is None and item.nullable:
                out.values[path] = None
            elif item.keys is None:
                if not isinstance(value, Mapping):
                    raise ConfigError(here, "an object {...}", show(value))
                out.values[path] = value
            else:
                out.values[path] = value
                walk(item.keys, value, path, here, out)
        elif item.auto and value == AUTO:
            out.values[path] = AUTO
        else:
            try:
                out.values[path] = item.kind.check(value)
            except BadValue:
                expected = item.kind.expected + (' or "auto"' if item.auto else "")
                raise ConfigError(here, expected, show(value), item.hint) from None
