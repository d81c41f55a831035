"""Adapter for qwix's quantized parameters: paths without the ``array`` wrapper."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

from .adapter_base import Adapter
from .describe import LeafInfo, describe_pytree, flatten_pytree, unflatten_pytree


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
