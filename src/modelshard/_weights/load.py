"""``load_safetensors`` and ``save_safetensors``: pretrained weights in and out.

Import: the headers give every stored tensor's name, shape and dtype; the mapping resolves
them against the target's leaves (``.mapping.resolve``, all problems at once); the
target is planned by the one pipeline ([`modelshard.plan`][modelshard.plan]); then each leaf is built
with ``jax.make_array_from_callback``, whose callback reads exactly the slice each
addressable device holds through the leaf's recipe. One leaf's reads are in flight at a
time, so host memory stays at the placed state plus, at most, one stored tensor.

Export runs the same resolution against a reference checkpoint's header (the names,
shapes and dtypes to write), inverts every recipe and writes one stored tensor at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from .._base import (
    CheckpointError,
    MappingError,
    Problem,
    Progress,
    is_abstract,
    make_mesh,
    reporter,
)
from .._base import split as split_path
from .._containers import split
from . import transforms as T
from .mapfile import checkpoint_config, load_weight_map
from .mapping import Resolution, WeightMap, resolve
from .safetensors import (
    SafetensorsFiles,
    dtype_code,
    open_safetensors,
    write_safetensors,
    write_sharded,
)

MappingLike = WeightMap | str | os.PathLike[str] | None


def as_mapping(mapping: MappingLike, *, split_dots: bool) -> WeightMap:
    """A [`WeightMap`][modelshard.WeightMap], a path to a mapping TOML file, or ``None`` (every tensor under
    its own name; ``split_dots``: ``a.b.c`` -> ``a/b/c``)."""
    if mapping is None:
        return WeightMap.identity(split_dots=split_dots)
    if isinstance(mapping, WeightMap):
        return mapping
    return load_weight_map(mapping)


def nest_paths(items: Mapping[str, Any]) -> dict[str, Any]:
    """A nested dict from ``path -> value`` (``a/b`` -> ``{"a": {"b": value}}``).

    Raises:
        MappingError: a path that is both a leaf and a parent of another leaf.
    """
    out: dict[str, Any] = {}
    problems: list[Problem] = []
    for path, value in items.items():
        node = out
        parts = split_path(path)
        for c in parts[:-1]:
            nxt = node.setdefault(c, {})
            if not isinstance(nxt, dict):
                problems.append(Problem("target", path, f"{c!r} is a leaf and a parent"))
                break
            node = nxt
        else:
            if parts[-1] in node:
                problems.append(Problem("target", path, "a leaf and a parent at once"))
            else:
                node[parts[-1]] = value
    if problems:
        raise MappingError(problems)
    return out


def target_table(like: Any) -> tuple[Any, dict[str, tuple[tuple[int, ...], Any]]]:
    flat = split(like)
    return flat, {
        p: (tuple(x.shape), x.dtype) for p, x in zip(flat.paths, flat.arrays, strict=True)
    }


def _sharding_of(x: Any) -> Any:
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding):
        if is_abstract(s.mesh):
            return NamedSharding(make_mesh(dict(s.mesh.shape)), s.spec)
        return s
    if s is not None and not isinstance(x, jax.ShapeDtypeStruct | np.ndarray):
        return s
    return SingleDeviceSharding(jax.local_devices()[0])


def build_leaf(
    node: T.Node,
    sharding: Any,
    fetch_for: Callable[[dict[Any, np.ndarray]], T.Fetch],
) -> jax.Array:
    """One target leaf from its recipe: each addressable device's slice read once.

    A device's slice of a transposed leaf (PyTorch's ``[out, in]`` into an ``[in, out]``
    kernel) is a strided view of the stored tensor's memory map; it is handed to JAX as
    it is, and the runtime's host-to-device copy, which takes arbitrary strides, writes
    it transposed into the device's buffer (XLA's blocked transpose, faster than NumPy's
    tiled copy: docs/benchmarks/weights.md): one pass over the device's bytes, no device computation
    and no resharding.
    """
    cache: dict[Any, np.ndarray] = {}
    fetch = fetch_for(cache)
    with contextlib.suppress(AttributeError):  # a whole tensor a reshape needs: read once
        fetch.wholes = {}  # type: ignore[attr-defined]
    seen: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def piece(index: Any) -> np.ndarray:
        idx = T.full_index(node.shape) if index is None else index
        norm = tuple(s.indices(d)[:2] for s, d in zip(idx, node.shape, strict=True))
        got = seen.get(norm)
        if got is None:
            got = seen[norm] = T.unaliased(node.read(tuple(slice(a, b) for a, b in norm), fetch))
        return got

    out = jax.make_array_from_callback(node.shape, sharding, piece)
    cache.clear()
    seen.clear()
    getattr(fetch, "wholes", {}).clear()
    return out


def load_safetensors(
    path: str | os.PathLike[str],
    *,
    like: Any = None,
    mapping: MappingLike = None,
    specs: Any = None,
    mesh: Any = None,
    dtype: Any = None,
    dry_run: bool = False,
    progress: Progress = True,
) -> Any:
    """Load a safetensors checkpoint (one file or a sharded index) into a container, each
    device reading only its slice of each stored tensor.

    Args:
        path: a ``.safetensors`` file, a ``model.safetensors.index.json``, a directory
            with either, or a Hugging Face Hub repository ``hf://org/name[@revision]``
            (needs ``huggingface_hub``: ``pip install 'modelshard[hf]'``): the local cache
            first, else a download of its ``*.safetensors`` and ``*.json`` files only;
            nothing is downloaded when ``HF_HUB_OFFLINE=1``.
        like: a concrete or abstract container (``nnx.eval_shape``, ``jax.eval_shape``)
            giving the leaves to fill and the type to return. Without it a nested dict of
            every mapped leaf.
        mapping: a [`WeightMap`][modelshard.WeightMap], or a path to a mapping TOML file. Default: every
            stored tensor under its own name with ``.`` read as ``/``
            (``model.norm.weight`` -> ``model/norm/weight``).
        specs: one spec-like for the container, planned on ``mesh`` by the same pipeline as
            [`shard`][modelshard.shard] (default: replicated).
        mesh: the target mesh. Without it each leaf takes ``like``'s sharding, else the
            first local device.
        dtype: cast floating-point stored tensors to this dtype first (a bfloat16 file into
            a float32 model: ``dtype="float32"``).
        dry_run: resolve and plan only: return the mapping table
            (``Resolution``; ``print`` it) without reading
            a tensor.
        progress: ``True``: a progress bar in bytes on stderr when stderr is a terminal
            and the checkpoint is 256 MiB or more; ``False``: none; a callable: called as
            ``progress(bytes_done, bytes_total)`` after each leaf instead.

    Returns:
        The container (same type as ``like``), leaves placed in their planned shardings;
        leaves the mapping keeps hold ``like``'s values. With ``dry_run``, the table.

    Raises:
        MappingError: every unmapped stored tensor, every target leaf with no source, every
            shape or dtype that does not fit after the transforms, every rule that matched
            nothing, listed at once.
        SpecError: the specs do not fit the container or the mesh.
        CheckpointError: a missing or malformed file or index, an index entry outside
            the index's directory, an ``hf://`` repository that cannot be had.

    Example:
        >>> import tempfile, numpy as np, jax, modelshard as ms
        >>> from jax.sharding import PartitionSpec as P
        >>> from modelshard._weights.safetensors import write_safetensors
        >>> w = np.arange(32, dtype=np.float32).reshape(4, 8)  # PyTorch [out, in]
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> _ = write_safetensors(path, [("fc.weight", w.shape, w.dtype)], lambda n: w)
        >>> like = {"fc": {"kernel": jax.ShapeDtypeStruct((8, 4), np.float32)}}
        >>> wm = ms.WeightMap([ms.MapRule(r"(\\w+)\\.weight", "{1}/kernel", transpose=(1, 0))])
        >>> out = ms.load_safetensors(path, like=like, mapping=wm,
        ...                           specs=P("data"), mesh=ms.make_mesh({"data": 8}))
        >>> out["fc"]["kernel"].sharding.spec, bool((out["fc"]["kernel"] == w.T).all())
        (P('data',), True)
    """
    wm = as_mapping(mapping, split_dots=True)
    with open_safetensors(path) as files:
        return load_with(files, like, wm, specs, mesh, dtype, dry_run, progress)


def load_with(
    files: SafetensorsFiles,
    like: Any,
    wm: WeightMap,
    specs: Any,
    mesh: Any,
    dtype: Any,
    dry_run: bool,
    progress: Progress,
) -> Any:
    wm = wm.with_config(checkpoint_config(files.path))
    like, flat, res = resolve_target(wm, files.table(), like, dtype)
    shardings = leaf_shardings(like, flat, specs, mesh)
    if dry_run:
        return res
    total = sum(math.prod(n.shape) * n.dtype.itemsize for n in res.recipes.values())
    with reporter(progress, total, "Loading safetensors") as report:
        return place_mapped(flat, res, shardings, files.fetch, report)


def resolve_target(
    wm: WeightMap, table: Mapping[str, tuple[tuple[int, ...], Any]], like: Any, dtype: Any
) -> tuple[Any, Any, Resolution]:
    """``(like, its Flat, the resolution)``; without ``like``, a nested dict of
    ``ShapeDtypeStruct`` of every mapped leaf stands in for it."""
    if like is not None:
        flat, targets = target_table(like)
        res = resolve(wm, table, targets, dtype=dtype)
        abstract = [
            p
            for p, x in zip(flat.paths, flat.arrays, strict=True)
            if p in res.kept and isinstance(x, jax.ShapeDtypeStruct)
        ]
        if abstract:
            raise MappingError([_abstract_kept(p) for p in abstract])
        return like, flat, res
    res = resolve(wm, table, None, dtype=dtype)
    like = nest_paths({p: jax.ShapeDtypeStruct(n.shape, n.dtype) for p, n in res.recipes.items()})
    return like, split(like), res


def leaf_shardings(like: Any, flat: Any, specs: Any, mesh: Any) -> list[Any]:
    """One sharding per array leaf: planned by [`modelshard.plan`][modelshard.plan] on ``mesh``
    (``specs`` default: replicated), else ``like``'s own, else the first local device."""
    if specs is not None and mesh is None:
        raise CheckpointError("specs=... needs mesh=...: specs are planned on a mesh.")
    if mesh is None:
        return [_sharding_of(x) for x in flat.arrays]
    from jax.sharding import PartitionSpec

    from .._place import plan

    if is_abstract(mesh):
        mesh = make_mesh(dict(mesh.shape), axis_types=tuple(mesh.axis_types))
    return plan(like, PartitionSpec() if specs is None else specs, mesh).flat_shardings(0)


def place_mapped(
    flat: Any,
    res: Resolution,
    shardings: list[Any],
    fetch_for: Callable[[dict[Any, np.ndarray]], T.Fetch],
    progress: Callable[[int, int], None] | None = None,
) -> Any:
    """Every leaf of ``flat`` built from its recipe (kept leaves: ``like``'s value placed)."""
    total = sum(int(np.prod(n.shape)) * n.dtype.itemsize for n in res.recipes.values())
    done = 0
    out = []
    for path, x, s in zip(flat.paths, flat.arrays, shardings, strict=True):
        node = res.recipes.get(path)
        if node is None:
            out.append(keep_value(path, x, s))
            continue
        out.append(build_leaf(node, s, fetch_for))
        done += int(np.prod(node.shape)) * node.dtype.itemsize
        if progress is not None:
            progress(done, total)
    return flat.update_inplace(out)


@dataclasses.dataclass(frozen=True)
class MappedLeaf:
    """One target leaf of a mapped import, computed a run of rows at a time: what a
    streaming checkpoint writer consumes (``modelshard convert``).

    Attributes:
        path: the canonical target path.
        shape: its shape.
        dtype: its dtype.
        spec: its planned ``PartitionSpec`` on the mesh (``None``: not on a mesh).
        read: ``read(index)``: the block ``index`` (a tuple of slices, one per
            dimension; ``()`` for a 0-d leaf) as a C-order NumPy array; the stored tensors
            are read as in a load (whole rows: one positioned read; across the rows: from
            the tensor's memory map, closed once the leaf's last element is read).
        nbytes: its size in bytes.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: Any
    read: Callable[[tuple[slice, ...]], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def mapped_leaves(
    files: SafetensorsFiles,
    *,
    like: Any = None,
    mapping: MappingLike = None,
    specs: Any = None,
    mesh: Any = None,
    dtype: Any = None,
) -> tuple[Resolution, list[MappedLeaf]]:
    """Resolve and plan a safetensors import (as ``load_safetensors`` does, every problem
    at once) without reading a tensor: the mapping table and one ``MappedLeaf`` per
    target leaf, in container order, each reading only what its rows need when asked.

    ``files`` must stay open while the leaves are read.
    """
    wm = as_mapping(mapping, split_dots=True).with_config(checkpoint_config(files.path))
    like, flat, res = resolve_target(wm, files.table(), like, dtype)
    shardings = leaf_shardings(like, flat, specs, mesh)
    out = []
    for path, x, s in zip(flat.paths, flat.arrays, shardings, strict=True):
        spec = s.spec if isinstance(s, NamedSharding) else None
        node = res.recipes.get(path)
        if node is None:  # kept: like's value
            value = np.asarray(jax.device_get(keep_value(path, x, None)))
            read = functools.partial(_value_block, value)
            out.append(MappedLeaf(path, value.shape, value.dtype, spec, read))
        else:
            read = _BlockReader(node, files.fetch)
            out.append(MappedLeaf(path, node.shape, node.dtype, spec, read))
    return res, out


def _value_block(value: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    return value[index] if index else value


class _BlockReader:
    """``read(index)`` of one target leaf through its recipe; the tensors mapped or read
    whole for it are dropped once its last element has been read."""

    def __init__(self, node: T.Node, fetch_for: Callable[[dict[Any, np.ndarray]], T.Fetch]):
        self.node = node
        self.cache: dict[Any, np.ndarray] = {}
        self.fetch = fetch_for(self.cache)

    def __call__(self, index: tuple[slice, ...]) -> np.ndarray:
        shape = self.node.shape
        norm = T.norm_index(index, shape)
        block = T.contiguous(self.node.read(norm, self.fetch))
        if all(s.stop == d for s, d in zip(norm, shape, strict=True)):
            self.cache.clear()  # blocks come in C order: this was the last
        return block


def keep_value(path: str, x: Any, sharding: Any) -> Any:
    """A kept leaf (no stored tensor): ``like``'s value, placed on its planned sharding."""
    from .._place import place

    if isinstance(x, jax.ShapeDtypeStruct):
        raise MappingError([_abstract_kept(path)])
    return x if sharding is None else place([x], [sharding])[0]


def _abstract_kept(path: str) -> Problem:
    return Problem(
        "target",
        path,
        "kept (no stored tensor) but like holds no value for it",
        hint="pass a concrete like for kept leaves (a freshly initialised model)",
        cause="a kept leaf with no value in like",
    )


def save_safetensors(
    path: str | os.PathLike[str],
    state: Any,
    *,
    reference: Any = None,
    mapping: MappingLike = None,
    dtype: Any = None,
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str | None = None,
    progress: Progress = True,
    untie: bool = False,
) -> Path:
    """Write ``state`` as safetensors: in its own names, or in a checkpoint's names, shapes
    and dtypes (the import mapping run backwards).

    Without ``reference``, every leaf is written under its canonical path with ``.`` for
    ``/`` (``layers/0/up/kernel`` -> ``layers.0.up.kernel``), as it is: what
    ``load_safetensors`` with the default mapping reads back as the same tree, bit for
    bit. With ``reference``, the tensors ``mapping`` imports from it, computed from
    ``state``, one at a time.

    Args:
        path: the ``.safetensors`` file to write (replaced once complete; missing parent
            directories are created, as ``save_pretrained`` creates its directory). With
            ``max_shard_size``: a directory, a ``name.safetensors`` or a
            ``name.safetensors.index.json`` (see ``max_shard_size``).
        state: the container (a fine-tuned model); its leaves may be sharded (each is
            gathered to the host on its own, when written).
        reference: the checkpoint the mapping was written for (a file, index, directory
            or ``hf://org/name[@revision]`` whose headers give the names, shapes and dtypes
            to write), or a container of those (``{"fc.weight": jax.ShapeDtypeStruct(...)}``).
            Default: none, ``state`` in its own names.
        mapping: the same mapping that imports ``reference`` into ``state`` (needs
            ``reference``).
        dtype: without ``reference``: write floating-point leaves in this dtype
            (``"bfloat16"``); with it: the ``dtype`` the import was given (the export
            casts back to the reference's dtypes).
        metadata: ``__metadata__`` strings for the header (default: the reference's;
            without one ``{"format": "pt"}``, which ``transformers`` expects).
        max_shard_size: write Hugging Face's sharded layout, as ``save_pretrained`` does:
            files ``model-00001-of-0000n.safetensors`` of at most this many bytes each (an
            int, or ``"5GB"``, ``"500MB"``, ``"2GiB"``; a larger tensor gets a file of its
            own) and ``model.safetensors.index.json`` (``metadata.total_size``,
            ``weight_map``), in the directory ``path`` (or beside ``path`` when it names
            a ``.safetensors`` file or an index, whose stem replaces ``model``). When
            everything fits one file it is ``model.safetensors`` alone. Shards of an
            earlier layout under the same names are removed once the new one is
            complete.
        progress: ``True``: a progress bar in bytes on stderr when stderr is a terminal
            and the export is 256 MiB or more; ``False``: none; a callable: called as
            ``progress(bytes_done, bytes_total)`` after each tensor instead.
        untie: with ``reference``: leaves an ``also`` rule filled from a stored tensor (a
            head tied to the embedding) are written under their rule's ``untied`` name
            (``lm_head.weight``) instead of being checked against that tensor.

    Returns:
        The path written: the file, or the index of a sharded checkpoint. Importing it
        again gives ``state`` back bit for bit (casts that lose precision aside).

    Raises:
        MappingError: the mapping does not fit the reference and the state (the same
            checks as an import); without a reference, leaves that cannot be written in
            their own names (a ``.`` inside a path component, a dtype safetensors has no
            code for, such as a PRNG key), every one listed; an ``also`` leaf that no
            longer equals the stored tensor it was loaded from (without ``untie``; nothing
            is written).
        CheckpointError: ``path`` ends ``.index.json`` without ``max_shard_size``; a
            parent of ``path`` is a file; a malformed ``max_shard_size``.

    Example:
        >>> import tempfile, jax, numpy as np, jax.numpy as jnp, modelshard as ms
        >>> table = {"fc.weight": jax.ShapeDtypeStruct((4, 8), np.float32)}  # [out, in]
        >>> wm = ms.WeightMap([ms.MapRule(r"(\\w+)\\.weight", "{1}/kernel", transpose=(1, 0))])
        >>> state = {"fc": {"kernel": jnp.ones((8, 4))}}
        >>> p = ms.save_safetensors(tempfile.mkdtemp() + "/out.safetensors", state,
        ...                         reference=table, mapping=wm)
        >>> ms.load_safetensors(p, like=state, mapping=wm)["fc"]["kernel"].shape
        (8, 4)

        Without a reference, sharded:

        >>> state = {"layers": [{"w": jnp.zeros((64, 64))}, {"w": jnp.ones((64, 64))}]}
        >>> p = ms.save_safetensors(tempfile.mkdtemp(), state, max_shard_size="20KB")
        >>> p.name, sorted(f.name for f in p.parent.glob("*.safetensors"))
        ('model.safetensors.index.json', ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
        >>> ms.load_safetensors(p)["layers"]["1"]["w"].sum()
        Array(4096., dtype=float32)
    """
    if reference is None:
        if mapping is not None:
            raise MappingError(
                [
                    Problem(
                        "mapping",
                        "",
                        "a mapping exports to a reference's names, shapes and dtypes, and "
                        "no reference= was given",
                        hint="pass reference= (the checkpoint the mapping imports), or drop "
                        "mapping= to write the state in its own names",
                    )
                ]
            )
        items, compute = canonical_export(state, dtype)
        meta: Mapping[str, str] = {"format": "pt"}
    else:
        wm = as_mapping(mapping, split_dots=True)
        table, meta, sizes = reference_table(reference)
        wm = wm.with_config(sizes)
        ex = Exporter.of_state(state, table, wm, dtype, untie=untie)
        ex.check_also()  # a refused export writes nothing
        items = [(n, ex.table[n][0], ex.table[n][1]) for n in ex.order]
        compute = ex.compute
    return write_export(
        path,
        items,
        compute,
        metadata if metadata is not None else meta,
        max_shard_size=max_shard_size,
        progress=progress,
    )


Entry = tuple[str, tuple[int, ...], Any]


def canonical_export(state: Any, dtype: Any = None) -> tuple[list[Entry], Callable[[str], Any]]:
    """Every leaf of ``state`` as a stored tensor named by its canonical path with ``.``
    for ``/`` (floating leaves cast to ``dtype``), and ``compute(name)``: that leaf on
    the host, gathered from its devices when asked (one leaf at a time).

    Raises:
        MappingError: every leaf whose name would not read back (a ``.`` in a path
            component) or whose dtype safetensors cannot store.
    """
    flat, targets = target_table(state)
    cast = None if dtype is None else np.dtype(dtype)
    items: list[Entry] = []
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for (path, (shape, dt)), x in zip(targets.items(), flat.arrays, strict=True):
        dotted = [c for c in split_path(path) if "." in c]
        if dotted:
            problems.append(
                Problem(
                    "state",
                    path,
                    f"path component {dotted[0]!r} holds a '.', which loading reads as '/'",
                    hint="rename it, or export with reference= and mapping=",
                )
            )
            continue
        try:
            floating = np.issubdtype(np.dtype(dt), np.floating)
            out = cast if cast is not None and floating else np.dtype(dt)
            dtype_code(out)
        except (TypeError, CheckpointError):
            problems.append(
                Problem(
                    "state",
                    path,
                    f"dtype {dt} has no safetensors code",
                    hint="export the parameters only (nnx.state(model, nnx.Param)), or "
                    "convert this leaf first",
                )
            )
            continue
        name = path.replace("/", ".")
        items.append((name, tuple(shape), out))
        values[name] = x
    if problems:
        raise MappingError(problems)

    want = {name: dt for name, _, dt in items}

    def compute(name: str) -> list[np.ndarray]:
        return [
            a if a.dtype == want[name] else a.astype(want[name])
            for a in host_rows(values[name], name)
        ]

    return items, compute


def host_rows(x: Any, name: str = "") -> list[np.ndarray]:
    """One leaf on the host as blocks of whole rows, in order: a leaf sharded along its
    first axis only is its shards' own buffers, written one after the other without
    assembling the leaf; any other leaf is ``[host_leaf(x)]``."""
    if isinstance(x, jax.Array) and x.is_fully_addressable and x.ndim > 0:
        blocks: dict[tuple[int, int], Any] = {}
        for shard in x.addressable_shards:
            idx = [s.indices(d)[:2] for s, d in zip(shard.index, x.shape, strict=True)]
            if any(lo != 0 or hi != d for (lo, hi), d in zip(idx[1:], x.shape[1:], strict=True)):
                break
            blocks.setdefault(idx[0], shard.data)
        else:
            spans = sorted(blocks)
            if (
                spans
                and spans[0][0] == 0
                and spans[-1][1] == x.shape[0]
                and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            ):
                return [np.asarray(blocks[s]) for s in spans]
    return [host_leaf(x, name)]


def host_leaf(x: Any, name: str = "") -> np.ndarray:
    """One leaf as a fresh NumPy array, assembled from its addressable shards (each
    distinct block copied once), so that nothing stays attached to the ``jax.Array``:
    ``np.asarray(x)`` / ``jax.device_get(x)`` cache the host copy on the array, which
    keeps every leaf written so far alive, and an export would peak at twice the state.

    Raises:
        CheckpointError: the array spans several processes (not all of it here).
    """
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if not x.is_fully_addressable:
        raise CheckpointError(
            f"{name or 'a leaf'}: spans several processes; save_safetensors writes from one "
            "process (gather it first, or write a checkpoint with save())"
        )
    out = np.empty(x.shape, x.dtype)
    done: set[tuple[tuple[int, int], ...]] = set()
    for shard in x.addressable_shards:
        key = tuple(s.indices(d)[:2] for s, d in zip(shard.index, x.shape, strict=True))
        if key not in done:
            done.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


def write_export(
    path: str | os.PathLike[str],
    items: list[Entry],
    compute: Callable[[str], Any],
    metadata: Mapping[str, str] | None,
    *,
    max_shard_size: int | str | None = None,
    progress: Progress = True,
) -> Path:
    """Write ``items`` (name, shape, dtype), each computed when written: one file, or
    Hugging Face's sharded layout with ``max_shard_size``; progress in bytes."""
    total = sum(math.prod(shape) * np.dtype(dt).itemsize for _, shape, dt in items)
    with reporter(progress, total, "Writing safetensors") as report:
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            if report is not None:
                report(done[0], total)

        if max_shard_size is None:
            return write_safetensors(path, items, compute, metadata, step)
        return write_sharded(path, items, compute, metadata, max_shard_size, step)


def reference_table(
    reference: Any,
) -> tuple[dict[str, tuple[tuple[int, ...], Any]], dict[str, str], dict[str, int]]:
    """``(name -> (shape, dtype), metadata, config sizes)`` of an export's reference: a
    safetensors file/index/directory (its headers, and the ``config.json`` beside it), or
    any container (its leaves' paths; no metadata, no sizes)."""
    if isinstance(reference, str | os.PathLike):
        with open_safetensors(reference) as ref:
            return ref.table(), dict(ref.metadata), checkpoint_config(ref.path)
    return target_table(reference)[1], {}, {}


class Exporter:
    """The stored tensors of a reference computed from target leaves by the inverted
    mapping, one at a time (``compute`` in ``order``); each target leaf is loaded to the
    host once (``load(path)``) and dropped when no later tensor reads it.

    A stored tensor that an ``also`` rule copied into more leaves is written once, from
    its first rule's leaf; ``check_also`` (run by every export before anything is
    written) refuses an ``also`` leaf that no longer equals it. With ``untie`` each such
    leaf is written instead under its rule's ``untied`` name.

    Args:
        targets: the target leaves, path -> (shape, dtype).
        load: ``load(path)``: that target leaf as a NumPy array (from a state on the
            devices, or from a checkpoint one leaf at a time).
        table: the reference's stored tensors, name -> (shape, dtype).
        wm: the import mapping.
        dtype: the import's ``dtype``.
        untie: write ``also`` leaves under their rules' ``untied`` names.

    Raises:
        MappingError: the mapping does not fit; ``untie`` with an ``also`` rule that
            names no ``untied`` tensor.
    """

    def __init__(
        self,
        targets: Mapping[str, tuple[tuple[int, ...], Any]],
        load: Callable[[str], np.ndarray],
        table: Mapping[str, tuple[tuple[int, ...], Any]],
        wm: WeightMap,
        dtype: Any,
        *,
        untie: bool = False,
    ):
        res = resolve(wm, table, targets, dtype=dtype, export=True)
        self.load = load
        self.sources = invert_resolution(res)
        # (stored name, also leaf paths, rule index, the stored tensor from those leaves)
        self.also: list[tuple[str, list[str], int, T.Node]] = []
        table = dict(table)
        problems: list[Problem] = []
        for i, (paths, inverse) in invert_also(res).items():
            for name, node in inverse.items():
                leaves = [p for p in paths if name in res.recipes[p].reads()]
                if name not in self.sources:  # its first rule skips it: written from here
                    self.sources[name] = node
                elif untie:
                    untied = wm.format_untied(i, name)
                    if untied is None:
                        problems.append(
                            Problem(
                                "mapping",
                                f"rules[{i}]",
                                f"untie=True, but this also rule names no untied tensor to "
                                f"write {', '.join(leaves)} as",
                                hint='give the rule untied="..." (lm_head.weight)',
                            )
                        )
                        continue
                    if untied in table:
                        problems.append(
                            Problem(
                                "source",
                                untied,
                                f"untie=True writes {', '.join(leaves)} as {untied} "
                                f"(rules[{i}]), but the reference already has it",
                            )
                        )
                        continue
                    table[untied] = (tuple(node.shape), node.dtype)
                    self.sources[untied] = node
                else:
                    self.also.append((name, leaves, i, node))
        if problems:
            raise MappingError(problems)
        self.table = table
        self.order = [n for n in table if n in self.sources]
        self._pos = {n: i for i, n in enumerate(self.order)}
        last: dict[str, int] = {}
        for i, n in enumerate(self.order):
            for k in self.sources[n].reads():
                last[k] = i
        self._last = last
        self._cache: dict[str, np.ndarray] = {}

    @classmethod
    def of_state(
        cls,
        state: Any,
        table: Mapping[str, tuple[tuple[int, ...], Any]],
        wm: WeightMap,
        dtype: Any,
        *,
        untie: bool = False,
    ) -> Exporter:
        """An exporter reading the leaves of ``state`` (fetched from its devices)."""
        flat, targets = target_table(state)
        values = dict(zip(flat.paths, flat.arrays, strict=True))
        return cls(
            targets,
            lambda p: host_leaf(values[p], p),
            table,
            wm,
            dtype,
            untie=untie,
        )

    def _fetch(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        whole = self._cache.get(key)
        if whole is None:
            whole = self._cache[key] = self.load(key)
        return whole[index]

    def compute(self, name: str) -> np.ndarray:
        value = self.sources[name].read(None, self._fetch)
        i = self._pos[name]
        for k in self.sources[name].reads():
            if self._last[k] <= i:
                self._cache.pop(k, None)
        return value

    def check_also(self) -> None:
        """Refuse ``also`` leaves that no longer equal the tensor they were loaded from
        (each compared, bit for bit, with what its first rule's leaf writes).

        Raises:
            MappingError: every such leaf, named, with how many elements differ.
        """
        problems: list[Problem] = []
        for name, leaves, i, node in self.also:
            cache: dict[str, np.ndarray] = {}

            def fetch(key: str, index: tuple[slice, ...], cache: dict = cache) -> np.ndarray:
                whole = cache.get(key)
                if whole is None:
                    whole = cache[key] = self.load(key)
                return whole[index]

            want = T.contiguous(self.sources[name].read(None, fetch))
            got = T.contiguous(node.read(None, fetch))
            cache.clear()
            bits = np.dtype(f"u{want.dtype.itemsize}") if want.dtype.itemsize <= 8 else None
            if bits is None:
                same = want.tobytes() == got.tobytes()
                differ = 0 if same else want.size
            else:
                differ = int(np.count_nonzero(want.view(bits) != got.view(bits)))
            if differ:
                problems.append(
                    Problem(
                        "target",
                        ", ".join(leaves),
                        f"filled from {name} by rules[{i}] (also=True), but no longer "
                        f"equals it: {differ} of {want.size} elements of {name} differ; "
                        f"the export writes {name} once, from its first rule's leaf",
                        hint="tie the two in training, or export untied "
                        "(untie=True and the rule's untied= name)",
                        cause="an also leaf no longer equals its stored tensor",
                    )
                )
        if problems:
            raise MappingError(problems)


def unmap(
    state: Any,
    *,
    reference: Any,
    mapping: MappingLike = None,
    dtype: Any = None,
    untie: bool = False,
) -> Any:
    r"""``state`` in the layout of ``reference``: the mapping that imports ``reference`` into
    ``state``, run backwards, on this host.

    Args:
        state: the container in the target layout (an NNX model).
        reference: the source layout: a container (concrete or abstract, e.g. a linen
            model's ``jax.eval_shape(init)``; the result has its type) or a safetensors
            file (the result is a dict of stored name -> array).
        mapping: the import mapping (a [`WeightMap`][modelshard.WeightMap] or a TOML path).
        dtype: the ``dtype`` the import was given.
        untie: as for [`save_safetensors`][modelshard.save_safetensors] (a safetensors
            reference: the untied tensor is one more entry of the result).

    Returns:
        The reference's container with NumPy leaves computed from ``state``; write it with
        [`save`][modelshard.save] to get a checkpoint the other code base restores. Leaves a
        rule skips keep the reference's (concrete) values.

    Raises:
        MappingError: the mapping does not fit ``reference`` and ``state``; an ``also``
            leaf no longer equals the stored tensor it was loaded from (without ``untie``).

    Example:
        >>> import jax, numpy as np, modelshard as ms
        >>> wm = ms.WeightMap([ms.MapRule(r"params/layers/(\w+)", "layers/{i}/{1}",
        ...                               unstack=ms.Unstack("i"))])
        >>> scanned = {"params": {"layers": {"w": jax.ShapeDtypeStruct((2, 3), np.float32)}}}
        >>> state = {"layers": {"0": {"w": np.zeros(3, np.float32)}, "1": {"w": np.ones(3, np.float32)}}}
        >>> ms.unmap(state, reference=scanned, mapping=wm)["params"]["layers"]["w"].tolist()
        [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    wm = as_mapping(mapping, split_dots=isinstance(reference, str | os.PathLike))
    table, _, sizes = reference_table(reference)
    wm = wm.with_config(sizes)
    ex = Exporter.of_state(state, table, wm, dtype, untie=untie)
    ex.check_also()
    if isinstance(reference, str | os.PathLike):
        return {n: ex.compute(n) for n in ex.order}
    flat = split(reference)
    homeless = [n for n in ex.order if n not in table]  # table: the container's paths
    if homeless:  # untie=True: the untied tensors have no leaf in a container
        raise MappingError(
            [
                Problem(
                    "source",
                    n,
                    "untie=True writes this tensor, but the reference container has no such leaf",
                    hint="untie a safetensors reference, or give the container the leaf",
                )
                for n in homeless
            ]
        )
    out = []
    for path, x in zip(flat.paths, flat.arrays, strict=True):
        if path in ex.sources:
            out.append(ex.compute(path))
        else:
            out.append(_no_value(path) if isinstance(x, jax.ShapeDtypeStruct) else x)
    return flat.rebuild(out)


def _no_value(path: str) -> Any:
    raise MappingError(
        [
            Problem(
                "source",
                path,
                "a rule skips this leaf, and the reference holds no value for it",
                hint="pass a concrete reference, or map the leaf",
            )
        ]
    )


def invert_resolution(res: Resolution) -> dict[str, T.Node]:
    """For each stored tensor the resolution reads, the recipe computing it from targets
    (from the first rule's leaf; ``also`` leaves: ``invert_also``)."""
    out: dict[str, T.Node] = {}
    pieces: dict[int, dict[str, Any]] = {}
    for path, node in res.recipes.items():
        if path not in res.also:
            T.invert(path, node, out, pieces)
    T.finish_inverse(out, pieces)
    return out


def invert_also(res: Resolution) -> dict[int, tuple[list[str], dict[str, T.Node]]]:
    """Per ``also`` rule: its leaves, and for each stored tensor it reads, the recipe
    computing that tensor from those leaves."""
    by_rule: dict[int, list[str]] = {}
    for path, i in res.also.items():
        by_rule.setdefault(i, []).append(path)
    out: dict[int, tuple[list[str], dict[str, T.Node]]] = {}
    for i, paths in by_rule.items():
        inverse: dict[str, T.Node] = {}
        pieces: dict[int, dict[str, Any]] = {}
        for path in paths:
            T.invert(path, res.recipes[path], inverse, pieces)
        T.finish_inverse(inverse, pieces)
        out[i] = (paths, inverse)
    return out
