"""Meshes: ``make_mesh``, the active mesh, what modules read of one, and ``constrain_array``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .errors import MeshError

_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def _axis_types(axis_types: Any, n: int) -> tuple[AxisType, ...]:
    given = [axis_types] * n if isinstance(axis_types, str | AxisType) else list(axis_types)
    for t in given:
        if not (isinstance(t, AxisType) or (isinstance(t, str) and t.lower() in _TYPES)):
            raise MeshError(f"axis type {t!r} is not one of 'auto', 'explicit' or a jax AxisType.")
    if len(given) != n:
        raise MeshError(f"got {len(given)} axis types for {n} mesh axes.")
    return tuple(t if isinstance(t, AxisType) else _TYPES[t.lower()] for t in given)


def make_mesh(
    axes: Mapping[str, int],
    *,
    axis_types: Literal["auto", "explicit"] | AxisType | Sequence[Any] = "auto",
    devices: Sequence[Any] | None = None,
    abstract: bool = False,
) -> Any:
    """Build a mesh from axis sizes, with axis types set explicitly (Auto by default).

    Args:
        axes: axis name -> size, in mesh order; one size may be ``-1`` (the rest).
        axis_types: ``"auto"``, ``"explicit"``, a JAX ``AxisType``, or one per axis.
        devices: the devices to use (default ``jax.devices()``; the first ones suffice).
        abstract: return a ``jax.sharding.AbstractMesh`` (no devices needed).

    Returns:
        A ``jax.sharding.Mesh`` (or ``AbstractMesh``).

    Raises:
        MeshError: bad sizes, more than one ``-1``, or more devices asked for than exist.

    Example:
        >>> import modelshard as ms
        >>> ms.make_mesh({"data": 2, "model": 4}).shape
        OrderedDict({'data': 2, 'model': 4})
        >>> ms.make_mesh({"data": 32, "model": 8}, abstract=True).size
        256
    """
    if not isinstance(axes, Mapping) or not axes:
        raise MeshError(f"make_mesh needs a non-empty mapping of axis name -> size, got {axes!r}.")
    names = list(axes)
    sizes = list(axes.values())
    bad = [
        f"{k}={v!r}"
        for k, v in axes.items()
        if not isinstance(k, str)
        or isinstance(v, bool)
        or not isinstance(v, int)
        or (v < 1 and v != -1)
    ]
    if bad:
        raise MeshError(f"mesh axis sizes must be positive ints (or one -1): {', '.join(bad)}.")
    types = _axis_types(axis_types, len(names))
    if abstract:
        if -1 in sizes:
            raise MeshError("an abstract mesh needs every size given; -1 needs real devices.")
        return AbstractMesh(tuple(sizes), tuple(names), axis_types=types)
    devs = list(devices) if devices is not None else jax.devices()
    if sizes.count(-1) > 1:
        raise MeshError(f"at most one axis size may be -1, got {dict(axes)}.")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if len(devs) % rest:
            raise MeshError(
                f"cannot infer the -1 axis: {len(devs)} devices are not divisible by "
                f"{rest} (the product of the other axes) in {dict(axes)}."
            )
        sizes[sizes.index(-1)] = len(devs) // rest
    need = math.prod(sizes)
    if need > len(devs):
        raise MeshError(
            f"mesh {dict(zip(names, sizes, strict=True))} needs {need} devices but only "
            f"{len(devs)} are available; on CPU, simulate more with "
            f"jax.config.update('jax_num_cpu_devices', {need}) before any JAX computation, or "
            "pass abstract=True to plan without devices."
        )
    return jax.make_mesh(tuple(sizes), tuple(names), types, devices=devs[:need])


def is_abstract(mesh: Any) -> bool:
    """Whether ``mesh`` has no devices (an ``AbstractMesh``)."""
    return isinstance(mesh, AbstractMesh) and not isinstance(mesh, Mesh)


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """Axis name -> size for a ``Mesh`` or ``AbstractMesh``."""
    try:
        return {str(k): int(v) for k, v in dict(mesh.shape).items()}
    except Exception as e:
        raise MeshError(
            f"expected a jax.sharding.Mesh or AbstractMesh, got {type(mesh).__name__}; build "
            "one with modelshard.make_mesh({'data': 8})."
        ) from e


def current_mesh(concrete: bool = False) -> Any:
    """The mesh of the active ``jax.set_mesh`` context, for entry points given no ``mesh=``."""
    if concrete:
        try:
            mesh = jax.sharding.get_mesh()
        except ValueError:  # inside a trace: only the abstract mesh is known
            mesh = None
        if mesh is not None and not getattr(mesh, "empty", False) and mesh.axis_names:
            return mesh
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False) or not mesh.axis_names:
        raise MeshError(
            "no mesh given and none is active; pass mesh=..., or call inside "
            "`with jax.set_mesh(mesh):` (shard_jit sets it while tracing)."
        )
    return mesh


def constrain_array(x: Any, sharding: NamedSharding | PartitionSpec, mesh: Any) -> Any:
    """``x`` constrained to ``sharding`` on a mesh of any axis types: ``reshard`` where an
    Explicit axis is involved (``with_sharding_constraint`` only asserts there)."""
    explicit = explicit_axes(mesh)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    if explicit and (_axes(spec) & explicit or _sharded_over(x, explicit)):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def explicit_axes(mesh: Any) -> frozenset[str]:
    """The names of the mesh's Explicit axes."""
    kinds = zip(mesh.axis_names, mesh.axis_types, strict=True)
    return frozenset(name for name, kind in kinds if kind == AxisType.Explicit)


def _axes(spec: Any) -> set[str]:
    """The mesh axes a ``PartitionSpec`` names (``None`` and ``UNCONSTRAINED`` name none)."""
    entries = (e if isinstance(e, tuple) else (e,) for e in spec)
    return {a for entry in entries for a in entry if isinstance(a, str)}


def _sharded_over(x: Any, axes: frozenset[str]) -> bool:
    """Whether ``x``'s type says it is sharded over one of ``axes`` (only ``reshard`` moves it)."""
    try:
        spec = jax.typeof(x).sharding.spec
    except Exception:
        return False
    return bool(_axes(spec) & axes)
