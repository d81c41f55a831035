"""The one pipeline: split each argument, expand its spec onto every array leaf, validate.

Everything that places arrays (``shard``, ``shard_jit``, ``constrain``, ``restore``, the
CLI) calls :func:`expand_args` and consumes its :class:`LeafPlan` lists; nothing else
expands or validates specs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec

from ._describe import _ARRAY_TYPES, LeafInfo
from ._errors import AdapterError, Problem, SpecError
from ._flat import Flat, split
from ._paths import format_path
from ._paths import split as split_path
from ._specs import FSDP, Rules, format_spec, is_leaf_spec, partial_axes

__all__ = ["ArgPlan", "LeafPlan", "expand_args", "mesh_sizes"]


class LeafPlan(NamedTuple):
    """The plan for one array leaf.

    Attributes:
        path: canonical path inside its argument.
        shape: global shape.
        dtype: NumPy/JAX dtype.
        spec: the resolved ``PartitionSpec`` over mesh axes (logical names mapped).
        rule: what produced the spec (``"rule 1 'kernel$'"``, ``"metadata"``, ``"P()"``...).
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: PartitionSpec
    rule: str


@dataclasses.dataclass
class ArgPlan:
    """One argument's split container and the plan of each of its array leaves."""

    name: str
    flat: Flat
    leaves: list[LeafPlan]


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """Axis name -> size for a ``Mesh`` or ``AbstractMesh``."""
    try:
        return {str(k): int(v) for k, v in dict(mesh.shape).items()}
    except Exception as e:
        from ._errors import MeshError

        raise MeshError(
            f"expected a jax.sharding.Mesh or AbstractMesh, got {type(mesh).__name__}; build "
            "one with modelshard.make_mesh({'data': 8})."
        ) from e


def _fmt_mesh(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "(no axes)"


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


class _Ctx:
    """State shared across all arguments of one expansion (rule usage, problems)."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes
        self.mesh_text = _fmt_mesh(sizes)
        self.problems: list[Problem] = []
        self.used: dict[int, tuple[Rules, set[int]]] = {}
        self.resolved: dict[tuple[Any, ...], tuple[PartitionSpec, str, list[tuple[str, str]]]] = {}
        self.placed: dict[Any, Any] = {}  # dtype -> the dtype it has once placed

    def used_by(self, rules: Rules) -> set[int]:
        """The indices of ``rules``' rules that matched a leaf so far (filled by the caller)."""
        entry = self.used.get(id(rules))
        if entry is None:
            entry = self.used[id(rules)] = (rules, set())
        return entry[1]

    def problem(
        self,
        arg: str,
        path: str,
        leaf: Any,
        what: str,
        spec: Any = None,
        rule: str | None = None,
        hint: str | None = None,
    ) -> None:
        shape = tuple(getattr(leaf, "shape", ())) if leaf is not None else None
        dtype = _dtype_name(leaf.dtype) if leaf is not None and hasattr(leaf, "dtype") else None
        self.problems.append(
            Problem(
                arg=arg,
                path=path,
                what=what,
                shape=shape,
                dtype=dtype,
                spec=format_spec(spec) if spec is not None else None,
                rule=rule,
                mesh=self.mesh_text,
                hint=hint,
            )
        )


def _resolve_names(spec: PartitionSpec, logical: Mapping[str, Any] | None) -> PartitionSpec:
    """Map logical names through ``logical`` (unknown names stay, for ``_check`` to report)."""
    out: list[Any] = []
    if partial_axes(spec):  # left for _check to report
        return spec
    for entry in spec:
        if entry is None or not (
            isinstance(entry, str)
            or (isinstance(entry, tuple) and all(isinstance(n, str) for n in entry))
        ):
            out.append(entry)  # junk stays as it is, for _check to report
            continue
        names = (entry,) if isinstance(entry, str) else entry
        mapped: list[str] = []
        for n in names:
            if logical is not None and n in logical:
                target = logical[n]
                if target is None:
                    continue
                mapped.extend((target,) if isinstance(target, str) else target)
            else:
                mapped.append(n)
        out.append(None if not mapped else mapped[0] if len(mapped) == 1 else tuple(mapped))
    return PartitionSpec(*out)


def _check(
    spec: PartitionSpec, shape: tuple[int, ...], sizes: Mapping[str, int]
) -> list[tuple[str, str]]:
    """Every (what, hint) wrong with placing ``shape`` by ``spec`` on a mesh of ``sizes``."""
    out: list[tuple[str, str]] = []
    partial = partial_axes(spec)
    if partial:  # JAX cannot device_put these (unreduced) or only on Explicit axes (reduced)
        return [
            (
                f"the spec marks mesh axes {', '.join(map(repr, sorted(partial)))} unreduced or "
                "reduced, which placing arrays does not support",
                "place with a plain PartitionSpec; unreduced/reduced shardings belong inside a "
                "jitted computation",
            )
        ]
    entries = tuple(spec)
    if len(entries) > len(shape):
        out.append(
            (
                f"spec has {len(entries)} entries but the leaf has rank {len(shape)}",
                f"give at most {len(shape)} entries for this leaf (a rule with a shorter spec, or "
                "P() to replicate it)",
            )
        )
    seen: dict[str, int] = {}
    for dim, entry in enumerate(entries):
        if entry is None:
            continue
        if not (
            isinstance(entry, str)
            or (isinstance(entry, tuple) and all(isinstance(a, str) for a in entry))
        ):
            out.append(
                (
                    f"entry {dim} is {entry!r}, not a mesh axis name, tuple of names or None",
                    "spec entries are mesh axis names such as 'data', tuples of them, or None",
                )
            )
            continue
        axes = (entry,) if isinstance(entry, str) else entry
        for a in axes:
            if a not in sizes:
                out.append(
                    (
                        f"axis {a!r} (dimension {dim}) is not in the mesh",
                        f"mesh axes are {', '.join(map(repr, sizes)) or 'none'}; map logical "
                        f"names with Rules(..., logical={{{a!r}: <mesh axis or None>}})",
                    )
                )
            elif a in seen:
                out.append(
                    (
                        f"mesh axis {a!r} is used twice (dimensions {seen[a]} and {dim})",
                        "each mesh axis may shard at most one dimension of a leaf",
                    )
                )
            else:
                seen[a] = dim
        if dim < len(shape) and all(a in sizes for a in axes):
            n = math.prod(sizes[a] for a in axes)
            if shape[dim] % n:
                by = " x ".join(f"{a}={sizes[a]}" for a in axes)
                out.append(
                    (
                        f"dimension {dim} (size {shape[dim]}) is partitioned {n} times ({by}), "
                        f"but {shape[dim]} is not divisible by {n}",
                        "shard this dimension over axes whose sizes divide it, pad it, or "
                        "replicate it with None",
                    )
                )
    return out


def _prefix_entries(prefix: Any, arg: str, ctx: _Ctx) -> list[tuple[tuple[str, ...], Any]] | None:
    try:
        items = jax.tree_util.tree_flatten_with_path(prefix, is_leaf=is_leaf_spec)[0]
    except Exception as e:
        ctx.problems.append(
            Problem(
                arg,
                "",
                f"the spec {type(prefix).__name__} could not be "
                f"read as a prefix tree: {type(e).__name__}: {e}",
            )
        )
        return None
    return [(split_path(format_path(k)), v) for k, v in items]


def _expand_one(arg: str, flat: Flat, spec_like: Any, ctx: _Ctx) -> list[LeafPlan]:
    infos = flat.infos
    arrays = flat.arrays
    per_leaf: list[Any]
    hits = None
    if is_leaf_spec(spec_like):
        per_leaf = [spec_like] * len(arrays)
        if type(spec_like) is Rules:  # match every path in one loop
            hits = spec_like.match_all([info.path for info in infos])
    else:
        entries = _prefix_entries(spec_like, arg, ctx)
        if entries is None:
            return []
        table = dict(entries)
        hit_keys: set[tuple[str, ...]] = set()
        per_leaf = []
        for info, leaf in zip(infos, arrays, strict=True):
            comps = split_path(info.path)
            found = _NOTHING
            for n in range(len(comps), -1, -1):
                key = comps[:n]
                if key in table:
                    found = table[key]
                    hit_keys.add(key)
                    break
            if found is _NOTHING:
                ctx.problem(
                    arg,
                    info.path,
                    leaf,
                    "no entry of the prefix tree covers this leaf",
                    hint="add its path (or a parent of it) to the spec tree; the "
                    "container's top-level keys are " + _top_keys(flat),
                )
            per_leaf.append(found)
        for key, value in entries:
            if key in hit_keys:
                continue
            if flat.children(key) is None:
                ctx.problems.append(
                    Problem(
                        arg,
                        "/".join(key),
                        "this prefix-tree entry matches nothing in the container",
                        spec=format_spec(value),
                        hint="the container's top-level keys are " + _top_keys(flat),
                    )
                )
    return _plan_leaves(arg, infos, arrays, per_leaf, ctx, hits)


_NOTHING = object()


def _top_keys(flat: Flat) -> str:
    tops = flat.children(()) or []
    return (
        ", ".join(map(repr, tops[:20])) + (" ..." if len(tops) > 20 else "") if tops else "(none)"
    )


# Leaf types that are never NumPy arrays (skip the refused-dtype check without isinstance).
_NOT_NUMPY: frozenset[type] = frozenset(
    t for t in _ARRAY_TYPES if not issubclass(t, np.ndarray | np.generic)
)
_new = tuple.__new__


def _plan_leaves(
    arg: str,
    infos: list[LeafInfo],
    arrays: list[Any],
    per_leaf: list[Any],
    ctx: _Ctx,
    hits: list[Any] | None = None,
) -> list[LeafPlan]:
    """Resolve, validate and plan every leaf (``per_leaf``: its spec source, or _NOTHING;
    ``hits``: when every leaf has the same ``Rules``, each leaf's match, found in bulk).

    This loop runs over every leaf of every plan (10,000-leaf trees), so it is written
    flat: leaves that resolve the same way (same spec source, same shape, same matched
    rule) share one resolution and one validation, cached in ``ctx.resolved``; per leaf
    there is a dict lookup and one tuple built.
    """
    resolved = ctx.resolved
    placed = ctx.placed
    out: list[LeafPlan] = []
    append = out.append
    rules: Rules | None = None  # the Rules last seen, and its match cache and used set
    matched: dict[str, Any] = {}
    used: set[int] = set()
    pre: list[Any] = [_NOTHING] * len(infos) if hits is None else hits
    for info, leaf, s, hit in zip(infos, arrays, per_leaf, pre, strict=True):
        if s is _NOTHING:
            continue
        shape = leaf.shape
        if type(shape) is not tuple:
            shape = tuple(shape)
        t = type(s)
        key: tuple[Any, ...] | None
        if t is PartitionSpec or t is FSDP:
            key = (id(s), shape)
        elif t is Rules:
            if s is not rules:
                rules, matched, used = s, s._cache, ctx.used_by(s)  # match() fills _cache
            if hit is _NOTHING:
                hit = matched.get(info.path, _NOTHING)
                if hit is _NOTHING:
                    hit = s.match(info.path)
            if hit is not None:
                used.add(hit[0])  # a rule naming a scalar still counts as used
                key = (id(s), hit[0], shape) if shape else (id(s), "scalar")
            else:
                key = _unmatched_key(arg, info, leaf, s, shape, ctx)
                if key is None:
                    continue
        else:
            key = None
        cached = resolved.get(key) if key is not None else None
        if cached is None:
            cached = _resolve_checked(arg, info, leaf, s, shape, ctx)
            if cached is None:
                continue
            if key is not None:
                resolved[key] = cached
        spec, rule, problems = cached
        if problems:
            for what, hint in problems:
                ctx.problem(arg, info.path, leaf, what, spec=spec, rule=rule, hint=hint or None)
            continue
        if type(leaf) not in _NOT_NUMPY and isinstance(leaf, np.ndarray | np.generic):
            refused = _refused_by_jax(leaf)
            if refused is not None:
                ctx.problem(arg, info.path, leaf, refused[0], spec=spec, rule=rule, hint=refused[1])
                continue
        dtype = leaf.dtype
        try:
            dtype = placed[dtype]
        except KeyError:
            dtype = placed[dtype] = _placed_dtype(dtype)
        append(_new(LeafPlan, (info.path, shape, dtype, spec, rule)))
    return out


def _unmatched_key(
    arg: str, info: LeafInfo, leaf: Any, s: Rules, shape: tuple[int, ...], ctx: _Ctx
) -> tuple[Any, ...] | None:
    """The resolution-cache key of a leaf no rule matches, or None after reporting it
    (under ``strict``)."""
    if not shape:
        return (id(s), "scalar")  # scalars always replicate
    if info.names is not None:
        return (id(s), "metadata", info.names, info.box, shape)
    if s.strict:
        ctx.problem(
            arg,
            info.path,
            leaf,
            "no rule matches this leaf",
            hint=f"add a rule whose pattern matches {info.path!r}, a catch-all "
            "(r'.*', P()), or use Rules(..., strict=False) to replicate unmatched leaves",
        )
        return None
    return (id(s), "unmatched")


def _resolve_checked(
    arg: str, info: LeafInfo, leaf: Any, s: Any, shape: tuple[int, ...], ctx: _Ctx
) -> tuple[PartitionSpec, str, list[tuple[str, str]]] | None:
    """Resolve one leaf's spec and validate it: (spec, rule text, problems), or None."""
    got = _resolve(arg, info, leaf, s, shape, ctx)
    if got is None:
        return None
    spec, rule = got
    try:
        problems = _check(spec, shape, ctx.sizes)
    except TypeError:  # junk inside a spec from a function: report, never crash
        problems = [(f"{format_spec(spec)} is not a valid PartitionSpec", "")]
    return spec, rule, problems


_REFUSED: dict[Any, tuple[str, str] | None] = {}


def _refused_by_jax(leaf: np.ndarray | np.generic) -> tuple[str, str] | None:
    """(what, hint) if JAX cannot hold this NumPy leaf: masked arrays, str/bytes/object/
    datetime/structured/float128 dtypes. Plans must say so, not ``device_put`` later."""
    if isinstance(leaf, np.ma.MaskedArray):
        return (
            "a NumPy masked array cannot be placed on devices",
            "JAX does not support masked arrays; pass arr.filled(...) instead",
        )
    try:
        return _REFUSED[leaf.dtype]
    except KeyError:
        pass
    try:
        jax.typeof(np.zeros((), leaf.dtype))  # JAX's own check, once per dtype
        refused = None
    except TypeError:
        refused = (
            f"dtype {leaf.dtype} cannot be placed on devices",
            "JAX arrays hold booleans and numbers; convert it with .astype(...) or keep "
            "it out of the container",
        )
    _REFUSED[leaf.dtype] = refused
    return refused


def _placed_dtype(dtype: Any) -> Any:
    """The dtype a leaf has once placed: without ``jax_enable_x64``, ``device_put`` turns
    NumPy float64/int64/uint64/complex128 into their 32-bit kinds, and plans count bytes."""
    if getattr(dtype, "itemsize", 0) < 8:  # the fast path: nothing narrower changes
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def _resolve(
    arg: str, info: LeafInfo, leaf: Any, s: Any, shape: tuple[int, ...], ctx: _Ctx
) -> tuple[PartitionSpec, str] | None:
    """The (mesh-axis spec, rule text) for one leaf; None after reporting a problem."""
    if isinstance(s, PartitionSpec):
        return s, f"{format_spec(s)} for the whole argument"
    if isinstance(s, Rules):
        if not shape:
            return PartitionSpec(), "scalar (replicated)"
        hit = s.match(info.path)
        if hit is not None:
            spec, rule = hit[1], s.describe(hit[0])
        elif info.names is not None:
            spec, rule = PartitionSpec(*info.names), f"metadata ({info.box})"
        else:
            return PartitionSpec(), "unmatched (replicated, strict=False)"
        if s.logical is not None:
            spec = _resolve_names(spec, s.logical)
        return spec, rule
    if isinstance(s, FSDP):
        return s.spec_for(shape, ctx.sizes)
    if s is None:
        ctx.problem(
            arg,
            info.path,
            leaf,
            "the spec is None",
            hint="use P() to replicate; None is not a spec in modelshard",
        )
        return None
    if callable(s):
        name = getattr(s, "__name__", type(s).__name__)
        try:
            got = s(info.path, leaf)
        except Exception as e:
            ctx.problem(
                arg, info.path, leaf, f"spec function {name} raised {type(e).__name__}: {e}"
            )
            return None
        if not isinstance(got, PartitionSpec):
            ctx.problem(
                arg,
                info.path,
                leaf,
                f"spec function {name} returned {got!r}, not a PartitionSpec",
                hint="return P(...) for every leaf (P() replicates)",
            )
            return None
        return got, f"function {name}"
    ctx.problem(
        arg,
        info.path,
        leaf,
        f"{s!r} ({type(s).__name__}) is not a spec",
        hint="give a PartitionSpec, Rules, fsdp(...), a function (path, leaf) -> "
        "PartitionSpec, or a prefix tree of these",
    )
    return None


def expand_args(args: Sequence[tuple[str, Any, Any]], mesh: Any) -> list[ArgPlan]:
    """Split and plan several ``(name, container, spec_like)`` arguments at once.

    Returns:
        One :class:`ArgPlan` per argument.

    Raises:
        SpecError: listing every problem across every argument.
        AdapterError: a container could not be split.
    """
    with _gc_paused():
        return _expand_args(args, mesh)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a plan is built.

    A plan allocates a few objects per leaf, and nothing in it forms a reference cycle;
    with the collector running, those allocations set off collections that scan the whole
    heap (every object JAX and the model hold) several times per 10,000-leaf plan.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _expand_args(args: Sequence[tuple[str, Any, Any]], mesh: Any) -> list[ArgPlan]:
    sizes = mesh_sizes(mesh)
    ctx = _Ctx(sizes)
    out = []
    for name, tree, spec_like in args:
        try:
            flat = split(tree)
        except AdapterError:
            raise
        out.append(ArgPlan(name, flat, _expand_one(name, flat, spec_like, ctx)))
    for rules, used in ctx.used.values():
        if not rules.strict:
            continue
        for i, (pattern, spec) in enumerate(rules.rules):
            if i not in used:
                ctx.problems.append(
                    Problem(
                        "Rules",
                        f"rule {i}",
                        f"rule {i} {pattern!r} matched no leaf",
                        spec=format_spec(spec),
                        mesh=ctx.mesh_text,
                        hint="fix the pattern (plan with Rules(..., strict=False) to list every "
                        "path), remove the rule, or pass strict=False",
                    )
                )
    if ctx.problems:
        raise SpecError(ctx.problems)
    return out
