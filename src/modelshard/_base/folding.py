"""Folding paths that differ only in layer numbers: ``encoderblock_{0..26}/mlp/kernel``."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

_NUMBER = re.compile(r"\d+")


def template(path: str) -> tuple[str, tuple[str, ...]]:
    """``("layers_#/attn_#/w", ("3", "0"))``: the path with each run of digits taken out."""
    return _NUMBER.sub("#", path), tuple(_NUMBER.findall(path))


def format_numbers(values: Iterable[str]) -> str:
    """``0..26``, ``0..3,5,7..9``; more than four runs: ``0..98 (50 values)``."""
    ints = sorted({int(v) for v in values})
    runs: list[tuple[int, int]] = []
    for i in ints:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    if len(runs) > 4:
        return f"{ints[0]}..{ints[-1]} ({len(ints)} values)"
    return ",".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs)


class Fold:
    """One folded group: the items that share a path template (and a key)."""

    __slots__ = ("_numbers", "_template", "items", "paths")

    def __init__(self, tmpl: str, numbers: int) -> None:
        self._template = tmpl
        self._numbers: list[set[str]] = [set() for _ in range(numbers)]
        self.items: list[object] = []
        self.paths: list[str] = []

    def add(self, path: str, numbers: tuple[str, ...], item: object) -> None:
        for seen, n in zip(self._numbers, numbers, strict=True):
            seen.add(n)
        self.items.append(item)
        self.paths.append(path)

    @property
    def count(self) -> int:
        return len(self.items)

    @property
    def path(self) -> str:
        """The folded path: numbers that vary become ``{0..26}``, the others stay."""
        if len(self.paths) == 1:
            return self.paths[0]
        parts = self._template.split("#")
        out = [parts[0]]
        for seen, rest in zip(self._numbers, parts[1:], strict=True):
            out.append(next(iter(seen)) if len(seen) == 1 else "{" + format_numbers(seen) + "}")
            out.append(rest)
        return "".join(out)


def fold(
    items: Sequence[T], path: Callable[[T], str], key: Callable[[T], Hashable] | None = None
) -> list[Fold]:
    """Group ``items`` whose paths differ only in numbers (and ``key``), in order."""
    groups: dict[tuple[str, Hashable], Fold] = {}
    for item in items:
        p = path(item)
        tmpl, numbers = template(p)
        k = (tmpl, key(item) if key is not None else None)
        g = groups.get(k)
        if g is None:
            g = groups[k] = Fold(tmpl, len(numbers))
        g.add(p, numbers, item)
    return list(groups.values())
