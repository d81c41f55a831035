"""``reshard``: a checkpoint rewritten for another mesh and specs, each stored array copied
a slab at a time from the source's store through ``stream.write_stream``, verified and
optionally cast on the way; nothing is placed on a device."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._base import CheckpointError
from .._place import plan
from .codec import parse_dtype
from .items import extras_json
from .listing import manager_step
from .reader import ArrayReader, check_holdable
from .restoring import check_cast, concrete_mesh
from .slabs import StreamLeaf
from .sources import Source, locate, planning_tree, reader_context
from .stream import Stream
from .urls import is_remote, location
from .write import check_compression, check_destination, write_checkpoint

DEFAULT_CHUNK_BYTES = 64 << 20

# a chunk's bytes hold the slab read, the slab written and TensorStore's two buffers
SLABS_PER_CHUNK = 4


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    specs: Any = None,
    mesh: Any,
    dtype: Any = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    verify: bool = True,
    overwrite: bool = False,
    drop_items: bool = False,
    progress: Callable[[int, int], None] | None = None,
    compression: str | None = None,
) -> Path:
    """Rewrite checkpoint ``src`` as ``dst``, laid out for ``specs`` on ``mesh``.

    No model code is needed (the structure comes from the checkpoint's record or Orbax
    metadata), and host memory stays near ``chunk_bytes`` however large a leaf is: each
    stored array is copied a slab at a time, verified against its checksum and optionally
    cast; nothing is placed on a device. ``dst`` is a checkpoint like any
    [`save`][modelshard.save] wrote, chunked for its new shards, and appears only when
    complete. Under several processes each writes a share of the leaves.

    Args:
        src: a checkpoint written by [`save`][modelshard.save], plain Orbax, or a manager step;
            a [`CheckpointManager`][modelshard.CheckpointManager]'s root directory stands
            for its latest complete step, as on the command line.
        dst: the new checkpoint directory, or a ``gs://``/``s3://`` URL (written in place,
            complete once its commit file is written).
        specs: a spec-like over the checkpoint's canonical paths (``P(...)``,
            [`Rules`][modelshard.Rules], [`fsdp`][modelshard.fsdp], a rules file's ``load_rules``...), planned on
            ``mesh`` as [`plan`][modelshard.plan] does. Default: the specs it was saved with.
        mesh: the target ``Mesh`` (an ``AbstractMesh`` is made concrete): it gives the
            shard shapes and the recorded layout; its devices hold no data.
        dtype: cast floating-point leaves to this floating-point dtype.
        chunk_bytes: host bytes in flight: slabs of a quarter of it are read ahead while
            one is written; a stored block of the source up to this size is read whole,
            larger ones in pieces.
        verify: check the source's checksums as leaves are read. Without it each leaf
            whose bits no ``dtype`` cast changes keeps the source's checksum, unverified
            (so a later ``restore`` still catches damage that was copied); a cast leaf gets
            the checksum of what was read, damaged or not.
        overwrite: replace ``dst`` if it is a checkpoint (anything else is refused).
        drop_items: reshard a [`CheckpointManager`][modelshard.CheckpointManager] step's
            arrays without its items and metrics (config, RNG state, data iterator,
            losses), which the new checkpoint, arrays only, cannot hold. Without it such a
            step is refused, never silently stripped: keep them by saving them again with
            the resharded state (``CheckpointManager.items(step)``, ``.metrics(step)``).
        progress: called as ``progress(bytes_done, bytes_total)`` after each slab.
        compression: how the new checkpoint stores each chunk, as in
            [`save`][modelshard.save]: None (default) or ``"zstd"``; the source may use either.

    Returns:
        The new checkpoint: its absolute path, or an ``epath.Path`` for a ``gs://`` or
        ``s3://`` URL.

    Raises:
        SpecError: the specs do not fit the checkpoint on ``mesh`` (every leaf listed).
        CheckpointError: ``src`` is missing or damaged (every leaf whose checksum does not
            match is named; nothing is published), ``dst`` exists (without
            ``overwrite``, or is not a checkpoint), ``dtype`` is not a float dtype,
            ``compression`` is not None or ``"zstd"``, or ``src`` is a manager step with
            items or metrics and ``drop_items`` is false.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> d = tempfile.mkdtemp()
        >>> src = ms.save(d + "/src", {"w": jnp.ones((8, 2))})
        >>> dst = ms.reshard(src, d + "/dst", specs=P("data"), mesh=ms.make_mesh({"data": 8}))
        >>> ms.restore(dst)["w"].sharding.spec
        P('data',)
    """
    src, _ = manager_step(src)
    check_compression(compression)
    source: Source = locate(src)
    extras = step_extras(source.path)
    if any(extras.values()) and not drop_items:
        raise CheckpointError(_not_carried(source.path, extras))
    out_path = location(dst)
    if not is_remote(out_path):
        if out_path == source.path:
            raise CheckpointError(
                f"cannot reshard {source.path} into itself: the destination is the source "
                "checkpoint; write to another path (and remove the source once the new one "
                "restores, if it should take its place)."
            )
        check_destination(out_path, overwrite=overwrite)
        if out_path.is_relative_to(source.path):
            raise CheckpointError(
                f"cannot reshard {source.path} into {out_path}: the destination is inside the "
                "source checkpoint; choose a path outside it."
            )
    record = source.record
    dtype = check_cast(dtype)
    check_holdable(source, [leaf.path for leaf in record.leaves])
    mesh = concrete_mesh(mesh)
    like = planning_tree(record)
    p = plan(like, record.saved_specs() if specs is None else specs, mesh)
    shardings = p.flat_shardings(0)
    by_path = record.by_path()
    chunks = source.write_shapes()
    context = reader_context(source)
    leaves = []
    for leaf, s in zip(p.args[0].leaves, shardings, strict=True):
        rec = by_path[leaf.path]
        leaves.append(
            StreamLeaf(
                path=rec.path,
                shape=rec.stored_shape,
                dtype=parse_dtype(rec.stored_dtype),
                read=ArrayReader(source, rec, context),
                spec=s.spec,
                key_impl=rec.key_impl,
                names=rec.names,
                chunks=chunks.get(rec.key),
                expect=rec.checksum if verify else None,
                carry=None if verify else rec.checksum,
                logical_dtype=None if rec.key_impl else parse_dtype(rec.dtype),
            )
        )
    stream = Stream(
        leaves,
        mesh=mesh,
        dtype=dtype,
        slab_bytes=max(1, chunk_bytes // SLABS_PER_CHUNK),
        whole_bytes=chunk_bytes,
        kind=record.kind,
        metadata={**record.metadata, "resharded_from": str(source.path)},
        source=str(source.path),
        progress=progress,
        compression=compression,
        values=record.values,  # the Python values (an epoch, a name) go with the arrays
    )
    write_checkpoint(out_path, stream.write, stream.record, overwrite=overwrite)
    return out_path


def step_extras(directory: Any) -> dict[str, list[str]]:
    """A manager step's item and metric names: what a resharded copy cannot carry."""
    extras = extras_json(directory)
    return {k: list(extras.get(k) or {}) for k in ("items", "metrics")}


def _not_carried(path: Any, extras: dict[str, list[str]]) -> str:
    held = " and ".join(f"{k} ({', '.join(v)})" for k, v in extras.items() if v)
    where = location(path)  # a URL stays a URL: Path("s3://b/run") would be "s3:/b/run"
    step, root = where.name, where.parent
    return (
        f"{path} is step {step} of a CheckpointManager and holds {held} beside its arrays; a "
        "resharded checkpoint holds arrays only, so they would be lost. Keep them: read "
        f"CheckpointManager({str(root)!r}).items({step}) and .metrics({step}) and save them "
        "with the resharded state; or pass drop_items=True to reshard the arrays without them."
    )
