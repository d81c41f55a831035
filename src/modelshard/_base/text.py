"""How the package writes (and reads) byte counts, specs, patterns and user text."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, overload

from jax.sharding import PartitionSpec

Vocabulary = Literal["python", "cli"]

_VOCABULARY: contextvars.ContextVar[Vocabulary] = contextvars.ContextVar(
    "modelshard_vocabulary", default="python"
)


@contextlib.contextmanager
def speaking(vocabulary: Vocabulary) -> Iterator[None]:
    """Within the block, hints name fixes in the entry point's words (``"cli"``, ``"python"``)."""
    token = _VOCABULARY.set(vocabulary)
    try:
        yield
    finally:
        _VOCABULARY.reset(token)


def vocabulary() -> Vocabulary:
    """The entry point's vocabulary that hints use (see ``speaking``)."""
    return _VOCABULARY.get()


SHOW_ALL = "run without --max-rows to show all"
"""What every table cut by the command line's ``--max-rows`` says on the line below it."""


def format_bytes(n: float) -> str:
    """``1.50 MiB``-style text for a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_spec(spec: Any) -> str:
    """``P('data', None)``-style text for a spec (or ``repr`` for anything else)."""
    if isinstance(spec, PartitionSpec):
        if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
            return repr(spec)  # iterating such a spec raises in JAX; its repr is fine
        return "P(" + ", ".join(repr(e) for e in spec) + ")"
    return repr(spec)


@overload
def spec_json(spec: PartitionSpec) -> list[Any]: ...
@overload
def spec_json(spec: None) -> None: ...
def spec_json(spec: PartitionSpec | None) -> list[Any] | None:
    """A spec as JSON, the one spelling of every JSON output (plans, records, errors).

    Example:
        >>> spec_json(PartitionSpec("data", None, ("a", "b")))
        ['data', None, ['a', 'b']]
    """
    if spec is None:
        return None
    entries = spec.partitions if hasattr(spec, "partitions") else tuple(spec)
    return [list(e) if isinstance(e, tuple) else e for e in entries]


@overload
def spec_from_json(value: Iterable[Any]) -> PartitionSpec: ...
@overload
def spec_from_json(value: None) -> None: ...
def spec_from_json(value: Iterable[Any] | None) -> PartitionSpec | None:
    """The inverse of ``spec_json``."""
    if value is None:
        return None
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in value])


def toml_spec(entries: Any) -> str:
    """A spec (a ``PartitionSpec`` or its ``spec_json``) as a rules file writes it.

    Example:
        >>> print(toml_spec([None, "model"]), toml_spec([["data", "fsdp"]]), toml_spec([]))
        ["none", "model"] [["data", "fsdp"]] []
    """
    if isinstance(entries, PartitionSpec):
        entries = spec_json(entries)
    return "[" + ", ".join(toml_entry(e) for e in entries) + "]"


TOML_NONE = "none"
"""A replicated dimension in a rules file (TOML has no null)."""


def toml_entry(e: Any) -> str:
    """One spec entry as a rules file writes it: ``"none"``, ``"model"``, ``["data", "fsdp"]``."""
    if e is None:
        return f'"{TOML_NONE}"'
    if isinstance(e, list | tuple):
        return "[" + ", ".join(toml_entry(x) for x in e) + "]"
    return '"' + str(e).replace("\\", "\\\\").replace('"', '\\"') + '"'


def format_mesh(sizes: Mapping[str, int]) -> str:
    """``data=2, model=4``: how errors and tables spell a mesh (``(no axes)`` when empty)."""
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "(no axes)"


def quote_pattern(pattern: str) -> str:
    r"""A regular expression in quotes, exactly as written: ``'norm\d?/weight$'`` (never
    ``repr``'s doubled backslashes); double quotes when the pattern holds a ``'``.

    Example:
        >>> print(quote_pattern(r"norm\d?/weight$"), quote_pattern("it's"))
        'norm\d?/weight$' "it's"
    """
    if "'" not in pattern:
        return f"'{pattern}'"
    if '"' not in pattern:
        return f'"{pattern}"'
    return repr(pattern)


def literal(text: Any) -> Any:
    """User text as a ``rich`` renderable shown character for character, never as markup.

    Example:
        >>> from rich.console import Console
        >>> Console(color_system=None).print(literal("attn/w[qkv]$ [bold]x[/bold]"))
        attn/w[qkv]$ [bold]x[/bold]
    """
    from rich.text import Text

    return Text(str(text))


def close_match(name: str, choices: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The one of ``choices`` that ``name`` is most likely a typo of, for "did you mean"."""
    got = difflib.get_close_matches(name, list(choices), n=1, cutoff=cutoff)
    return got[0] if got and got[0] != name else None


def natural_key(text: str) -> list[tuple[int, int | str]]:
    """A sort key reading numbers as numbers: ``layers/2`` before ``layers/10``."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", text) if p]


_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"b": 1} | {
    f"{u}{i}b": (1024 if i else 1000) ** (n + 1) for n, u in enumerate("kmgt") for i in ("i", "")
}


def size_in_bytes(value: object) -> int | None:
    """Bytes from a finite number >= 0, or from a string: a number and an optional unit
    (``KB`` = 1000, ``KiB`` = 1024, any case); None when ``value`` is no size.

    >>> size_in_bytes("16GiB"), size_in_bytes("80 GB"), size_in_bytes(4096), size_in_bytes("lots")
    (17179869184, 80000000000, 4096, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value) if math.isfinite(value) and value >= 0 else None
    if isinstance(value, str) and (m := _SIZE.fullmatch(value)) is not None:
        return int(float(m[1]) * _UNITS[(m[2] or "b").lower()])
    return None
