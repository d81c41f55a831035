"""TOML files the package reads (rules files, weight-mapping files): the file read as UTF-8 and
parsed, every failure a ``Problem``; and the checks each schema makes of its tables (unknown keys
named with a did-you-mean, a true/false flag, an array of tables)."""

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
    """The parsed TOML of the file at ``path``.

    Args:
        path: the file.
        fail: makes the reader's error from the problem (``SpecError``, ``MappingError``).
        where: the ``path`` field of the problems (``None`` or ``""``).
        unreadable: what the file is, when a file that cannot be read is a problem too
            ("cannot read the mapping file: ..."); ``None``: its ``OSError``
            (``FileNotFoundError`` for a missing file) propagates as it is.

    Raises:
        OSError: the file cannot be read and ``unreadable`` is None.
        Exception: ``fail([problem])``: the text is not UTF-8 or not valid TOML (with a
            hint on escapes when a backslash is the cause), or the file cannot be read
            and ``unreadable`` is given.

    Example:
        >>> import pathlib, tempfile
        >>> from modelshard._base.errors import SpecError
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.toml"
        >>> _ = p.write_text('strict = true\\n')
        >>> read_toml(p, lambda problems: SpecError(problems), where=None, unreadable=None)
        {'strict': True}
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
    """``unknown key 'rearange' (did you mean 'rearrange'?)``.

    Example:
        >>> unknown_key("strickt", ["strict", "rules"], "top-level key")
        "unknown top-level key 'strickt' (did you mean 'strict'?)"
    """
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
    """Add a problem for every key of ``table`` that is not ``allowed`` (in the order given, which
    the hint lists); whether all were allowed."""
    allowed = list(allowed)
    ok = True
    for k in table:
        if k not in allowed:
            at = f"{where}.{k}" if where else k
            hint = "allowed: " + ", ".join(allowed)
            problems.append(Problem(source, at, unknown_key(k, allowed, what), hint=hint))
            ok = False
    return ok


def flag(
    data: Mapping[str, Any], key: str, default: bool, source: str, problems: list[Problem]
) -> bool:
    """``data[key]`` as a true/false flag (``default`` when absent or invalid; an invalid
    one is a problem)."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        problems.append(Problem(source, key, f"{key} must be true or false, got {value!r}"))
        return default
    return value


def tables(data: Mapping[str, Any], key: str, source: str, problems: list[Problem]) -> list[Any]:
    """``data[key]`` as an array of tables (``[[rules]]`` blocks; empty when absent, or
    when it is not an array, which is a problem). Its items are the caller's to check."""
    raw = data.get(key, [])
    if not isinstance(raw, list):
        problems.append(
            Problem(
                source, key, f"{key} must be an array of tables", hint=f"write [[{key}]] blocks"
            )
        )
        return []
    return raw
