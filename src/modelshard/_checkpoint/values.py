"""Leaves that are not arrays: a state's Python values (``record.VALUE_TYPES``: an epoch, a
run name) are kept in the record with their types; code (an activation function) is never
stored and comes from ``like``; any other object is refused by ``save`` before it writes."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._base import CheckpointError, PartialRestoreWarning, caller_stacklevel, format_path
from .._containers import Flat
from .codec import is_key
from .record import VALUE_TYPES, Record, ValueRecord, some, value_text
from .storage import MAX_METADATA_BYTES, storage_key

MAX_VALUES_BYTES = MAX_METADATA_BYTES // 4
"""The most bytes of JSON a save's values may take in its record (its metadata gets half
of ``MAX_METADATA_BYTES``), so the record can be read back."""

Diff = list[tuple[str, str, str]]  # (what, path, detail), as restoring.diff's

_NAMES = ", ".join(t.__name__ for t in VALUE_TYPES if t is not type(None)) + " and None"


def is_code(x: Any) -> bool:
    """Whether the leaf ``x`` is code (a function, a class, a callable object)."""
    return type(x) not in VALUE_TYPES and callable(x)


def _why_not(x: Any) -> str:
    t = type(x)
    name = f"a {t.__module__}.{t.__qualname__}"
    for base in VALUE_TYPES:
        if isinstance(x, base) and base is not type(None):
            return f"{name}, a subclass of {base.__name__} (convert it: {base.__name__}(x))"
    return name


def none_paths(flat: Flat) -> list[str]:
    """Paths of a plain pytree's ``None`` entries (no leaf to JAX), kept by the record so a
    restore without ``like`` gives them back, as Orbax does."""
    if not flat.adapter.follows_pytree:
        return []
    found, _ = jax.tree_util.tree_flatten_with_path(flat.obj, is_leaf=lambda x: x is None)
    return [path for keys, x in found if x is None and (path := format_path(keys))]


def saved_values(flat: Flat) -> list[ValueRecord]:
    """The values of ``flat`` the record stores; CheckpointError naming any other object."""
    values, refused = [], []
    for _, path, x in flat.statics():
        tag = VALUE_TYPES.get(type(x))
        if tag is not None:
            values.append(ValueRecord(path, storage_key(path), tag, x))
        elif not is_code(x):
            refused.append(f"  {path or '<root>'}: {_why_not(x)}")
    values += [ValueRecord(p, storage_key(p), "none", None) for p in none_paths(flat)]
    if refused:
        n = len(refused)
        raise CheckpointError(
            f"cannot save {n} lea{'ves' if n != 1 else 'f'} (nothing was written): a "
            f"checkpoint holds arrays and the values {_NAMES}, and "
            f"{'these are' if n != 1 else 'this is'} neither:\n"
            + "\n".join(refused)
            + "\nhint: make each an array or one of those values; or, if it is part of the "
            "model's definition, a static field (eqx.field(static=True), "
            "flax.struct.field(pytree_node=False), an NNX attribute that is not a Variable), "
            "which is not saved and comes from like= on restore."
        )
    size = len(json.dumps([v.to_json() for v in values]))
    if size > MAX_VALUES_BYTES:
        largest = sorted(values, key=lambda v: -len(json.dumps(v.to_json())))[:3]
        raise CheckpointError(
            f"cannot save: the state's Python values take {size} bytes of JSON in the record, "
            f"more than {MAX_VALUES_BYTES}; the largest: "
            + ", ".join(f"{v.path or '<root>'} ({v.type})" for v in largest)
            + ". Store large data as arrays (np.frombuffer for bytes)."
        )
    return values


def restored_values(
    flat: Flat, record: Record, where: Any = ""
) -> tuple[dict[int, Any], Diff, Diff, Diff]:
    """``(position -> value, missing, extra, changed)``: like's values replaced by the saved
    ones of their types; a record without values keeps like's, and a warning names them."""
    if record.values is None:
        kept = [p for _, p, x in flat.statics() if not is_code(x)]
        if kept:
            warnings.warn(
                f"checkpoint {where} holds no Python values (written before modelshard saved "
                f"them, or by plain Orbax): {len(kept)} kept like's values: "
                + some([p or "<root>" for p in kept], 5),
                UserWarning,
                stacklevel=caller_stacklevel(),
            )
        return {}, [], [], []
    saved = {v.path: v for v in record.values}
    out: dict[int, Any] = {}
    missing: Diff = []
    changed: Diff = []
    seen = set()
    for i, path, x in flat.statics():
        if is_code(x):
            continue
        here = VALUE_TYPES.get(type(x)) or type(x).__name__
        v = saved.get(path)
        if v is None:
            missing.append(("missing", path, f"{here} (in the target, not in the checkpoint)"))
            continue
        seen.add(path)
        if v.type != here:
            was = f"checkpoint {v.type} {value_text(v.value)}"
            changed.append(("changed", path, f"{was} -> target {here}"))
        else:
            out[i] = v.value
    seen.update(none_paths(flat))  # like's own Nones: its structure, given back as it is
    extra: Diff = [
        ("extra", p, f"{v.type} {value_text(v.value)} (in the checkpoint, not in the target)")
        for p, v in saved.items()
        if p not in seen
    ]
    return out, missing, extra, changed


_NUMBER_KINDS = {"bool": "b", "int": "biu", "float": "f", "complex": "c"}


def values_as_arrays(paths: list[str], arrays: list[Any], record: Record) -> dict[str, np.ndarray]:
    """The record's numbers ``like`` holds as rank-0 arrays (``eval_shape`` of an ``int``):
    path -> the value in ``like``'s dtype, where its kind holds the value's type."""
    saved = {v.path: v for v in record.values or ()}
    out = {}
    for path, x in zip(paths, arrays, strict=True):
        v = saved.get(path)
        if v is None or tuple(x.shape) != () or v.type not in _NUMBER_KINDS or is_key(x.dtype):
            continue
        kind = np.dtype(x.dtype).kind
        if kind in _NUMBER_KINDS[v.type] or (v.type == "int" and kind in "fc"):
            out[path] = np.asarray(v.value, dtype=x.dtype)
    return out


def warn_partial(where: Any, n: int, restored: Sequence[str], missing: Diff, extra: Diff) -> None:
    """A ``PartialRestoreWarning`` naming the leaves a partial restore did not restore (``n``:
    the target's array leaves; ``restored``: those read from the checkpoint)."""
    kept = [p for _, p, _ in missing]
    skipped = [p for _, p, _ in extra]
    parts = [f"restored {len(restored)} of the target's {n} leaves from {where}"]
    if kept:
        parts.append(f"{len(kept)} kept like's values (not in the checkpoint): {some(kept, 5)}")
    if skipped:
        parts.append(f"{len(skipped)} checkpoint leaves not restored: {some(skipped, 5)}")
    warnings.warn(
        PartialRestoreWarning(
            "; ".join(parts) + " (partial=True)", restored=restored, kept=kept, skipped=skipped
        ),
        stacklevel=caller_stacklevel(),
    )
