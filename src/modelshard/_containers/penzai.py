"""Adapters for penzai models (``pz.nn``): mutable variables and named arrays."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from .adapter_base import Adapter
from .describe import LeafInfo, describe_pytree, nested_leaf
from .pytree import PytreeAdapter


@dataclasses.dataclass(frozen=True)
class _VariableAux:
    """A variable's class, label and value structure (its metadata not compared)."""

    cls: type
    label: Hashable
    treedef: Any
    metadata: dict[Any, Any] = dataclasses.field(compare=False, hash=False)


@dataclasses.dataclass(frozen=True)
class PenzaiVariableAdapter(Adapter):
    """``pz.Parameter`` and ``pz.StateVariable``: the leaves of the variable's value.

    Rebuilding makes a new variable with the same label and metadata; ``update``
    writes into the caller's variable instead (penzai variables are mutable).
    """

    kind: str = "penzai.Variable"
    mutable = True

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        # The value may itself be a container of its own (a NamedArray): then it is the one
        # leaf here, for its adapter to split.
        leaves, treedef = jax.tree_util.tree_flatten(obj.value, is_leaf=nested_leaf())
        return leaves, _VariableAux(type(obj), obj.label, treedef, dict(obj.metadata))

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        assert isinstance(aux, _VariableAux)
        value = jax.tree_util.tree_unflatten(aux.treedef, leaves)
        return aux.cls(label=aux.label, value=value, metadata=dict(aux.metadata))

    def describe(self, obj: Any) -> list[LeafInfo]:
        is_nested = nested_leaf()
        if is_nested is not None and is_nested(obj.value):
            return [LeafInfo("")]
        return describe_pytree(obj.value)

    def tree_of(self, obj: Any) -> Any:
        return obj.value

    def update(self, obj: Any, aux: Hashable, leaves: Sequence[Any]) -> Any:
        assert isinstance(aux, _VariableAux)
        obj.value = jax.tree_util.tree_unflatten(aux.treedef, leaves)
        return obj


def named_array_names(x: Any) -> tuple[Any, ...]:
    """The axis name of each dimension of a named array's ``data_array`` (``None`` for
    positional axes).

    Example:
        >>> import jax.numpy as jnp
        >>> from penzai import pz
        >>> named_array_names(pz.nx.wrap(jnp.ones((2, 3, 4))).tag_prefix("batch"))
        ('batch', None, None)
    """
    if hasattr(x, "data_axis_for_name"):  # a NamedArrayView: axes anywhere in the data
        names: list[Any] = [None] * len(x.data_shape)
        for name, axis in x.data_axis_for_name.items():
            names[axis] = name
        return tuple(names)
    named = tuple(x.named_axes)
    return (None,) * (x.data_array.ndim - len(named)) + named


@dataclasses.dataclass(frozen=True)
class NamedArrayAdapter(PytreeAdapter):
    """``pz.nx.NamedArray`` and ``NamedArrayView``: one leaf, its data, named by its axes."""

    kind: str = "penzai.NamedArray"
    follows_pytree = False  # one leaf named by its axes, not JAX's paths

    def describe(self, obj: Any) -> list[LeafInfo]:
        return [LeafInfo("", named_array_names(obj), type(obj).__name__)]
