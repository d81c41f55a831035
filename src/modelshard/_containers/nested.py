"""Containers inside containers: each split by its own adapter."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from .._base import AdapterError, join
from .adapter_base import Adapter
from .describe import ARRAY_TYPES, LeafInfo, nested_leaf, nested_types, numbers_to_arrays
from .registry import get_adapter


def flatten_one(adapter: Adapter, obj: Any) -> tuple[list[Any], Hashable]:
    """``adapter.flatten(obj)``: failures as ``AdapterError``, numbers arrays where it says so."""
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


def _is_nested(x: Any, is_nested: Callable[[Any], bool] | None) -> bool:
    """Whether leaf ``x`` is a nested container (``nested_leaf``'s test; arrays never are)."""
    return is_nested is not None and type(x) not in ARRAY_TYPES and is_nested(x)


def holds_nested(leaves: Sequence[Any]) -> bool:
    """Whether any of ``leaves`` is a container to be split by its own adapter."""
    stop = nested_types()
    return bool(stop) and any(issubclass(t, stop) for t in set(map(type, leaves)) - ARRAY_TYPES)


def flatten_nested(adapter: Adapter, obj: Any) -> tuple[Adapter, list[Any], Hashable]:
    """``obj`` flattened by ``adapter``, nested containers by their own (a ``NestedAdapter``)."""
    leaves, aux = flatten_one(adapter, obj)
    if not holds_nested(leaves):
        return adapter, leaves, aux
    nested = nested_adapter(adapter)
    return nested, *nested.nest(leaves, aux)


_NESTED: dict[Adapter, NestedAdapter] = {}


def nested_adapter(outer: Adapter) -> NestedAdapter:
    """The ``NestedAdapter`` over ``outer``, one per adapter: cache keys compare it by identity."""
    try:
        return _NESTED.setdefault(outer, NestedAdapter(outer))
    except TypeError:  # an unhashable user adapter
        return NestedAdapter(outer)


class Inner(NamedTuple):
    """One container nested among an outer container's leaves."""

    pos: int
    adapter: Adapter
    aux: Hashable
    size: int


class NestedAux(NamedTuple):
    """The outer adapter's ``aux`` and each nested container, in leaf order."""

    outer: Hashable
    inner: tuple[Inner, ...]


@dataclasses.dataclass(frozen=True)
class NestedAdapter(Adapter):
    """The outer adapter's leaves, each nested container replaced by its own (recursively)."""

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
        return self.nest(*flatten_one(self.outer, obj))

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
        originals = flatten_one(self.outer, obj)[0]
        outer = self._outer(
            aux, leaves, lambda inn, sub: inn.adapter.update(originals[inn.pos], inn.aux, sub)
        )
        return self.outer.update(obj, aux.outer, outer)

    def describe(self, obj: Any) -> list[LeafInfo]:
        outer_infos = self.outer.describe(obj)
        leaves = flatten_one(self.outer, obj)[0]
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
