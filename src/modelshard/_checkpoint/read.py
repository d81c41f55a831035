"""Reading checkpoints: ``restore``, every leaf read straight into its planned sharding.

Reads go through ``reader.py`` with a cap on the bytes in flight, are verified against the
record's checksums (each leaf's checksum starts on the host as soon as it is read, while
the next leaves are read), and fail with a [`CheckpointError`][modelshard.CheckpointError]
that names the damaged leaves and, where it can be told, the file at fault.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from .._base import (
    CheckpointError,
    canonical_dtype,
    dtype_name,
    is_abstract,
    make_mesh,
)
from .._containers import split
from .._place import place, plan
from .checksum import Checksums, checksum_mismatch_message, checksums
from .codec import decode, encode, is_key, key_impl, parse_dtype, stored_struct
from .mismatch import diff, mismatch_message, warn_partial
from .reader import read_checked
from .record import LeafRecord, Record
from .sources import Source, abstract_like, stored_view
from .values import restored_values, values_as_arrays


def concrete_mesh(mesh: Any) -> Any:
    """``mesh``, or for an ``AbstractMesh`` a concrete mesh of its shape and axis types."""
    if is_abstract(mesh):
        return make_mesh(dict(mesh.shape), axis_types=tuple(mesh.axis_types))
    return mesh


def check_cast(dtype: Any) -> Any:
    """``dtype`` (the cast of ``restore(dtype=)``/``reshard``) as a JAX dtype, or None:
    only a floating-point dtype this process can hold (float64 needs x64) is accepted."""
    if dtype is None:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise CheckpointError(f"dtype={dtype!r} is not a dtype.") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise CheckpointError(
            f"dtype={dtype_name(dt)} is not a floating-point dtype: dtype= casts the "
            "floating-point leaves (integers, booleans and PRNG keys keep theirs); casting "
            "weights to an integer dtype would silently destroy them."
        )
    if canonical_dtype(dt) != dt:
        raise CheckpointError(
            f"dtype={dtype_name(dt)} needs jax_enable_x64, which is off in this process "
            f"(JAX would hold {dtype_name(canonical_dtype(dt))})."
        )
    return dt


def check_holdable(source: Source, paths: Sequence[str]) -> None:
    """CheckpointError listing every leaf of ``paths`` whose stored dtype this process
    cannot hold (64-bit dtypes with x64 off): read anyway it would come back narrowed
    (int64 values above 2**31 wrapped) and fail its checksum as if damaged."""
    recs = source.record.by_path()
    bad = []
    for p in paths:
        dt = parse_dtype(recs[p].stored_dtype)
        if canonical_dtype(dt) != dt:
            bad.append(f"  {p or '<root>'}: {recs[p].stored_dtype}{list(recs[p].stored_shape)}")
    if bad:
        n = len(bad)
        raise CheckpointError(
            f"cannot restore {n} lea{'ves' if n != 1 else 'f'} of {source.path} in this "
            "process: their 64-bit dtypes need jax_enable_x64, which is off (the checkpoint "
            "is fine):\n"
            + "\n".join(bad)
            + "\nhint: jax.config.update('jax_enable_x64', True) before using JAX."
        )


def _default_sharding(x: Any, rec: LeafRecord, record: Record) -> Any:
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding):
        return NamedSharding(concrete_mesh(s.mesh), s.spec) if is_abstract(s.mesh) else s
    if s is not None and not isinstance(x, jax.ShapeDtypeStruct | np.ndarray):
        return s
    sizes = record.mesh_sizes()
    if sizes and rec.spec is not None and int(np.prod(list(sizes.values()))) == jax.device_count():
        return NamedSharding(make_mesh(sizes, axis_types=record.mesh_axis_types()), rec.spec)
    return SingleDeviceSharding(jax.local_devices()[0])


def _checked(source: Source, targets: Mapping[str, Any]) -> dict[str, Any]:
    """The targets whose checksums ``verify_checksums`` will compare."""
    recs = source.record.by_path()
    return {p: t for p, t in targets.items() if recs[p].checksum is not None}


def verify_checksums(
    source: Source, values: Mapping[str, Any], sums: Mapping[str, str] | None = None
) -> None:
    """Raise CheckpointError naming every leaf whose stored bits changed since saving.

    ``sums``: the checksums of ``values`` where the caller has computed them already.
    """
    recs = source.record.by_path()
    paths = [p for p in values if recs[p].checksum is not None]
    if not paths:
        return
    got = [sums[p] for p in paths] if sums is not None else checksums([values[p] for p in paths])
    bad = [
        (recs[p], recs[p].checksum, g)
        for p, g in zip(paths, got, strict=True)
        if g != recs[p].checksum
    ]
    if bad:
        raise CheckpointError(checksum_mismatch_message(str(source.path), bad))


def _matching_view(source: Source, paths: Sequence[str]) -> Source:
    """``source`` named as ``like`` names it: a plain Orbax checkpoint's boxes by their
    canonical paths (``kernel``), unless ``like``'s own paths are the stored keys (a dict
    that really has a leaf named ``value``: ``stored_view``)."""
    view = stored_view(source)
    if view is source:
        return source
    wanted = set(paths)
    canonical = sum(p in wanted for p in source.record.by_path())
    return view if sum(p in wanted for p in view.record.by_path()) > canonical else source


def _keys_as_like(source: Source, paths: Sequence[str], arrays: Sequence[Any]) -> Source:
    """Plain Orbax stores a typed PRNG key (an NNX ``Rngs``'s) as its key data and names
    no implementation: a leaf ``like`` holds as a typed key, whose key data the stored
    array is (shape and dtype), is read as that key."""
    if source.record.source != "orbax":
        return source
    recs = source.record.by_path()
    keys = {}
    for path, x in zip(paths, arrays, strict=True):
        rec = recs.get(path)
        if rec is None or rec.key_impl is not None or not is_key(x.dtype):
            continue
        data = jax.eval_shape(encode, jax.ShapeDtypeStruct(x.shape, x.dtype))
        if (tuple(data.shape), dtype_name(data.dtype)) == (rec.stored_shape, rec.stored_dtype):
            keys[path] = dataclasses.replace(
                rec, shape=tuple(x.shape), dtype=dtype_name(x.dtype), key_impl=key_impl(x.dtype)
            )
    if not keys:
        return source
    leaves = [keys.get(leaf.path, leaf) for leaf in source.record.leaves]
    return dataclasses.replace(source, record=dataclasses.replace(source.record, leaves=leaves))


def restore_saved(
    source: Source,
    *,
    like: Any,
    specs: Any,
    mesh: Any,
    dtype: Any,
    partial: bool,
    verify: bool,
) -> Any:
    """The body of [`restore`][modelshard.restore] without a mapping: every leaf read as
    saved, into its planned sharding (``dtype`` already checked by ``check_cast``)."""
    if like is None:
        like = abstract_like(source, dtype)
    flat = split(like)
    paths, arrays = flat.paths, flat.arrays
    source = _keys_as_like(_matching_view(source, paths), paths, arrays)
    record = source.record
    stored = record.by_path()
    missing, extra, changed = diff(paths, arrays, stored, dtype)
    # Python values (an epoch, a name) come from the record, diffed as the arrays are
    statics, v_missing, v_extra, v_changed = restored_values(flat, record, source.path)
    missing, extra, changed = missing + v_missing, extra + v_extra, changed + v_changed
    numbers = values_as_arrays(paths, arrays, record)  # an abstract like's int32[] epoch
    if numbers:
        missing = [r for r in missing if r[1] not in numbers]
        extra = [r for r in extra if r[1] not in numbers]
    concrete_missing = all(
        not isinstance(x, jax.ShapeDtypeStruct)
        for p, x in zip(paths, arrays, strict=True)
        if p not in stored
    )
    allowed = partial and concrete_missing
    rows = changed + ([] if allowed else missing) + ([] if partial else extra)
    if partial and (missing or extra) and not any(p in stored or p in numbers for p in paths):
        rows = changed + missing + extra  # nothing would be restored: show every difference
    if rows:
        raise CheckpointError(
            mismatch_message(
                source,
                like,
                paths,
                arrays,
                stored,
                rows,
                [r for r in missing if r in rows],
                [r for r in extra if r in rows],
                changed,
                partial,
            )
        )
    if missing or extra:
        restored = [p for p in paths if p in stored or p in numbers]
        warn_partial(source, len(paths), restored, missing, extra)
    if specs is not None and mesh is None:
        raise CheckpointError("restore(specs=...) needs mesh=...: specs are planned on a mesh.")
    if mesh is not None:
        mesh = concrete_mesh(mesh)
        p = plan(like, record.saved_specs() if specs is None else specs, mesh)
        shardings = p.flat_shardings(0)
    else:
        shardings = [
            _default_sharding(x, stored[path], record) if path in stored else None
            for path, x in zip(paths, arrays, strict=True)
        ]
    targets = {}
    for path, s in zip(paths, shardings, strict=True):
        rec = stored.get(path)
        if rec is not None:
            targets[path] = stored_struct(rec, rec.stored_sharding(s))
    check_holdable(source, list(targets))
    sums = None
    if verify:
        checked = _checked(source, targets)
        # each leaf's checksum is started as it arrives, while later leaves are read
        sums = Checksums(checked)
    try:
        values = read_checked(source, targets, None if sums is None else sums.add)
    except BaseException:
        if sums is not None:
            sums.close()
        raise
    if sums is not None:
        verify_checksums(source, values, sums.collect(values))
    out = []
    for path, x, s in zip(paths, arrays, shardings, strict=True):
        if path in values:
            out.append(decode(values.pop(path), stored[path], dtype))
        elif path in numbers:
            y = jnp.asarray(numbers[path])
            out.append(place([y], [s])[0] if s is not None else y)
        else:  # partial restore: a missing leaf keeps like's value
            out.append(place([x], [s])[0] if s is not None else x)
    return flat.rebuild(out, statics=statics)
