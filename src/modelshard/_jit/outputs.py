"""How ``shard_jit`` splits a function's output into array leaves and builds it back."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from .._containers import NUMBER_TYPES, Adapter, flatten_nested, get_adapter, is_array
from .._specs import entry_axes


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of an output: a container (``adapter`` set) or a single leaf."""

    adapter: Adapter | None
    aux: Hashable
    template: tuple[Any, ...]
    array_index: tuple[int, ...]
    source: int | None

    def build(self, arrays: Sequence[Any]) -> Any:
        if self.adapter is None:
            return arrays[0] if self.array_index else self.template[0]
        if len(self.array_index) == len(self.template):
            return self.adapter.unflatten(self.aux, arrays)
        leaves = list(self.template)
        for i, v in zip(self.array_index, arrays, strict=True):
            leaves[i] = v
        return self.adapter.unflatten(self.aux, leaves)


@dataclasses.dataclass(frozen=True)
class OutDesc:
    """The recorded structure of a function's output."""

    outer: Any
    parts: tuple[Part, ...]
    bounds: tuple[tuple[int, int], ...]

    @property
    def num_arrays(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0

    def build(self, flat: Sequence[Any]) -> Any:
        """The output rebuilt from its flat arrays."""
        parts = [p.build(flat[a:b]) for p, (a, b) in zip(self.parts, self.bounds, strict=True)]
        if self.outer is None:
            return parts[0]
        return jax.tree_util.tree_unflatten(self.outer, parts)


def split_output(
    out: Any, sources: Sequence[tuple[Adapter, Hashable]]
) -> tuple[list[Any], OutDesc]:
    """Split ``out`` into its array leaves and an ``OutDesc``."""
    index = {(id(a), aux): j for j, (a, aux) in reversed(list(enumerate(sources)))}

    def match(x: Any) -> tuple[Adapter, list[Any], Hashable, int | None] | None:
        try:
            own = get_adapter(x)
            adapter, leaves, aux = flatten_nested(own, x)
        except Exception:
            return None
        try:
            j = index.get((id(adapter), aux))
        except TypeError:  # unhashable structure key: never an input's
            j = None
        # A pytree that is no input's (a (new_state, loss) tuple) is looked into, even
        # when it holds registered containers: one of them may be an input coming back.
        if j is None and own.follows_pytree:
            return None
        return adapter, leaves, aux, j

    top = match(out)
    if top is not None and (top[3] is not None or not top[0].follows_pytree):
        found: list[Any] = [out]
        outer = None
    else:
        found, outer = jax.tree_util.tree_flatten(out, is_leaf=lambda x: match(x) is not None)
    arrays: list[Any] = []
    parts: list[Part] = []
    bounds: list[tuple[int, int]] = []
    for x in found:
        start = len(arrays)
        hit = match(x) if outer is not None or top is None else top
        if hit is None and is_array(x):
            parts.append(Part(None, None, (None,), (0,), None))
            arrays.append(x)
        elif hit is None:
            parts.append(Part(None, None, (x,), (), None))
        else:
            adapter, leaves, aux, j = hit
            numbers = adapter.numbers_are_arrays
            idx = [
                i
                for i, v in enumerate(leaves)
                if is_array(v) or (numbers and type(v) in NUMBER_TYPES)
            ]
            at = set(idx)
            template = tuple(None if i in at else v for i, v in enumerate(leaves))
            parts.append(Part(adapter, aux, template, tuple(idx), j))
            arrays.extend(leaves[i] for i in idx)
        bounds.append((start, len(arrays)))
    return arrays, OutDesc(outer, tuple(parts), tuple(bounds))


def set_by_function(jaxpr: Any) -> list[bool]:
    """Per output of a closed jaxpr: whether the function itself gave it a sharding."""

    @functools.cache  # jaxprs hash by identity
    def producers(j: Any) -> dict[int, Any]:
        return {id(v): eqn for eqn in j.eqns for v in eqn.outvars}

    def constrained(j: Any, var: Any, depth: int) -> bool:
        while depth < 64:
            eqn = producers(j).get(id(var))
            if eqn is None:  # an input or a literal
                return False
            name = eqn.primitive.name
            if name in _CONSTRAINTS:
                return True
            at = next(i for i, v in enumerate(eqn.outvars) if v is var)
            if name in _PASS_THROUGH and eqn.invars:
                var = eqn.invars[at if len(eqn.invars) == len(eqn.outvars) else 0]
                continue
            return any(
                constrained(inner, inner.outvars[at], depth + 1)
                for inner in _inner_jaxprs(eqn, len(eqn.outvars))
            )
        return False  # pragma: no cover - pathological nesting: say "not set"

    inner = jaxpr.jaxpr
    return [constrained(inner, v, 0) for v in inner.outvars]


_CONSTRAINTS = frozenset({"sharding_constraint", "reshard", "mesh_cast"})
_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p", "optimization_barrier"})


def _inner_jaxprs(eqn: Any, nout: int) -> list[Any]:
    """The open jaxprs of a call-like equation whose outputs are its outputs, one to one."""
    jaxprs = (getattr(p, "jaxpr", p) for p in eqn.params.values())  # ClosedJaxpr -> Jaxpr
    return [j for j in jaxprs if hasattr(j, "eqns") and len(getattr(j, "outvars", ())) == nout]


def inferred_shardings(
    desc: OutDesc,
    avals: Sequence[Any],
    by_function: Sequence[bool],
    inputs: Callable[[int], tuple[Sequence[Any], Sequence[Any]]],
    explicit_axes: frozenset[str],
) -> list[Any]:
    """Out shardings when ``out_specs`` is omitted."""
    out: list[Any] = [None] * desc.num_arrays
    for part, (a, b) in zip(desc.parts, desc.bounds, strict=True):
        if part.source is None:
            continue
        shardings, leaves = inputs(part.source)
        if len(shardings) != b - a or len(leaves) != b - a:
            continue
        for k in range(b - a):
            o, x, s = avals[a + k], leaves[k], shardings[k]
            if by_function[a + k] or tuple(o.shape) != tuple(x.shape) or o.dtype != x.dtype:
                continue
            if explicit_axes and _explicit_part(
                getattr(o, "sharding", None), o.ndim, explicit_axes
            ) != _explicit_part(s, o.ndim, explicit_axes):
                continue  # the output's type says where it lives: keep that
            out[a + k] = s
    return out


def _explicit_part(
    sharding: Any, ndim: int, explicit: frozenset[str]
) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the Explicit axes a sharding splits it over."""
    spec = tuple(getattr(sharding, "spec", None) or ())
    spec = spec + (None,) * (ndim - len(spec))
    return tuple(tuple(a for a in entry_axes(e) if a in explicit) for e in spec[:ndim])
