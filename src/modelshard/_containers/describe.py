"""What a leaf is and what it is called: array leaves, canonical paths, metadata boxes, and
the container types that are one leaf wherever they appear (split by their own adapter)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey

from .._base import format_path, join
from .._internals import ArrayImpl

# Exact types known to be array leaves, and known not to be (both learned by is_array):
# describing big trees and flattening shard_jit arguments check these sets first.
ARRAY_TYPES: set[type] = {np.ndarray, jax.ShapeDtypeStruct, type(np.zeros(()) + 0), ArrayImpl}
_NOT_ARRAY_TYPES: set[type] = set()


_ARRAY_BASES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)

# Python numbers: static leaves, except in containers whose adapter says
# ``numbers_are_arrays`` (then converted to rank-0 arrays when split).
NUMBER_TYPES = frozenset({bool, int, float, complex})


def numbers_to_arrays(leaves: list[Any]) -> list[Any]:
    """``leaves`` with every Python number a (weakly typed) rank-0 array, as ``jax.jit`` makes it."""
    if not any(type(x) in NUMBER_TYPES for x in leaves):
        return leaves
    return [jnp.asarray(x) if type(x) in NUMBER_TYPES else x for x in leaves]


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array leaf (sharded by modelshard) rather than a static leaf.

    Arrays are ``jax.Array``, NumPy arrays and scalars, and ``jax.ShapeDtypeStruct``;
    everything else is static and passes through untouched, as in Equinox.
    """
    t = type(x)
    if t in ARRAY_TYPES:
        return True
    if t in _NOT_ARRAY_TYPES:
        return False
    yes = isinstance(x, _ARRAY_BASES)  # decided by the type alone (ABC registration)
    (ARRAY_TYPES if yes else _NOT_ARRAY_TYPES).add(t)
    return yes


class LeafInfo(NamedTuple):
    """What an adapter knows about one leaf beyond its value.

    Attributes:
        path: canonical ``/``-joined path (``"layers/0/attn/kernel"``).
        names: axis names carried by metadata (a linen box, an NNX ``out_sharding``), or None.
        box: the type name of the box the value came from, or ``None``.
    """

    path: str
    names: tuple[Any, ...] | None = None
    box: str | None = None


def _box_types() -> tuple[type, ...]:
    """The metadata box classes of the Flax modules imported so far."""
    out: list[type] = []
    meta = sys.modules.get("flax.core.meta")
    if meta is not None:
        out.append(meta.AxisMetadata)
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:
        out.append(nnx.Variable)
    return tuple(out)


def _box_names(x: Any) -> tuple[Any, ...] | None:
    """The axis names a linen box or NNX Variable carries, if any."""
    names = getattr(x, "names", None)  # linen Partitioned / LogicallyPartitioned
    if names is None and hasattr(x, "get_metadata"):  # NNX Variable
        keys = ("out_sharding", "sharding_names", "sharding")
        names = next((n for k in keys if (n := _metadata(x, k)) is not None), None)
        rules = _metadata(x, "sharding_rules")
        if rules and isinstance(names, tuple | list):
            try:  # the Variable's own sharding_rules, applied as Flax applies them
                table = {alias: on_mesh for alias, on_mesh in rules}
            except (TypeError, ValueError):  # not pairs: Flax could not use them either
                return tuple(names)
            targets = [table.get(n, n) if isinstance(n, str) else n for n in names]
            return tuple(tuple(t) if isinstance(t, list) else t for t in targets)
    return tuple(names) if isinstance(names, tuple | list) else None


def _metadata(x: Any, key: str) -> Any:
    try:
        return x.get_metadata(key, None)
    except Exception:  # older Flax spells metadata access differently
        return getattr(x, key, None)


def describe_pytree(obj: Any) -> list[LeafInfo]:
    """Describe every leaf of a JAX pytree, in ``tree_flatten`` order.

    Plain dicts, lists and tuples are walked directly (this runs on every plan); other nodes
    are opened with JAX's ``tree_flatten_with_path``, so custom pytrees keep their key names.
    Metadata boxes give their payload the box's path and their axis names.

    Example:
        >>> import numpy as np
        >>> [i.path for i in describe_pytree({"layers": [{"w": np.ones(2)}], "b": np.ones(1)})]
        ['b', 'layers/0/w']
    """
    return _describe(obj)[0]


def describe_cached(obj: Any, treedef: Any) -> list[LeafInfo]:
    """``describe_pytree`` of ``obj``, whose ``jax.tree_util`` structure is ``treedef``."""
    global _last
    last_treedef, last_nested, last_infos = _last
    nested = nested_types()
    try:
        if last_treedef is not None and last_nested is nested and last_treedef == treedef:
            return last_infos
    except Exception:  # uncomparable aux data: describe afresh
        return _describe(obj)[0]
    infos, exact = _describe(obj)
    if exact:
        _last = (treedef, nested, infos)
    return infos


# The structure described last, the nested container types it was described with, and
# its leaf descriptions.
_last: tuple[Any, tuple[type, ...], list[LeafInfo]] = (None, (), [])
_new = tuple.__new__


def _describe(obj: Any) -> tuple[list[LeafInfo], bool]:
    """The leaf descriptions, and whether every dict key on the way was a ``str``."""
    boxes = _box_types()
    arrays = ARRAY_TYPES
    nested = nested_types()  # below the root, each of these is one leaf here
    root = obj
    out: list[LeafInfo] = []
    append = out.append
    inexact: list[Any] = []

    def leaf(path: str) -> None:
        append(_new(LeafInfo, (path, None, None)))

    def walk(x: Any, path: str) -> None:
        # Children that are array leaves are appended inline: one call per node, not leaf.
        t = type(x)
        if t is dict:
            try:
                keys = sorted(x)
            except TypeError:  # mixed key types: let JAX order them (below)
                keys = None
            if keys is not None:
                pre = path + "/" if path else ""
                for k in keys:
                    if type(k) is not str:
                        inexact.append(k)
                    v = x[k]
                    if type(v) in arrays:
                        append(_new(LeafInfo, (f"{pre}{k}", None, None)))
                    else:
                        walk(v, f"{pre}{k}")
                return
        elif t is list or t is tuple:
            pre = path + "/" if path else ""
            for i, v in enumerate(x):
                tv = type(v)
                if tv in arrays:
                    append(_new(LeafInfo, (f"{pre}{i}", None, None)))
                elif tv is dict and len(x) > 1:
                    stacked(v, f"{pre}{i}")
                else:
                    walk(v, f"{pre}{i}")
            return
        elif t in arrays:
            leaf(path)
            return
        elif x is None:
            return
        if nested and x is not root and isinstance(x, nested):
            leaf(path)  # a container of its own: its adapter describes what is inside
            return
        if boxes and isinstance(x, boxes):
            names = _box_names(x)
            box = t.__name__
            inner = jax.tree_util.tree_flatten_with_path(x)[0]
            for inner_keys, _ in inner:
                sub = format_path(inner_keys, drop_artifacts=True) if len(inner) > 1 else ""
                append(LeafInfo(join(path, sub), names, box))
            return
        children = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda c: c is not x)[0]
        if len(children) == 1 and not children[0][0] and children[0][1] is x:
            leaf(path)
            return
        for keys, child in children:
            for k in keys:
                if type(k) is DictKey and type(k.key) is not str:
                    inexact.append(k)
            walk(child, join(path, format_path(keys)))

    # Layer stacks repeat one structure hundreds of times (and again in each optimizer
    # moment): describe each structure of a list element once, then only join paths.
    seen: dict[Any, list[LeafInfo] | None] = {}

    def stacked(v: Any, path: str) -> None:
        try:
            treedef = jax.tree_util.tree_structure(v)
            rel = seen.get(treedef, _NOTHING)
        except Exception:  # unhashable aux data
            walk(v, path)
            return
        if rel is _NOTHING:
            got, exact = _describe(v)
            rel = seen[treedef] = got if exact else None
        if rel is None:  # a dict key that is not a str: equal structures may differ
            walk(v, path)
            return
        pre = path + "/"
        for info in rel:  # type: ignore[union-attr]
            sub = info[0]
            append(_new(LeafInfo, (pre + sub if sub else path, info[1], info[2])))

    walk(obj, "")
    return out, not inexact


_NOTHING: Any = object()


def children_of(node: Any) -> dict[str, Any]:
    """One level of a pytree node, keyed by canonical path component."""
    t = type(node)
    if t is dict:
        try:
            return {str(k): node[k] for k in sorted(node)}  # JAX's order
        except TypeError:
            return {str(k): v for k, v in node.items()}
    if t is list or t is tuple:
        return {str(i): v for i, v in enumerate(node)}
    if node is None or is_array(node):
        return {}
    boxes = _box_types()
    if boxes and isinstance(node, boxes):
        return {}
    items = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda c: c is not node)[0]
    if len(items) == 1 and not items[0][0] and items[0][1] is node:
        return {}
    return {format_path(k): v for k, v in items}


# The registered container types split by their own adapter wherever they appear (the
# registry installs its answer).
_source: Callable[[], tuple[type, ...]] = tuple
# Per type: whether it is a nested type's subclass, for the types it was computed against
# (``isinstance`` against ABC-based classes runs Python code, and flattening asks per node).
_memo: tuple[tuple[type, ...], dict[type, bool]] = ((), {})


def install(source: Callable[[], tuple[type, ...]]) -> None:
    """Make ``source()`` the answer of ``nested_types`` (the registry calls this once)."""
    global _source
    _source = source


def nested_types() -> tuple[type, ...]:
    """The registered container types split by their own adapter wherever they appear."""
    return _source()


def nested_leaf(root: Any = None) -> Callable[[Any], bool] | None:
    """An ``is_leaf`` true for instances of ``nested_types`` other than ``root`` (None: none)."""
    global _memo
    stop = _source()
    if not stop:
        return None
    if _memo[0] is not stop:
        _memo = (stop, {})
    memo = _memo[1]
    get = memo.get

    def is_nested(x: Any) -> bool:
        hit = get(type(x))
        if hit is None:
            hit = memo[type(x)] = isinstance(x, stop)
        return hit and x is not root

    return is_nested
