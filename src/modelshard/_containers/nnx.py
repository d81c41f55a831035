"""NNX objects on ``shard_jit``'s per-call path: their Variables without ``nnx.split``."""

from __future__ import annotations

import dataclasses
import functools
import operator
import sys
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from .adapter_base import Adapter, Again, CallLeaves, WriteBack
from .describe import ARRAY_TYPES, LeafInfo, describe_pytree
from .watched import generation, watch, watches_attributes


@dataclasses.dataclass(frozen=True, eq=False)
class LeafOrder:
    """How one NNX structure's pytree leaves (Variables) map onto ``nnx.split``'s order."""

    aux: Hashable
    perm: tuple[int, ...]
    unique: int
    metadata: list[dict[str, Any]]


_ORDERS: dict[Hashable, LeafOrder | None] = {}
_MAX_ORDERS = 256
_raw_value = operator.attrgetter("_raw_value")
_metadata = operator.attrgetter("_var_metadata")
_set_slot = object.__setattr__


def _nnx() -> Any:
    """``flax.nnx``, imported at first use: importing modelshard imports no Flax."""
    from flax import nnx

    return nnx


def _is_variable(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def _equal(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """``a == b`` for lists of metadata dicts (one C-level comparison)."""
    try:
        return a == b
    except Exception:  # a metadata value whose == is no bool (an array): treat as changed
        return False


def _copies(variables: list[Any]) -> list[dict[str, Any]]:
    """A copy of each Variable's metadata, equal ones shared (few copies compare faster)."""
    shared: dict[Any, dict[str, Any]] = {}
    out = []
    for m in map(_metadata, variables):
        try:
            key = tuple(m.items())
            copy = shared.setdefault(key, dict(m))
        except TypeError:  # an unhashable metadata value
            copy = dict(m)
        out.append(copy)
    return out


@dataclasses.dataclass(eq=False)
class Snapshot:
    """One NNX object's graph as last seen: each container with the objects it held."""

    ref: Any
    containers: list[tuple[Any, list[Any] | None, list[Any]]]
    variables: list[Any]
    metadata: list[dict[str, Any]]
    order: LeafOrder
    again: Again = dataclasses.field(init=False)
    dicts: list[dict[str, Any]] = dataclasses.field(init=False)
    attributes: dataclasses.InitVar[Sequence[dict[str, Any]]] = ()
    always: list[tuple[Any, list[Any] | None, list[Any]]] = dataclasses.field(init=False)
    watching: bool = dataclasses.field(init=False, default=False)
    seen: int | None = dataclasses.field(init=False, default=None)

    def __post_init__(self, attributes: Sequence[dict[str, Any]]) -> None:
        self.again = functools.partial(_again, weakref.ref(self))
        self.dicts = list(map(_metadata, self.variables))
        # dicts (and attribute dicts where ``watches_attributes``) are watched with the
        # metadata; the other containers are compared on every call
        compared = {id(d) for d in attributes} if not watches_attributes() else set()
        self.always = [x for x in self.containers if x[1] is None or id(x[0]) in compared]
        owned = [c for c, keys, _ in self.containers if keys is not None and id(c) not in compared]
        self.watching = self.ref is not None and watch(owned) and watch(self.dicts)
        self.seen = generation()

    def holds(self) -> bool:
        """Whether every container holds the same objects, and every Variable the same metadata."""
        is_ = operator.is_
        now = generation()
        quiet = self.watching and now == self.seen
        for c, keys, values in self.always if quiet else self.containers:
            if keys is None:
                if len(c) != len(values) or not all(map(is_, c, values)):
                    return False
            elif list(c) != keys or not all(map(is_, c.values(), values)):
                return False
        dicts = list(map(_metadata, self.variables))
        # watched dicts unchanged are equal to the copies: comparing the lists (identity
        # first, in C) is the whole check, and a dict Flax replaced compares by content
        if quiet and _equal(dicts, self.dicts):
            return True
        same_dicts = all(map(is_, dicts, self.dicts))
        if not _equal(dicts, self.metadata):
            return False
        if not same_dicts:
            self.dicts = dicts
            if self.watching and not watch(dicts):
                self.watching = False  # compared on every call from now on
        self.seen = now
        return True

    def values(self) -> list[Any] | None:
        """The Variables' values in ``nnx.split`` order while ``holds`` and all are arrays."""
        return _array_values(self.variables) if self.holds() else None

    def call(self) -> CallLeaves | None:
        """This call's leaves; the ``LeafOrder`` is the cheap cache key."""
        raws = self.values()
        if raws is None:
            return None
        return CallLeaves(raws, self.order.aux, self.order, self.write_back, True, self.again)

    def write_back(self, positions: Sequence[int], values: Sequence[Any]) -> None:
        """Set the Variables at ``positions`` (``nnx.split`` order) to ``values``."""
        # Variable.__setattr__ asks JAX for the current trace per Variable; asked once here,
        # each Variable costs a comparison.
        here = sys.modules["flax.nnx.tracers"].current_jax_trace()
        ordered = self.variables
        for m, new in zip(positions, values, strict=True):
            var = ordered[m]
            if "on_set_value" in var._var_metadata or type(var._raw_value) not in ARRAY_TYPES:
                var.set_value(new)
            elif var._trace_state._jax_trace == here:
                # what set_value does for a plain array, minus its copy and hook lookup
                _set_slot(var, "_raw_value", new)
            else:  # a ref Variable, or Flax's TraceContextError for another trace level
                var._raw_value = new


def _again(snapshot: weakref.ref[Snapshot], value: Any) -> tuple[list[Any], WriteBack] | None:
    snap = snapshot()
    if snap is None or snap.ref() is not value:
        return None
    raws = snap.values()
    return None if raws is None else (raws, snap.write_back)


def _array_values(variables: list[Any]) -> list[Any] | None:
    """Each Variable's value, or ``None`` unless every one is an array."""
    try:
        raws = list(map(_raw_value, variables))
    except AttributeError:
        return None
    return raws if set(map(type, raws)) <= ARRAY_TYPES else None


_SNAPSHOTS: dict[int, Snapshot] = {}
_MAX_SNAPSHOTS = 64


def _forget(snapshots: dict[int, Snapshot], key: int, ref: Any) -> None:
    """Drop a collected object's snapshot (``snapshots`` bound early: globals go at exit)."""
    snap = snapshots.get(key)
    if snap is not None and snap.ref is ref:
        del snapshots[key]


def _snapshot(value: Any, variables: list[Any], order: LeafOrder) -> Snapshot | None:
    """The containers of ``value``'s graph, or ``None`` if one cannot be watched."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    try:
        ref = weakref.ref(value, functools.partial(_forget, _SNAPSHOTS, id(value)))
    except TypeError:
        return None
    containers: list[tuple[Any, list[Any] | None, list[Any]]] = []
    attributes: list[dict[str, Any]] = []  # the containers that are an object's vars()
    seen: set[int] = set()
    todo = [value]
    while todo:
        x = todo.pop()
        if id(x) in seen or isinstance(x, nnx.Variable):
            continue
        seen.add(id(x))
        t = type(x)
        if isinstance(x, nnx.Pytree):
            d = vars(x)
            containers.append((d, list(d), list(d.values())))
            attributes.append(d)
            todo.extend(d.values())
        elif t is dict:
            containers.append((x, list(x), list(x.values())))
            todo.extend(x.values())
        elif t is list or t is tuple:
            containers.append((x, None, list(x)))
            todo.extend(x)
    return Snapshot(ref, containers, variables, _copies(variables), order, attributes)


def nnx_call_leaves(value: Any) -> CallLeaves | None:
    """The per-call route for an NNX object, or ``None`` to use ``nnx.split``."""
    snap = _SNAPSHOTS.get(id(value))
    if snap is not None and snap.ref() is value and (call := snap.call()) is not None:
        return call
    found = _order_of(value)
    if found is None:
        return None
    ordered, order = found
    if any(v._var_metadata.get("on_get_value") for v in ordered):
        return None
    snap = _snapshot(value, ordered, order)
    if snap is None:  # not watchable: for this call only
        raws = _array_values(ordered)
        if raws is None:
            return None
        write_back = Snapshot(None, [], ordered, [], order).write_back
        return CallLeaves(raws, order.aux, order, write_back, True)
    if len(_SNAPSHOTS) >= _MAX_SNAPSHOTS:
        _SNAPSHOTS.clear()
    _SNAPSHOTS[id(value)] = snap
    return snap.call()


def _order_of(value: Any) -> tuple[list[Any], LeafOrder] | None:
    """``value``'s Variables in ``nnx.split`` order and their ``LeafOrder``."""
    try:
        variables, treedef = jax.tree_util.tree_flatten(value, is_leaf=_is_variable)
    except Exception:
        return None
    key = (treedef, tuple(map(type, variables)))
    try:
        known = key in _ORDERS
    except TypeError:
        return None
    order = _ORDERS[key] if known else None
    if not known or (
        order is not None and not _equal(list(map(_metadata, variables)), order.metadata)
    ):
        order = _leaf_order(value, variables)
        if len(_ORDERS) >= _MAX_ORDERS:
            _ORDERS.clear()
        _ORDERS[key] = order
    if order is None or len(set(map(id, variables))) != order.unique:
        return None
    return [variables[i] for i in order.perm], order


def _leaf_order(value: Any, variables: list[Any]) -> LeafOrder | None:
    if not variables or not all(_is_variable(v) for v in variables):
        return None
    graphdef, state = _nnx().split(value)
    in_state = jax.tree_util.tree_leaves(state, is_leaf=_is_variable)
    where = {id(v): i for i, v in enumerate(variables)}
    if len(in_state) != len(where) or any(id(v) not in where for v in in_state):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if len(leaves) != len(in_state):  # a Variable holding several arrays
        return None
    return LeafOrder(
        (graphdef, treedef), tuple(where[id(v)] for v in in_state), len(where), _copies(variables)
    )


@dataclasses.dataclass(frozen=True)
class NnxModuleAdapter(Adapter):
    """Flax NNX modules: ``nnx.split`` into graph + state, Variables as leaves.

    Mutable: updates are written into the caller's module. Prefix trees and mirrors follow
    its ``nnx.State``. On ``shard_jit``'s per-call path a module seen before skips
    ``nnx.split``: its Variables are read in a cached order and only checked for changes.
    """

    kind: str = "nnx.Module"
    mutable = True

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        graphdef, state = _nnx().split(obj)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        return leaves, (graphdef, treedef)

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        graphdef, treedef = aux  # type: ignore[misc]
        return _nnx().merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))

    def describe(self, obj: Any) -> list[LeafInfo]:
        return describe_pytree(_nnx().state(obj))

    def tree_of(self, obj: Any) -> Any:
        """The module's ``nnx.State``."""
        return _nnx().state(obj)

    def mirror(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """The ``nnx.State`` holding ``leaves`` (what NNX users expect for sharding trees)."""
        _, treedef = aux  # type: ignore[misc]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def update(self, obj: Any, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """Write ``leaves`` into the caller's module in place (``nnx.update``)."""
        _nnx().update(obj, self.mirror(aux, leaves))
        return obj

    def flatten_for_call(self, obj: Any) -> CallLeaves:
        fast = nnx_call_leaves(obj)
        return Adapter.flatten_for_call(self, obj) if fast is None else fast
