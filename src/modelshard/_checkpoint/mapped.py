"""``restore(..., mapping=...)``: an Orbax checkpoint of another layout, read through a
weight mapping (``modelshard._weights``).

The checkpoint's leaves are the stored tensors (named by their canonical paths,
``params/layers/mlp/kernel``); the mapping resolves them against the target's leaves
with every problem reported at once. A target leaf that is one stored leaf renamed (and
perhaps cast) is read by Orbax straight into its planned sharding, as a plain restore
reads it. Any other recipe (a transpose, a reshape, a stack of layers, one layer of a
scanned leaf) reads each stored leaf it needs to this host once, in full, builds the
target leaves from it, then drops it before the next: host memory stays near the largest
stored leaf beyond the restored state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from .._weights import as_mapping
from .._weights import transforms as T
from .._weights.load import build_leaf, keep_value, leaf_shardings, resolve_target
from .locate import Source
from .read import check_holdable, finish_leaf, read_checked, verify_checksums
from .record import parse_dtype


def _direct(node: T.Node) -> tuple[str, Any] | None:
    """``(stored path, cast dtype or None)`` when ``node`` is one stored leaf, maybe cast."""
    if isinstance(node, T.Read):
        return node.key, None
    if isinstance(node, T.Cast) and isinstance(node.child, T.Read):
        return node.child.key, node.dtype
    return None


def restore_mapped(
    source: Source,
    *,
    like: Any,
    mapping: Any,
    specs: Any,
    mesh: Any,
    dtype: Any,
    verify: bool,
    progress: Callable[[int, int], None] | None = None,
) -> Any:
    """The body of ``restore`` when a mapping is given (see [`restore`][modelshard.restore])."""
    wm = as_mapping(mapping, split_dots=False)
    recs = source.record.by_path()
    table = {p: (r.shape, parse_dtype(r.dtype)) for p, r in recs.items() if r.key_impl is None}
    like, flat, res = resolve_target(wm, table, like, dtype)
    shardings = leaf_shardings(like, flat, specs, mesh)
    uses: dict[str, int] = {}
    for node in res.recipes.values():
        for k in node.reads():
            uses[k] = uses.get(k, 0) + 1
    check_holdable(source, list(uses))

    direct: dict[str, tuple[str, Any]] = {}
    for path, node in res.recipes.items():
        d = _direct(node)
        if d is not None and uses[d[0]] == 1:
            direct[path] = d
    by_path = dict(zip(flat.paths, shardings, strict=True))
    targets_direct = {}
    for path, (key, _) in direct.items():
        rec = recs[key]
        targets_direct[key] = jax.ShapeDtypeStruct(
            rec.stored_shape, parse_dtype(rec.stored_dtype), sharding=by_path[path]
        )
    values = read_checked(source, targets_direct) if targets_direct else {}
    if verify and values:
        verify_checksums(source, values)

    # The other leaves, in the order of the first stored leaf each reads, so every stored
    # leaf is read once and dropped as soon as no later leaf needs it.
    order = list(recs)
    rank = {k: i for i, k in enumerate(order)}
    rest = sorted(
        (p for p in res.recipes if p not in direct),
        key=lambda p: min(rank[k] for k in res.recipes[p].reads()),
    )
    host: dict[str, np.ndarray] = {}
    remaining = dict(uses)
    device0 = SingleDeviceSharding(jax.local_devices()[0])

    def fetch_for(cache: dict[Any, np.ndarray]) -> T.Fetch:
        def fetch(key: str, index: tuple[slice, ...]) -> np.ndarray:
            whole = host.get(key)
            if whole is None:
                rec = recs[key]
                target = jax.ShapeDtypeStruct(
                    rec.stored_shape, parse_dtype(rec.stored_dtype), sharding=device0
                )
                got = read_checked(source, {key: target})
                if verify:
                    verify_checksums(source, got)
                whole = host[key] = np.asarray(finish_leaf(got[key], rec, None))
            return whole[index]

        return fetch

    built: dict[str, Any] = {}
    for path in rest:
        node = res.recipes[path]
        built[path] = build_leaf(node, by_path[path], fetch_for)
        for k in node.reads():
            remaining[k] -= 1
            if remaining[k] == 0:
                host.pop(k, None)

    out = []
    for path, x, s in zip(flat.paths, flat.arrays, shardings, strict=True):
        if path in direct:
            key, cast = direct[path]
            v = finish_leaf(values.pop(key), recs[key], None)
            out.append(v if cast is None else v.astype(cast))
        elif path in built:
            out.append(built.pop(path))
        else:  # kept: like's value
            out.append(keep_value(path, x, s))
    return flat.update_inplace(out)
