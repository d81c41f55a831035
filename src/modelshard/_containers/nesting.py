"""The container types that are split by their own adapter wherever they appear.

A registered container whose adapter is not JAX's own flattening (an NNX module, a user
class registered with callbacks, a penzai variable) is one leaf to any other container's
flattening and description: its own adapter splits it (``nested.py``). Which types those
are is the registry's knowledge; this module sits below describing (``describe.py``) and
pytree flattening (``pytree.py``) so that neither imports the registry. The registry
installs its ``nested`` query here once, when it is created (``install``); every reader
asks through ``nested_types``, so lazily registered built-ins are seen as soon as their
library is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

_source: Callable[[], tuple[type, ...]] = tuple
# Per type: whether it is a subclass of a nested type, for the tuple of types it was
# computed against (``isinstance`` against ABC-based framework classes runs Python code;
# flattening asks once per node, about 17,000 times for a 10,000-leaf tree).
_memo: tuple[tuple[type, ...], dict[type, bool]] = ((), {})


def install(source: Callable[[], tuple[type, ...]]) -> None:
    """Make ``source()`` the answer of ``nested_types`` (the registry calls this once)."""
    global _source
    _source = source


def nested_types() -> tuple[type, ...]:
    """The registered container types that are split by their own adapter wherever they
    appear inside another container (those whose adapter is not JAX's own flattening)."""
    return _source()


def nested_leaf(root: Any = None) -> Callable[[Any], bool] | None:
    """An ``is_leaf`` for ``jax.tree_util`` that is true for instances of the nested
    container types (``nested_types``) other than ``root``, or None when there are none.

    The answer is memoised per type while the nested types stay the same.
    """
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
    """``jax.tree_util.tree_flatten(obj)``, stopping at every nested container type
    (``nested_types``) below the root: such a container is one leaf here, for its own
    adapter to split."""
    return jax.tree_util.tree_flatten(obj, is_leaf=nested_leaf(obj))


def unflatten_pytree(aux: Any, leaves: Sequence[Any]) -> Any:
    """The inverse of ``flatten_pytree``."""
    return jax.tree_util.tree_unflatten(aux, leaves)
