"""Finding a checkpoint and what it holds, without reading any array.

``locate`` finds the Orbax tree and the record of a checkpoint written by modelshard or by
plain Orbax (then a record is inferred from Orbax's metadata), refusing links out of the
checkpoint and oversized metadata. The abstract trees built from a record stand in for
the model code when restoring, planning or resharding.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._errors import CheckpointError
from .._paths import format_path, key_name
from .record import (
    RECORD_FILE,
    LeafRecord,
    Record,
    dtype_name,
    parse_dtype,
)
from .write import RECORD_ITEM, STATE_ITEM, _abs, _nest, _storage_key

__all__ = ["Source", "abstract_like", "abstract_tree", "locate", "planning_tree"]


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


def _leaf_target_dtype(rec: LeafRecord, dtype: Any) -> Any:
    if rec.key_impl is not None:
        return None
    stored = parse_dtype(rec.dtype)
    if dtype is not None and jnp.issubdtype(stored, jnp.floating):
        return jnp.dtype(dtype)
    return stored


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
