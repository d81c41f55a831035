"""The container types that are split by their own adapter wherever they appear."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

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


def flatten_pytree(obj: Any) -> tuple[list[Any], Any]:
    """``jax.tree_util.tree_flatten(obj)``, a nested container below the root one leaf."""
    return jax.tree_util.tree_flatten(obj, is_leaf=nested_leaf(obj))


def unflatten_pytree(aux: Any, leaves: Sequence[Any]) -> Any:
    """The inverse of ``flatten_pytree``."""
    return jax.tree_util.tree_unflatten(aux, leaves)
