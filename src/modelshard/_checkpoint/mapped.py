"""``restore(mapping=)``: a checkpoint of another layout read through a weight mapping, by
default each saved spec carried through its recipe; and an export's one-leaf reads. A
renamed (maybe cast) leaf is read straight into its sharding; other recipes' leaves are
read in the specs their blocks need, one at a time, each device computing its own block.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._base import MappingError
from .._weights import (
    Cast,
    Node,
    Read,
    Spec,
    as_mapping,
    carried_spec,
    keep_value,
    leaf_shardings,
    needed_specs,
    norm_index,
    on_key_data,
    resolve_target,
    unaliased,
)
from .checksum import box_sums, format_sums
from .codec import decode, logical_dtype, parse_dtype, stored_sharding, stored_struct
from .reader import ArrayReader, check_holdable, read_verified, verify_checksums
from .record import LeafRecord
from .sources import Source, stored_view


def _direct(node: Node) -> tuple[str, Any] | None:
    """``(stored path, cast dtype or None)`` when ``node`` is one stored leaf, maybe cast."""
    if isinstance(node, Read):
        return node.key, None
    if isinstance(node, Cast) and isinstance(node.child, Read):
        return node.child.key, node.dtype
    return None


def carried_specs(res: Any, recs: dict[str, LeafRecord]) -> Callable[[str, Any], PartitionSpec]:
    """Each target leaf's saved spec carried through its recipe, else replicated."""
    saved = {k: None if r.spec is None else tuple(r.spec) for k, r in recs.items()}
    carried = {p: carried_spec(node, saved.__getitem__) for p, node in res.recipes.items()}
    return lambda path, leaf: PartitionSpec(*(carried.get(path) or ()))


def _covering(x: jax.Array, device: Any, index: tuple[slice, ...]) -> np.ndarray | None:
    """The block ``index`` of ``x`` as a view of one shard holding it (``device``'s first)."""
    shards = sorted(x.addressable_shards, key=lambda s: s.device != device)
    for sh in shards:
        inner = []
        for want, have, d in zip(index, sh.index, x.shape, strict=True):
            lo, hi, _ = have.indices(d)
            if want.start < lo or want.stop > hi:
                break
            inner.append(slice(want.start - lo, want.stop - lo))
        else:
            return np.asarray(sh.data)[tuple(inner)]
    return None


def _build_on_devices(node: Node, sharding: Any, stored: dict[str, jax.Array]) -> jax.Array:
    """A leaf from its recipe, each device's block computed from its own shards."""
    gathered: dict[str, np.ndarray] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(node.shape).items():
        norm = norm_index(index, node.shape)

        def fetch(key: str, idx: tuple[slice, ...], device: Any = device) -> np.ndarray:
            got = _covering(stored[key], device, idx)
            if got is None:  # no shard holds the block (a spec the recipe cannot follow)
                whole = gathered.get(key)
                if whole is None:
                    whole = gathered[key] = np.asarray(stored[key])
                got = whole[idx]
            return got

        arrays.append(jax.device_put(unaliased(node.read(norm, fetch)), device))
    return jax.make_array_from_single_device_arrays(node.shape, sharding, arrays)


def _resolved(wm: Any, source: Source, like: Any, dtype: Any) -> Any:
    """``resolve_target`` of the mapping against the checkpoint's leaves."""
    table = {r.path: (r.shape, logical_dtype(r)) for r in source.record.leaves}
    return resolve_target(wm, table, like, dtype)


def restore_mapped(
    source: Source,
    *,
    like: Any,
    mapping: Any,
    specs: Any,
    mesh: Any,
    dtype: Any,
    verify: bool,
) -> Any:
    """The body of ``restore`` when a mapping is given (see [`restore`][modelshard.restore])."""
    wm = as_mapping(mapping, split_dots=False)
    try:
        like, flat, res = _resolved(wm, source, like, dtype)
    except MappingError as first:
        # rules for Orbax's own names of its boxes (``kernel/value``) resolve against its keys
        view = stored_view(source)
        if view is source:
            raise
        try:
            like, flat, res = _resolved(wm, view, like, dtype)
        except MappingError:
            raise first from None
        source = view
    recs = source.record.by_path()
    if mesh is not None and specs is None:
        specs = carried_specs(res, recs)
    shardings = leaf_shardings(like, flat, specs, mesh)
    by_path = dict(zip(flat.paths, shardings, strict=True))
    uses = collections.Counter(k for node in res.recipes.values() for k in node.reads())
    check_holdable(source, list(uses))

    def read(targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
        return read_verified(source, targets, verify)

    direct = {p: d for p, n in res.recipes.items() if (d := _direct(n)) and uses[d[0]] == 1}
    targets = {
        k: stored_struct(recs[k], recs[k].stored_sharding(by_path[p]))
        for p, (k, _) in direct.items()
    }
    values = read(targets) if targets else {}

    # the others in the order of the first stored leaf each reads: each read once, then dropped
    rank = {k: i for i, k in enumerate(recs)}
    rest = sorted(
        (p for p in res.recipes if p not in direct),
        key=lambda p: min(rank[k] for k in res.recipes[p].reads()),
    )
    plans: dict[str, tuple[Node, Any, LeafRecord | None]] = {}
    needs: dict[str, list[Spec]] = {}
    for path in rest:
        plans[path] = plan = _executed(res.recipes[path], by_path[path], recs)
        node, sharding, _ = plan
        if isinstance(sharding, NamedSharding):
            needed_specs(node, tuple(sharding.spec), needs)
    on_mesh: dict[str, jax.Array] = {}
    remaining = dict(uses)
    built: dict[str, Any] = {}
    for path in rest:
        node, sharding, keys = plans[path]
        for k in node.reads():
            if k not in on_mesh:
                on_mesh[k] = _read_stored(read, k, recs[k], needs.get(k), sharding)
        x = _build_on_devices(node, sharding, on_mesh)
        built[path] = x if keys is None else decode(x, keys)
        for k in node.reads():
            remaining[k] -= 1
            if remaining[k] == 0:
                del on_mesh[k]

    out = []
    for path, x, s in zip(flat.paths, flat.arrays, shardings, strict=True):
        if path in direct:
            key, cast = direct[path]
            v = decode(values.pop(key), recs[key])
            out.append(v if cast is None else v.astype(cast))
        elif path in built:
            out.append(built.pop(path))
        else:  # kept: like's value
            out.append(keep_value(path, x, s))
    return flat.update_inplace(out)


def _executed(
    node: Node, sharding: Any, recs: dict[str, LeafRecord]
) -> tuple[Node, Any, LeafRecord | None]:
    """``(recipe over the stored arrays, its sharding, the record of a key it reads)``: a
    typed key leaf is computed on its key data, then wrapped."""
    rec = recs[node.reads()[0]]
    if rec.key_impl is None:
        return node, sharding, None
    data = on_key_data(node, lambda k: (recs[k].stored_shape, parse_dtype(recs[k].stored_dtype)))
    return data, stored_sharding(sharding, len(data.shape) - len(node.shape)), rec


def _read_stored(
    read: Callable[[dict[str, jax.ShapeDtypeStruct]], dict[str, Any]],
    key: str,
    rec: LeafRecord,
    wanted: list[Spec] | None,
    sharding: Any,
) -> jax.Array:
    """One stored leaf read onto the target's mesh in the spec its readers need (replicated
    where they disagree), decoded (key data left to the recipe)."""
    if isinstance(sharding, NamedSharding):
        specs = set(wanted or [])
        spec = PartitionSpec(*specs.pop()) if len(specs) == 1 else PartitionSpec()
        target = NamedSharding(sharding.mesh, spec)
    else:
        target = sharding
    got = read({key: stored_struct(rec, target)})[key]
    return got if rec.key_impl is not None else decode(got, rec)


def host_leaves(
    source: Source, *, verify: bool = True
) -> tuple[dict[str, tuple[tuple[int, ...], Any]], Callable[[str], np.ndarray]]:
    """A checkpoint's array leaves (path -> shape, dtype; no typed keys) and ``load(path)``:
    that one leaf read to the host and verified (an export holds one leaf at a time)."""
    recs = source.record.by_path()
    table = {p: (r.shape, logical_dtype(r)) for p, r in recs.items() if r.key_impl is None}

    def load(path: str) -> np.ndarray:
        rec = recs[path]
        # a context of its own: a shared one keeps its cache of every leaf read so far
        reader = ArrayReader(source, rec)
        bits = np.asarray(reader(tuple(slice(0, d) for d in rec.stored_shape)))
        if verify and rec.checksum is not None:
            verify_checksums(source, {path: bits}, {path: format_sums(*box_sums(bits))})
        return decode(bits, rec)

    return table, load
