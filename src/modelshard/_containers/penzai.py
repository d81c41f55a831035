"""Adapters for penzai models (``pz.nn``): mutable variables and named arrays.

A penzai model is a pytree whose parameters are *variables*: mutable ``pz.Parameter`` /
``pz.StateVariable`` objects that are deliberately not pytree nodes (JAX sees each as one
opaque leaf). Their values are usually ``pz.nx.NamedArray``\\ s, whose axis names are the
model's own logical vocabulary (``"embedding"``, ``"neurons"``, ``"heads"``).

Two adapters, registered lazily once penzai is imported (the registry's table), let modelshard see through both:

- ``PenzaiVariableAdapter`` splits a variable into the leaves of its value; the
  variable's own path is the path of its value (``blocks/0/attn/query/weights``, no
  ``/value``). It is mutable: ``update`` writes new values into the caller's variable.
- ``NamedArrayAdapter`` names a named array's data by its axis names: positional axes
  first (``None``), then the named axes in order, so ``Rules(logical={"embedding": "data",
  "neurons": "model"})`` shards it as penzai's own ``name_to_name_sharding`` would.

Neither module imports penzai at import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from .adapter_base import Adapter
from .describe import LeafInfo, describe_pytree
from .nesting import nested_leaf


@dataclasses.dataclass(frozen=True)
class _VariableAux:
    """A variable's structure: its class, label and value structure (its metadata dict,
    which may be unhashable, travels along without taking part in equality)."""

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
class NamedArrayAdapter(Adapter):
    """``pz.nx.NamedArray`` and ``NamedArrayView``: one leaf, its data, named by its axes."""

    kind: str = "penzai.NamedArray"

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        leaves, treedef = jax.tree_util.tree_flatten(obj)
        return leaves, treedef

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(aux, leaves)  # type: ignore[arg-type]

    def describe(self, obj: Any) -> list[LeafInfo]:
        return [LeafInfo("", named_array_names(obj), type(obj).__name__)]
