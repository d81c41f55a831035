"""The public ``restore``: every leaf read as saved straight into its planned sharding, or
through a mapping to another layout (``mapped.restore_mapped``); a target unlike its
checkpoint said as a path-first diff with the hint that fits."""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from .._base import CheckpointError, canonical_dtype, dtype_name, fold, is_abstract, make_mesh
from .._containers import split
from .._place import place, plan
from .codec import decode, encode, is_key, key_impl, logical_dtype, stored_struct
from .mapped import restore_mapped
from .reader import check_holdable, read_verified
from .record import LeafRecord, Record
from .sources import Source, abstract_like, locate, stored_view
from .values import Diff, restored_values, values_as_arrays, warn_partial


def concrete_mesh(mesh: Any) -> Any:
    """``mesh``, or for an ``AbstractMesh`` a concrete mesh of its shape and axis types."""
    if is_abstract(mesh):
        return make_mesh(dict(mesh.shape), axis_types=tuple(mesh.axis_types))
    return mesh


def check_cast(dtype: Any) -> Any:
    """``dtype=`` as a JAX dtype, or None: a floating-point dtype this process can hold."""
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


def restore(
    directory: str | os.PathLike[str],
    *,
    like: Any = None,
    specs: Any = None,
    mesh: Any = None,
    dtype: Any = None,
    partial: bool = False,
    verify: bool = True,
    mapping: Any = None,
) -> Any:
    """Restore a checkpoint, every leaf read directly into its planned sharding.

    Args:
        directory: a checkpoint written by [`save`][modelshard.save], by Orbax's
            ``StandardCheckpointer``, or a step directory of an Orbax ``CheckpointManager``.
            A node Orbax stored with the one child ``value`` (a linen box, an NNX
            ``Variable``) is read as the box it was, named by its canonical path
            (``linear/kernel``), so it restores into a boxed or NNX ``like`` with no mapping
            (a ``like`` whose own paths end in ``value`` matches the stored names). A Python
            number Orbax stored 64-bit is read as JAX holds it (an int that does not fit
            int32 without x64 is refused), a typed PRNG key as the key ``like`` holds.
        like: a concrete or abstract container (``jax.eval_shape``, ``nnx.eval_shape``)
            giving the type to return; without it a nested dict of arrays is rebuilt from
            the checkpoint's record (or Orbax metadata). The state's Python values (an
            epoch, a name) come from the checkpoint, never from ``like`` (one of another
            type is a changed leaf); functions among the leaves come from ``like``.
        specs: one spec-like for the whole container (``P()``, [`Rules`][modelshard.Rules],
            [`fsdp`][modelshard.fsdp], ...), planned on ``mesh`` by the same pipeline as [`shard`][modelshard.shard].
            Default with a mesh: the specs the checkpoint was saved with.
        mesh: the target mesh (an ``AbstractMesh`` is made concrete). Without a mesh each
            leaf takes ``like``'s sharding, else the saved mesh (its axis types too) if
            this host has exactly its devices, else the first local device.
        dtype: cast floating-point leaves to this floating-point dtype (stored values are
            verified first; an integer dtype is refused).
        partial: restore only the leaves both sides have: extra checkpoint leaves are
            skipped and missing ones keep ``like``'s (concrete) values.
        verify: check each leaf's checksum against the record.
        mapping: a [`WeightMap`][modelshard.WeightMap] (or a path to its TOML file) from the checkpoint's
            leaf paths to ``like``'s: a checkpoint of another layout (linen scanned layers
            into an unscanned NNX model, t5x/MaxText names, a model without the new head).
            Rules match the canonical paths (a mapping written for a plain Orbax
            checkpoint's ``kernel/value`` names still resolves against them).
            Every unmapped or unfitting leaf is reported at once (``MappingError``);
            with a mesh, ``specs`` default to each leaf's saved spec carried through its
            recipe; typed PRNG keys map too; ``partial`` is the mapping's ``keep``.

    Returns:
        The container (same type as ``like``; a nested dict without it).

    Raises:
        CheckpointError: no checkpoint, a structure mismatch (a path-first diff), a damaged
            leaf or a checksum mismatch (naming the leaves).
        SpecError: ``specs`` do not fit the container or the mesh.

    Example:
        >>> import tempfile, jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> path = ms.save(tempfile.mkdtemp() + "/ckpt", {"w": jnp.ones((8, 2))})
        >>> like = jax.eval_shape(lambda: {"w": jnp.ones((8, 2))})
        >>> out = ms.restore(path, like=like, specs=ms.Rules([("w", P("data"))]),
        ...                  mesh=ms.make_mesh({"data": 8}))
        >>> out["w"].sharding.spec
        P('data',)
    """
    dtype = check_cast(dtype)
    source = locate(directory)
    if mapping is not None:
        return restore_mapped(
            source, like=like, mapping=mapping, specs=specs, mesh=mesh, dtype=dtype, verify=verify
        )
    return _restore_saved(source, like, specs, mesh, dtype, partial, verify)


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


def _matching_view(source: Source, paths: Sequence[str]) -> Source:
    """``source`` named as ``like`` names it: by canonical paths, or by the keys Orbax stored
    (``stored_view``: a dict that really has a leaf ``value``) where more paths match so."""
    view, wanted = stored_view(source), set(paths)
    as_view, as_is = (sum(p in wanted for p in s.record.by_path()) for s in (view, source))
    return view if as_view > as_is else source


def _keys_as_like(source: Source, paths: Sequence[str], arrays: Sequence[Any]) -> Source:
    """Plain Orbax stores a typed PRNG key as its key data, naming no impl: such a leaf is
    read as the typed key ``like`` holds there, where its key data fits the stored array."""
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


def _restore_saved(
    source: Source, like: Any, specs: Any, mesh: Any, dtype: Any, partial: bool, verify: bool
) -> Any:
    """``restore`` without a mapping (``dtype`` already checked by ``check_cast``)."""
    if like is None:
        like = abstract_like(source, dtype)
    flat = split(like)
    paths, arrays = flat.paths, flat.arrays
    source = _keys_as_like(_matching_view(source, paths), paths, arrays)
    record = source.record
    stored = record.by_path()
    missing, extra, changed = diff(paths, arrays, stored, dtype)
    statics, v_missing, v_extra, v_changed = restored_values(flat, record, source.path)
    missing, extra, changed = missing + v_missing, extra + v_extra, changed + v_changed
    numbers = values_as_arrays(paths, arrays, record)  # an abstract like's int32[] epoch
    missing = [r for r in missing if r[1] not in numbers]
    extra = [r for r in extra if r[1] not in numbers]
    abstract = any(
        isinstance(x, jax.ShapeDtypeStruct)
        for p, x in zip(paths, arrays, strict=True)
        if p not in stored
    )
    rows = changed + (missing if abstract or not partial else []) + ([] if partial else extra)
    if partial and (missing or extra) and not any(p in stored or p in numbers for p in paths):
        rows = changed + missing + extra  # nothing would be restored: show every difference
    if rows:
        raise CheckpointError(mismatch_message(source, like, paths, arrays, stored, rows, partial))
    if missing or extra:
        restored = [p for p in paths if p in stored or p in numbers]
        warn_partial(source.path, len(paths), restored, missing, extra)
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
    targets = {
        p: stored_struct(stored[p], stored[p].stored_sharding(s))
        for p, s in zip(paths, shardings, strict=True)
        if p in stored
    }
    check_holdable(source, list(targets))
    values = read_verified(source, targets, verify)
    out = []
    for path, x, s in zip(paths, arrays, shardings, strict=True):
        if path in values:
            out.append(decode(values.pop(path), stored[path], dtype))
        else:  # a number like holds as an array, or (partial) like's own value
            y = jnp.asarray(numbers[path]) if path in numbers else x
            out.append(place([y], [s])[0] if s is not None else y)
    return flat.rebuild(out, statics=statics)


def diff(
    paths: Sequence[str], arrays: Sequence[Any], stored: Mapping[str, LeafRecord], dtype: Any
) -> tuple[Diff, Diff, Diff]:
    """Missing, extra and changed leaves between a target and a checkpoint, path first."""
    missing: Diff = []
    changed: Diff = []
    seen = set()
    for path, x in zip(paths, arrays, strict=True):
        rec = stored.get(path)
        here = f"{dtype_name(x.dtype)}{list(x.shape)}"
        if rec is None:
            missing.append(("missing", path, f"{here} (in the target, not in the checkpoint)"))
            continue
        seen.add(path)
        want_name = dtype_name(logical_dtype(rec, dtype))
        if tuple(x.shape) != rec.shape or dtype_name(x.dtype) != want_name:
            cast = f" (restored as {want_name} by dtype=)" if want_name != rec.dtype else ""
            was = f"checkpoint {rec.dtype}{list(rec.shape)}{cast}"
            changed.append(("changed", path, f"{was} -> target {here}"))
    extra: Diff = [
        ("extra", p, f"{r.dtype}{list(r.shape)} (in the checkpoint, not in the target)")
        for p, r in stored.items()
        if p not in seen
    ]
    return missing, extra, changed


def format_diff(rows: Diff, limit: int = 24) -> list[str]:
    """The rows, those differing only in layer numbers folded into one; at most ``limit``."""
    groups = fold(rows, lambda r: r[1] or "<root>", key=lambda r: (r[0], r[2]))
    width = max(len(g.path) for g in groups[:limit])
    out = []
    for g in groups[:limit]:
        what, _, detail = g.items[0]  # type: ignore[misc]
        n = f"  ({g.count} leaves)" if g.count > 1 else ""
        out.append(f"  {what:<7}  {g.path:<{width}}  {detail}{n}")
    rest = groups[limit:]
    if rest:
        out.append(f"  ... {len(rest)} more rows ({sum(g.count for g in rest)} leaves)")
    return out


def _subtree(paths: Sequence[str], stored: Mapping[str, LeafRecord]) -> str | None:
    """``"model"`` if every target path is stored under ``model/``."""
    tops = sorted({p.split("/", 1)[0] for p in stored if "/" in p})
    for top in tops:
        if paths and all(f"{top}/{p}" in stored for p in paths):
            return top
    return None


def _size_changes(
    paths: Sequence[str], arrays: Sequence[Any], stored: Mapping[str, LeafRecord]
) -> tuple[list[str], bool]:
    """The sizes that changed (``"64 -> 128 (12 leaves)"``), and whether some dtypes did."""
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    dtype_only = False
    for p, x in zip(paths, arrays, strict=True):
        rec = stored.get(p)
        if rec is None:
            continue
        shape = tuple(x.shape)
        if shape == rec.shape:
            dtype_only = dtype_only or dtype_name(x.dtype) != rec.dtype
            continue
        if len(shape) == len(rec.shape):
            counts.update((a, b) for a, b in zip(rec.shape, shape, strict=True) if a != b)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return [f"{a} -> {b} ({n} leaves)" for (a, b), n in ranked[:3]], dtype_only


_KINDS = ("changed", "missing", "extra")


def mismatch_message(
    source: Source,
    like: Any,
    paths: Sequence[str],
    arrays: Sequence[Any],
    stored: Mapping[str, LeafRecord],
    rows: Diff,
    partial: bool = False,
) -> str:
    """Why ``like`` does not match the checkpoint: counts by kind, the folded ``rows``, and
    the hint that fits (never ``partial=True`` where the caller passed it)."""
    changed, missing, extra = ([r for r in rows if r[0] == k] for k in _KINDS)
    n = len(rows)
    kinds = [f"{len(r)} {k}" for k, r in zip(_KINDS, (changed, missing, extra), strict=True) if r]
    shared = sum(p in stored for p in paths)
    target = type(like).__name__
    if partial and not shared:
        head = (
            f"restore(partial=True) would restore nothing from checkpoint {source.path}: "
            f"none of the target {target}'s {len(paths)} leaves is in it"
        )
    else:
        head = f"checkpoint {source.path} does not match the target {target}"
    head += f" ({n} difference{'s' if n != 1 else ''}: {', '.join(kinds)}; paths first):\n"
    hints = []
    top = _subtree(paths, stored)
    if top is not None:
        hints.append(
            f"every leaf of the target is in the checkpoint under {top + '/'!r}: restore that "
            f"part with like={{{top!r}: like}}, partial=True (and take [{top!r}] of the result)"
        )
    elif changed and not missing and not extra:
        sizes, dtype_only = _size_changes(paths, arrays, stored)
        if sizes:
            hints.append(
                "the checkpoint's shapes differ from the target's (sizes "
                + "; ".join(sizes)
                + "): build the target with the configuration the checkpoint was saved with "
                "(partial=True cannot help: these leaves exist on both sides)"
            )
        if dtype_only:
            hints.append("shapes must match; pass dtype=... to cast floating leaves")
    else:
        if (missing or extra) and not shared:
            renamed = rename_mapping(paths, arrays, stored, missing, extra)
            hints.append(
                "the target and the checkpoint share no leaf path, so partial=True would "
                "restore nothing: "
                + (
                    renamed
                    if renamed is not None
                    else "compare the paths (modelshard inspect shows the checkpoint's) and "
                    "restore with mapping=ms.WeightMap([...]): a rule per renamed path, then "
                    'ms.MapRule(r"(.*)", "{1}") to keep the other paths'
                )
            )
        elif missing and partial:
            hints.append(
                "partial=True keeps like's values for the missing leaves, but like is "
                "abstract there: pass a concrete like (a freshly initialised model)"
            )
        elif missing or extra:
            renamed = rename_mapping(paths, arrays, stored, missing, extra)
            if renamed is not None:
                hints.append(renamed)
            hints.append(
                "pass partial=True to restore only the leaves both have (missing leaves then "
                "keep like's values, so like must be concrete for them; a warning names them)"
            )
        if changed:
            hints.append("shapes must match; pass dtype=... to cast floating leaves")
    if any(p not in stored for _, p, _ in changed):  # a Python value of another type
        hints.append(
            "a Python value must keep its type: build like with the saved value's type "
            "(ms.restore without like shows them)"
        )
    return head + "\n".join(format_diff(rows)) + "\nhint: " + "; ".join(hints)


def rename_mapping(
    paths: Sequence[str],
    arrays: Sequence[Any],
    stored: Mapping[str, LeafRecord],
    missing: Diff,
    extra: Diff,
) -> str | None:
    """The ``mapping=`` to paste where missing and extra leaves pair up (shape, dtype, last
    name) as renamed parents (``up/kernel`` saved, ``up_proj/kernel`` wanted), else None."""
    target = {p: x for p, x in zip(paths, arrays, strict=True)}
    pool: dict[tuple[Any, ...], list[str]] = {}
    for _, p, _ in extra:
        r = stored.get(p)
        if r is not None:
            pool.setdefault((r.shape, r.dtype, p.rsplit("/", 1)[-1]), []).append(p)
    renames: dict[str, str] = {}
    unpaired = []
    for _, p, _ in missing:
        x = target.get(p)
        key = None if x is None else (tuple(x.shape), dtype_name(x.dtype), p.rsplit("/", 1)[-1])
        cands = pool.get(key) if key is not None else None
        if not cands:
            unpaired.append(p)
            continue
        a, b = cands.pop(0).split("/"), p.split("/")
        while len(a) > 1 and len(b) > 1 and a[-1] == b[-1]:
            a, b = a[:-1], b[:-1]
        renames.setdefault("/".join(a), "/".join(b))
    if not renames or len(renames) > 4:
        return None
    dropped = sorted(p for ps in pool.values() for p in ps)
    rules = [f'ms.MapRule(r"{re.escape(a)}/(.*)", "{b}/{{1}}")' for a, b in renames.items()]
    rules += [f'ms.MapRule(r"{re.escape(p)}", None)' for p in dropped[:4]]
    paired = len(missing) - len(unpaired)
    kept = len(stored) > paired + len(dropped)  # paths both sides have: kept as they are
    if kept:
        rules.append('ms.MapRule(r"(.*)", "{1}")')
    keep = f", keep={[re.escape(p) for p in unpaired[:4]]!r}" if unpaired else ""
    return (
        "leaves that match in shape look renamed ("
        + ", ".join(f"{a}/ -> {b}/" for a, b in renames.items())
        + "): restore them with mapping=ms.WeightMap(["
        + ", ".join(rules)
        + f"]{keep})"
        + (" (the last rule keeps every other path as it is)" if kept else "")
    )
