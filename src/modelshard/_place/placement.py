"""Arrays onto a mesh: ``shard`` and ``place`` by a plan, ``assemble`` from per-device pieces,
and back (``partitions``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from .._base import AdapterError, AssembleError, MeshError, dtype_name, is_abstract, mesh_sizes
from .._containers import Flat, split
from .._specs import SpecLike, entry_axes, expand_args
from .planning import plan


def place(arrays: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """Put each array on its sharding; abstract leaves get the sharding attached."""
    out: list[Any] = list(arrays)
    todo = []
    for i, (x, s) in enumerate(zip(arrays, shardings, strict=True)):
        if isinstance(x, jax.ShapeDtypeStruct):
            out[i] = jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=s, weak_type=getattr(x, "weak_type", False)
            )
        elif not (isinstance(x, jax.Array) and x.sharding == s):
            todo.append(i)
    if todo:
        todo_x, todo_s = [arrays[i] for i in todo], [shardings[i] for i in todo]
        if is_abstract(todo_s[0].mesh):
            raise MeshError(
                "cannot place concrete arrays on an AbstractMesh; build a real mesh "
                "with modelshard.make_mesh, or pass jax.ShapeDtypeStruct leaves."
            )
        if jax.process_count() > 1:
            todo_x = [_local_to_global(x, s) for x, s in zip(todo_x, todo_s, strict=True)]
        for i, y in zip(todo, jax.device_put(todo_x, todo_s), strict=True):
            out[i] = y
    return out


def _local_to_global(x: Any, s: Any) -> Any:
    """Multi-process: an array committed to this process's devices, as a global array."""
    if not (
        isinstance(x, jax.Array)
        and x.is_fully_addressable
        and x.committed
        and not s.is_fully_addressable
    ):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _local_to_global(jax.random.key_data(x), s)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])


def shard(tree: Any, specs: SpecLike, mesh: Any = None) -> Any:
    """Place every array leaf of ``tree`` by its plan; return the same container type.

    Every array leaf ends up in its planned sharding; static leaves pass through;
    ``jax.ShapeDtypeStruct`` leaves get the sharding attached (a restore target). An NNX
    module is updated in place and returned.

    Args:
        tree: any registered container.
        specs: one spec-like for the whole tree (see [`plan`][modelshard.plan]).
        mesh: a concrete ``jax.sharding.Mesh`` (abstract ones only for abstract leaves);
            default: the mesh set by ``jax.set_mesh``.

    Returns:
        The container, same type, with placed leaves.

    Raises:
        SpecError: listing every leaf that cannot be placed.
        MeshError: ``mesh`` is omitted and no mesh is active.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 8})
        >>> params = ms.shard({"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}, ms.fsdp("data", min_size=0), mesh)
        >>> params["w"].sharding.spec
        P('data',)
    """
    arg = (p := plan(tree, specs, mesh)).args[0]
    return arg.flat.update_inplace(place(arg.flat.arrays, p.flat_shardings(0)))


def global_shape(local_shape: Sequence[int], spec: PartitionSpec, mesh: Any) -> tuple[int, ...]:
    """The global shape of a leaf whose every device holds ``local_shape`` under ``spec``.

    Args:
        local_shape: the shape of one device's piece.
        spec: the leaf's ``PartitionSpec`` over ``mesh``'s axes.
        mesh: a ``Mesh`` or ``AbstractMesh``.

    Returns:
        Each dimension times the product of the sizes of the mesh axes sharding it.

    Raises:
        SpecError: ``spec`` has more entries than the shape has dimensions, or names an
            axis that is not in the mesh.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 2, "model": 4}, abstract=True)
        >>> ms.global_shape((3, 5), P(("data", "model"), None), mesh)
        (24, 5)
    """
    sizes = mesh_sizes(mesh)
    # Validate as the rule engine would, on the (always divisible) global candidate.
    candidate = [int(d) for d in local_shape]
    for d, entry in enumerate(spec):
        if d < len(candidate):
            candidate[d] *= math.prod(sizes.get(a, 1) for a in entry_axes(entry))
    expand_args([("spec", jax.ShapeDtypeStruct(tuple(candidate), np.float32), spec)], mesh)
    return tuple(candidate)


def _positions(mesh: Any) -> tuple[list[Any], list[int]]:
    """Devices in mesh order, and the mesh positions this process can address."""
    devices = list(mesh.devices.flat)
    me = jax.process_index()
    return devices, [p for p, d in enumerate(devices) if d.process_index == me]


def local_specs(name: str, tree: Any, specs: SpecLike, mesh: Any) -> list[PartitionSpec]:
    """Each leaf's spec, chosen from ``tree``'s local shapes on a size-1 copy of ``mesh``."""
    names = tuple(mesh.axis_names)
    ones = AbstractMesh((1,) * len(names), names, axis_types=tuple(mesh.axis_types))
    (arg,) = expand_args([(name, tree, specs)], ones)
    return [leaf.spec for leaf in arg.leaves]


def _check_pieces(flats: Sequence[Flat], ids: Sequence[int]) -> None:
    first = flats[0]
    problems: list[str] = []
    paths0 = first.paths
    for p, flat in zip(ids[1:], flats[1:], strict=True):
        if flat.kind != first.kind or flat.aux != first.aux:
            mine = flat.paths
            missing = [x for x in paths0 if x not in set(mine)]
            extra = [x for x in mine if x not in set(paths0)]
            said = [
                f"{w} {', '.join(map(repr, xs[:5]))}"
                for w, xs in (("missing", missing), ("extra", extra))
                if xs
            ]
            detail = "; ".join(said) or "same paths, different container structure"
            problems.append(
                f"  partition {p}: structure differs from partition {ids[0]} "
                f"({flat.kind} vs {first.kind}): {detail}"
            )
            continue
        for path, *pair in zip(paths0, first.arrays, flat.arrays, strict=True):
            shapes = [tuple(np.shape(x)) for x in pair]
            for what, (a, b) in (("shape", shapes), ("dtype", [dtype_name(x.dtype) for x in pair])):
                if a != b:
                    problems.append(
                        f"  partition {p}, leaf {path!r}: {what} {b} but partition {ids[0]} has {a}"
                    )
    if problems:
        raise AssembleError(
            f"{len(problems)} inconsistent piece{'s' if len(problems) != 1 else ''} (every "
            "partition must hold the same structure, dtypes and shapes):\n" + "\n".join(problems)
        )


def assemble(pieces: Sequence[Any] | Mapping[Any, Any], specs: SpecLike, mesh: Any) -> Any:
    """Build global arrays from per-device local pieces; return the same container type.

    ``pieces[p]`` is the container of local shards of mesh position ``p``
    (``mesh.devices.flat`` order); in a multi-process run, only this process's positions.

    Args:
        pieces: one container per mesh position (or per addressable position), or a
            mapping from device to container.
        specs: one spec-like for the container (see [`plan`][modelshard.plan]); each
            leaf's global shape is computed from its own spec ([`global_shape`][modelshard.global_shape]).
        mesh: a concrete ``jax.sharding.Mesh``.

    Returns:
        The container of piece 0's type whose array leaves are global ``jax.Array``s.

    Raises:
        AssembleError: wrong number of pieces, or pieces that disagree (every one listed).
        SpecError: specs that do not fit the pieces or the mesh.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 2, "model": 2})
        >>> pieces = [{"x": jnp.full((1, 3), float(p))} for p in range(4)]
        >>> out = ms.assemble(pieces, P("data", "model"), mesh)
        >>> out["x"].shape, out["x"][:, 0].tolist()
        ((2, 6), [0.0, 2.0])
    """
    devices, local = _positions(mesh)
    if isinstance(pieces, Mapping):
        where = {d: p for p, d in enumerate(devices)}
        unknown = [d for d in pieces if d not in where]
        if unknown:
            raise AssembleError(f"pieces are keyed by devices that are not in the mesh: {unknown}")
        ids = sorted(where[d] for d in pieces)
        seq = [pieces[devices[p]] for p in ids]
    else:
        seq = list(pieces)
        if len(seq) == len(devices):
            ids = list(range(len(devices)))
        elif len(seq) == len(local):
            ids = local
        else:
            n_local = (
                f" or {len(local)} (this process's devices)" if len(local) != len(devices) else ""
            )
            raise AssembleError(
                f"got {len(seq)} pieces for a mesh of {len(devices)} devices; give one piece "
                f"per mesh position in mesh order: {len(devices)}{n_local}."
            )
    if not seq:
        raise AssembleError("no pieces given; give one container per mesh position.")
    missing = [p for p in local if p not in set(ids)]
    if missing:
        raise AssembleError(
            f"no piece for mesh positions {missing}, which this process "
            "addresses; every addressable device needs its piece."
        )
    try:
        flats = [split(x) for x in seq]
    except AdapterError as e:
        raise AssembleError(f"a piece could not be split: {e}") from e
    _check_pieces(flats, ids)
    first = flats[0]
    specs_local = local_specs("pieces[0]", first.obj, specs, mesh)
    shapes = [
        global_shape(np.shape(a), s, mesh) for a, s in zip(first.arrays, specs_local, strict=True)
    ]
    targets = [devices[p] for p in ids if p in set(local)]
    chosen = [f for p, f in zip(ids, flats, strict=True) if p in set(local)]
    out = []
    for k, (shape, spec) in enumerate(zip(shapes, specs_local, strict=True)):
        sharding = NamedSharding(mesh, spec)
        placed = jax.device_put([f.arrays[k] for f in chosen], targets)
        try:
            out.append(jax.make_array_from_single_device_arrays(shape, sharding, placed))
        except ValueError as e:  # pragma: no cover - shapes are checked above
            raise AssembleError(f"leaf {first.paths[k]!r}: {e}") from e
    return first.rebuild(out)


def assemble_process_local(data: Any, specs: SpecLike, mesh: Any) -> Any:
    """Global arrays from this process's rows of each leaf (a data-parallel batch).

    Every process passes its own slice; the result spans all processes (one process:
    [`shard`][modelshard.shard]).

    Args:
        data: a container holding this process's slice of every leaf.
        specs: one spec-like for the container; it is planned on the global shapes.
        mesh: a concrete ``jax.sharding.Mesh``.

    Returns:
        The same container type holding global ``jax.Array``s.

    Example:
        >>> import numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 8})
        >>> ms.assemble_process_local({"x": np.ones((16, 2))}, P("data"), mesh)["x"].shape
        (16, 2)
    """
    flat = split(data)
    specs_local = local_specs("pieces[0]", flat.obj, specs, mesh)
    for i, x in enumerate(flat.arrays):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise AssembleError(
                f"assemble_process_local: leaf {flat.paths[i]!r} {x.dtype}{list(x.shape)} is "
                "already a global array spanning devices of other processes; pass this "
                "process's part as a NumPy or local array (modelshard.distributed.local_slice "
                "says which), or use the global array as it is."
            )
    out = [
        jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.asarray(x))
        for x, spec in zip(flat.arrays, specs_local, strict=True)
    ]
    return flat.rebuild(out)


def partitions(tree: Any) -> list[Any]:
    """Per mesh position, the container of that device's local shards (``assemble``'s inverse).

    Args:
        tree: a container whose array leaves are ``jax.Array``s sharded on one mesh.

    Returns:
        One container per mesh position this process addresses, in mesh order
        (``mesh.devices.flat``); each leaf is the shard that device holds.

    Raises:
        AssembleError: a leaf is not a ``jax.Array`` with a ``NamedSharding``, or leaves
            live on different meshes.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 4})
        >>> parts = ms.partitions(ms.shard({"x": jnp.arange(8.0)}, P("data"), mesh))
        >>> [p["x"].tolist() for p in parts]
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    """
    flat = split(tree)
    mesh = None
    bad = []
    for path, x in zip(flat.paths, flat.arrays, strict=True):
        s = getattr(x, "sharding", None)
        if not isinstance(x, jax.Array) or not isinstance(s, NamedSharding):
            bad.append(
                f"  {path}: {type(x).__name__} with {type(s).__name__ if s else 'no sharding'}"
            )
        elif mesh is None:
            mesh = s.mesh
        elif s.mesh != mesh:
            bad.append(
                f"  {path}: on another mesh ({dict(s.mesh.shape)}) than the first leaf "
                f"({dict(mesh.shape)})"
            )
    if bad:
        raise AssembleError(
            "partitions needs every array leaf sharded on one mesh "
            "(place them with modelshard.shard first):\n" + "\n".join(bad)
        )
    if mesh is None:
        return [tree]
    devices, local = _positions(mesh)
    per_leaf = [{sh.device: sh.data for sh in x.addressable_shards} for x in flat.arrays]
    return [flat.rebuild([m[devices[p]] for m in per_leaf]) for p in local]
