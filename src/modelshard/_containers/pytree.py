"""The plain-pytree plug-in, and user classes registered with callbacks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax

from .._base import AdapterError
from .adapter_base import Adapter
from .describe import LeafInfo, describe_pytree, nested_leaf


@dataclasses.dataclass(frozen=True)
class PytreeAdapter(Adapter):
    """The adapter for anything JAX can flatten (the default for unregistered types).

    A subclass that changes ``flatten`` or ``describe`` must set ``follows_pytree = False``.

    Attributes:
        kind: the name recorded for this container kind (``"pytree"``, ``"optax"``, ...).
        numbers_are_arrays: Python numbers among the leaves are rank-0 arrays (on for
            Flax's ``TrainState``, whose ``step`` is state); off, they are configuration.
    """

    kind: str = "pytree"
    numbers_are_arrays: bool = False
    follows_pytree = True

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        # a registered container below the root is one leaf here, split by its own adapter
        return jax.tree_util.tree_flatten(obj, is_leaf=nested_leaf(obj))

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(aux, leaves)  # type: ignore[arg-type]

    def describe(self, obj: Any) -> list[LeafInfo]:
        return describe_pytree(obj)


# Callbacks per user type; the JAX pytree registration (made once) dispatches through this,
# so ``override=True`` can replace them.
_CALLBACKS: dict[
    type, tuple[Callable[[Any], Mapping[str, Any]], Callable[[Mapping[str, Any]], Any]]
] = {}


def callbacks_adapter(
    ty: type,
    flatten: Callable[[Any], Mapping[str, Any]],
    unflatten: Callable[[Mapping[str, Any]], Any],
    kind: str,
) -> Adapter:
    """A ``PytreeAdapter`` for ``ty`` through replaceable callbacks (JAX registers it once)."""

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
        children = _CALLBACKS[ty][0](obj)
        if not isinstance(children, Mapping):
            raise AdapterError(
                f"flatten for {ty.__name__} must return a mapping of child name -> child, "
                f"got {type(children).__name__}."
            )
        names = tuple(str(k) for k in children)
        return [(jax.tree_util.GetAttrKey(n), children[n]) for n in names], names

    def unflatten_pytree(names: tuple[str, ...], children: Any) -> Any:
        return _CALLBACKS[ty][1](dict(zip(names, children, strict=True)))

    instead = f"register it with an adapter instead: register_container({ty.__name__}, "
    instead += f"modelshard.adapters.PytreeAdapter({kind!r}))."
    if ty not in _CALLBACKS and issubclass(ty, dict | list | tuple):
        base = ty.__mro__[1].__name__
        raise AdapterError(
            f"{ty.__name__} is a {base} subclass, which JAX already flattens; {instead}"
        )
    if ty not in _CALLBACKS:
        try:
            jax.tree_util.register_pytree_with_keys(ty, flatten_with_keys, unflatten_pytree)
        except ValueError as e:
            owns = f"{ty.__name__} is already a JAX pytree, so JAX owns its flattening"
            raise AdapterError(f"{owns}; {instead}") from e
    _CALLBACKS[ty] = (flatten, unflatten)
    return PytreeAdapter(kind)
