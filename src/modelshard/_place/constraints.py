"""``constrain``: a sharding constraint on every array leaf of a container, inside model code."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from .._base import (
    MeshError,
    SpecError,
    close_match,
    constrain_array,
    current_mesh,
    dtype_name,
    format_spec,
    mesh_sizes,
)
from .._specs import (
    Rules,
    SpecLike,
    Via,
    active_logical,
    entry_axes,
    expand_args,
    is_axes_entry,
    is_leaf_spec,
)

# modelshard itself, every area: a frame of shard_jit's (_jit/) is no more the user's than
# one of _place/.
_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep
_JAX = str(Path(jax.__file__).resolve().parent) + os.sep


def _where(frame: FrameType, function: bool = False) -> str:
    """``model.py:42`` (with ``function``: ``model.py:42 in f``), relative where it can be."""
    path = frame.f_code.co_filename
    with contextlib.suppress(ValueError):  # another drive (Windows)
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    return f"{path}:{frame.f_lineno}" + (f" in {frame.f_code.co_qualname}" if function else "")


def _traced(tree: Any) -> bool:
    """Whether ``tree`` holds a tracer (``constrain`` inside a trace)."""
    return any(isinstance(x, Tracer) for x in jax.tree.leaves(tree))


def _caller(stacklevel: int) -> FrameType | None:
    """The first frame outside modelshard, then ``stacklevel - 1`` further out."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    for _ in range(max(stacklevel, 1) - 1):
        if frame is None or frame.f_back is None:
            break
        frame = frame.f_back
    return frame


def call_site(traced: bool, stacklevel: int = 1) -> str | None:
    """``constrain at model.py:42 in f, while tracing step (train.py:9)``: the user's call."""
    frame = _caller(stacklevel)
    if frame is None:
        return None
    out = f"constrain at {_where(frame, function=True)}"
    outer = _traced_function(frame) if traced else None
    if outer is frame:
        out += ", while it is traced"
    elif outer is not None:
        out += f", while tracing {outer.f_code.co_qualname} ({_where(outer)})"
    return out


def _traced_function(frame: FrameType) -> FrameType | None:
    """The outermost user frame JAX's machinery called, from ``frame`` out; None if none."""
    found: FrameType | None = None
    user: FrameType | None = None  # the outermost user frame since the last JAX frame
    f: FrameType | None = frame
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_JAX):
            if user is not None and not path.endswith(_TREE_UTIL):
                found = user
            user = None
        elif not (path.startswith(("<", _PACKAGE)) or any(p in path for p in _INSTALLED)):
            user = f  # not installed code (site-packages, the standard library), nor ours
        f = f.f_back
    return found


_TREE_UTIL = os.sep + "tree_util.py"
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}lib{os.sep}python")


_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "modelshard_strict_constraints", default=False
)
# jax.jit keys its caches on this context: a function traced lenient is traced again strict.
_JIT_KEY = jax.make_user_context(False)


@contextlib.contextmanager
def strict_constraints(strict: bool = True) -> Iterator[None]:
    """Make every [`constrain`][modelshard.constrain] call inside the block strict (or,
    with ``False``, lenient again), including those in library code you do not edit.

    A lenient ``constrain`` does nothing where no mesh is active, or where its spec names
    logical axes and no logical rules are set; a strict one raises there. ``strict=`` on a
    call wins. The setting is part of ``jax.jit``'s cache key (traced again inside the block).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> ms.constrain(jnp.ones(4), P("batch")).shape  # no mesh: nothing to do
        (4,)
        >>> with ms.strict_constraints():
        ...     ms.constrain(jnp.ones(4), P("batch"))
        Traceback (most recent call last):
        ...
        modelshard.MeshError: constrain at <doctest ...>: no mesh given and none is active; ...
    """
    token = _STRICT.set(strict)
    try:
        with _JIT_KEY(strict):
            yield
    finally:
        _STRICT.reset(token)


@dataclasses.dataclass(frozen=True)
class ActivationConstraint:
    """One leaf [`constrain`][modelshard.constrain] placed while a step was traced; a
    step's [`Plan`][modelshard.Plan] lists them as ``plan.activations``.

    Attributes:
        name: the ``name=`` given to ``constrain``, else its call site.
        path: the leaf's path inside the constrained container (``""`` for one array).
        shape: the leaf's shape.
        dtype: the leaf's dtype name.
        logical: per dimension, the logical names and the rule entries that mapped them
            (see [`LeafPlan`][modelshard.LeafPlan]).
        spec: the mesh-axis ``PartitionSpec`` applied.
        written: the spec as the model code wrote it (``P('batch', 'seq', 'embed')``).
        bytes_per_device: bytes of one device's shard.
    """

    name: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    logical: Via
    spec: PartitionSpec
    written: str
    bytes_per_device: int


_RECORDING: contextvars.ContextVar[list[ActivationConstraint] | None] = contextvars.ContextVar(
    "modelshard_recording_constraints", default=None
)


@contextlib.contextmanager
def recording_constraints() -> Iterator[list[ActivationConstraint]]:
    """Collect every leaf ``constrain`` places inside the block (for a step's plan)."""
    out: list[ActivationConstraint] = []
    token = _RECORDING.set(out)
    try:
        yield out
    finally:
        _RECORDING.reset(token)


def constrain(
    tree: Any,
    specs: SpecLike,
    mesh: Any = None,
    *,
    strict: bool | None = None,
    stacklevel: int = 1,
    name: str | None = None,
) -> Any:
    """Constrain every array leaf of ``tree`` to its planned sharding; same container back.

    For traced model code (it also works eagerly); each leaf's spec comes from the rule
    engine, as for [`shard`][modelshard.shard]. Auto axes get
    ``jax.lax.with_sharding_constraint``, Explicit ones ``jax.sharding.reshard``, so one
    model runs on both. Where no mesh is active, or the spec names logical axes and no
    rules are set, it returns ``tree`` unchanged unless ``strict``.

    Args:
        tree: any registered container (or a single array).
        specs: one spec-like for the whole tree (see [`plan`][modelshard.plan]).
        mesh: the mesh; default: the active ``jax.set_mesh`` context (inside
            [`shard_jit`][modelshard.shard_jit], its mesh).
        strict: raise where there is nothing to constrain by; default: the
            [`strict_constraints`][modelshard.strict_constraints] context, else lenient.
        stacklevel: which frame errors name as the call site (a wrapper passes 2).
        name: how a step's plan names this constraint (default: its call site).

    Returns:
        The same container type with constrained leaves. NNX modules are updated in
        place and returned.

    Raises:
        MeshError: strict, and no mesh given or active.
        SpecError: listing every leaf that cannot take its spec, headed by the call site
            (``err.site``), which a trace's traceback does not show.

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
    if strict is None:
        strict = _STRICT.get()
    if mesh is None:
        try:
            # concrete arrays go on the concrete mesh (the abstract one cannot place them)
            mesh = current_mesh(concrete=not _traced(tree))
        except MeshError as e:  # name the user's call, as a SpecError does
            if not strict:
                return tree
            site = call_site(_traced(tree), stacklevel)
            if site is None:
                raise
            raise MeshError(f"{site}: {e}") from None
    if not strict and _unmapped_names(specs, mesh):
        return tree
    try:
        (arg,) = expand_args([("tree", tree, specs)], mesh)
    except SpecError as e:  # name the user's call: a trace's traceback hides it
        site = call_site(_traced(tree), stacklevel)
        if site is None or type(e) is not SpecError:
            raise
        raise SpecError(e.problems, header=e.header, site=site) from None
    recording = _RECORDING.get()
    if recording is not None:  # for a step's plan
        if name is None:
            frame = _caller(stacklevel)
            name = _where(frame, function=True) if frame is not None else "constrain"
        sizes = mesh_sizes(mesh)
        written = format_spec(specs) if isinstance(specs, PartitionSpec) else repr(specs)
        for leaf in arg.leaves:
            size = nbytes(shard_shape(leaf.shape, leaf.spec, sizes), leaf.dtype)
            dtype = dtype_name(leaf.dtype)
            recording.append(
                ActivationConstraint(
                    name, leaf.path, leaf.shape, dtype, leaf.logical, leaf.spec, written, size
                )
            )
    return arg.flat.update_inplace(
        constrain_leaves(arg.flat.arrays, [leaf.spec for leaf in arg.leaves], mesh)
    )


def _unmapped_names(specs: Any, mesh: Any) -> bool:
    """Whether ``specs`` names only logical axes while no logical rules are set."""
    if active_logical() is not None:
        return False
    axes = list(mesh.axis_names)
    for s in jax.tree.leaves(specs, is_leaf=is_leaf_spec):
        if isinstance(s, PartitionSpec):
            written = [s]
        elif isinstance(s, Rules) and s.logical is None:
            written = [spec for _, spec in s.rules]
        else:
            continue
        names = {a for spec in written for e in spec if is_axes_entry(e) for a in entry_axes(e)}
        if names and not any(n in axes or close_match(n, axes) is not None for n in names):
            return True
    return False


def nbytes(shape: Sequence[int], dtype: Any) -> int:
    return math.prod(shape) * int(getattr(dtype, "itemsize", 0) or 0)


def shard_shape(shape: Sequence[int], spec: Any, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard of a ``shape`` placed by ``spec`` on a mesh of ``sizes``."""
    out = list(shape)
    for d, entry in enumerate(spec):
        if d < len(out) and is_axes_entry(entry):
            out[d] //= math.prod(sizes[a] for a in entry_axes(entry))
    return tuple(out)


def constrain_leaves(arrays: Sequence[Any], specs: Sequence[Any], mesh: Any) -> list[Any]:
    """Each array constrained to its spec (``constrain_array``)."""
    return [
        constrain_array(x, NamedSharding(mesh, spec), mesh)
        for x, spec in zip(arrays, specs, strict=True)
    ]
