"""How ``shard_jit`` splits a function's output into array leaves and builds it back.

A function's output is cut into *parts*: containers that have the structure of an input
argument (so they can inherit that argument's shardings), containers whose adapter is not
JAX's own flattening (NNX modules: :attr:`~modelshard.adapters.Adapter.follows_pytree`
is false), and single leaves. The description is recorded once, while
tracing, and replayed on every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from .._adapters import Adapter, get_adapter
from .._describe import NUMBER_TYPES, is_array


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of an output: a container (``adapter`` set) or a single leaf.

    Attributes:
        adapter: the container's adapter, or ``None`` for a single leaf.
        aux: the adapter's structure key.
        template: every leaf, with array positions set to ``None`` (static leaves kept).
        array_index: positions of the array leaves in ``template``.
        source: index of the dynamic input argument with the same structure, or ``None``.
    """

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
    """The recorded structure of a function's output.

    Attributes:
        outer: tree structure over the parts (``None`` when the output is one part).
        parts: the parts, in order.
        bounds: ``(start, stop)`` of each part's arrays in the flat output.
    """

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
    """Split ``out`` into its array leaves and an :class:`OutDesc`.

    Args:
        out: what the function returned (traced or abstract leaves).
        sources: ``(adapter, aux)`` of each dynamic input argument; an output container
            with the same pair is a part that remembers which input it mirrors.
    """
    index = {(id(a), aux): j for j, (a, aux) in reversed(list(enumerate(sources)))}

    def match(x: Any) -> tuple[Adapter, list[Any], Hashable, int | None] | None:
        adapter = get_adapter(x)
        try:
            leaves, aux = adapter.flatten(x)
        except Exception:
            return None
        try:
            j = index.get((id(adapter), aux))
        except TypeError:  # unhashable structure key: never an input's
            j = None
        if j is None and adapter.follows_pytree:
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
        hit = match(x) if outer is not None or top is None else top
        if hit is None:
            leaf_is_array = is_array(x)
            parts.append(
                Part(
                    None, None, (None if leaf_is_array else x,), (0,) if leaf_is_array else (), None
                )
            )
            start = len(arrays)
            if leaf_is_array:
                arrays.append(x)
        else:
            adapter, leaves, aux, j = hit
            numbers = adapter.numbers_are_arrays
            idx = tuple(
                i
                for i, v in enumerate(leaves)
                if is_array(v) or (numbers and type(v) in NUMBER_TYPES)
            )
            at = set(idx)
            template = tuple(None if i in at else v for i, v in enumerate(leaves))
            parts.append(Part(adapter, aux, template, idx, j))
            start = len(arrays)
            arrays.extend(leaves[i] for i in idx)
        bounds.append((start, len(arrays)))
    return arrays, OutDesc(outer, tuple(parts), tuple(bounds))


def leaf_shardings(
    desc: OutDesc,
    avals: Sequence[Any],
    input_shardings: Callable[[int], Sequence[Any] | None],
    input_shapes: Callable[[int], Sequence[tuple[int, ...]] | None],
) -> list[Any]:
    """Out shardings when ``out_specs`` is omitted: an input's, where the structure matches.

    Leaves of a part that mirrors an input take that input's shardings, leaf for leaf,
    where the shapes agree; every other leaf is ``None`` (the compiler decides).
    """
    out: list[Any] = [None] * desc.num_arrays
    for part, (a, b) in zip(desc.parts, desc.bounds, strict=True):
        if part.source is None:
            continue
        shardings = input_shardings(part.source)
        shapes = input_shapes(part.source)
        if shardings is None or shapes is None or len(shardings) != b - a:
            continue
        for k in range(b - a):
            if tuple(avals[a + k].shape) == tuple(shapes[k]):
                out[a + k] = shardings[k]
    return out
