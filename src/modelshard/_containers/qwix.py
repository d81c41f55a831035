"""Adapter for qwix's quantized parameters: paths without the ``array`` wrapper.

qwix (post-training quantization for Flax) replaces a weight by ``WithAux(QArray(qvalue,
scale, zero_point), how)``. JAX opens it as a pytree, which would name the quantized value
``kernel/array/qvalue``; this adapter, registered lazily once qwix is imported, names it
``kernel/qvalue`` (and ``kernel/scale``, ``kernel/zero_point``). The metadata boxes qwix puts
around each part (the weight's logical axis names, with the scale's reduced axes already set to
``None`` by qwix) reach the rule engine unchanged, so a quantized linen or NNX model plans
exactly as Flax's own ``logical_to_mesh_sharding`` shards it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

from .adapter_base import Adapter
from .describe import LeafInfo, describe_pytree
from .nesting import flatten_pytree, unflatten_pytree


@dataclasses.dataclass(frozen=True)
class QwixWithAuxAdapter(Adapter):
    """``qwix``'s ``WithAux``: the leaves of the array it wraps, named without ``array``."""

    kind: str = "qwix.WithAux"

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        return flatten_pytree(obj)

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        return unflatten_pytree(aux, leaves)

    def describe(self, obj: Any) -> list[LeafInfo]:
        return describe_pytree(obj.array)

    def tree_of(self, obj: Any) -> Any:
        return obj.array
