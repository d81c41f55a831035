"""TOML files the package reads: every failure a ``Problem``; the schemas' table checks."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import Problem
from .text import close_match

_ESCAPE_HINT = (
    "in a double-quoted TOML string a backslash starts an escape (\\n, \\t, "
    "\\\\; \\d and \\. are none): write regular expressions in single quotes, "
    "pattern = 'norm\\d?$' (a TOML literal string, backslashes kept as written)"
)


def read_toml(
    path: str | os.PathLike[str],
    fail: Callable[[list[Problem]], Exception],
    *,
    where: str | None,
    unreadable: str | None,
) -> dict[str, Any]:
    """The parsed TOML of the file at ``path``; a failure is ``fail([problem])``.

    ``where`` is the problems' ``path``; ``unreadable`` names the file when one that cannot
    be read is a problem too (``None``: its ``OSError`` propagates).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        problem = Problem(str(p), where, f"not UTF-8 text (byte {e.start}); TOML files are UTF-8")
        raise fail([problem]) from e
    except OSError as e:
        if unreadable is None:
            raise
        problem = Problem(str(p), where, f"cannot read {unreadable}: {e.strerror or e}")
        raise fail([problem]) from e
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        hint = _ESCAPE_HINT if "escape" in str(e).lower() or "\\" in str(e) else None
        raise fail([Problem(str(p), where, f"not valid TOML: {e}", hint=hint)]) from e


def unknown_key(key: str, allowed: Iterable[str], what: str = "key") -> str:
    """``unknown key 'rearange' (did you mean 'rearrange'?)``: ``key`` not among ``allowed``."""
    close = close_match(key, allowed)
    return f"unknown {what} {key!r}" + (f" (did you mean {close!r}?)" if close else "")


def check_keys(
    table: Mapping[str, Any],
    allowed: Iterable[str],
    source: str,
    where: str,
    problems: list[Problem],
    what: str = "key",
) -> bool:
    """Add a problem for every key of ``table`` not ``allowed``; whether all were."""
    allowed = list(allowed)
    unknown = [k for k in table if k not in allowed]
    for k in unknown:
        at = f"{where}.{k}" if where else k
        hint = "allowed: " + ", ".join(allowed)
        problems.append(Problem(source, at, unknown_key(k, allowed, what), hint=hint))
    return not unknown


def flag(
    data: Mapping[str, Any], key: str, default: bool, source: str, problems: list[Problem]
) -> bool:
    """``data[key]`` as a true/false flag (``default`` when absent or invalid, a problem)."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        problems.append(Problem(source, key, f"{key} must be true or false, got {value!r}"))
        return default
    return value


def tables(data: Mapping[str, Any], key: str, source: str, problems: list[Problem]) -> list[Any]:
    """``data[key]`` as an array of tables (empty when absent, or not one: a problem)."""
    raw = data.get(key, [])
    if not isinstance(raw, list):
        what, hint = f"{key} must be an array of tables", f"write [[{key}]] blocks"
        problems.append(Problem(source, key, what, hint=hint))
        return []
    return raw
