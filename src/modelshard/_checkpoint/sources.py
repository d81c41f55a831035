"""Finding a checkpoint and what it holds, without reading any array: ``locate`` (refusing
links out of it and oversized metadata; a plain Orbax checkpoint's record inferred from its
metadata), and the abstract trees a record gives for restoring, planning or resharding."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._base import CheckpointError, dtype_name, format_path, key_name, natural_key
from .codec import logical_dtype
from .leaks import stop_leaks
from .ocdbt import OCDBT_MANIFEST, LostFile, array_keys, lost_files, metadata_entries, read_spec
from .ocdbt import context as ocdbt_context
from .record import LeafRecord, Record, dims, some
from .storage import (
    COMMIT_FILE,
    MAX_METADATA_BYTES,
    RECORD_FILE,
    RECORD_ITEM,
    STATE_ITEM,
    TREE_METADATA,
    aside_dir,
    is_marked,
    kind_of,
    nest,
    orbax_name,
    read_json,
    read_small,
    storage_key,
)
from .urls import is_remote, kvstore, location, reaching


@dataclasses.dataclass
class Source:
    """A located checkpoint: the path asked for, its Orbax tree, its record (maybe inferred)
    and, for plain Orbax, the stored tree structure (``template``)."""

    path: Path
    tree_dir: Path
    record: Record
    template: Any = None
    _tree: Any = dataclasses.field(default=None, repr=False)
    _write_shapes: dict[tuple[str, ...], tuple[int, ...]] | None = dataclasses.field(
        default=None, repr=False
    )

    def tree_metadata(self) -> Any:
        """Orbax's ``_METADATA``, parsed once (a file that does not parse raises each time)."""
        if self._tree is None:
            self._tree = json.loads(read_small(self.tree_dir / TREE_METADATA))
        return self._tree

    def write_shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        """Each stored array's write (chunk) shape by storage key, where ``_METADATA`` has it."""
        if self._write_shapes is None:
            self._write_shapes = {}
            try:
                for key, value in metadata_entries(self.tree_metadata()):
                    if shape := value.get("write_shape"):
                        self._write_shapes[key] = tuple(int(d) for d in shape)
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                pass  # unknown chunking (CheckpointError is a ValueError)
        return self._write_shapes


def store_format(source: Source) -> tuple[bool, bool]:
    """``(use_ocdbt, use_zarr3)`` as the source's ``_METADATA`` says (Orbax's defaults if unread)."""
    try:
        meta = source.tree_metadata()
        return bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", False))
    except (OSError, ValueError, AttributeError):
        return True, False


def reader_context(source: Source) -> Any:
    """The TensorStore context the reads of ``source`` share: Orbax's."""
    if store_format(source) == (True, False):
        return ocdbt_context()
    from orbax.checkpoint import type_handlers as tsu

    return tsu.get_ts_context(use_ocdbt=store_format(source)[0])


def array_spec(source: Source, name: str) -> Any:
    """The TensorStore spec Orbax's read path opens for the stored array ``name``."""
    use_ocdbt, use_zarr3 = store_format(source)
    if (use_ocdbt, use_zarr3) == (True, False):
        return read_spec(kvstore(source.tree_dir), name)
    from .._internals import ArrayReadSpec

    stop_leaks()  # Orbax's spec converts TensorStore JSON to Python
    return ArrayReadSpec(str(source.tree_dir), name, use_zarr3, use_ocdbt=use_ocdbt).json


def _manager_hint(p: Path) -> str:
    steps = sorted(int(c.name) for c in p.iterdir() if c.is_dir() and c.name.isdigit())
    if steps:
        return (
            f" It looks like a CheckpointManager directory (steps "
            f"{', '.join(map(str, steps[-5:]))}): pass a step directory such as "
            f"{p / str(steps[-1])}, or restore with modelshard.CheckpointManager(...).restore()."
        )
    return ""


def _untrusted(root: Path) -> str | None:
    """The first entry under ``root`` a reader must not open, said: a link out of it, not a
    file or directory (a named pipe blocks), metadata over ``MAX_METADATA_BYTES``."""
    real = root.resolve()
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            entry = Path(here, name)
            try:
                st = entry.lstat()
                if stat.S_ISLNK(st.st_mode):
                    target = entry.resolve()
                    if not target.is_relative_to(real):
                        return (
                            f"{entry} is a symbolic link to {target}, outside the checkpoint "
                            f"{root}; refusing to follow it."
                        )
                    st = target.stat()
            except (OSError, RuntimeError) as e:
                return f"{entry} cannot be examined ({type(e).__name__}: {e})."
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                return (
                    f"{entry} is a {kind_of(st.st_mode)}, not a regular file; a checkpoint "
                    "holds only files and directories, refusing to read it."
                )
            big = stat.S_ISREG(st.st_mode) and st.st_size > MAX_METADATA_BYTES
            if big and Path(here).name != "d":
                return (
                    f"{entry} is {st.st_size} bytes, more than the {MAX_METADATA_BYTES} that "
                    "checkpoint metadata may have; refusing to read it."
                )
    return None


def locate(directory: str | os.PathLike[str]) -> Source:
    """Find the Orbax tree and record of a checkpoint written by modelshard or plain Orbax."""
    p = location(directory)
    remote = is_remote(p)
    with reaching(p):
        found = p.exists()
    if found and not p.is_dir():
        raise CheckpointError(
            f"no checkpoint at {p}: it is a file, not a checkpoint directory "
            "(a checkpoint is the directory save() wrote)."
        )
    if not p.is_dir():
        old = aside_dir(p)
        extra = (
            f" A previous checkpoint was moved aside to {old} by an interrupted overwrite."
            if old.exists()
            else ""
        )
        raise CheckpointError(f"no checkpoint at {p}: the directory does not exist.{extra}")
    if remote and not (p / COMMIT_FILE).exists():
        raise CheckpointError(
            f"no complete checkpoint at {p}: Orbax's commit file {COMMIT_FILE} is missing "
            "(on object storage it is written last, so the save there did not finish)."
        )
    if not remote and (problem := _untrusted(p)) is not None:
        raise CheckpointError(problem)
    if (p / TREE_METADATA).exists():
        tree_dir = p
        record_file = p / RECORD_FILE
    else:
        items = [c for c in sorted(p.iterdir()) if (c / TREE_METADATA).exists()]
        named = [c for c in items if c.name == STATE_ITEM] or items
        if len(named) != 1:
            found = ", ".join(c.name for c in items) or "none"
            written = (
                p / RECORD_FILE if (p / RECORD_FILE).exists() else p / RECORD_ITEM / RECORD_FILE
            )
            if not items and written.exists():  # modelshard wrote it: its tree metadata is gone
                where = p if written.parent == p else p / STATE_ITEM
                raise CheckpointError(
                    f"checkpoint {p} is damaged: Orbax's tree metadata {where / TREE_METADATA} "
                    f"is missing, though modelshard's record {written} is there: the save "
                    "completed and the file was lost since. Restore a complete copy of the "
                    "checkpoint."
                )
            raise CheckpointError(
                f"no Orbax checkpoint at {p}: expected a _METADATA file there or "
                f"in exactly one item directory (found: {found})." + _manager_hint(p)
            )
        tree_dir = named[0]
        record_file = p / RECORD_ITEM / RECORD_FILE
    raw = read_small(tree_dir / TREE_METADATA)  # a regular file of bounded size, or refused
    try:
        tree = json.loads(raw)
    except (ValueError, RecursionError):
        tree = None  # left to the reads, which name the file
    if not remote and tree is not None:
        beside = p.name == STATE_ITEM and (p.parent / RECORD_ITEM / RECORD_FILE).exists()
        written = record_file.exists() or is_marked(p) or beside
        _check_manifest(p, tree_dir, tree, plain=not written)
    data = read_json(record_file)
    if data is not None:
        return Source(p, tree_dir, Record.from_json(data, str(record_file)), _tree=tree)
    if p.name == STATE_ITEM and (p.parent / RECORD_ITEM / RECORD_FILE).exists():
        # a manager step's arrays given alone: read as the step, whose record is beside them
        return locate(p.parent)
    if is_marked(p):
        raise CheckpointError(
            f"{record_file} is missing, but modelshard wrote {p}: without the record the "
            "leaves' paths, dtypes (typed PRNG keys) and checksums are unknown. Restore a "
            "complete copy of the checkpoint."
        )
    return _from_orbax(p, tree_dir, tree)


def _check_manifest(p: Path, tree_dir: Path, meta: Any, *, plain: bool = False) -> None:
    """Refuse, before any read, a checkpoint whose OCDBT database lost its manifest or a
    file its index names (``plain``: plain Orbax's, boxes named canonically)."""
    try:
        ocdbt = bool(meta.get("use_ocdbt", True))
        keys = array_keys(meta)
        every = [key for key, _ in metadata_entries(meta)]
    except (KeyError, TypeError, AttributeError):
        return
    if not (ocdbt and keys):
        return
    manifest = tree_dir / OCDBT_MANIFEST
    if not (manifest.exists() or manifest.is_symlink()):
        raise CheckpointError(
            f"checkpoint {p} is damaged: its OCDBT manifest {manifest}, the file that indexes "
            "its arrays, is missing. Restore a complete copy of the checkpoint."
        )
    lost = lost_files(str(tree_dir))
    if lost:
        boxes = box_parents(every) if plain else set()
        named = {".".join(k): "/".join(k[:-1] if k[:-1] in boxes else k) for k in keys}
        raise CheckpointError(_lost_message(p, lost, named))


_NAMED = 6  # the arrays a lost file's line names; the rest are counted


def _lost_message(p: Path, lost: list[LostFile], paths: dict[str, str]) -> str:
    """A line per lost file with the arrays stored in it (``paths``: Orbax's name -> path)."""
    n = len(lost)
    lines = [
        f"checkpoint {p} is damaged: {n} file{'s' if n != 1 else ''} of its OCDBT database "
        f"{'are' if n != 1 else 'is'} missing or cut short:"
    ]
    for f in lost:
        state = (
            "missing"
            if f.size is None
            else f"cut short: {f.size} bytes, the index needs {f.needed}"
        )
        names = sorted({paths.get(name, name) for name in f.names}, key=natural_key)
        held = ["part of the index of its arrays"] if f.index else []
        if names:
            held.append(f"the array{'s' if len(names) != 1 else ''} {some(names, _NAMED)}")
        lines.append(f"  {f.path}: {state}; it holds {' and '.join(held)}")
    lines.append("Restore a complete copy of the checkpoint.")
    return "\n".join(lines)


def _from_orbax(p: Path, tree_dir: Path, meta: Any) -> Source:
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(tree_dir)).tree
    except Exception as e:
        raise CheckpointError(
            f"cannot read the Orbax metadata of {tree_dir}: {type(e).__name__}: {e}"
        ) from e
    leaves, mesh = [], None
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    stored = [tuple(key_name(k) for k in keys) for keys, _ in flat]
    boxes = box_parents(stored)
    narrowed = []
    for (keys, info), key in zip(flat, stored, strict=True):
        try:
            shape = dims(list(getattr(info, "shape", ()) or ()))
        except ValueError as e:
            raise CheckpointError(
                f"{tree_dir / TREE_METADATA}: the array {format_path(keys)!r} is invalid: {e}."
            ) from e
        dtype = dtype_name(getattr(info, "dtype", None) or jnp.float32)
        spec = None
        sh: Any = getattr(info, "sharding", None)
        if type(sh).__name__ == "NamedShardingMetadata":
            axes = dict(zip(sh.axis_names, (int(s) for s in sh.shape), strict=True))
            if mesh is None:
                mesh = {"axes": axes, "axis_types": []}
            if axes == mesh["axes"]:
                spec = PartitionSpec(*sh.partition_spec)
        if type(info).__name__ == "ScalarMetadata":
            held = jax.dtypes.canonicalize_dtype(getattr(info, "dtype", None))
            if dtype_name(held) != dtype:  # a Python number Orbax stored 64-bit
                narrowed.append((len(leaves), held))
        path = format_path(key[:-1] if key[:-1] in boxes else key)
        leaves.append(LeafRecord(path, key, shape, dtype, shape, dtype, spec=spec))
    record = Record(kind="orbax", leaves=leaves, mesh=mesh, source="orbax")
    source = Source(p, tree_dir, record, template=tree, _tree=meta)
    for i, held in narrowed:
        # read as JAX holds it (int32 without x64) where it fits, else a restore asks for x64
        if _holds(source, leaves[i].key, held):
            name = dtype_name(held)
            record.leaves[i] = dataclasses.replace(leaves[i], dtype=name, stored_dtype=name)
    return source


def _holds(source: Source, key: tuple[str, ...], held: Any) -> bool:
    """Whether the number plain Orbax stored 64-bit at ``key`` fits ``held`` (a float always
    does); one that cannot be read stays 64-bit, for the restore to name its damage."""
    if not jnp.issubdtype(held, jnp.integer):
        return True
    import numpy as np
    import tensorstore as ts

    try:
        spec = array_spec(source, orbax_name(key))
        value = ts.open(spec, open=True, context=reader_context(source)).result().read().result()
    except Exception:
        return False
    info = np.iinfo(held)
    return info.min <= int(np.asarray(value)) <= info.max


def box_parents(keys: list[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """The boxes of a plain Orbax tree (``keys``: its leaves'): nodes, not the root, whose
    only child is the leaf ``value``, as Orbax stores a linen ``Partitioned`` or an NNX
    ``Variable`` (``kernel/value``) with no type recorded."""
    children: dict[tuple[str, ...], set[str]] = {}
    for key in keys:
        for i in range(len(key)):
            children.setdefault(key[:i], set()).add(key[i])
    return {
        key[:-1]
        for key in keys
        if len(key) >= 2 and key[-1] == "value" and children[key[:-1]] == {"value"}
    }


def stored_view(source: Source) -> Source:
    """``source`` with each leaf named by its stored key (``kernel/value``), not its canonical
    path (``kernel``): what a target whose dict really has a leaf ``value`` matches."""
    leaves = [dataclasses.replace(x, path=format_path(x.key)) for x in source.record.leaves]
    if all(a.path == b.path for a, b in zip(leaves, source.record.leaves, strict=True)):
        return source
    return dataclasses.replace(source, record=dataclasses.replace(source.record, leaves=leaves))


def _unboxed(tree: Any, boxes: set[tuple[str, ...]], at: tuple[str, ...] = ()) -> Any:
    """Orbax's metadata tree with each box (``box_parents``) replaced by its ``value``."""
    if isinstance(tree, dict):
        if at in boxes:
            return tree["value"]
        return {k: _unboxed(v, boxes, (*at, str(k))) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a NamedTuple: keyed by field
        fields = zip(tree._fields, tree, strict=True)  # pyright: ignore[reportAttributeAccessIssue]
        return type(tree)(*(_unboxed(v, boxes, (*at, f)) for f, v in fields))
    if isinstance(tree, list | tuple):
        return type(tree)(_unboxed(v, boxes, (*at, str(i))) for i, v in enumerate(tree))
    return tree


def _abstract_leaf(leaf: LeafRecord, dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape, logical_dtype(leaf, dtype))


def planning_tree(record: Record) -> dict[str, Any]:
    """Nested dicts of the record's leaves as ``ShapeDtypeStruct``, to plan without the model,
    each leaf saved with logical axis names boxed again with them (needs Flax)."""
    box = None
    if any(leaf.names for leaf in record.leaves):
        with contextlib.suppress(ImportError):
            from flax.linen import LogicallyPartitioned as box
    items = []
    for leaf in record.leaves:
        x = _abstract_leaf(leaf, None)
        items.append((storage_key(leaf.path), box(x, leaf.names) if box and leaf.names else x))
    return nest(items, "record")


def abstract_like(source: Source, dtype: Any = None) -> Any:
    """The abstract container a checkpoint describes: Orbax's own structure (boxes unboxed)
    for plain Orbax, else nested dicts from the record, its Python values included."""
    if source.template is None:
        items = [(storage_key(x.path), _abstract_leaf(x, dtype)) for x in source.record.leaves]
        return nest(items + [(v.key, v.value) for v in source.record.values or ()], "record")
    leaves = source.record.leaves
    boxes = {x.key[:-1] for x in leaves if x.path != format_path(x.key)}
    by_key = {x.key: x for x in leaves}
    keys, treedef = jax.tree_util.tree_flatten_with_path(_unboxed(source.template, boxes))
    out = []
    for path, _ in keys:
        key = tuple(key_name(k) for k in path)
        out.append(_abstract_leaf(by_key[(*key, "value") if key in boxes else key], dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
