"""``load_safetensors`` (each leaf one device block at a time) and ``mapped_leaves``."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping
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
from . import recipe
from .mapfile import checkpoint_config, load_weight_map
from .resolver import Resolution, resolve
from .rules import WeightMap
from .safetensors import SafetensorsFiles, open_safetensors

MappingLike = WeightMap | str | os.PathLike[str] | None


def as_mapping(mapping: MappingLike, *, split_dots: bool) -> WeightMap:
    """A ``WeightMap``, a TOML file or shipped name, or ``None``: each tensor under its name."""
    if mapping is None:
        return WeightMap.identity(split_dots=split_dots)
    if isinstance(mapping, WeightMap):
        return mapping
    return load_weight_map(mapping)


def nest_paths(items: Mapping[str, Any]) -> dict[str, Any]:
    """A nested dict from ``path -> value``; ``MappingError``: a path a leaf and a parent."""
    out: dict[str, Any] = {}
    problems: list[Problem] = []
    for path, value in items.items():
        *parents, last = split_path(path)
        node: Any = out
        for c in parents:
            node = node.setdefault(c, {}) if isinstance(node, dict) else node
        if not isinstance(node, dict) or last in node:
            problems.append(Problem("target", path, "a leaf and a parent at once"))
        else:
            node[last] = value
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
    node: recipe.Node,
    sharding: Any,
    fetch_for: Callable[[dict[Any, np.ndarray]], recipe.Fetch],
) -> jax.Array:
    """One target leaf from its recipe, each addressable device's block read once (a
    transposed block stays a strided view: the host-to-device copy takes any strides)."""
    cache: dict[Any, np.ndarray] = {}
    fetch = fetch_for(cache)
    fetch.wholes = wholes = {}  # type: ignore[attr-defined]  # what a reshape reads whole
    seen: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def piece(index: Any) -> np.ndarray:
        norm = recipe.norm_index(index, node.shape)
        key = tuple((s.start, s.stop) for s in norm)
        if key not in seen:
            seen[key] = recipe.unaliased(node.read(norm, fetch))
        return seen[key]

    out = jax.make_array_from_callback(node.shape, sharding, piece)
    cache.clear()
    seen.clear()
    wholes.clear()
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
            with either, or a Hub repository ``hf://org/name[@revision]`` (needs
            ``pip install 'modelshard[hf]'``): the local cache first, else a download of
            its ``*.safetensors`` and ``*.json`` files (none when ``HF_HUB_OFFLINE=1``).
        like: a concrete or abstract container giving the leaves to fill and the type to
            return. Without it a nested dict of every mapped leaf.
        mapping: a [`WeightMap`][modelshard.WeightMap], a mapping TOML file or a shipped
            mapping's name. Default: every stored tensor under its own name, ``.`` read as
            ``/`` (``model.norm.weight`` -> ``model/norm/weight``).
        specs: one spec-like for the container, planned on ``mesh`` as
            [`shard`][modelshard.shard] plans (default: replicated).
        mesh: the target mesh. Without it each leaf takes ``like``'s sharding, else the
            first local device.
        dtype: cast floating-point stored tensors to this dtype first (``"float32"``).
        dry_run: return the mapping table (``Resolution``; ``print`` it), reading nothing.
        progress: ``True``: a bar in bytes on stderr when it is a terminal and the
            checkpoint is 256 MiB or more; ``False``: none; a callable: called as
            ``progress(bytes_done, bytes_total)`` after each leaf.

    Returns:
        The container (same type as ``like``), leaves placed in their planned shardings;
        leaves the mapping keeps hold ``like``'s values. With ``dry_run``, the table.

    Raises:
        MappingError: every unmapped stored tensor, target leaf with no source, shape or
            dtype that does not fit, rule that matched nothing, listed at once.
        SpecError: the specs do not fit the container or the mesh.
        CheckpointError: a missing or malformed file or index, an index entry outside
            the index's directory, an ``hf://`` repository that cannot be had.

    Example:
        >>> import tempfile, numpy as np, jax, modelshard as ms
        >>> from jax.sharding import PartitionSpec as P
        >>> from modelshard._weights import write_safetensors
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
    with open_safetensors(path) as files:
        flat, res, shardings = _planned(files, like, mapping, specs, mesh, dtype)
        if dry_run:
            return res
        total = sum(math.prod(n.shape) * n.dtype.itemsize for n in res.recipes.values())
        done, out = 0, []
        with reporter(progress, total, "Loading safetensors") as report:
            for p, x, s in zip(flat.paths, flat.arrays, shardings, strict=True):
                node = res.recipes.get(p)
                if node is None:  # kept: like's value, placed
                    out.append(keep_value(p, x, s))
                    continue
                out.append(build_leaf(node, s, files.fetch))
                done += math.prod(node.shape) * node.dtype.itemsize
                if report is not None:
                    report(done, total)
        return flat.update_inplace(out)


def _planned(
    files: SafetensorsFiles, like: Any, mapping: MappingLike, specs: Any, mesh: Any, dtype: Any
) -> tuple[Any, Resolution, list[Any]]:
    """``(like's Flat, the resolution, each leaf's sharding)`` of an import from ``files``."""
    wm = as_mapping(mapping, split_dots=True).with_config(checkpoint_config(files.path))
    like, flat, res = resolve_target(wm, files.table(), like, dtype)
    return flat, res, leaf_shardings(like, flat, specs, mesh)


def resolve_target(
    wm: WeightMap, table: Mapping[str, tuple[tuple[int, ...], Any]], like: Any, dtype: Any
) -> tuple[Any, Any, Resolution]:
    """``(like, its Flat, the resolution)``; no ``like``: a dict of the mapped leaves' structs."""
    if like is not None:
        flat, targets = target_table(like)
        res = resolve(wm, table, targets, dtype=dtype)
        abstract = [
            Problem(
                "target",
                p,
                "kept (no stored tensor) but like holds no value for it",
                hint="pass a concrete like for kept leaves (a freshly initialised model)",
                cause="a kept leaf with no value in like",
            )
            for p, x in zip(flat.paths, flat.arrays, strict=True)
            if p in res.kept and isinstance(x, jax.ShapeDtypeStruct)
        ]
        if abstract:
            raise MappingError(abstract)
        return like, flat, res
    res = resolve(wm, table, None, dtype=dtype)
    like = nest_paths({p: jax.ShapeDtypeStruct(n.shape, n.dtype) for p, n in res.recipes.items()})
    return like, split(like), res


def leaf_shardings(like: Any, flat: Any, specs: Any, mesh: Any) -> list[Any]:
    """One sharding per array leaf: planned on ``mesh`` (``specs`` default: replicated),
    else ``like``'s own, else the first local device."""
    if specs is not None and mesh is None:
        raise CheckpointError("specs=... needs mesh=...: specs are planned on a mesh.")
    if mesh is None:
        return [_sharding_of(x) for x in flat.arrays]
    from jax.sharding import PartitionSpec

    from .._place import plan

    if is_abstract(mesh):
        mesh = make_mesh(dict(mesh.shape), axis_types=tuple(mesh.axis_types))
    return plan(like, PartitionSpec() if specs is None else specs, mesh).flat_shardings(0)


@dataclasses.dataclass(frozen=True)
class MappedLeaf:
    """One target leaf of a mapped import, which ``modelshard convert`` streams: its
    planned ``spec`` (None off a mesh) and ``read(index)``, a block as a C-order array."""

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
    """An import resolved and planned as ``load_safetensors`` does, reading nothing: the
    table and one ``MappedLeaf`` per target leaf (``files`` stays open while they read)."""
    flat, res, shardings = _planned(files, like, mapping, specs, mesh, dtype)
    out = []
    for path, x, s in zip(flat.paths, flat.arrays, shardings, strict=True):
        spec = s.spec if isinstance(s, NamedSharding) else None
        node = res.recipes.get(path)
        if node is None:  # kept: like's value
            value = np.asarray(jax.device_get(x))
            read = functools.partial(_value_block, value)
            out.append(MappedLeaf(path, value.shape, value.dtype, spec, read))
        else:
            read = _block_reader(node, files.fetch)
            out.append(MappedLeaf(path, node.shape, node.dtype, spec, read))
    return res, out


def _value_block(value: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    return value[index] if index else value


def _block_reader(
    node: recipe.Node, fetch_for: Callable[[dict[Any, np.ndarray]], recipe.Fetch]
) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """``read(index)`` of one target leaf; what it mapped is dropped after its last block."""
    cache: dict[Any, np.ndarray] = {}
    fetch = fetch_for(cache)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        norm = recipe.norm_index(index, node.shape)
        block = recipe.contiguous(node.read(norm, fetch))
        if all(s.stop == d for s, d in zip(norm, node.shape, strict=True)):
            cache.clear()  # blocks come in C order: this was the last
        return block

    return read


def keep_value(path: str, x: Any, sharding: Any) -> Any:
    """A kept leaf: ``like``'s value (``resolve_target`` refused abstract ones), placed."""
    from .._place import place

    return x if sharding is None else place([x], [sharding])[0]
