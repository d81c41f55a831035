"""Adapter for qwix's quantized parameters: paths without the ``array`` wrapper."""

from __future__ import annotations

import dataclasses
from typing import Any

from .describe import LeafInfo, describe_pytree
from .pytree import PytreeAdapter


@dataclasses.dataclass(frozen=True)
class QwixWithAuxAdapter(PytreeAdapter):
    """``qwix``'s ``WithAux``: the leaves of the array it wraps, named without ``array``."""

    kind: str = "qwix.WithAux"
    follows_pytree = False  # its paths are not JAX's

    def describe(self, obj: Any) -> list[LeafInfo]:
        return describe_pytree(obj.array)

    def tree_of(self, obj: Any) -> Any:
        return obj.array
