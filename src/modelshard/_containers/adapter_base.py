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
        key: a hashable stand-in for ``aux`` in per-call cache keys (``aux`` itself by
            default; an adapter whose ``aux`` is costly to hash may give an interned object).
        write_back: for a mutable container, ``write_back(positions, values)`` sets the
            leaves at those ``flatten`` positions to ``values`` in the caller's object;
            ``None`` for an immutable one.
        arrays_only: the adapter has checked that every leaf is an array (a type in
            ``ARRAY_TYPES``), so the caller need not look for static or nested leaves.
        again: for a container that a later call may take again without flattening,
            ``again(obj)`` gives ``(leaves, write_back)`` when ``obj`` is this very object
            with the same ``key`` and every leaf still an array, else ``None``; ``None``
            (the default) when the adapter cannot tell cheaply.
    """

    leaves: list[Any]
    aux: Hashable
    key: Hashable
    write_back: WriteBack | None
    arrays_only: bool = False
    again: Again | None = None


class Adapter:
    """How one container type is split into leaves and rebuilt: the base of every adapter.

    A subclass must give ``kind`` and the three methods ``flatten``, ``unflatten`` and
    ``describe``. Everything else modelshard asks of a container is a *capability* declared
    here with a default that is right for an immutable container whose paths come from
    ``describe``; override the ones your container differs in:

    - ``numbers_are_arrays``: Python numbers among the leaves are rank-0 array leaves.
    - ``follows_pytree``: ``flatten``/``unflatten``/``describe`` are exactly JAX's
      flattening of the object (``aux`` is its ``PyTreeDef``), so descriptions can be cached
      per structure and ``shard_jit`` may gather leaves as JAX does.
    - ``mutable`` with ``update``: the container is changed in place (an NNX
      module): ``shard``, ``constrain`` and ``shard_jit`` write new values into the caller's
      object instead of returning a copy only.
    - ``tree_of``: the pytree whose structure canonical paths follow, for prefix trees.
    - ``mirror``: what a tree of shardings or plans for this container looks like.
    - ``flatten_for_call``: flattening on ``shard_jit``'s per-call path.

    ``flatten`` is on the hot path of every ``shard_jit`` call and must be cheap;
    ``describe`` (paths and metadata) runs only when a plan is made.

    Attributes:
        kind: the container kind recorded in plans and checkpoints (``"nnx.Module"``...).
        numbers_are_arrays: treat Python numbers (``bool``, ``int``, ``float``,
            ``complex``) among the leaves as rank-0 array leaves, as ``jax.jit`` does,
            instead of static leaves (default ``False``, as in Equinox).
        follows_pytree: the adapter is JAX's own flattening of the object (default
            ``False``).
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
        """The pytree whose structure the canonical paths follow (default: ``obj``).

        Prefix trees given for the container (one spec per subtree) are matched against
        this tree's nodes.
        """
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
        """Flatten ``obj`` for one ``shard_jit`` call.

        The default is ``flatten``, with a ``write_back`` through ``update`` when
        ``mutable``. An adapter may override it with a faster route that gives the same
        leaves and ``aux``.
        """
        leaves, aux = self.flatten(obj)
        if not self.mutable:
            return CallLeaves(leaves, aux, aux, None)

        def write_back(positions: Sequence[int], values: Sequence[Any]) -> None:
            new = list(leaves)
            for i, v in zip(positions, values, strict=True):
                new[i] = v
            self.update(obj, aux, new)

        return CallLeaves(leaves, aux, aux, write_back)
