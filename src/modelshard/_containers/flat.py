"""A container split by its adapter: leaves, structure, paths, and rebuilding it.

Containers nest: a registered container found among another container's leaves (a custom
class inside a dict, penzai's ``Parameter`` inside a penzai model) is split by its own
adapter, through ``NestedAdapter``, so its leaves, paths and metadata are seen at any
depth and it is rebuilt as itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from .._base import AdapterError, join
from .describe import (
    ARRAY_TYPES,
    LeafInfo,
    children_of,
    describe_cached,
    is_array,
    numbers_to_arrays,
)
from .registry import Adapter, get_adapter, nested_leaf, nested_types


@dataclasses.dataclass
class Flat:
    """A container split into leaves, ready for planning and rebuilding.

    Attributes:
        obj: the original container.
        adapter: the adapter that split it.
        leaves: every leaf, in adapter order (array and static).
        aux: the hashable structure key from the adapter.
        array_index: positions of the array leaves within ``leaves``.
    """

    obj: Any
    adapter: Adapter
    leaves: list[Any]
    aux: Hashable
    array_index: tuple[int, ...]
    _infos: list[LeafInfo] | None = None

    @property
    def kind(self) -> str:
        return self.adapter.kind

    @property
    def arrays(self) -> list[Any]:
        """The array leaves, in order."""
        if len(self.array_index) == len(self.leaves):
            return list(self.leaves)
        return [self.leaves[i] for i in self.array_index]

    @property
    def infos(self) -> list[LeafInfo]:
        """Path and metadata of every array leaf (computed on first use)."""
        if self._infos is None:
            if self.adapter.follows_pytree:  # paths follow the JAX structure: cached
                described = describe_cached(self.obj, self.aux)
            else:
                described = self.adapter.describe(self.obj)
            if len(described) != len(self.leaves):
                raise AdapterError(
                    f"adapter {self.adapter!r} described {len(described)} leaves but "
                    f"flattened {len(self.leaves)}; describe() and flatten() must agree."
                )
            if len(self.array_index) == len(described):
                self._infos = described  # may be shared with the structure cache: read-only
            else:
                self._infos = [described[i] for i in self.array_index]
        return self._infos

    @property
    def paths(self) -> list[str]:
        return [info.path for info in self.infos]

    def children(self, components: Sequence[str]) -> list[str] | None:
        """Names of the children of the node at ``components`` (``None``: no such node).

        Empty subtrees (an optax ``EmptyState``) exist here though they hold no leaf, so
        prefix trees that mirror the container's structure always line up.
        """
        node = self.adapter.tree_of(self.obj)
        for c in components:
            kids = children_of(node)
            if c not in kids:
                return None
            node = kids[c]
        return list(children_of(node))

    def rebuild(self, arrays: Sequence[Any], *, mirror: bool = False) -> Any:
        """The same container with its array leaves replaced by ``arrays``.

        With ``mirror=True`` the container comes back in the form its adapter uses for
        trees of shardings or plans (``Adapter.mirror``: an NNX module's
        ``nnx.State``); otherwise it is rebuilt as itself.
        """
        leaves = self._with(arrays)
        if mirror:
            return self.adapter.mirror(self.aux, leaves)
        return self.adapter.unflatten(self.aux, leaves)

    def update_inplace(self, arrays: Sequence[Any]) -> Any:
        """Rebuild, writing into the original object where its adapter is
        ``mutable`` (NNX)."""
        return self.adapter.update(self.obj, self.aux, self._with(arrays))

    def hidden_arrays(self) -> list[tuple[str, type, list[str]]]:
        """Static leaves that hold arrays in their attributes (an object modelshard cannot
        open): ``(path, type, attribute names)`` for each, looked at one level deep."""
        at = set(self.array_index)
        found = [
            (i, x, attrs)
            for i, x in enumerate(self.leaves)
            if i not in at and (attrs := _holds_arrays(x))
        ]
        if not found:
            return []
        try:
            paths = [info.path for info in self.adapter.describe(self.obj)]
        except Exception:  # a path is a courtesy here; the position still names the leaf
            paths = []
        return [
            (paths[i] if i < len(paths) else f"<leaf {i}>", type(x), attrs) for i, x, attrs in found
        ]

    def _with(self, arrays: Sequence[Any]) -> list[Any]:
        leaves = list(self.leaves)
        for i, v in zip(self.array_index, arrays, strict=True):
            leaves[i] = v
        return leaves


def split(obj: Any) -> Flat:
    """Split any registered container into a [`Flat`][modelshard.adapters.Flat].

    Example:
        >>> import jax.numpy as jnp
        >>> import modelshard as ms
        >>> flat = ms.adapters.split({"w": jnp.ones((2, 3)), "act": print})
        >>> flat.paths, flat.kind
        (['w'], 'pytree')
    """
    adapter, leaves, aux = flatten_nested(get_adapter(obj), obj)
    # This runs over every leaf of every plan: when every leaf has a known array type,
    # one set of types decides it.
    if set(map(type, leaves)) <= ARRAY_TYPES:
        index = tuple(range(len(leaves)))
    else:
        index = tuple(i for i, leaf in enumerate(leaves) if is_array(leaf))
    return Flat(obj, adapter, leaves, aux, index)


def _flatten_one(adapter: Adapter, obj: Any) -> tuple[list[Any], Hashable]:
    try:
        leaves, aux = adapter.flatten(obj)
    except AdapterError:
        raise
    except Exception as e:
        raise AdapterError(
            f"adapter {adapter.kind!r} failed to flatten a {type(obj).__name__}: "
            f"{type(e).__name__}: {e}"
        ) from e
    if adapter.numbers_are_arrays:
        leaves = numbers_to_arrays(leaves)
    return leaves, aux


def _holds_arrays(x: Any) -> list[str]:
    """Names of ``x``'s attributes that are arrays or plain containers of arrays."""
    try:
        attrs = vars(x)
    except TypeError:  # no __dict__: numbers, strings, functions' builtins, ...
        return []
    if callable(x) and not attrs:
        return []
    out = []
    for k, v in attrs.items():
        vals = v.values() if type(v) is dict else v if type(v) in (list, tuple) else (v,)
        if any(is_array(u) for u in vals):
            out.append(str(k))
    return out


def _is_nested(x: Any, is_nested: Callable[[Any], bool] | None) -> bool:
    """Whether leaf ``x`` is a nested container (``nested_leaf``'s test; arrays never are)."""
    return is_nested is not None and type(x) not in ARRAY_TYPES and is_nested(x)


def holds_nested(leaves: Sequence[Any]) -> bool:
    """Whether any of ``leaves`` is a container to be split by its own adapter."""
    stop = nested_types()
    if not stop:
        return False
    types = set(map(type, leaves)) - ARRAY_TYPES
    return any(issubclass(t, stop) for t in types)


def flatten_nested(adapter: Adapter, obj: Any) -> tuple[Adapter, list[Any], Hashable]:
    """``obj`` flattened by ``adapter``, then every nested container among its leaves by
    its own adapter: the adapter that rebuilds it all (``adapter`` itself when nothing
    nests, else a ``NestedAdapter``), the leaves and their structure key."""
    leaves, aux = _flatten_one(adapter, obj)
    if not holds_nested(leaves):
        return adapter, leaves, aux
    nested = nested_adapter(adapter)
    leaves, aux = nested.nest(leaves, aux)
    return nested, leaves, aux


_NESTED: dict[Adapter, NestedAdapter] = {}


def nested_adapter(outer: Adapter) -> NestedAdapter:
    """The ``NestedAdapter`` over ``outer``: one object per outer adapter, so that
    structure keys that include the adapter (``shard_jit``'s caches) compare by identity."""
    try:
        hit = _NESTED.get(outer)
    except TypeError:  # an unhashable user adapter
        return NestedAdapter(outer)
    if hit is None:
        hit = _NESTED[outer] = NestedAdapter(outer)
    return hit


class Inner(NamedTuple):
    """One container nested among an outer container's leaves.

    Attributes:
        pos: its position among the outer adapter's leaves.
        adapter: its adapter (a ``NestedAdapter`` when it nests further).
        aux: its structure key.
        size: how many leaves it contributes.
    """

    pos: int
    adapter: Adapter
    aux: Hashable
    size: int


class NestedAux(NamedTuple):
    """The structure of a container with nested containers: the outer adapter's ``aux``
    and each nested container, in leaf order."""

    outer: Hashable
    inner: tuple[Inner, ...]


@dataclasses.dataclass(frozen=True)
class NestedAdapter(Adapter):
    """A container holding containers of registered kinds: the outer adapter's leaves, with
    each nested container replaced by its own leaves (recursively).

    Its kind is the outer container's. It counts as mutable (so ``shard_jit`` writes back
    through ``update``): nested containers that are mutable themselves (NNX modules,
    penzai variables) are updated in place, the rest rebuilt.
    """

    outer: Adapter
    mutable = True

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.outer.kind

    def nest(self, leaves: Sequence[Any], outer_aux: Hashable) -> tuple[list[Any], NestedAux]:
        """The outer adapter's ``leaves`` with every nested container split in place."""
        stop = nested_leaf()
        out: list[Any] = []
        inner: list[Inner] = []
        for i, x in enumerate(leaves):
            if _is_nested(x, stop):
                adapter, sub, aux = flatten_nested(get_adapter(x), x)
                inner.append(Inner(i, adapter, aux, len(sub)))
                out.extend(sub)
            else:
                out.append(x)
        return out, NestedAux(outer_aux, tuple(inner))

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        return self.nest(*_flatten_one(self.outer, obj))

    def _outer(
        self, aux: NestedAux, leaves: Sequence[Any], make: Callable[[Inner, list[Any]], Any]
    ) -> list[Any]:
        """The outer adapter's leaves, each nested container made from its own leaves."""
        out: list[Any] = []
        j = 0
        for inn in aux.inner:
            plain = inn.pos - len(out)
            out.extend(leaves[j : j + plain])
            j += plain
            out.append(make(inn, list(leaves[j : j + inn.size])))
            j += inn.size
        out.extend(leaves[j:])
        return out

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        assert isinstance(aux, NestedAux)
        outer = self._outer(aux, leaves, lambda inn, sub: inn.adapter.unflatten(inn.aux, sub))
        return self.outer.unflatten(aux.outer, outer)

    def mirror(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        assert isinstance(aux, NestedAux)
        outer = self._outer(aux, leaves, lambda inn, sub: inn.adapter.mirror(inn.aux, sub))
        return self.outer.mirror(aux.outer, outer)

    def update(self, obj: Any, aux: Hashable, leaves: Sequence[Any]) -> Any:
        assert isinstance(aux, NestedAux)
        originals = _flatten_one(self.outer, obj)[0]
        outer = self._outer(
            aux, leaves, lambda inn, sub: inn.adapter.update(originals[inn.pos], inn.aux, sub)
        )
        return self.outer.update(obj, aux.outer, outer)

    def describe(self, obj: Any) -> list[LeafInfo]:
        outer_infos = self.outer.describe(obj)
        leaves = _flatten_one(self.outer, obj)[0]
        stop = nested_leaf()
        out: list[LeafInfo] = []
        for info, x in zip(outer_infos, leaves, strict=True):
            if _is_nested(x, stop):
                adapter = flatten_nested(get_adapter(x), x)[0]
                out.extend(
                    LeafInfo(join(info.path, sub.path), sub.names, sub.box)
                    for sub in adapter.describe(x)
                )
            else:
                out.append(info)
        return out

    def tree_of(self, obj: Any) -> Any:
        return self.outer.tree_of(obj)
