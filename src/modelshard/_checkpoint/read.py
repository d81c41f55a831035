"""Reading checkpoints: ``restore``, every leaf read straight into its planned sharding.

Reads go through Orbax with a cap on the bytes in flight, are verified against the
record's checksums on the devices (each leaf's checksum starts as soon as it is read, while
the next leaves are read: ``arrival.py``), and fail with a [`CheckpointError`][modelshard.CheckpointError] that names the
damaged leaves and, where it can be told, the file at fault.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from .._base import (
    CheckpointError,
    canonical_dtype,
    dtype_name,
    format_path,
    is_abstract,
    make_mesh,
)
from .._containers import split
from .._place import place, plan
from .arrival import each_array_registry, shard_boxes
from .checksum import Checksums, checksum_mismatch_message, checksums, warm_checksums
from .chunks import shares_chunks
from .direct import read_direct, readable
from .mismatch import diff, mismatch_message, warn_partial
from .record import STORED_AS, LeafRecord, Record, parse_dtype
from .sources import Source, abstract_like, stored_view
from .storage import nest
from .values import restored_values, values_as_arrays

# Bytes of read buffers Orbax may hold at once during a restore: bounds host memory beyond
# the restored arrays themselves (each read buffer is copied onto its devices, then freed).
# Orbax counts a read as the whole stored chunks it touches; a restore onto another layout
# (a column block of row-chunked data) touches up to several times its buffer, so the cap
# grows by that factor (``read_cap``) and the buffers in flight stay at this many bytes. A
# restore whose largest single read is bigger raises its cap just above that read (Orbax
# refuses a read larger than the cap). 32 MiB holds two 16 MiB arrays' reads at once, so one
# array's reads overlap the next one's opening; what that costs and saves (restore time
# against raw Orbax, peak memory) is measured in docs/benchmarks/checkpoint.md.
RESTORE_CONCURRENT_BYTES = 32 << 20


def read_sizes(target: jax.ShapeDtypeStruct, chunk: Sequence[int] | None) -> list[int]:
    """The bytes Orbax reserves for each read of ``target`` on this host (one per distinct
    shard, as it reads them): the shard's extent rounded out to whole stored chunks (as its
    ``estimate_read_memory_footprint`` counts; with the chunk shape unknown, a bound)."""
    shape = tuple(target.shape)
    whole = (slice(None),) * len(shape)
    s = target.sharding
    indices = [whole] if s is None else s.addressable_devices_indices_map(shape).values()
    sizes = {}
    for index in indices:
        size = np.dtype(target.dtype).itemsize
        bounds = []
        for i, (d, sl) in enumerate(zip(shape, index or whole, strict=True)):
            lo, hi, _ = sl.indices(d)
            bounds.append((lo, hi))
            c = chunk[i] if chunk is not None and len(chunk) == len(target.shape) else 0
            size *= max(1, (-(-hi // c) - lo // c) * c if c > 0 else 2 * d)
        sizes[tuple(bounds)] = size
    return list(sizes.values())


def largest_read(target: jax.ShapeDtypeStruct, chunk: Sequence[int] | None) -> int:
    """The most bytes Orbax reserves to read one of this host's shards of ``target``
    (``read_sizes``)."""
    return max(read_sizes(target, chunk))


def _largest_shard(target: jax.ShapeDtypeStruct) -> int:
    """Bytes of the largest read buffer of ``target`` on this host: one shard."""
    s = target.sharding
    shape = tuple(target.shape) if s is None else s.shard_shape(tuple(target.shape))
    return max(1, math.prod(shape) * np.dtype(target.dtype).itemsize)


def read_cap(reads: Sequence[tuple[jax.ShapeDtypeStruct, Sequence[int] | None]]) -> int:
    """Orbax's ``restore_concurrent_bytes`` for ``reads`` (``(target, stored chunk shape)``
    pairs): ``RESTORE_CONCURRENT_BYTES`` of read buffers, counted as Orbax counts them.

    Orbax reserves for each read the stored chunks it touches (``largest_read``), which
    on a relayout is several times the buffer actually held: a column block of row-chunked
    data touches every row chunk. Capping that count at ``RESTORE_CONCURRENT_BYTES`` let
    two or three reads run at once where the layout's own restore runs dozens, so the cap
    is scaled by the largest such overcount; and raised above the largest single read."""
    largest = max((largest_read(t, c) for t, c in reads), default=0)
    over = max((largest_read(t, c) / _largest_shard(t) for t, c in reads), default=1.0)
    # + 1: a reservation must leave a byte to spare, so an array of exactly
    # RESTORE_CONCURRENT_BYTES can still be read whole (``arrival``'s groups)
    return max(int(RESTORE_CONCURRENT_BYTES * max(1.0, over)) + 1, 1 + largest)


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


def read_arrays(
    source: Source,
    targets: Mapping[str, Any],
    on_read: Callable[[str, jax.Array], None] | None = None,
) -> dict[str, Any]:
    """Restore the stored arrays of ``targets`` (path -> sharded ShapeDtypeStruct), calling
    ``on_read(path, array)`` for each one as soon as it is read (the rest still reading).

    A modelshard checkpoint on a local disk is read straight from TensorStore
    (``direct.read_direct``, no Orbax imported); any other through Orbax."""
    recs = source.record.by_path()
    # zero-size leaves are in the record only (Orbax refuses to store them)
    empty = {p: t for p, t in targets.items() if math.prod(t.shape) == 0}
    zeros = {p: jnp.zeros(t.shape, t.dtype, device=t.sharding) for p, t in empty.items()}
    targets = {p: t for p, t in targets.items() if p not in empty}
    if not targets:
        return zeros
    chunks = {p: source.write_shapes().get(recs[p].key) for p in targets}
    cap = read_cap([(t, chunks[p]) for p, t in targets.items()])
    shared = any(
        shares_chunks(list(shard_boxes(t.sharding, tuple(t.shape))), tuple(t.shape), chunks[p])
        for p, t in targets.items()
    )
    cache = cap if shared else 0  # decoded chunks, where two of this process's shards share one
    if readable(source):
        sizes = {p: read_sizes(t, chunks[p]) for p, t in targets.items()}
        return zeros | read_direct(source, targets, on_read, cap, sizes, cache)
    return zeros | _orbax_read(source, targets, on_read, cap, cache)


def _orbax_read(
    source: Source,
    targets: Mapping[str, Any],
    on_read: Callable[[str, jax.Array], None] | None,
    cap: int,
    cache: int,
) -> dict[str, Any]:
    """``read_arrays`` through Orbax's ``PyTreeCheckpointHandler`` (``arrival``'s handler
    for ``jax.Array``), at most ``cap`` bytes reserved at once, ``cache`` bytes of decoded
    chunks cached."""
    import orbax.checkpoint as ocp

    recs = source.record.by_path()
    full = len(targets) == sum(math.prod(r.stored_shape) > 0 for r in recs.values())
    if source.template is not None:
        # Orbax's own structure (lists stay lists); leaves not asked for are placeholders.
        flat_t = jax.tree_util.tree_flatten_with_path(source.template)
        path_of = {format_path([*r.key]): p for p, r in recs.items()}  # a box's kernel/value
        tree = jax.tree_util.tree_unflatten(
            flat_t[1],
            [targets.get(path_of.get(format_path(k), ""), ocp.PLACEHOLDER) for k, _ in flat_t[0]],
        )
        restore_args = jax.tree.map(lambda t: t if t is ocp.PLACEHOLDER else _restore_args(t), tree)
        partial = False
    else:
        tree = nest([(recs[p].key, t) for p, t in targets.items()], str(source.path))
        restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
        partial = not full
    args = ocp.args.PyTreeRestore(item=tree, partial_restore=partial, restore_args=restore_args)
    from .._internals import BasePyTreeCheckpointHandler

    chunks = source.write_shapes()
    orbax_path = {format_path([*recs[p].key]): p for p in targets}

    def arrived(info: Any, x: Any) -> None:
        path = orbax_path.get(format_path(info.keypath or ()))
        if on_read is not None and path is not None:
            on_read(path, x)

    groups = {
        format_path([*recs[p].key]): sum(read_sizes(t, chunks.get(recs[p].key)))
        for p, t in targets.items()
    }

    def group_bytes(info: Any) -> int:
        return groups.get(format_path(info.keypath or ()), 0)

    registry = each_array_registry(arrived, cap, group_bytes, cache)
    handler = ocp.PyTreeCheckpointHandler(
        type_handler_registry=registry,
        handler_impl=BasePyTreeCheckpointHandler(
            restore_concurrent_bytes=cap, type_handler_registry=registry
        ),
    )
    with ocp.Checkpointer(handler) as ckptr:
        out = ckptr.restore(source.tree_dir, args=args)
    flat_out = {format_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(out)[0]}
    return {p: flat_out[format_path([*recs[p].key])] for p in targets}


def _restore_args(target: jax.ShapeDtypeStruct) -> Any:
    import orbax.checkpoint as ocp

    return ocp.checkpoint_utils.construct_restore_args(target)


_STATUS = re.compile(r"^[A-Z_]+: ")  # TensorStore's status codes: "DATA_LOSS: ..."
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')
# TensorStore appends the whole spec it failed on, JSON with its context: noise to a reader
_SPEC = re.compile(r"\s*\[tensorstore_spec='(?:[^'\\]|\\.)*'\]")
_MAX_TEXT = 300  # characters of one failure shown
_MAX_NAMED = 8  # leaves named per failure before "and N more"


def _json_unreadable(tree_dir: Path) -> str | None:
    """The first of Orbax's JSON metadata files in ``tree_dir`` that does not parse."""
    import json

    names = ["_METADATA", "_sharding", "_CHECKPOINT_METADATA"]
    for f in [*(tree_dir / n for n in names), *sorted(tree_dir.glob("array_metadatas/*"))]:
        try:
            if f.is_file():
                json.loads(f.read_bytes())
        except (ValueError, RecursionError):
            return str(f)
    return None


def read_failure(e: BaseException, tree_dir: Path | None = None) -> str:
    """One leaf's read failure: TensorStore's innermost status (Orbax wraps it in vaguer
    errors) names the chunk and the file; a JSON error is pinned on the file that fails."""
    chain: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and len(chain) < 16:
        chain.append(x)
        x = x.__cause__ or x.__context__
    best = next((c for c in reversed(chain) if _STATUS.match(str(c))), e)
    text = _SPEC.sub("", (str(best).strip().splitlines() or [""])[0])
    files = _LOCAL_FILE.findall(text)
    where = files[-1] if files else None
    if (
        where is None
        and tree_dir is not None
        and any(type(c).__name__ == "JSONDecodeError" for c in chain)
    ):
        where = _json_unreadable(tree_dir)
    if len(text) > _MAX_TEXT:
        text = text[: _MAX_TEXT - 1] + "…"
    return f"{type(best).__name__}: {text}" + (f"\n    file: {where}" if where else "")


def unreadable(where: Any, failures: Sequence[tuple[str, str]], alone: str = "") -> CheckpointError:
    """The error of a checkpoint ``where`` whose leaves could not be read: one entry per
    distinct failure (``failures``: ``(path, read_failure(...))``; none: ``alone``, a
    failure no single leaf's read showed), and what to do."""
    n = len(failures)
    what = f"{n} lea{'ves' if n != 1 else 'f'}" if n else "the checkpoint"
    lines = _grouped(failures) if n else [f"  {alone}"]
    return CheckpointError(
        f"cannot read {what} of {where} (damaged or incomplete checkpoint):\n"
        + "\n".join(lines)
        + "\nhint: a file of the checkpoint is damaged or missing (a copy cut short, a disk "
        "fault); use a complete copy of it, or an earlier checkpoint."
    )


def _grouped(failures: Sequence[tuple[str, str]]) -> list[str]:
    """One entry per distinct failure, naming the leaves that failed so: a damaged file
    shared by many leaves (OCDBT keeps several arrays' data in one file) is one entry, not
    the same text once per leaf. Failures that name the same file with the same kind of
    error are one failure (their texts may differ by the array or byte range read): the
    first one's text is shown."""
    groups: dict[str, tuple[str, list[str]]] = {}
    for path, text in failures:
        head, _, file = text.partition("\n    file: ")
        key = f"{head.split(':', 2)[:2]}|{file}" if file else text
        groups.setdefault(key, (text, []))[1].append(path or "<root>")
    lines = []
    for text, paths in groups.values():
        shown = ", ".join(paths[:_MAX_NAMED])
        if len(paths) > _MAX_NAMED:
            shown += f" and {len(paths) - _MAX_NAMED} more"
        lines.append(f"  {shown}: {text}")
    return lines


def read_checked(
    source: Source,
    targets: Mapping[str, Any],
    on_read: Callable[[str, jax.Array], None] | None = None,
) -> dict[str, Any]:
    """``read_arrays``, turning any failure into a CheckpointError naming the bad leaves
    and, where it can be told, the file at fault."""
    try:
        return read_arrays(source, targets, on_read)
    except Exception as e:
        bad = []
        for p, t in targets.items():
            try:
                if len(targets) == 1:
                    raise e
                read_arrays(source, {p: t})
            except Exception as e1:
                bad.append((p, read_failure(e1, source.tree_dir)))
        raise unreadable(source.path, bad, read_failure(e, source.tree_dir)) from e


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


def finish_leaf(x: Any, rec: LeafRecord, dtype: Any) -> Any:
    """Stored array -> the leaf the user gets: typed keys rewrapped, floats cast to ``dtype``."""
    if rec.key_impl is not None:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x  # Orbax's read gave the key back itself (a plain Orbax checkpoint's)
        return jax.random.wrap_key_data(x, impl=rec.key_impl)
    if STORED_AS.get(rec.dtype) == rec.stored_dtype:
        # device_put: a zero-size bitcast forgets its sharding
        x = jax.device_put(jax.lax.bitcast_convert_type(x, parse_dtype(rec.dtype)), x.sharding)
    want = rec.restored_dtype(dtype)
    return x if want is None or x.dtype == want else x.astype(want)


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


_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")  # JAX's named PRNG implementations


@functools.cache
def _key_impl_of(dtype: Any) -> str | None:
    """The name of the PRNG implementation of a typed key dtype (an abstract key has no
    ``jax.random.key_impl``)."""
    for name in _KEY_IMPLS:
        if jax.eval_shape(lambda name=name: jax.random.key(0, impl=name)).dtype == dtype:
            return name
    return None


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
        if rec is None or not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue
        impl = _key_impl_of(x.dtype)
        if impl is None or rec.key_impl is not None:
            continue
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        if (tuple(data.shape), dtype_name(data.dtype)) == (rec.stored_shape, rec.stored_dtype):
            keys[path] = dataclasses.replace(
                rec, shape=tuple(x.shape), dtype=dtype_name(x.dtype), key_impl=impl
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
            targets[path] = jax.ShapeDtypeStruct(
                rec.stored_shape, parse_dtype(rec.stored_dtype), sharding=rec.stored_sharding(s)
            )
    check_holdable(source, list(targets))
    sums = None
    if verify:
        checked = _checked(source, targets)
        # each leaf's checksum is dispatched as it arrives, while later leaves are read; the
        # programs are compiled first, on the checksums' thread, while the reads start
        sums = Checksums(checked)
        sums.first(lambda: warm_checksums(list(checked.values())))
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
            out.append(finish_leaf(values.pop(path), stored[path], dtype))
        elif path in numbers:
            y = jnp.asarray(numbers[path])
            out.append(place([y], [s])[0] if s is not None else y)
        else:  # partial restore: a missing leaf keeps like's value
            out.append(place([x], [s])[0] if s is not None else x)
    return flat.rebuild(out, statics=statics)
