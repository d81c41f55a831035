"""``save`` and ``restore``: sharded Orbax checkpoints of any container, restored onto any mesh.

On disk a checkpoint is a plain Orbax PyTree checkpoint (OCDBT, each process writing its
own shards) of a nested dict keyed by the components of each leaf's canonical path, plus
``modelshard.json`` (see :mod:`modelshard._record`). ``orbax.checkpoint.StandardCheckpointer``
restores it without modelshard; typed PRNG keys are stored as their key data.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from ._errors import CheckpointError
from ._flat import split
from ._mesh import is_abstract, make_mesh
from ._paths import format_path, key_name
from ._paths import split as split_path
from ._plan import plan
from ._record import (
    FORMAT,
    RECORD_FILE,
    STORED_AS,
    LeafRecord,
    Record,
    checksums,
    dtype_name,
    mesh_json,
    parse_dtype,
    saved_spec,
    start_checksums,
    versions,
    warm_checksums,
)
from ._shard import place

__all__ = ["Source", "locate", "prepare", "restore", "save"]

STATE_ITEM = "state"
# Bytes Orbax may read at once during a restore: bounds host memory beyond the restored
# arrays themselves (each read buffer is copied onto its devices, then freed). A restore
# whose largest single read is bigger raises its own cap just above that read (Orbax
# refuses a read larger than the cap).
RESTORE_CONCURRENT_BYTES = 16 << 20
RECORD_ITEM = "modelshard"
# In Orbax's own _CHECKPOINT_METADATA: says a record must be there (typed PRNG keys, paths
# and checksums are only in the record; without it a checkpoint reads as plain Orbax).
MARKER = {"modelshard": FORMAT}


# ---- writing -------------------------------------------------------------------------


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _nest(items: Sequence[tuple[tuple[str, ...], Any]], what: str) -> dict[str, Any]:
    """Nested dicts from ``(key path, value)`` pairs; a path both leaf and node is an error."""
    root: dict[str, Any] = {}
    for key, value in items:
        node = root
        for i, k in enumerate(key[:-1]):
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise CheckpointError(
                    f"{what}: leaf {'/'.join(key[: i + 1])!r} is also a parent "
                    f"of {'/'.join(key)!r}; canonical paths must form a tree."
                )
            node = child
        if key[-1] in node:
            raise CheckpointError(
                f"{what}: two leaves have the canonical path {'/'.join(key)!r}; rename one of them."
            )
        node[key[-1]] = value
    return root


def storable(x: Any) -> Any:
    """``x``, or its bits in a dtype TensorStore can store (see ``STORED_AS``)."""
    to = STORED_AS.get(dtype_name(x.dtype))
    return x if to is None else jax.lax.bitcast_convert_type(x, jnp.dtype(to))


def _storage_key(path: str) -> tuple[str, ...]:
    return split_path(path) or ("value",)


def prepare(state: Any, metadata: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], Record]:
    """Split ``state`` into the nested dict Orbax stores and the record beside it."""
    flat = split(state)
    infos, arrays = flat.infos, flat.arrays
    if not arrays:
        raise CheckpointError(f"nothing to save: the {type(state).__name__} has no array leaves.")
    mesh = None
    for x in arrays:
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and not is_abstract(s.mesh):
            mesh = s.mesh
            break
    stored, leaves = [], []
    for info, x in zip(infos, arrays, strict=True):
        if isinstance(x, jax.ShapeDtypeStruct):
            raise CheckpointError(
                f"cannot save {info.path or '<root>'}: it is an abstract "
                f"ShapeDtypeStruct {dtype_name(x.dtype)}{list(x.shape)}, "
                "not an array."
            )
        if isinstance(x, np.ndarray | np.generic):
            x = jnp.asarray(x)
        impl = None
        data = x
        if _is_key(x):
            impl = str(jax.random.key_impl(x))
            data = jax.random.key_data(x)
        else:
            data = storable(x)
        stored.append(data)
        leaves.append(
            LeafRecord(
                path=info.path,
                key=_storage_key(info.path),
                shape=tuple(x.shape),
                dtype=dtype_name(x.dtype),
                stored_shape=tuple(data.shape),
                stored_dtype=dtype_name(data.dtype),
                key_impl=impl,
                spec=saved_spec(x, mesh),
                names=info.names,
            )
        )
    # Device reductions run while the data is written; the record resolves them at the end.
    pending = start_checksums(stored)
    if jax.process_count() > 1:
        stored = [_replicated_if_local(x) for x in stored]
    items = [(leaf.key, x) for leaf, x in zip(leaves, stored, strict=True)]
    _nest(items, "save")  # canonical paths must form a tree, zero-size leaves included
    # Orbax refuses zero-size arrays: the record's shape and dtype say all there is.
    tree = _nest([(k, x) for k, x in items if x.size], "save")
    if not tree:
        raise CheckpointError(
            f"nothing to save: every array leaf of the {type(state).__name__} is zero-size."
        )
    record = Record(
        kind=flat.kind,
        leaves=leaves,
        mesh=None if mesh is None else mesh_json(mesh),
        versions=versions(),
        metadata=dict(metadata or {}),
        pending=pending,
    )
    return tree, record


def _replicated_if_local(x: Any) -> Any:
    """Multi-process: a leaf held by this process only (NumPy, one device), as a global
    array replicated on every device, which Orbax can write (process 0's value is kept)."""
    if not (isinstance(x, jax.Array) and x.is_fully_addressable):
        return x
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    host = np.asarray(x)
    return jax.make_array_from_callback(
        host.shape, NamedSharding(mesh, PartitionSpec()), lambda idx: host[idx]
    )


def _abs(directory: str | os.PathLike[str]) -> Path:
    return Path(directory).expanduser().absolute()


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def write_text_durable(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``), so an
    overwrite never leaves the path empty; False where the system cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def write_atomic(path: Path, write: Any, record: Record, *, overwrite: bool) -> None:
    """Write a checkpoint into a staging directory, add the record, then rename it into place.

    A crash at any point leaves an existing checkpoint at ``path`` untouched; with
    ``overwrite`` the old one is renamed aside only once the new one is complete. Saves
    into one parent directory take turns (an flock on it): two saves of one path would
    otherwise write into the same staging directory.
    """
    import fcntl

    lock = None
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(path.parent, os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        _write_atomic(path, write, record, overwrite=overwrite)
    finally:
        if lock is not None:
            os.close(lock)


def _write_atomic(path: Path, write: Any, record: Record, *, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointError(
            f"{path} already exists; pass overwrite=True to replace it (the "
            "old checkpoint is kept until the new one is complete)."
        )
    staging = path.parent / f".{path.name}.modelshard-tmp"
    old = path.parent / f".{path.name}.modelshard-old"
    primary = jax.process_index() == 0
    if primary:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    _sync("modelshard:save:start")
    write(staging)
    if primary:
        write_text_durable(staging / RECORD_FILE, record.dumps())
        _fsync_dir(staging)
        if path.exists() and _exchange(staging, path):
            old = staging  # the swap put the old checkpoint there
        else:
            if path.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.rename(path, old)
            os.rename(staging, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    _sync("modelshard:save:end")


def orbax_save(directory: Path, tree: Any) -> None:
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        ckptr.save(directory, args=ocp.args.StandardSave(tree), custom_metadata=MARKER)


def save(
    directory: str | os.PathLike[str],
    state: Any,
    *,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Save any registered container as a sharded Orbax checkpoint with a modelshard record.

    Each process writes its own shards (Orbax OCDBT). Beside the data, ``modelshard.json``
    records each leaf's canonical path, shape, dtype, the spec and mesh it was saved with,
    the container kind, package versions and a checksum. The directory appears only when
    complete: a save that fails or is killed leaves any earlier checkpoint there intact.

    Args:
        directory: where to write (made absolute; its parent is created).
        state: any registered container (pytree, optax state, NNX module or state, linen
            variables, Equinox module, TrainState...). Typed PRNG keys, bfloat16 and NumPy
            leaves are fine; abstract leaves are not.
        overwrite: replace an existing checkpoint at ``directory``.
        metadata: JSON-serialisable user metadata stored in the record.

    Returns:
        The absolute path of the checkpoint.

    Raises:
        CheckpointError: ``directory`` exists (without ``overwrite``), a leaf is abstract,
            or two leaves share a canonical path.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import modelshard as ms
        >>> path = ms.save(tempfile.mkdtemp() + "/ckpt", {"w": jnp.ones((4, 2))})
        >>> ms.restore(path)["w"].shape
        (4, 2)
    """
    path = _abs(directory)
    tree, record = prepare(state, metadata)
    write_atomic(path, lambda d: orbax_save(d, tree), record, overwrite=overwrite)
    return path


# ---- reading -------------------------------------------------------------------------


@dataclasses.dataclass
class Source:
    """A located checkpoint: its Orbax tree directory and its (possibly inferred) record.

    Attributes:
        path: what was asked for (absolute).
        tree_dir: the Orbax PyTree checkpoint directory.
        record: the modelshard record, or one inferred from Orbax metadata.
        template: for plain Orbax checkpoints, the stored tree structure (Orbax metadata).
    """

    path: Path
    tree_dir: Path
    record: Record
    template: Any = None
    _write_shapes: dict[tuple[str, ...], tuple[int, ...]] | None = dataclasses.field(
        default=None, repr=False
    )

    def write_shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        """Each stored array's write (chunk) shape, by storage key, where Orbax's
        ``_METADATA`` records it (read once)."""
        if self._write_shapes is None:
            self._write_shapes = _read_write_shapes(self.tree_dir / "_METADATA")
        return self._write_shapes


def _read_write_shapes(meta: Path) -> dict[tuple[str, ...], tuple[int, ...]]:
    import json

    out: dict[tuple[str, ...], tuple[int, ...]] = {}
    try:
        if meta.stat().st_size > MAX_METADATA_BYTES:
            return out
        for entry in json.loads(meta.read_bytes())["tree_metadata"].values():
            shape = entry["value_metadata"].get("write_shape")
            if shape:
                key = tuple(str(k["key"]) for k in entry["key_metadata"])
                out[key] = tuple(int(d) for d in shape)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass  # unknown chunking: largest_read falls back to a bound
    return out


def largest_read(target: jax.ShapeDtypeStruct, chunk: Sequence[int] | None) -> int:
    """The most bytes Orbax reserves to read one of this host's shards of ``target``: the
    shard's extent rounded out to whole stored chunks (as its
    ``estimate_read_memory_footprint`` counts; with the chunk shape unknown, a bound)."""
    shape = tuple(target.shape)
    whole = (slice(None),) * len(shape)
    s = target.sharding
    indices = [whole] if s is None else s.addressable_devices_indices_map(shape).values()
    n = 0
    for index in indices:
        size = np.dtype(target.dtype).itemsize
        for i, (d, sl) in enumerate(zip(shape, index or whole, strict=True)):
            lo, hi, _ = sl.indices(d)
            c = chunk[i] if chunk is not None and len(chunk) == len(target.shape) else 0
            size *= max(1, (-(-hi // c) - lo // c) * c if c > 0 else 2 * d)
        n = max(n, size)
    return n


def _manager_hint(p: Path) -> str:
    steps = sorted(c.name for c in p.iterdir() if c.is_dir() and c.name.isdigit())
    if steps:
        return (
            f" It looks like a CheckpointManager directory (steps {', '.join(steps[-5:])}): "
            f"pass a step directory such as {p / steps[-1]}, or use "
            "modelshard.CheckpointManager(...).restore()."
        )
    return ""


# A record or Orbax tree metadata file larger than this is refused unread.
MAX_METADATA_BYTES = 256 << 20


def _links_outside(root: Path) -> list[tuple[Path, Path]]:
    """Symbolic links under ``root`` that lead outside it (``os.walk`` does not enter them)."""
    real = root.resolve()
    found = []
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            link = Path(here, name)
            if link.is_symlink() and not link.resolve().is_relative_to(real):
                found.append((link, link.resolve()))
    return found


def locate(directory: str | os.PathLike[str]) -> Source:
    """Find the Orbax tree and record of a checkpoint written by modelshard or plain Orbax.

    A checkpoint is untrusted input: a symbolic link leading out of it, or metadata over
    ``MAX_METADATA_BYTES``, is refused before anything is read.
    """
    p = _abs(directory)
    if not p.is_dir():
        old = p.parent / f".{p.name}.modelshard-old"
        extra = (
            f" A previous checkpoint was moved aside to {old} by an interrupted overwrite."
            if old.exists()
            else ""
        )
        raise CheckpointError(f"no checkpoint at {p}: the directory does not exist.{extra}")
    for link, target in _links_outside(p)[:1]:
        raise CheckpointError(
            f"{link} is a symbolic link to {target}, outside the checkpoint {p}; "
            "refusing to follow it."
        )
    record_file = None
    if (p / "_METADATA").exists():
        tree_dir = p
        record_file = p / RECORD_FILE
    else:
        items = [c for c in sorted(p.iterdir()) if (c / "_METADATA").exists()]
        named = [c for c in items if c.name == STATE_ITEM] or items
        if len(named) != 1:
            found = ", ".join(c.name for c in items) or "none"
            raise CheckpointError(
                f"no Orbax checkpoint at {p}: expected a _METADATA file there or "
                f"in exactly one item directory (found: {found})." + _manager_hint(p)
            )
        tree_dir = named[0]
        record_file = p / RECORD_ITEM / RECORD_FILE
    for meta in (record_file, tree_dir / "_METADATA"):
        size = meta.stat().st_size if meta.is_file() else 0
        if size > MAX_METADATA_BYTES:
            raise CheckpointError(
                f"{meta} is {size} bytes, more than the {MAX_METADATA_BYTES} that checkpoint "
                "metadata may have; refusing to read it."
            )
    if record_file.exists():
        import json

        try:
            data = json.loads(record_file.read_text())
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{record_file} is not valid JSON: {e}") from e
        return Source(p, tree_dir, Record.from_json(data, str(record_file)))
    if _marked(p / "_CHECKPOINT_METADATA"):
        raise CheckpointError(
            f"{record_file} is missing, but modelshard wrote {p}: without the record the "
            "leaves' paths, dtypes (typed PRNG keys) and checksums are unknown. Restore a "
            "complete copy of the checkpoint."
        )
    return _from_orbax(p, tree_dir)


def _marked(meta: Path) -> bool:
    """Whether Orbax's ``_CHECKPOINT_METADATA`` carries modelshard's ``MARKER``."""
    import json

    try:
        if meta.stat().st_size > MAX_METADATA_BYTES:
            return False
        data = json.loads(meta.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    custom = data.get("custom_metadata") if isinstance(data, dict) else None
    return isinstance(custom, dict) and "modelshard" in custom


def _from_orbax(p: Path, tree_dir: Path) -> Source:
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(tree_dir)).tree
    except Exception as e:
        raise CheckpointError(
            f"cannot read the Orbax metadata of {tree_dir}: {type(e).__name__}: {e}"
        ) from e
    leaves, mesh = [], None
    for keys, meta in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(int(d) for d in getattr(meta, "shape", ()) or ())
        dtype = dtype_name(getattr(meta, "dtype", None) or jnp.float32)
        spec = None
        sh: Any = getattr(meta, "sharding", None)
        if type(sh).__name__ == "NamedShardingMetadata":
            axes = dict(zip(sh.axis_names, (int(s) for s in sh.shape), strict=True))
            if mesh is None:
                mesh = {"axes": axes, "axis_types": []}
            if axes == mesh["axes"]:
                spec = PartitionSpec(*sh.partition_spec)
        leaves.append(
            LeafRecord(
                path=format_path(keys),
                key=tuple(key_name(k) for k in keys),
                shape=shape,
                dtype=dtype,
                stored_shape=shape,
                stored_dtype=dtype,
                spec=spec,
            )
        )
    record = Record(kind="orbax", leaves=leaves, mesh=mesh, source="orbax")
    return Source(p, tree_dir, record, template=tree)


def _concrete(mesh: Any) -> Any:
    if is_abstract(mesh):
        return make_mesh(dict(mesh.shape), axis_types=tuple(mesh.axis_types))
    return mesh


def _leaf_target_dtype(rec: LeafRecord, dtype: Any) -> Any:
    if rec.key_impl is not None:
        return None
    stored = parse_dtype(rec.dtype)
    if dtype is not None and jnp.issubdtype(stored, jnp.floating):
        return jnp.dtype(dtype)
    return stored


Diff = list[tuple[str, str, str]]  # (what, path, detail)


def _diff(
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
        want = _leaf_target_dtype(rec, dtype)
        want_name = rec.dtype if want is None else dtype_name(want)
        if tuple(x.shape) != rec.shape or dtype_name(x.dtype) != want_name:
            changed.append(
                ("changed", path, f"checkpoint {want_name}{list(rec.shape)} -> target {here}")
            )
    extra: Diff = [
        ("extra", p, f"{r.dtype}{list(r.shape)} (in the checkpoint, not in the target)")
        for p, r in stored.items()
        if p not in seen
    ]
    return missing, extra, changed


def _format_diff(rows: Diff) -> list[str]:
    width = max(len(p or "<root>") for _, p, _ in rows)
    return [f"  {what:<7}  {(p or '<root>'):<{width}}  {detail}" for what, p, detail in rows]


def _saved_specs(record: Record) -> Any:
    specs = {leaf.path: leaf.spec for leaf in record.leaves}

    def saved(path: str, leaf: Any) -> PartitionSpec:
        return specs.get(path) or PartitionSpec()

    saved.__name__ = "saved_specs"
    return saved


def _default_sharding(x: Any, rec: LeafRecord, record: Record) -> Any:
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding):
        return NamedSharding(_concrete(s.mesh), s.spec) if is_abstract(s.mesh) else s
    if s is not None and not isinstance(x, jax.ShapeDtypeStruct | np.ndarray):
        return s
    sizes = record.mesh_sizes()
    if sizes and rec.spec is not None and int(np.prod(list(sizes.values()))) == jax.device_count():
        return NamedSharding(make_mesh(sizes), rec.spec)
    return SingleDeviceSharding(jax.local_devices()[0])


def _stored_sharding(sharding: Any, rec: LeafRecord) -> Any:
    extra = len(rec.stored_shape) - len(rec.shape)
    if extra and isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, *([None] * extra)))
    return sharding


def orbax_read(source: Source, targets: Mapping[str, Any]) -> dict[str, Any]:
    """Restore the stored arrays of ``targets`` (path -> sharded ShapeDtypeStruct)."""
    import orbax.checkpoint as ocp

    recs = source.record.by_path()
    # zero-size leaves are in the record only (Orbax refuses to store them)
    empty = {p: t for p, t in targets.items() if math.prod(t.shape) == 0}
    zeros = {p: jnp.zeros(t.shape, t.dtype, device=t.sharding) for p, t in empty.items()}
    targets = {p: t for p, t in targets.items() if p not in empty}
    if not targets:
        return zeros
    full = len(targets) == sum(math.prod(r.stored_shape) > 0 for r in recs.values())
    if source.template is not None:
        # Orbax's own structure (lists stay lists); leaves not asked for are placeholders.
        flat_t = jax.tree_util.tree_flatten_with_path(source.template)
        tree = jax.tree_util.tree_unflatten(
            flat_t[1], [targets.get(format_path(k), ocp.PLACEHOLDER) for k, _ in flat_t[0]]
        )
        restore_args = jax.tree.map(lambda t: t if t is ocp.PLACEHOLDER else _restore_args(t), tree)
        partial = False
    else:
        tree = _nest([(recs[p].key, t) for p, t in targets.items()], str(source.path))
        restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
        partial = not full
    args = ocp.args.PyTreeRestore(item=tree, partial_restore=partial, restore_args=restore_args)
    from orbax.checkpoint._src.handlers.base_pytree_checkpoint_handler import (
        BasePyTreeCheckpointHandler,
    )

    chunks = source.write_shapes()
    cap = max(
        RESTORE_CONCURRENT_BYTES,
        1 + max(largest_read(t, chunks.get(recs[p].key)) for p, t in targets.items()),
    )
    handler = ocp.PyTreeCheckpointHandler(
        handler_impl=BasePyTreeCheckpointHandler(restore_concurrent_bytes=cap)
    )
    with ocp.Checkpointer(handler) as ckptr:
        out = ckptr.restore(source.tree_dir, args=args)
    flat_out = {format_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(out)[0]}
    return zeros | {p: flat_out[format_path([*recs[p].key])] for p in targets}


def _restore_args(target: jax.ShapeDtypeStruct) -> Any:
    import orbax.checkpoint as ocp

    return ocp.checkpoint_utils.construct_restore_args(target)


_STATUS = re.compile(r"^[A-Z_]+: ")  # TensorStore's status codes: "DATA_LOSS: ..."
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')


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


def _failure(e: BaseException, tree_dir: Path) -> str:
    """One leaf's read failure: TensorStore's innermost status (Orbax wraps it in vaguer
    errors) names the chunk and the file; a JSON error is pinned on the file that fails."""
    chain: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and len(chain) < 16:
        chain.append(x)
        x = x.__cause__ or x.__context__
    best = next((c for c in reversed(chain) if _STATUS.match(str(c))), e)
    text = (str(best).strip().splitlines() or [""])[0]
    files = _LOCAL_FILE.findall(text)
    where = files[-1] if files else None
    if where is None and any(type(c).__name__ == "JSONDecodeError" for c in chain):
        where = _json_unreadable(tree_dir)
    return f"{type(best).__name__}: {text[:300]}" + (f"\n    file: {where}" if where else "")


def read_checked(source: Source, targets: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`orbax_read`, turning any failure into a CheckpointError naming the bad leaves
    and, where it can be told, the file at fault."""
    try:
        return orbax_read(source, targets)
    except Exception as e:
        bad = []
        for p, t in targets.items():
            try:
                if len(targets) == 1:
                    raise e
                orbax_read(source, {p: t})
            except Exception as e1:
                bad.append(f"  {p or '<root>'}: {_failure(e1, source.tree_dir)}")
        detail = "\n".join(bad) if bad else f"  {_failure(e, source.tree_dir)}"
        n = len(bad)
        what = f"{n} lea{'ves' if n != 1 else 'f'}" if bad else "the checkpoint"
        raise CheckpointError(
            f"cannot read {what} of {source.path} (damaged or incomplete checkpoint):\n{detail}"
        ) from e


def _checked(source: Source, targets: Mapping[str, Any]) -> list[Any]:
    """The targets whose checksums :func:`verify_checksums` will compute."""
    recs = source.record.by_path()
    return [t for p, t in targets.items() if recs[p].checksum is not None]


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
        f"  {p or '<root>'} {recs[p].stored_dtype}{list(recs[p].stored_shape)}: recorded "
        f"{recs[p].checksum}, read {g}"
        for p, g in zip(paths, got, strict=True)
        if g != recs[p].checksum
    ]
    if bad:
        n = len(bad)
        raise CheckpointError(
            f"checksum mismatch in {source.path}: the stored bytes of {n} lea"
            f"{'ves' if n != 1 else 'f'} changed since they were saved:\n"
            + "\n".join(bad)
            + "\nhint: the checkpoint is damaged; restore an earlier one, or pass verify=False "
            "to load it anyway."
        )


def finish_leaf(x: Any, rec: LeafRecord, dtype: Any) -> Any:
    """Stored array -> the leaf the user gets: typed keys rewrapped, floats cast to ``dtype``."""
    if rec.key_impl is not None:
        return jax.random.wrap_key_data(x, impl=rec.key_impl)
    if STORED_AS.get(rec.dtype) == rec.stored_dtype:
        # device_put: a zero-size bitcast forgets its sharding
        x = jax.device_put(jax.lax.bitcast_convert_type(x, parse_dtype(rec.dtype)), x.sharding)
    want = _leaf_target_dtype(rec, dtype)
    return x if want is None or x.dtype == want else x.astype(want)


def partial_wrap(impl: str) -> Any:
    return lambda data: jax.random.wrap_key_data(data, impl=impl)


def _abstract_leaf(leaf: LeafRecord, dtype: Any) -> jax.ShapeDtypeStruct:
    if leaf.key_impl is not None:
        data = jax.ShapeDtypeStruct(leaf.stored_shape, jnp.uint32)
        return jax.eval_shape(partial_wrap(leaf.key_impl), data)
    return jax.ShapeDtypeStruct(leaf.shape, _leaf_target_dtype(leaf, dtype))


def abstract_tree(record: Record, dtype: Any = None) -> dict[str, Any]:
    """A nested dict of ``ShapeDtypeStruct`` mirroring the record (floats cast to ``dtype``)."""
    items = [(_storage_key(leaf.path), _abstract_leaf(leaf, dtype)) for leaf in record.leaves]
    return _nest(items, "record")


def planning_tree(record: Record) -> dict[str, Any]:
    """:func:`abstract_tree` for planning without the model code: leaves whose metadata
    carried axis names at save time (linen ``LogicallyPartitioned``, NNX ``out_sharding``)
    are boxed again with those names, so :class:`Rules` fall back to them exactly as they
    would on the live model. Needs Flax for the box; without it the names are dropped."""
    tree = abstract_tree(record)
    if not any(leaf.names for leaf in record.leaves):
        return tree
    try:
        from flax.linen import LogicallyPartitioned
    except ImportError:
        return tree
    items = []
    flat = {leaf.path: leaf for leaf in record.leaves}
    for keys, sds in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaf = flat[format_path(keys)]
        value = sds if not leaf.names else LogicallyPartitioned(sds, tuple(leaf.names))
        items.append((leaf.key, value))
    return _nest(items, "record")


def abstract_like(source: Source, dtype: Any = None) -> Any:
    """The abstract container a checkpoint describes: Orbax's own structure (lists stay
    lists) for plain Orbax checkpoints, nested dicts from the record otherwise."""
    if source.template is None:
        return abstract_tree(source.record, dtype)
    by_path = source.record.by_path()
    keys, treedef = jax.tree_util.tree_flatten_with_path(source.template)
    leaves = [_abstract_leaf(by_path[format_path(path)], dtype) for path, _ in keys]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def restore(
    directory: str | os.PathLike[str],
    *,
    like: Any = None,
    specs: Any = None,
    mesh: Any = None,
    dtype: Any = None,
    partial: bool = False,
    verify: bool = True,
) -> Any:
    """Restore a checkpoint, every leaf read directly into its planned sharding.

    Args:
        directory: a checkpoint written by :func:`save`, by Orbax's
            ``StandardCheckpointer``, or a step directory of an Orbax ``CheckpointManager``.
        like: a concrete or abstract container (``jax.eval_shape``, ``nnx.eval_shape``)
            giving the type to return; without it a nested dict of arrays is rebuilt from
            the checkpoint's record (or Orbax metadata).
        specs: one spec-like for the whole container (``P()``, :class:`Rules`,
            :func:`fsdp`, ...), planned on ``mesh`` by the same pipeline as :func:`shard`.
            Default with a mesh: the specs the checkpoint was saved with.
        mesh: the target mesh (an ``AbstractMesh`` is made concrete). Without a mesh each
            leaf takes ``like``'s sharding, else the saved mesh if this host has exactly
            its devices, else the first local device.
        dtype: cast floating-point leaves to this dtype (stored values are verified
            first).
        partial: restore only the leaves both sides have: extra checkpoint leaves are
            skipped and missing ones keep ``like``'s (concrete) values.
        verify: check each leaf's checksum against the record.

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
    source = locate(directory)
    record = source.record
    if like is None:
        like = abstract_like(source, dtype)
    flat = split(like)
    paths, arrays = flat.paths, flat.arrays
    stored = record.by_path()
    missing, extra, changed = _diff(paths, arrays, stored, dtype)
    concrete_missing = all(
        not isinstance(x, jax.ShapeDtypeStruct)
        for p, x in zip(paths, arrays, strict=True)
        if p not in stored
    )
    allowed = partial and concrete_missing
    rows = changed + ([] if allowed else missing) + ([] if partial else extra)
    if rows:
        hints = []
        if (missing and not allowed) or extra:
            hints.append(
                "pass partial=True to restore only the leaves both have (missing leaves then "
                "keep like's values, so like must be concrete for them)"
            )
        if changed:
            hints.append("shapes must match; pass dtype=... to cast floating leaves")
        n = len(rows)
        raise CheckpointError(
            f"checkpoint {source.path} does not match the target {type(like).__name__} "
            f"({n} difference{'s' if n != 1 else ''}, paths first):\n"
            + "\n".join(_format_diff(rows))
            + "\nhint: "
            + "; ".join(hints)
        )
    if specs is not None and mesh is None:
        raise CheckpointError("restore(specs=...) needs mesh=...: specs are planned on a mesh.")
    if mesh is not None:
        mesh = _concrete(mesh)
        p = plan(like, _saved_specs(record) if specs is None else specs, mesh)
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
                rec.stored_shape, parse_dtype(rec.stored_dtype), sharding=_stored_sharding(s, rec)
            )
    if verify:
        warm_checksums(_checked(source, targets))
    values = read_checked(source, targets)
    if verify:
        verify_checksums(source, values)
    out = []
    for path, x, s in zip(paths, arrays, shardings, strict=True):
        if path in values:
            out.append(finish_leaf(values.pop(path), stored[path], dtype))
        else:  # partial restore: a missing leaf keeps like's value
            out.append(place([x], [s])[0] if s is not None else x)
    return flat.rebuild(out)
