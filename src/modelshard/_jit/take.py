"""Flattening ``shard_jit`` arguments on every call, as cheaply as the container allows.

Most containers go through their adapter's ``flatten``. NNX graph objects get a faster
route: ``nnx.split`` walks the whole graph and builds a ``GraphDef`` (tens of
milliseconds for a thousand Variables), so after the first call an object is flattened
as a JAX pytree down to its ``Variable`` objects (about a millisecond), and a cached
*route* maps those Variables onto ``nnx.split``'s leaf order. Updates are written back
with ``Variable.set_value`` on the Variables that changed.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from .._adapters import _REGISTRY, NnxModuleAdapter
from .._describe import _ARRAY_TYPES as ARRAY_TYPES
from .._describe import is_array, numbers_to_arrays
from .._errors import AdapterError
from .._flat import split

__all__ = ["Taken", "static_part", "take"]

_lookup = _REGISTRY.lookup

# (adapter, leaves, aux, array positions or None when every leaf is an array, arrays)
Taken = tuple[Any, list[Any], Hashable, "tuple[int, ...] | None", list[Any]]


def _known_arrays(leaves: Sequence[Any]) -> tuple[int, ...] | None:
    """Positions of the array leaves, or ``None`` when every leaf is an array."""
    types = set(map(type, leaves))
    if types <= ARRAY_TYPES:
        return None
    for t in types - ARRAY_TYPES:
        is_array(next(x for x in leaves if type(x) is t))  # learns whether t is an array type
    index = tuple(i for i, x in enumerate(leaves) if type(x) in ARRAY_TYPES)
    return None if len(index) == len(leaves) else index


def take_slow(value: Any, adapter: Any = None) -> Taken:
    """Flatten ``value`` with its adapter (looked up when not given)."""
    if adapter is None:
        adapter = _lookup(type(value))
    try:
        leaves, aux = adapter.flatten(value)
    except AdapterError:
        raise
    except Exception:
        split(value)  # raises the AdapterError that names the container
        raise
    leaves = numbers_to_arrays(leaves, adapter)
    index = _known_arrays(leaves)
    return adapter, leaves, aux, index, leaves if index is None else [leaves[i] for i in index]


@dataclasses.dataclass(frozen=True, eq=False)
class _Route:
    """How one NNX structure's pytree leaves (Variables) map onto ``nnx.split``'s order."""

    adapter: NnxModuleAdapter
    aux: Hashable
    perm: tuple[int, ...]
    unique: int


@dataclasses.dataclass(frozen=True, eq=False)
class NnxCall:
    """The adapter stand-in for one call's NNX argument: writes back changed Variables."""

    route: _Route
    variables: list[Any]

    @property
    def kind(self) -> str:
        return self.route.adapter.kind

    def set_changed(self, changed: Sequence[int], values: Sequence[Any]) -> None:
        for m, value in zip(changed, values, strict=True):
            var = self.variables[m]
            if "on_set_value" in var._var_metadata or type(var._raw_value) not in ARRAY_TYPES:
                var.set_value(value)
            else:  # what set_value does for a plain array, minus its copy and hook lookup
                var._raw_value = value


_ROUTES: dict[Hashable, _Route | None] = {}
_MAX_ROUTES = 256


def _is_variable(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def _take_nnx(value: Any, adapter: NnxModuleAdapter) -> tuple[Taken, Hashable] | None:
    """The fast route for an NNX object, or ``None`` to use ``nnx.split``."""
    try:
        variables, treedef = jax.tree_util.tree_flatten(value, is_leaf=_is_variable)
    except Exception:
        return None
    key = (treedef, tuple(map(type, variables)))
    try:
        known = key in _ROUTES
    except TypeError:
        return None
    if known:
        route = _ROUTES[key]
    else:
        route = _route(value, adapter, variables)
        if len(_ROUTES) >= _MAX_ROUTES:
            _ROUTES.clear()
        _ROUTES[key] = route
    if route is None or len(set(map(id, variables))) != route.unique:
        return None
    ordered = [variables[i] for i in route.perm]
    try:
        raws = [v._raw_value for v in ordered]
    except AttributeError:
        return None
    if not set(map(type, raws)) <= ARRAY_TYPES or any(
        v._var_metadata.get("on_get_value") for v in ordered
    ):
        return None
    return (NnxCall(route, ordered), raws, route.aux, None, raws), route


def _route(value: Any, adapter: NnxModuleAdapter, variables: list[Any]) -> _Route | None:
    if not variables or not all(_is_variable(v) for v in variables):
        return None
    from flax import nnx

    graphdef, state = nnx.split(value)
    in_state = jax.tree_util.tree_leaves(state, is_leaf=_is_variable)
    where = {id(v): i for i, v in enumerate(variables)}
    if len(in_state) != len(where) or any(id(v) not in where for v in in_state):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if len(leaves) != len(in_state):  # a Variable holding several arrays
        return None
    return _Route(adapter, (graphdef, treedef), tuple(where[id(v)] for v in in_state), len(where))


def take(value: Any) -> tuple[Taken, Hashable]:
    """Flatten ``value``; also return its structure key (adapter included) for the fast cache."""
    adapter = _lookup(type(value))
    if isinstance(adapter, NnxModuleAdapter):
        fast = _take_nnx(value, adapter)
        if fast is not None:
            return fast
    taken = take_slow(value, adapter)
    return taken, (adapter, taken[2])


def static_part(leaves: list[Any], index: tuple[int, ...] | None) -> tuple[Any, ...] | None:
    """``(position, value)`` of every static leaf, or ``None`` when there are none."""
    if index is None:
        return None
    at = set(index)
    return tuple((i, x) for i, x in enumerate(leaves) if i not in at)
