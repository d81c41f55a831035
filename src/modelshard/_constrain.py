"""``constrain``: a sharding constraint on every array leaf of a container, inside model code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding

from ._errors import MeshError
from ._expand import expand_args
from ._specs import SpecLike, entry_axes, is_axes_entry


def current_mesh(concrete: bool = False) -> Any:
    """The mesh of the active ``jax.set_mesh`` context: what every entry point uses when
    ``mesh=`` is not given.

    Args:
        concrete: prefer the concrete ``Mesh`` (outside a trace, where arrays can be
            placed); inside ``jit``, and otherwise, the ``AbstractMesh``.

    Raises:
        MeshError: no mesh is active.
    """
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


def constrain(tree: Any, specs: SpecLike, mesh: Any = None) -> Any:
    """Constrain every array leaf of ``tree`` to its planned sharding; same container back.

    For use inside traced model code (it also works eagerly). Each leaf's spec comes from
    the one rule engine, exactly as for [`shard`][modelshard.shard]. Leaves whose spec names
    only Auto mesh axes get ``jax.lax.with_sharding_constraint``; where an Explicit axis is
    involved (which ``with_sharding_constraint`` refuses), the leaf is resharded with
    ``jax.sharding.reshard``, so the same model code runs on Auto and Explicit meshes.

    Args:
        tree: any registered container (or a single array).
        specs: one spec-like for the whole tree (see [`plan`][modelshard.plan]).
        mesh: the mesh; default: the active ``jax.set_mesh`` context (inside
            [`shard_jit`][modelshard.shard_jit], its mesh).

    Returns:
        The same container type with constrained leaves. NNX modules are updated in
        place and returned.

    Raises:
        MeshError: ``mesh`` is omitted and no mesh is active.
        SpecError: listing every leaf that cannot take its spec.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 8})
        >>> @jax.jit
        ... def f(params):
        ...     return ms.constrain(params, P("data"), mesh)
        >>> f({"w": jnp.ones((16, 2))})["w"].sharding.spec
        P('data',)
    """
    if mesh is None:
        mesh = current_mesh()
    (arg,) = expand_args([("tree", tree, specs)], mesh)
    return arg.flat.update_inplace(
        constrain_leaves(arg.flat.arrays, [leaf.spec for leaf in arg.leaves], mesh)
    )


def constrain_leaves(arrays: Sequence[Any], specs: Sequence[Any], mesh: Any) -> list[Any]:
    """Each array constrained to its spec: ``with_sharding_constraint`` on Auto axes,
    ``jax.sharding.reshard`` where an Explicit axis is involved (which refuses the former)."""
    explicit = {
        name
        for name, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Explicit
    }
    out = []
    for x, spec in zip(arrays, specs, strict=True):
        s = NamedSharding(mesh, spec)
        if (explicit and _names(spec) & explicit) or _explicit_typed(x, explicit):
            out.append(jax.sharding.reshard(x, s))
        else:
            out.append(jax.lax.with_sharding_constraint(x, s))
    return out


def _names(spec: Any) -> set[str]:
    return {a for e in spec if is_axes_entry(e) for a in entry_axes(e)}


def _explicit_typed(x: Any, explicit: set[str]) -> bool:
    """Whether ``x`` is currently sharded over an Explicit axis (so only reshard may move it)."""
    if not explicit:
        return False
    try:
        spec = jax.typeof(x).sharding.spec
    except Exception:
        return False
    return bool(_names(spec) & explicit)
