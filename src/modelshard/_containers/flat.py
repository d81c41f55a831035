"""A container split by its adapter: leaves, structure, paths, and rebuilding it."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from .._base import AdapterError
from .adapter_base import Adapter
from .describe import ARRAY_TYPES, LeafInfo, children_of, describe_cached, is_array
from .nested import flatten_nested
from .registry import get_adapter


@dataclasses.dataclass
class Flat:
    """A container split into leaves, ready for planning and rebuilding.

    Attributes:
        obj: the original container.
        adapter: the adapter that split it.
        leaves: every leaf, in adapter order (array and static).
        aux: the hashable structure key from the adapter.
        array_index: positions of the array leaves within ``leaves``.
    """

    obj: Any
    adapter: Adapter
    leaves: list[Any]
    aux: Hashable
    array_index: tuple[int, ...]
    _infos: list[LeafInfo] | None = None

    @property
    def kind(self) -> str:
        return self.adapter.kind

    @property
    def arrays(self) -> list[Any]:
        """The array leaves, in order."""
        if len(self.array_index) == len(self.leaves):
            return list(self.leaves)
        return [self.leaves[i] for i in self.array_index]

    @property
    def infos(self) -> list[LeafInfo]:
        """Path and metadata of every array leaf (computed on first use)."""
        if self._infos is None:
            described = self._described()
            if len(described) != len(self.leaves):
                raise AdapterError(
                    f"adapter {self.adapter!r} described {len(described)} leaves but "
                    f"flattened {len(self.leaves)}; describe() and flatten() must agree."
                )
            if len(self.array_index) == len(described):
                self._infos = described  # may be shared with the structure cache: read-only
            else:
                self._infos = [described[i] for i in self.array_index]
        return self._infos

    def _described(self) -> list[LeafInfo]:
        if self.adapter.follows_pytree:  # paths follow the JAX structure: cached
            return describe_cached(self.obj, self.aux)
        return self.adapter.describe(self.obj)

    @property
    def paths(self) -> list[str]:
        return [info.path for info in self.infos]

    def children(self, components: Sequence[str]) -> list[str] | None:
        """Names of the children of the node at ``components`` (``None``: no such node);
        empty subtrees count, so prefix trees mirroring the structure line up."""
        node = self.adapter.tree_of(self.obj)
        for c in components:
            kids = children_of(node)
            if c not in kids:
                return None
            node = kids[c]
        return list(children_of(node))

    def statics(self) -> list[tuple[int, str, Any]]:
        """``(position in leaves, path, value)`` of every leaf that is not an array
        (Python numbers and strings, functions, other objects), in order."""
        at = set(self.array_index)
        if len(at) == len(self.leaves):
            return []
        described = zip(self._described(), self.leaves, strict=True)
        return [(i, info.path, x) for i, (info, x) in enumerate(described) if i not in at]

    def rebuild(
        self,
        arrays: Sequence[Any],
        *,
        mirror: bool = False,
        statics: Mapping[int, Any] | None = None,
    ) -> Any:
        """The same container with its array leaves replaced by ``arrays`` (``mirror``: in the
        form of trees of shardings, ``Adapter.mirror``; ``statics``: other leaves by position)."""
        leaves = self._with(arrays)
        for i, v in (statics or {}).items():
            leaves[i] = v
        if mirror:
            return self.adapter.mirror(self.aux, leaves)
        return self.adapter.unflatten(self.aux, leaves)

    def update_inplace(self, arrays: Sequence[Any]) -> Any:
        """Rebuild, writing into the original object where its adapter is ``mutable`` (NNX)."""
        return self.adapter.update(self.obj, self.aux, self._with(arrays))

    def hidden_arrays(self) -> list[tuple[str, type, list[str]]]:
        """``(path, type, attribute names)`` of static leaves holding arrays one level down."""
        at = set(self.array_index)
        found = [
            (i, x, attrs)
            for i, x in enumerate(self.leaves)
            if i not in at and (attrs := _holds_arrays(x))
        ]
        if not found:
            return []
        try:
            paths = [info.path for info in self.adapter.describe(self.obj)]
        except Exception:  # a path is a courtesy here; the position still names the leaf
            paths = []
        return [
            (paths[i] if i < len(paths) else f"<leaf {i}>", type(x), attrs) for i, x, attrs in found
        ]

    def _with(self, arrays: Sequence[Any]) -> list[Any]:
        leaves = list(self.leaves)
        for i, v in zip(self.array_index, arrays, strict=True):
            leaves[i] = v
        return leaves


def split(obj: Any) -> Flat:
    """Split any registered container into a [`Flat`][modelshard.adapters.Flat].

    Example:
        >>> import jax.numpy as jnp
        >>> import modelshard as ms
        >>> flat = ms.adapters.split({"w": jnp.ones((2, 3)), "act": print})
        >>> flat.paths, flat.kind
        (['w'], 'pytree')
    """
    adapter, leaves, aux = flatten_nested(get_adapter(obj), obj)
    # every leaf of every plan: one set of known array types decides most containers
    if set(map(type, leaves)) <= ARRAY_TYPES:
        index = tuple(range(len(leaves)))
    else:
        index = tuple(i for i, leaf in enumerate(leaves) if is_array(leaf))
    return Flat(obj, adapter, leaves, aux, index)


def _holds_arrays(x: Any) -> list[str]:
    """Names of ``x``'s attributes that are arrays or plain containers of arrays."""
    try:
        attrs = vars(x)
    except TypeError:  # no __dict__: numbers, strings, functions' builtins, ...
        return []
    if callable(x) and not attrs:
        return []
    out = []
    for k, v in attrs.items():
        vals = v.values() if type(v) is dict else v if type(v) in (list, tuple) else (v,)
        if any(is_array(u) for u in vals):
            out.append(str(k))
    return out
