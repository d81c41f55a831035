"""Writing checkpoints: ``save``, and the atomic staging that ``reshard`` and the manager share.

The state is split into the arrays stored (keyed by the components of each leaf's canonical
path; typed PRNG keys as their key data, dtypes TensorStore cannot name as their bits) and
the record beside it, written (``shards.py``) into a staging directory and renamed into
place only when complete. The names on disk are ``.storage``'s; README.md beside this
module describes the layout.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._base import (
    CheckpointError,
    canonical_dtype,
    dtype_name,
    fsync_dir,
    is_abstract,
    write_durable,
)
from .._containers import split
from .._runtime import raise_shared
from .codec import encode, is_empty, key_impl, storable
from .record import LeafRecord, Record, mesh_json, saved_spec, versions
from .remote import write_remote
from .shards import held_sums, take, write_and_commit, write_held
from .storage import (
    CHECKPOINT_METADATA,
    MAX_METADATA_BYTES,
    RECORD_FILE,
    aside_dir,
    check_names,
    is_marked,
    nest,
    orbax_tmp_dirs,
    pieces_dir,
    staging_dir,
    storage_key,
)
from .urls import is_remote, location
from .values import saved_values


def _json_problems(value: Any, where: str, depth: int = 0) -> list[str]:
    """Every entry of user ``metadata`` that JSON would not give back as it was."""
    if depth > 64:
        return [f"  {where}: nested more than 64 levels deep"]
    if value is None or isinstance(value, bool | str):
        return []
    if type(value) in (int, float):
        return []
    if isinstance(value, Mapping):
        out = []
        for k, v in value.items():
            if not isinstance(k, str):
                out.append(f"  {where}[{k!r}]: the key is a {type(k).__name__}, not a str")
            else:
                out.extend(_json_problems(v, f"{where}[{k!r}]", depth + 1))
        return out
    if isinstance(value, list | tuple):
        return [
            p for i, v in enumerate(value) for p in _json_problems(v, f"{where}[{i}]", depth + 1)
        ]
    hint = ""
    if isinstance(value, np.generic | np.ndarray | jax.Array):
        hint = " (convert it: int(x), float(x) or x.tolist())"
    return [f"  {where}: a {type(value).__module__}.{type(value).__name__}, not JSON{hint}"]


def check_metadata(metadata: Any) -> dict[str, Any]:
    """``metadata`` as the record stores it, or CheckpointError listing every entry that
    is not plain JSON (checked before any data is written)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise CheckpointError(
            f"metadata must be a dict of JSON values, got a {type(metadata).__name__}."
        )
    problems = _json_problems(metadata, "metadata")
    if not problems:
        import json

        size = len(json.dumps(metadata))
        if size > MAX_METADATA_BYTES // 2:
            problems = [f"  metadata: {size} bytes of JSON, more than {MAX_METADATA_BYTES // 2}"]
    if problems:
        n = len(problems)
        raise CheckpointError(
            f"cannot save: {n} metadata entr{'ies are' if n != 1 else 'y is'} not plain JSON "
            "(str, int, float, bool, None, lists and dicts with str keys):\n" + "\n".join(problems)
        )
    return dict(metadata)


def _leaf_problem(path: str, x: Any) -> str | None:
    """Why the leaf ``x`` at ``path`` cannot be saved, or None."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return (
            f"it is an abstract ShapeDtypeStruct {dtype_name(x.dtype)}{list(x.shape)}, not an array"
        )
    if isinstance(x, jax.Array) and x.is_deleted():
        return (
            "the array was deleted (donated to a jitted step, or .delete() called); save "
            "the step's output instead"
        )
    if isinstance(x, np.ndarray | np.generic) and x.dtype.kind in "USOMm":
        # strings, bytes, objects, dates: nothing JAX or a checkpoint's arrays can hold
        scalar = isinstance(x, np.generic)
        convert = {"U": "str(x)", "S": "bytes(x)"}.get(x.dtype.kind) if scalar else None
        return (
            f"it is a NumPy {'scalar' if scalar else 'array'} of dtype {x.dtype}, not numbers, "
            "which a checkpoint's arrays cannot hold"
            + (f"; as a Python value it is saved: {convert}" if convert else "")
        )
    if not storable(x.dtype):
        return (
            f"no checkpoint stores {dtype_name(x.dtype)} (TensorStore has no such type, and no "
            "integer of its width holds its bits); cast it to a wider dtype that holds its "
            "values exactly first (bfloat16 for a 6-bit float, int8 for int1)"
        )
    if isinstance(x, np.ndarray | np.generic) and canonical_dtype(x.dtype) != x.dtype:
        return (
            f"it is a NumPy {dtype_name(x.dtype)} array, which JAX holds as "
            f"{dtype_name(canonical_dtype(x.dtype))} with jax_enable_x64 off (its values "
            "could change); enable x64 or cast it first"
        )
    return None


def check_leaves(paths: Sequence[str], arrays: Sequence[Any]) -> None:
    """CheckpointError listing every leaf that cannot be saved as it is."""
    problems = [
        f"  {p or '<root>'}: {why}"
        for p, x in zip(paths, arrays, strict=True)
        if (why := _leaf_problem(p, x)) is not None
    ]
    if problems:
        n = len(problems)
        raise CheckpointError(
            f"cannot save {n} lea{'ves' if n != 1 else 'f'} (nothing was written):\n"
            + "\n".join(problems)
        )


def prepare(
    state: Any, metadata: Mapping[str, Any] | None = None
) -> tuple[list[tuple[tuple[str, ...], Any]], Record]:
    """Split ``state`` into the arrays stored (``(storage key, array)``, none zero-size) and
    the record beside it, whose checksums the caller starts (``shards.held_sums``); every
    check that can refuse the state is made here, before a byte is written."""
    flat = split(state)
    infos, arrays = flat.infos, flat.arrays
    if not arrays:
        raise CheckpointError(f"nothing to save: the {type(state).__name__} has no array leaves.")
    check_leaves([info.path for info in infos], arrays)
    values = saved_values(flat)
    check_names([(info.path, storage_key(info.path)) for info in infos], "cannot save")
    user_metadata = check_metadata(metadata)
    mesh = None
    for x in arrays:
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and not is_abstract(s.mesh):
            mesh = s.mesh
            break
    if mesh is not None and not all(isinstance(a, str) for a in mesh.axis_names):
        raise CheckpointError(
            f"cannot save: the arrays are placed on a mesh with axis names "
            f"{tuple(mesh.axis_names)!r}; a checkpoint records specs by axis name, so the "
            "names must be strings (modelshard.make_mesh({'data': 8}) makes such a mesh)."
        )
    stored, leaves = [], []
    for info, x in zip(infos, arrays, strict=True):
        if isinstance(x, np.ndarray | np.generic):
            x = jnp.asarray(x)
        data = encode(x)
        stored.append(data)
        leaves.append(
            LeafRecord(
                path=info.path,
                key=storage_key(info.path),
                shape=tuple(x.shape),
                dtype=dtype_name(x.dtype),
                stored_shape=tuple(data.shape),
                stored_dtype=dtype_name(data.dtype),
                key_impl=key_impl(x.dtype),
                spec=saved_spec(x, mesh),
                names=info.names,
            )
        )
    if jax.process_count() > 1:
        stored = [_replicated_if_local(x) for x in stored]
    items = [(leaf.key, x) for leaf, x in zip(leaves, stored, strict=True)]
    # canonical paths must form a tree, zero-size leaves and values included
    nest(items + [(v.key, v.value) for v in values], "save")
    # Orbax refuses zero-size arrays: the record's shape and dtype say all there is.
    arrays = [(k, x) for k, x in items if not is_empty(x.shape)]
    if not arrays:
        raise CheckpointError(
            f"nothing to save: every array leaf of the {type(state).__name__} is zero-size."
        )
    record = Record(
        kind=flat.kind,
        leaves=leaves,
        mesh=None if mesh is None else mesh_json(mesh),
        versions=versions(),
        metadata=user_metadata,
        values=values,
    )
    return arrays, record


def _replicated_if_local(x: Any) -> Any:
    """Multi-process: a leaf held by this process only (NumPy, one device), as a global
    array replicated on every device, whose first replica is written (process 0's value)."""
    if not (isinstance(x, jax.Array) and x.is_fully_addressable):
        return x
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    host = np.asarray(x)
    return jax.make_array_from_callback(
        host.shape, NamedSharding(mesh, PartitionSpec()), lambda idx: host[idx]
    )


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


def write_checkpoint(path: Path, write: Any, record: Record, *, overwrite: bool) -> None:
    """Write a checkpoint: ``write(directory)`` its arrays (every process), then the record.

    Locally into a staging directory renamed into place: a crash at any point leaves an
    existing checkpoint at ``path`` untouched; with ``overwrite`` the old one is renamed aside
    only once the new one is complete. Saves into one parent directory take turns (an flock
    on it): two saves of one path would otherwise share a staging directory. On object
    storage in place (``remote.write_remote``).
    """
    import fcntl

    if is_remote(path):
        write_remote(path, write, record, overwrite=overwrite)
        return
    staging = staging_dir(path)
    primary = jax.process_index() == 0
    lock = None
    failure: OSError | None = None  # told to every process at the start of the write
    if primary:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = os.open(path.parent, os.O_RDONLY)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as e:
            failure = e
    try:
        check_destination(path, overwrite=overwrite)
        if primary and failure is None:
            remove_leftovers(staging)
        raise_shared(failure, "modelshard:save:start", f"preparing {staging}")
        try:
            write_and_commit(
                lambda: write(staging),
                record,
                lambda: _commit(path, staging, record),
                name="modelshard:save",
                writing=f"writing {staging}",
                committing=f"committing {path}",
            )
        except BaseException:
            if primary:
                remove_leftovers(staging)
            raise
    finally:
        if lock is not None:
            os.close(lock)


def check_destination(path: Path, *, overwrite: bool) -> None:
    """Refuse to write a checkpoint at ``path`` unless nothing is there, or ``overwrite``
    and what is there is an empty directory or a checkpoint modelshard wrote (the marker in
    its ``_CHECKPOINT_METADATA``): ``overwrite`` never deletes anything else."""
    if not (path.exists() or path.is_symlink()):
        return
    if not overwrite:
        raise CheckpointError(
            f"{path} already exists; pass overwrite=True to replace it (the "
            "old checkpoint is kept until the new one is complete)."
        )
    if path.is_symlink():
        raise CheckpointError(
            f"cannot overwrite {path}: it is a symbolic link (to {path.resolve()}), not a "
            "checkpoint directory; remove the link or choose another path."
        )
    if not path.is_dir():
        raise CheckpointError(
            f"cannot overwrite {path}: it is a file, not a checkpoint; overwrite=True only "
            "replaces a checkpoint. Remove it yourself or choose another path."
        )
    if is_marked(path) or not any(path.iterdir()):
        return
    raise CheckpointError(
        f"cannot overwrite {path}: it is a directory but not a modelshard checkpoint (no "
        f"marker in its {CHECKPOINT_METADATA}), and overwrite=True only replaces a "
        "checkpoint; nothing was deleted. Choose a new path (a run folder's checkpoints "
        "belong in a directory of their own), or remove it yourself."
    )


def remove_leftovers(staging: Path) -> None:
    """Remove what a failed or killed save into ``staging`` left: the staging directory,
    reshard's pieces, and Orbax's own temporary copies of either."""
    pieces = pieces_dir(staging)
    for d in (staging, pieces, *orbax_tmp_dirs(staging), *orbax_tmp_dirs(pieces)):
        shutil.rmtree(d, ignore_errors=True)


def _commit(path: Path, staging: Path, record: Record) -> None:
    """Process 0: the record into the complete ``staging`` directory, put at ``path``."""
    write_durable(staging / RECORD_FILE, record.dumps())
    fsync_dir(staging)
    old = aside_dir(path)
    if path.exists() and _exchange(staging, path):
        old = staging  # the swap put the old checkpoint there
    else:
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(staging, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def check_compression(compression: Any) -> bool:
    """Whether ``save(compression=)`` compresses the chunks: None (the default: zstd, Orbax's
    default, costs several times the CPU time and saves little on float weights) or "zstd";
    CheckpointError otherwise."""
    if compression is None or (isinstance(compression, str) and compression == "zstd"):
        return compression is not None
    raise CheckpointError(
        f"compression={compression!r} is not one of None (each chunk's raw bytes, the "
        "default) or 'zstd' (Orbax's default codec: smaller files, several times the CPU)."
    )


def save(
    directory: str | os.PathLike[str],
    state: Any,
    *,
    overwrite: bool = False,
    metadata: Mapping[str, Any] | None = None,
    compression: str | None = None,
) -> Path:
    """Save any registered container as a sharded Orbax checkpoint with a modelshard record.

    Each process writes its own shards (Orbax's OCDBT format, which plain Orbax restores).
    Beside the data, ``modelshard.json`` records each leaf's canonical path, shape, dtype,
    saved spec and mesh, the container kind, package versions and a checksum. The directory
    appears only when complete: a failed or killed save leaves an earlier checkpoint intact.

    Args:
        directory: where to write (made absolute; its parent is created), or a
            ``gs://`` or ``s3://`` URL (written in place, complete once its commit file is).
        state: any registered container (pytree, optax state, NNX module or state, linen
            variables, Equinox module, TrainState...). Typed PRNG keys, bfloat16 and NumPy
            leaves are fine; abstract leaves are not. Leaves that are Python values
            (``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``None``) are
            stored in the record and restored with their types; functions among the leaves
            are code, not saved (``restore`` takes them from ``like``).
        overwrite: replace an existing checkpoint at ``directory``.
        metadata: JSON-serialisable user metadata stored in the record.
        compression: None (default) stores each chunk's raw bytes; ``"zstd"`` compresses
            them as Orbax does by default (a little smaller, at several times the CPU
            time). Plain Orbax and ``restore`` read either.

    Returns:
        The absolute path of the checkpoint.

    Raises:
        CheckpointError: ``directory`` exists (without ``overwrite``), a leaf is abstract
            or an object that is neither an array, a Python value nor code, two leaves
            share a canonical path, or ``compression`` is not None or ``"zstd"``.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import modelshard as ms
        >>> path = ms.save(tempfile.mkdtemp() + "/ckpt", {"w": jnp.ones((4, 2))})
        >>> ms.restore(path)["w"].shape
        (4, 2)
    """
    path = location(directory)
    compress = check_compression(compression)
    arrays, record = prepare(state, metadata)
    if not is_remote(path):  # refused before a byte is copied off the devices
        check_destination(path, overwrite=overwrite)
    # summed on the host workers from the bytes written, while they are written
    held = take(arrays, copy=False)
    record.pending = held_sums([leaf.key for leaf in record.leaves], held, "modelshard.save")
    write = functools.partial(write_held, held=held, compress=compress)
    write_checkpoint(path, write, record, overwrite=overwrite)
    return path
