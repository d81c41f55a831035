"""``constrain``: a sharding constraint on every array leaf of a container, inside model code."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding

from .._base import MeshError, SpecError
from .._specs import SpecLike, entry_axes, expand_args, is_axes_entry

_PACKAGE = str(Path(__file__).resolve().parent) + os.sep
_JAX = str(Path(jax.__file__).resolve().parent) + os.sep


def _where(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:  # another drive (Windows)
        pass
    return f"{path}:{frame.f_lineno}"


def _library(frame: FrameType) -> bool:
    """Whether ``frame`` runs installed code (site-packages, the standard library), not the
    user's own."""
    path = frame.f_code.co_filename
    return path.startswith("<") or any(
        part in path for part in (f"{os.sep}site-packages{os.sep}", f"{os.sep}lib{os.sep}python")
    )


def _traced(tree: Any) -> bool:
    """Whether ``tree`` holds a tracer (``constrain`` inside a trace); asked only when an
    error names the call site, never on the path of a call that succeeds."""
    return any(isinstance(x, Tracer) for x in jax.tree.leaves(tree))


def call_site(traced: bool) -> str | None:
    """``constrain at model.py:42 in MLP.__call__, while tracing step (train.py:9)``: the
    user's ``constrain`` call (the first frame outside modelshard) and, while tracing, the
    function being traced (the outermost user frame below JAX's tracing machinery)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return None
    out = f"constrain at {_where(frame)} in {frame.f_code.co_qualname}"
    if not traced:
        return out
    outer, f = frame, frame.f_back
    while f is not None and not f.f_code.co_filename.startswith(_JAX):
        if not _library(f) and not f.f_code.co_filename.startswith(_PACKAGE):
            outer = f
        f = f.f_back
    if f is not None and outer is not frame:
        out += f", while tracing {outer.f_code.co_qualname} ({_where(outer)})"
    elif f is not None:
        out += ", while it is traced"
    return out


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
        MeshError: ``mesh`` is omitted and no mesh is active; the message starts with
            the call site, as a SpecError's does.
        SpecError: listing every leaf that cannot take its spec, headed by the call site
            (``constrain at model.py:42 in MLP.__call__, while tracing step (train.py:9)``;
            also ``err.site``), which a trace's traceback does not show.

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
        try:
            mesh = current_mesh()
        except MeshError as e:  # name the user's call, as a SpecError does
            site = call_site(_traced(tree))
            if site is None:
                raise
            raise MeshError(f"{site}: {e}") from None
    try:
        (arg,) = expand_args([("tree", tree, specs)], mesh)
    except SpecError as e:  # name the user's call: a trace's traceback hides it
        site = call_site(_traced(tree))
        if site is None or type(e) is not SpecError:
            raise
        raise SpecError(e.problems, header=e.header, site=site) from None
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
