"""``shard_jit``'s per-call route: gather leaves by a remembered layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from .._containers import ARRAY_TYPES, WriteBack
from .build import Entry
from .take import Taken

_LEAF: Any = ("leaf",)
_NONE: Any = ("none",)


def _layout(x: Any) -> Any:
    """The layout of one node: what ``_gather`` checks and how it orders children."""
    t = type(x)
    if t in ARRAY_TYPES:
        return _LEAF
    if t is dict:
        keys = list(x)
        try:
            ordered = sorted(keys)  # JAX's leaf order
        except TypeError:
            return ("jax", jax.tree_util.tree_structure(x))
        perm = None if ordered == keys else sorted(range(len(keys)), key=keys.__getitem__)
        kids = tuple(_layout(x[k]) for k in ordered)
        return ("dict", keys, perm, kids, all(k is _LEAF for k in kids))
    if t is list or t is tuple:
        kids = tuple(_layout(v) for v in x)
        return ("seq", t, len(x), kids, all(k is _LEAF for k in kids))
    if x is None:
        return _NONE
    return ("jax", jax.tree_util.tree_structure(x))


def _count(lay: Any) -> tuple[int, int]:
    """(dict/list/tuple nodes, leaves) of a layout."""
    if lay[0] not in ("dict", "seq"):
        return 0, 1 if lay is _LEAF else 0
    kids = [_count(k) for k in lay[3]]
    return 1 + sum(n for n, _ in kids), sum(m for _, m in kids)


def _cheaper(x: Any, lay: Any) -> Any:
    """``lay``, or JAX's flattening where that is cheaper for ``x`` (few leaves per node)."""
    nodes, leaves = _count(lay)
    return lay if nodes * 5 <= leaves else ("jax", jax.tree_util.tree_structure(x))


def _gather(x: Any, lay: Any, out: list[Any]) -> bool:
    """Append ``x``'s leaves to ``out`` if ``x`` still has layout ``lay``; else ``False``."""
    kind = lay[0]
    if kind == "dict":
        if type(x) is not dict or list(x) != lay[1]:
            return False
        values = list(x.values())
        if lay[2] is not None:
            values = [values[i] for i in lay[2]]
        kids = lay[3]
    elif kind == "seq":
        if type(x) is not lay[1] or len(x) != lay[2]:
            return False
        values, kids = x, lay[3]
    elif kind == "leaf":
        out.append(x)
        return True
    elif kind == "none":
        return x is None
    else:
        leaves, treedef = jax.tree_util.tree_flatten(x)
        if treedef != lay[1]:
            return False
        out.extend(leaves)
        return True
    if lay[4]:  # every child is a leaf
        out.extend(values)
        return True
    for v, k in zip(values, kids, strict=True):
        if k is _LEAF:
            out.append(v)
        elif not _gather(v, k, out):
            return False
    return True


def routable(entry: Entry, taken: Sequence[Taken]) -> bool:
    """Whether later calls like this one may take a ``Route`` (plain, positional, dynamic)."""
    return entry.positional and all(
        t.again is not None
        or (t.adapter.follows_pytree and t.array_index is None and t.write_back is None)
        for t in taken
    )


class Route:
    """The remembered layout of one call's arguments (``routable``)."""

    def __init__(self, entry: Entry, args: Sequence[Any], taken: Sequence[Taken]):
        self.entry = entry
        self._layouts = [
            ("again", t.again) if t.again is not None else _cheaper(a, _layout(a))
            for a, t in zip(args, taken, strict=True)
        ]
        # Leaves taken again were checked by their adapter; the others are checked here.
        self._check_types = any(lay[0] != "again" for lay in self._layouts)

    def gather(self, args: Sequence[Any]) -> tuple[list[Any], list[WriteBack | None]] | None:
        """The flat array leaves of ``args`` and their write-backs; None if laid out otherwise."""
        if len(args) != len(self._layouts):
            return None
        out: list[Any] = []
        backs: list[WriteBack | None] = []
        for a, lay in zip(args, self._layouts, strict=True):
            if lay[0] == "again":
                got = lay[1](a)
                if got is None:
                    return None
                out.extend(got[0])
                backs.append(got[1])
            elif _gather(a, lay, out):
                backs.append(None)
            else:
                return None
        if self._check_types and not set(map(type, out)) <= ARRAY_TYPES:
            return None  # a Python number or another static leaf: the full path decides
        return out, backs
