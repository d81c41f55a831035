"""The base class of every container adapter: what modelshard asks of a container type."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from .describe import LeafInfo

WriteBack = Callable[[Sequence[int], Sequence[Any]], None]
"""``write_back(positions, values)``: set leaves of the caller's (mutable) container."""

Again = Callable[[Any], "tuple[list[Any], WriteBack | None] | None"]
"""``again(obj)``: an argument's leaves taken as the last call took them (``CallLeaves.again``)."""


class CallLeaves(NamedTuple):
    """One container flattened for one compiled call (``Adapter.flatten_for_call``).

    Attributes:
        leaves: every leaf, in ``flatten`` order.
        aux: the structure key (as from ``flatten``).
        key: a hashable stand-in for ``aux`` in per-call cache keys (cheaper to hash).
        write_back: for a mutable container, ``write_back(positions, values)`` sets those
            leaves in the caller's object; ``None`` for an immutable one.
        arrays_only: the adapter checked that every leaf is an array.
        again: ``again(obj)`` gives ``(leaves, write_back)`` for a later call with this very
            object, unchanged, else ``None``; ``None`` where the adapter cannot tell cheaply.
    """

    leaves: list[Any]
    aux: Hashable
    key: Hashable
    write_back: WriteBack | None
    arrays_only: bool = False
    again: Again | None = None


class Adapter:
    """How one container type is split into leaves and rebuilt: the base of every adapter.

    A subclass gives ``kind`` and ``flatten``, ``unflatten`` and ``describe``; every other
    capability has a default right for an immutable container, to override where yours
    differs (``mutable`` with ``update``, ``tree_of``, ``mirror``, ``flatten_for_call``).
    ``flatten`` runs on every ``shard_jit`` call and must be cheap; ``describe`` only when a
    plan is made.

    Attributes:
        kind: the container kind recorded in plans and checkpoints (``"nnx.Module"``...).
        numbers_are_arrays: Python numbers among the leaves are rank-0 array leaves, as in
            ``jax.jit`` (default ``False``: static, as in Equinox).
        follows_pytree: the adapter is exactly JAX's flattening of the object (``aux`` its
            ``PyTreeDef``), so descriptions are cached per structure (default ``False``).
        mutable: ``update`` writes into the object it is given (default ``False``).
    """

    kind: str = "container"
    numbers_are_arrays: bool = False
    follows_pytree: bool = False
    mutable: bool = False

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        """All leaves of ``obj`` (array and static) and a hashable structure key."""
        raise NotImplementedError(f"{type(self).__name__}.flatten")

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """Rebuild an object of the original type from ``flatten``'s output."""
        raise NotImplementedError(f"{type(self).__name__}.unflatten")

    def describe(self, obj: Any) -> list[LeafInfo]:
        """One [`LeafInfo`][modelshard.adapters.LeafInfo] per leaf, in ``flatten`` order."""
        raise NotImplementedError(f"{type(self).__name__}.describe")

    def tree_of(self, obj: Any) -> Any:
        """The pytree whose nodes prefix trees of specs match (default: ``obj``)."""
        return obj

    def mirror(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """The container's structure holding ``leaves`` as a tree of values such as
        shardings (default: ``unflatten``)."""
        return self.unflatten(aux, leaves)

    def update(self, obj: Any, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """``obj`` with its leaves replaced by ``leaves``: written into ``obj`` itself when
        ``mutable``, otherwise (the default) a new object from ``unflatten``."""
        return self.unflatten(aux, leaves)

    def flatten_for_call(self, obj: Any) -> CallLeaves:
        """Flatten ``obj`` for one ``shard_jit`` call (default: ``flatten``, and ``update`` to
        write back when ``mutable``); a faster route must give the same leaves and ``aux``."""
        leaves, aux = self.flatten(obj)
        if not self.mutable:
            return CallLeaves(leaves, aux, aux, None)

        def write_back(positions: Sequence[int], values: Sequence[Any]) -> None:
            new = list(leaves)
            for i, v in zip(positions, values, strict=True):
                new[i] = v
            self.update(obj, aux, new)

        return CallLeaves(leaves, aux, aux, write_back)
