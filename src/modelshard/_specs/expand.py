"""The one pipeline: split each argument, expand its spec onto every array leaf, validate."""

from __future__ import annotations

import dataclasses
import gc
import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._base import (
    AdapterError,
    Problem,
    SpecError,
    caller_stacklevel,
    canonical_dtype,
    format_path,
    mesh_sizes,
)
from .._base import split as split_path
from .._containers import ARRAY_TYPES, Flat, LeafInfo, split
from .language import FSDP, Rules, is_leaf_spec
from .resolution import UNMATCHED, Ctx, Via, refused_by_jax, resolve_checked, unmatched_key


class LeafPlan(NamedTuple):
    """The plan for one array leaf.

    Attributes:
        path: canonical path inside its argument.
        shape: global shape.
        dtype: NumPy/JAX dtype.
        spec: the resolved ``PartitionSpec`` over mesh axes (logical names mapped).
        rule: what produced the spec (``"rule 1 'kernel$'"``, ``"metadata"``, ``"P()"``...).
        logical: per dimension, the logical names that mapped it with their mesh axes and
            rule entry (``(("heads", ("model",), "rules['heads']"),)``); ``()`` for none.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: PartitionSpec
    rule: str
    logical: Via = ()


@dataclasses.dataclass
class ArgPlan:
    """One argument of a plan: its name, its split container and each array leaf's plan.

    Attributes:
        name: the argument's name (``"tree"`` for [`plan`][modelshard.plan]'s single tree).
        flat: the container split into leaves (``modelshard.adapters.Flat``).
        leaves: one [`LeafPlan`][modelshard.LeafPlan] per array leaf, in flatten order.
    """

    name: str
    flat: Flat
    leaves: list[LeafPlan]


def _expand_one(arg: str, flat: Flat, spec_like: Any, ctx: Ctx) -> list[LeafPlan]:
    infos, arrays = flat.infos, flat.arrays
    if is_leaf_spec(spec_like):
        if type(spec_like) is Rules:  # match every path in one loop
            hits = spec_like.match_all([info.path for info in infos])
            return _plan_matched(arg, infos, arrays, spec_like, ctx, hits)
        return _plan_leaves(arg, infos, arrays, [spec_like] * len(arrays), ctx)
    try:
        items = jax.tree_util.tree_flatten_with_path(spec_like, is_leaf=is_leaf_spec)[0]
    except Exception as e:
        what = f"the spec {type(spec_like).__name__} could not be read as a prefix tree"
        ctx.problems.append(Problem(arg, "", f"{what}: {type(e).__name__}: {e}"))
        return []
    entries = [(split_path(format_path(k)), v) for k, v in items]
    table = dict(entries)
    hit_keys: set[tuple[str, ...]] = set()
    per_leaf: list[Any] = []
    for info, leaf in zip(infos, arrays, strict=True):
        comps = split_path(info.path)
        key = next((comps[:n] for n in range(len(comps), -1, -1) if comps[:n] in table), None)
        if key is None:
            hint = "add its path (or a parent of it) to the spec tree; the container's "
            hint += "top-level keys are " + _top_keys(flat)
            ctx.problem(
                arg, info.path, leaf, "no entry of the prefix tree covers this leaf", hint=hint
            )
            per_leaf.append(_NOTHING)
            continue
        hit_keys.add(key)
        per_leaf.append(table[key])
    for key, value in entries:
        if key in hit_keys:
            continue
        if flat.children(key) is None:
            what = "this prefix-tree entry matches nothing in the container"
            hint = "the container's top-level keys are " + _top_keys(flat)
            ctx.problems.append(Problem(arg, "/".join(key), what, spec=value, hint=hint))
    return _plan_leaves(arg, infos, arrays, per_leaf, ctx)


_NOTHING = object()


def _top_keys(flat: Flat) -> str:
    tops = flat.children(()) or []
    return (
        ", ".join(map(repr, tops[:20])) + (" ..." if len(tops) > 20 else "") if tops else "(none)"
    )


# Leaf types that are never NumPy arrays (skip the refused-dtype check without isinstance).
_NOT_NUMPY: frozenset[type] = frozenset(
    t for t in ARRAY_TYPES if not issubclass(t, np.ndarray | np.generic)
)
_new = tuple.__new__


def _plan_leaves(
    arg: str,
    infos: list[LeafInfo],
    arrays: list[Any],
    per_leaf: list[Any],
    ctx: Ctx,
    hits: list[Any] | None = None,
) -> list[LeafPlan]:
    """Resolve, validate and plan every leaf (``hits``: each one's bulk match, if any)."""
    resolved, placed = ctx.resolved, ctx.placed
    out: list[LeafPlan] = []
    append = out.append
    rules: Rules | None = None  # the Rules last seen, and the indices of its rules used
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
                rules, used = s, ctx.used_by(s)
            if hit is _NOTHING:  # not matched in bulk: Rules differ between leaves
                hit = s.match(info.path)
            if hit is not None:
                used.add(hit[0])  # a rule naming a scalar still counts as used
                key = (id(s), hit[0], shape) if shape else (id(s), "scalar")
            else:
                key = unmatched_key(arg, info, leaf, s, shape, ctx)
                if key is None:
                    continue
        else:
            key = None
        cached = resolved.get(key) if key is not None else None
        if cached is None:
            cached = resolve_checked(arg, info, leaf, s, shape, ctx)
            if cached is None:
                continue
            if key is not None:
                resolved[key] = cached
        spec, rule, problems, via = cached
        if problems:
            for what, hint, fields in problems:
                ctx.problem(arg, info.path, leaf, what, spec, rule, hint or None, fields)
            continue
        if type(leaf) not in _NOT_NUMPY and isinstance(leaf, np.ndarray | np.generic):
            refused = refused_by_jax(leaf)
            if refused is not None:
                ctx.problem(arg, info.path, leaf, refused[0], spec=spec, rule=rule, hint=refused[1])
                continue
        dtype = leaf.dtype
        try:
            dtype = placed[dtype]
        except KeyError:
            dtype = placed[dtype] = canonical_dtype(dtype)
        append(_new(LeafPlan, (info.path, shape, dtype, spec, rule, via)))
    return out


def _plan_matched(
    arg: str, infos: list[LeafInfo], arrays: list[Any], rules: Rules, ctx: Ctx, hits: list[Any]
) -> list[LeafPlan]:
    """``_plan_leaves`` when one ``Rules`` was matched against every path in bulk."""
    out: list[LeafPlan] = []
    append = out.append
    done: dict[tuple[Any, ...], LeafPlan] = {}
    for info, leaf, hit in zip(infos, arrays, hits, strict=True):
        shape = leaf.shape
        if hit is not None and type(leaf) in _NOT_NUMPY:
            if type(shape) is not tuple:
                shape = tuple(shape)
            key = (hit[0], shape, leaf.dtype)
            like = done.get(key)
            if like is not None:
                append(_new(LeafPlan, (info.path, shape, like[2], like[3], like[4], like[5])))
                continue
        else:
            key = None
        got = _plan_leaves(arg, [info], [leaf], [rules], ctx, [hit])
        if got:
            append(got[0])
            if key is not None:
                done[key] = got[0]
    return out


def expand_args(args: Sequence[tuple[str, Any, Any]], mesh: Any) -> list[ArgPlan]:
    """Split and plan several ``(name, container, spec_like)`` arguments at once."""
    if not gc.isenabled():
        return _expand_args(args, mesh)
    gc.disable()  # a plan makes many small objects: no cyclic collections meanwhile
    try:
        return _expand_args(args, mesh)
    finally:
        gc.enable()


def _expand_args(args: Sequence[tuple[str, Any, Any]], mesh: Any) -> list[ArgPlan]:
    ctx = Ctx(mesh_sizes(mesh))
    out = []
    for name, tree, spec_like in args:
        flat = split(tree)
        if not flat.array_index and flat.leaves:
            _refuse_hidden_arrays(name, flat)
        out.append(ArgPlan(name, flat, _expand_one(name, flat, spec_like, ctx)))
    for rules, used in ctx.used.values():
        for i, (pattern, spec) in enumerate(rules.rules if rules.strict else ()):
            if i not in used and not is_catch_all(pattern):
                hint = (
                    "fix the pattern (plan with Rules(..., strict=False) to list every "
                    "path), remove the rule, or pass strict=False"
                    if rules.file is None
                    else f"fix its pattern in {rules.file} (strict = false there lets "
                    "a plan list every path), remove that [[rules]] table, or set strict = false"
                )
                what = f"{rules.describe(i)} matched no leaf"
                ctx.problems.append(
                    Problem("Rules", f"rule {i}", what, spec=spec, mesh=ctx.sizes, hint=hint)
                )
    if ctx.problems:
        raise SpecError(ctx.problems)
    for (name, tree, spec_like), planned in zip(args, out, strict=True):
        _tell_nothing_named(name, tree, spec_like, planned.leaves)
    return out


def _tell_nothing_named(arg: str, tree: Any, rules: Any, leaves: Sequence[LeafPlan]) -> None:
    """Warn where logical rules placed no leaf of an argument (``strict=False``)."""
    if type(rules) is not Rules or rules.logical is None or rules.strict:
        return
    if not any(lp.shape for lp in leaves) or any(lp.rule != UNMATCHED for lp in leaves if lp.shape):
        return
    n = sum(1 for lp in leaves if lp.shape)
    warnings.warn(
        f"{arg}: logical rules placed none of the {type(tree).__name__}'s {n} array leaves "
        "(no leaf carries logical names and no path rule matches), so every leaf is "
        "replicated. An unboxed state (nn.meta.unbox, MaxText) has lost its names: pass the "
        "boxed state, or its names as the spec (nn.get_partition_spec(boxed_state) inside "
        "ms.logical_rules(...)), or add path rules.",
        stacklevel=caller_stacklevel(),
    )


def is_catch_all(pattern: str) -> bool:
    """A pattern matching every path: a fallback, never reported as unused."""
    rx = re.compile(pattern)
    return all(rx.search(p) is not None for p in ("", "a", "a/b/0/c"))


def _refuse_hidden_arrays(arg: str, flat: Flat) -> None:
    """Refuse an argument whose only arrays hide in static leaves (it would plan as nothing)."""
    hidden = flat.hidden_arrays()
    if not hidden:
        return
    lines = [f"{arg}: no array leaves, but arrays are held by an object modelshard cannot open:"]
    lines += [
        f"  {path or '<root>'}: a {ty.__module__}.{ty.__qualname__} holding arrays at "
        + ", ".join(attrs)
        for path, ty, attrs in hidden
    ]
    name = hidden[0][1].__name__
    lines.append(
        f"hint: register its type with modelshard.register_container({name}, flatten=..., "
        "unflatten=...) (see the custom-container guide), or make it a JAX pytree."
    )
    raise AdapterError("\n".join(lines))
