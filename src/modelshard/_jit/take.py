"""Flattening ``shard_jit``'s dynamic arguments on every call, as cheaply as each allows."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from .._base import AdapterError
from .._containers import (
    ARRAY_TYPES,
    REGISTRY,
    Adapter,
    Again,
    CallLeaves,
    WriteBack,
    holds_nested,
    is_array,
    nested_adapter,
    numbers_to_arrays,
    split,
)
from .._place import Slot

_lookup = REGISTRY.lookup


class Taken(NamedTuple):
    """One dynamic argument of a call, flattened by its adapter."""

    slot: Slot
    value: Any
    adapter: Adapter
    leaves: list[Any]
    aux: Hashable
    array_index: tuple[int, ...] | None
    arrays: list[Any]
    write_back: WriteBack | None
    again: Again | None = None


def _array_index(leaves: Sequence[Any]) -> tuple[int, ...] | None:
    """Positions of the array leaves, or ``None`` when every leaf is an array."""
    types = set(map(type, leaves))
    if types <= ARRAY_TYPES:
        return None
    for t in types - ARRAY_TYPES:
        is_array(next(x for x in leaves if type(x) is t))  # learns whether t is an array type
    index = tuple(i for i, x in enumerate(leaves) if type(x) in ARRAY_TYPES)
    return None if len(index) == len(leaves) else index


def _taken(slot: Slot, value: Any, adapter: Adapter, call: CallLeaves) -> Taken:
    leaves, index = call.leaves, None
    if not call.arrays_only:
        if adapter.numbers_are_arrays:
            leaves = numbers_to_arrays(leaves)
        index = _array_index(leaves)
    arrays = leaves if index is None else [leaves[i] for i in index]
    return Taken(slot, value, adapter, leaves, call.aux, index, arrays, call.write_back, call.again)


def _flatten_for_call(adapter: Adapter, value: Any, plain: bool) -> CallLeaves:
    try:
        if plain:
            return Adapter.flatten_for_call(adapter, value)
        return adapter.flatten_for_call(value)
    except AdapterError:
        raise
    except Exception:
        split(value)  # raises the AdapterError that names the container
        raise


def take(slot: Slot, value: Any) -> tuple[Taken, Hashable]:
    """One argument flattened, and its structure key for the per-structure cache."""
    adapter = _lookup(type(value))
    call = _flatten_for_call(adapter, value, plain=False)
    if not call.arrays_only and holds_nested(call.leaves):
        # containers inside: each split by its own adapter
        adapter = nested_adapter(adapter)
        call = _flatten_for_call(adapter, value, plain=False)
    taken = _taken(slot, value, adapter, call)
    return taken, (adapter, call.key, static_part(taken.leaves, taken.array_index))


def take_plainly(taken: Taken) -> Taken:
    """``taken`` flattened by the adapter's own ``flatten``, as planning and tracing need."""
    call = _flatten_for_call(taken.adapter, taken.value, plain=True)
    return _taken(taken.slot, taken.value, taken.adapter, call)


def static_part(leaves: list[Any], index: tuple[int, ...] | None) -> tuple[Any, ...] | None:
    """``(position, value)`` of every static leaf, or ``None`` when there are none."""
    if index is None:
        return None
    at = set(index)
    return tuple((i, x) for i, x in enumerate(leaves) if i not in at)
