"""Writing checkpoints: ``save``, and the atomic staging that ``reshard`` and the manager share.

The state is split into the nested dict Orbax stores (keyed by the components of each
leaf's canonical path; typed PRNG keys as their key data, dtypes TensorStore cannot name as
their bits) and the record beside it, written into a staging directory and renamed into
place only when complete. The names on disk are :mod:`.storage`'s; README.md beside this
module describes the layout.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._dtypes import dtype_name
from .._errors import CheckpointError
from .._flat import split
from .._mesh import is_abstract
from .checksum import start_checksums
from .record import STORED_AS, LeafRecord, Record, mesh_json, saved_spec, versions
from .storage import (
    MARKER,
    RECORD_FILE,
    absolute,
    aside_dir,
    nest,
    staging_dir,
    storage_key,
)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def storable(x: Any) -> Any:
    """``x``, or its bits in a dtype TensorStore can store (see ``STORED_AS``)."""
    to = STORED_AS.get(dtype_name(x.dtype))
    return x if to is None else jax.lax.bitcast_convert_type(x, jnp.dtype(to))


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
                key=storage_key(info.path),
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
    nest(items, "save")  # canonical paths must form a tree, zero-size leaves included
    # Orbax refuses zero-size arrays: the record's shape and dtype say all there is.
    tree = nest([(k, x) for k, x in items if x.size], "save")
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
    staging = staging_dir(path)
    old = aside_dir(path)
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
    path = absolute(directory)
    tree, record = prepare(state, metadata)
    write_atomic(path, lambda d: orbax_save(d, tree), record, overwrite=overwrite)
    return path
