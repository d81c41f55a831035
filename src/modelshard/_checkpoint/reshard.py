"""``reshard``: rewrite a checkpoint for another mesh and specs, a few leaves at a time.

Host memory stays near one chunk of leaves however large the checkpoint is: each chunk
is restored straight into its new sharding, verified, optionally cast, and written as its
own Orbax PyTree piece. The pieces are then merged into one plain Orbax checkpoint the way
Orbax merges per-process pieces (and its own partial saves): the per-piece OCDBT stores
become ``ocdbt.process_*`` stores of the result, the JSON metadata files are merged, and
Orbax's finalize step writes the root OCDBT manifest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from .._dtypes import dtype_name
from .._errors import CheckpointError
from .._plan import Plan, plan
from .checksum import checksums
from .locate import Source, locate, planning_tree
from .read import (
    check_cast,
    check_holdable,
    concrete_mesh,
    finish_leaf,
    read_checked,
    verify_checksums,
)
from .record import LeafRecord, Record, mesh_json, parse_dtype, versions
from .storage import absolute, nest, pieces_dir
from .write import check_destination, orbax_save, storable, write_atomic

DEFAULT_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass
class _Item:
    rec: LeafRecord
    sharding: Any
    host_bytes: int  # bytes materialised on this host, replicas included


def _chunks(items: list[_Item], budget: int) -> Iterator[list[_Item]]:
    chunk: list[_Item] = []
    size = 0
    for it in items:
        if chunk and size + it.host_bytes > budget:
            yield chunk
            chunk, size = [], 0
        chunk.append(it)
        size += it.host_bytes
    if chunk:
        yield chunk


def _merge_json(dst: Path, src: Path, merge: Callable[[Any, Any], Any]) -> None:
    if not src.exists():
        return
    new = json.loads(src.read_text())
    if dst.exists():
        new = merge(json.loads(dst.read_text()), new)
    dst.write_text(json.dumps(new))


def _merge_tree_metadata(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    out["tree_metadata"] = {**a.get("tree_metadata", {}), **b.get("tree_metadata", {})}
    return out


def _merge_array_metadatas(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {**a, "array_metadatas": a.get("array_metadatas", []) + b.get("array_metadatas", [])}


def _merge_piece(piece: Path, into: Path, index: int) -> None:
    """Move one piece's per-process OCDBT stores and metadata into ``into``."""
    for store in sorted(piece.glob("ocdbt.process_*")):
        # Orbax reads the process id up to the first '_' after "process"; keep it a suffix.
        os.rename(store, into / f"{store.name}piece{index:05d}")
    _merge_json(into / "_METADATA", piece / "_METADATA", _merge_tree_metadata)
    _merge_json(into / "_sharding", piece / "_sharding", lambda a, b: {**a, **b})
    for meta in sorted((piece / "array_metadatas").glob("*")):
        (into / "array_metadatas").mkdir(exist_ok=True)
        _merge_json(into / "array_metadatas" / meta.name, meta, _merge_array_metadatas)
    if not (into / "_CHECKPOINT_METADATA").exists() and (piece / "_CHECKPOINT_METADATA").exists():
        shutil.copy(piece / "_CHECKPOINT_METADATA", into / "_CHECKPOINT_METADATA")


def _finalize(directory: Path) -> None:
    import orbax.checkpoint as ocp
    from etils import epath

    use_zarr3 = bool(json.loads((directory / "_METADATA").read_text()).get("use_zarr3", False))
    ocp.PyTreeCheckpointHandler(use_zarr3=use_zarr3).finalize(epath.Path(directory))


def _host_bytes(p: Plan, leaf_index: int, rec: LeafRecord) -> int:
    leaf = p.args[0].leaves[leaf_index]
    per_device = math.prod(p.shard_shape(leaf)) * parse_dtype(rec.stored_dtype).itemsize
    extra = math.prod(rec.stored_shape[len(rec.shape) :])
    local = len([d for d in p.mesh.devices.flat if d.process_index == jax.process_index()])
    return per_device * extra * local


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
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Rewrite checkpoint ``src`` as ``dst``, laid out for ``specs`` on ``mesh``.

    No model code is needed: the structure comes from the checkpoint's record (or Orbax
    metadata), and host memory stays near ``chunk_bytes`` however large the checkpoint
    is: a few leaves at a time are read straight into their new sharding, verified,
    optionally cast, and written. ``dst`` is a checkpoint like any [`save`][modelshard.save] wrote
    (the record says it was resharded from ``src``), and it appears only when complete.
    ``modelshard reshard`` on the command line calls this.

    Args:
        src: a checkpoint written by [`save`][modelshard.save], plain Orbax, or a manager step.
        dst: the new checkpoint directory.
        specs: a spec-like over the checkpoint's canonical paths (``P(...)``,
            [`Rules`][modelshard.Rules], [`fsdp`][modelshard.fsdp], a rules file's ``load_rules``...), planned on
            ``mesh`` as [`plan`][modelshard.plan] does. Default: the specs it was saved with.
        mesh: the target ``Mesh`` (an ``AbstractMesh`` is made concrete); its devices hold
            each chunk while it passes.
        dtype: cast floating-point leaves to this floating-point dtype.
        chunk_bytes: host bytes materialised per chunk (replicas included); a leaf
            larger than this is a chunk of its own.
        verify: check the source's checksums as leaves are read.
        overwrite: replace ``dst`` if it is a checkpoint (anything else is refused).
        progress: called as ``progress(bytes_done, bytes_total)`` after each chunk.

    Returns:
        The absolute path of the new checkpoint.

    Raises:
        SpecError: the specs do not fit the checkpoint on ``mesh`` (every leaf listed).
        CheckpointError: ``src`` is missing or damaged, ``dst`` exists (without
            ``overwrite``, or is not a checkpoint), or ``dtype`` is not a float dtype.

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
    rewrite(
        src,
        dst,
        specs=specs,
        mesh=mesh,
        dtype=dtype,
        chunk_bytes=chunk_bytes,
        verify=verify,
        overwrite=overwrite,
        progress=progress,
    )
    return absolute(dst)


def rewrite(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    specs: Any = None,
    mesh: Any,
    dtype: Any = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    verify: bool = True,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Record:
    """[`reshard`][modelshard.reshard], returning the record written beside the new checkpoint."""
    source: Source = locate(src)
    out_path = absolute(dst)
    check_destination(out_path, overwrite=overwrite)
    if out_path != source.path and out_path.is_relative_to(source.path):
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
    items = []
    for i, (leaf, s) in enumerate(zip(p.args[0].leaves, shardings, strict=True)):
        rec = by_path[leaf.path]
        items.append(_Item(rec, s, _host_bytes(p, i, rec)))
    total = sum(it.rec.nbytes for it in items)
    new_leaves: list[LeafRecord] = []
    order = {leaf.path: i for i, leaf in enumerate(record.leaves)}

    def write(staging: Path) -> None:
        import orbax.checkpoint as ocp

        pieces = pieces_dir(staging)
        shutil.rmtree(pieces, ignore_errors=True)
        pieces.mkdir(parents=True)
        done = 0
        # One Checkpointer for every piece: its setup and teardown (thread pools, an
        # event loop) cost more than writing a small piece.
        ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        try:
            for k, chunk in enumerate(_chunks(items, chunk_bytes)):
                targets = {
                    it.rec.path: jax.ShapeDtypeStruct(
                        it.rec.stored_shape,
                        parse_dtype(it.rec.stored_dtype),
                        sharding=it.rec.stored_sharding(it.sharding),
                    )
                    for it in chunk
                }
                values = read_checked(source, targets)
                del targets
                # One checksum pass over the stored bits checks the source and, where
                # no cast changes them, is the new checkpoint's checksum too. Summed on
                # the host: compiling a reduction per shape would cost more resident
                # memory (compiler code and buffers) than a chunk.
                read_sums = checksums([values[it.rec.path] for it in chunk], host=True)
                if verify:
                    sums_by_path = {
                        it.rec.path: cs for it, cs in zip(chunk, read_sums, strict=True)
                    }
                    verify_checksums(source, values, sums_by_path)
                stored, logical = [], []
                for it in chunk:
                    x = values.pop(it.rec.path)
                    if it.rec.key_impl is None:
                        x = finish_leaf(x, it.rec, dtype)
                    logical.append(it.rec.dtype if it.rec.key_impl else dtype_name(x.dtype))
                    stored.append(x if it.rec.key_impl else storable(x))
                sums = list(read_sums)
                changed = [
                    i
                    for i, (it, x) in enumerate(zip(chunk, stored, strict=True))
                    if dtype_name(x.dtype) != it.rec.stored_dtype
                ]
                if changed:
                    new_sums = checksums([stored[i] for i in changed], host=True)
                    for i, cs in zip(changed, new_sums, strict=True):
                        sums[i] = cs
                for it, x, cs, dt in zip(chunk, stored, sums, logical, strict=True):
                    new_leaves.append(
                        dataclasses.replace(
                            it.rec,
                            dtype=dt,
                            stored_dtype=dtype_name(x.dtype),
                            spec=it.sharding.spec,
                            checksum=cs,
                        )
                    )
                # as in save: zero-size leaves live in the record only
                tree = nest(
                    [(it.rec.key, x) for it, x in zip(chunk, stored, strict=True) if x.size],
                    "reshard",
                )
                if tree:
                    orbax_save(pieces / f"piece{k:05d}", tree, ckptr)
                    (pieces / "merged").mkdir(exist_ok=True)
                    _merge_piece(pieces / f"piece{k:05d}", pieces / "merged", k)
                del stored, tree, values
                done += sum(it.rec.nbytes for it in chunk)
                if progress is not None:
                    progress(done, total)
            _finalize(pieces / "merged")
            new_leaves.sort(key=lambda r: order[r.path])
            os.rename(pieces / "merged", staging)
        finally:
            ckptr.close()
            shutil.rmtree(pieces, ignore_errors=True)

    new_record = Record(
        kind=record.kind,
        leaves=new_leaves,
        mesh=mesh_json(mesh),
        versions=versions(),
        metadata={**record.metadata, "resharded_from": str(source.path)},
    )
    write_atomic(
        out_path,
        write,
        new_record,
        overwrite=overwrite,
    )
    return new_record
