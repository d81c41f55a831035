"""A rule's steps on one stored tensor, as recipe nodes: the load's dtype, each operation
(a rearrange becomes reshape -> transpose -> reshape), a split's parts, a join's order, the
rule's cast, and sizes looked up in the mapping's config. Every problem is appended to the
caller's list with the tensor and the rule; a step that fails returns ``None``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._base import Problem, close_match, dtype_name
from . import recipe
from .ops import Add, Op, Rearrange, Reshape, Transpose, parse_rearrange
from .rules import Concat, MapRule, Stack, WeightMap, rule_ops

NO_SIZE = "a size the mapping's config lacks"
"""The cause of a problem naming a size the config lacks (reported once per rule)."""


def bad(name: str, read: recipe.Node, what: str, i: int, hint: str | None = None) -> Problem:
    return Problem(
        "source",
        name,
        f"{what} (rules[{i}])",
        shape=read.shape,
        dtype=dtype_name(read.dtype),
        hint=hint,
    )


def pre_cast(
    mapping: WeightMap,
    rule: MapRule,
    i: int,
    node: recipe.Node,
    name: str,
    dtype: Any,
    problems: list[Problem],
) -> recipe.Node | None:
    """``node`` through the load's dtype and the rule's operations."""
    if rule.cast is not None and recipe.is_key(node.dtype):
        problems.append(bad(name, node, f"a PRNG key cannot be cast (cast = {rule.cast!r})", i))
        return None
    if dtype is not None and jnp.issubdtype(node.dtype, jnp.floating) and node.dtype != dtype:
        node = recipe.Cast(node, np.dtype(dtype))
    for op in rule_ops(rule):
        got = _apply(mapping, op, node, name, i, problems)
        if got is None:
            return None
        node = got
    return node


def _apply(
    mapping: WeightMap, op: Op, node: recipe.Node, name: str, i: int, problems: list[Problem]
) -> recipe.Node | None:
    """``node`` through one operation, as recipe nodes; ``None`` after a problem."""
    if isinstance(op, Transpose):
        perm = tuple(int(p) for p in op.perm)
        if sorted(perm) != list(range(len(node.shape))):
            problems.append(
                bad(
                    name,
                    node,
                    f"transpose{perm} is not a permutation of this tensor's {len(node.shape)} axes",
                    i,
                )
            )
            return None
        return recipe.Permuted(node, perm)
    if isinstance(op, Reshape):
        shape = _reshape(mapping, op.shape, node, name, i, problems)
        return None if shape is None else recipe.Reshaped(node, shape)
    if isinstance(op, Rearrange):
        return _rearrange(mapping, op, node, name, i, problems)
    what = "add" if isinstance(op, Add) else "scale"
    if not (isinstance(node.dtype, np.dtype) and jnp.issubdtype(node.dtype, jnp.floating)):
        problems.append(
            bad(
                name,
                node,
                f"{op.text()} needs a floating-point tensor, not {dtype_name(node.dtype)}",
                i,
                hint=f"{what} applies to float tensors only",
            )
        )
        return None
    return recipe.Arith(node, "add" if isinstance(op, Add) else "mul", float(op.value))


def _rearrange(
    mapping: WeightMap, op: Rearrange, node: recipe.Node, name: str, i: int, problems: list[Problem]
) -> recipe.Node | None:
    """A rearrange as reshape -> transpose -> reshape nodes (each left out when it does
    nothing)."""
    left, right = parse_rearrange(op.pattern)  # checked when the mapping was built
    shape = node.shape
    where = f"rearrange({op.pattern})"
    if len(left) != len(shape):
        problems.append(
            bad(name, node, f"{where} expects {len(left)} axes, the tensor has {len(shape)}", i)
        )
        return None
    given = _sizes(mapping, [v for _, v in op.sizes], node, name, i, problems, "rearrange size")
    if given is None:
        return None
    known = dict(zip([k for k, _ in op.sizes], given, strict=True))
    sizes: dict[str, int] = {}
    for (names, _), dim in zip(left, shape, strict=True):
        unknown = [n for n in names if n not in known]
        prod = math.prod(known[n] for n in names if n in known)
        if len(unknown) > 1:
            problems.append(
                bad(
                    name,
                    node,
                    f"{where}: give the size of all but one of {', '.join(unknown)}",
                    i,
                )
            )
            return None
        if unknown and (prod <= 0 or dim % prod):
            problems.append(
                bad(name, node, f"{where}: axis of size {dim} does not divide by {prod}", i)
            )
            return None
        if not unknown and prod != dim:
            sizes_text = " * ".join(f"{n}={known[n]}" for n in names) or "()"
            problems.append(bad(name, node, f"{where}: axis of size {dim} is not {sizes_text}", i))
            return None
        for n in names:
            sizes[n] = known[n] if n in known else dim // prod
    order = [n for names, _ in left for n in names]
    out: recipe.Node = node
    elementary = tuple(sizes[n] for n in order)
    if elementary != shape:
        out = recipe.Reshaped(out, elementary)
    target_order = [n for names, _ in right for n in names]
    perm = tuple(order.index(n) for n in target_order)
    if perm != tuple(range(len(perm))):
        out = recipe.Permuted(out, perm)
    final = tuple(math.prod(sizes[n] for n in names) for names, _ in right)
    if final != out.shape:
        out = recipe.Reshaped(out, final)
    return out


def piece(
    mapping: WeightMap,
    rule: MapRule,
    i: int,
    node: recipe.Node,
    name: str,
    dtype: Any,
    problems: list[Problem],
) -> recipe.Node | None:
    pre = pre_cast(mapping, rule, i, node, name, dtype, problems)
    return None if pre is None else cast(rule, pre)


def cast(rule: MapRule, node: recipe.Node) -> recipe.Node:
    if rule.cast is not None and np.dtype(rule.cast) != node.dtype:
        return recipe.Cast(node, np.dtype(rule.cast))
    return node


def _reshape(
    mapping: WeightMap,
    entries: Iterable[int | str],
    node: recipe.Node,
    name: str,
    i: int,
    problems: list[Problem],
) -> tuple[int, ...] | None:
    got = _sizes(mapping, entries, node, name, i, problems, "reshape size")
    if got is None:
        return None
    sizes = got
    total = math.prod(node.shape)
    if sizes.count(-1) > 1:
        problems.append(bad(name, node, f"reshape{tuple(sizes)} has more than one -1", i))
        return None
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if known <= 0 or total % known:
            problems.append(
                bad(name, node, f"cannot reshape {list(node.shape)} to {tuple(sizes)}", i)
            )
            return None
        sizes[sizes.index(-1)] = total // known
    if math.prod(sizes) != total or any(s < 0 for s in sizes):
        problems.append(bad(name, node, f"cannot reshape {list(node.shape)} to {tuple(sizes)}", i))
        return None
    return tuple(sizes)


def split_parts(
    mapping: WeightMap, rule: MapRule, i: int, read: recipe.Read, name: str, problems: list[Problem]
) -> list[tuple[str, recipe.Node]]:
    """``(part name, Slice of the stored tensor)`` for a rule's ``split``; ``[]`` after a
    problem."""
    split = rule.split
    assert split is not None
    shape, ax = read.shape, split.axis
    if not -len(shape) <= ax < len(shape):
        problems.append(bad(name, read, f"split axis {ax} is out of range", i))
        return []
    ax %= len(shape)
    n = shape[ax]
    if split.sizes is None:
        if n % len(split.names):
            problems.append(
                bad(
                    name,
                    read,
                    f"axis {ax} of size {n} does not split into {len(split.names)} equal parts "
                    f"{tuple(split.names)!r}",
                    i,
                    hint="give sizes = [...], one per name",
                )
            )
            return []
        sizes = [n // len(split.names)] * len(split.names)
    else:
        got = _sizes(mapping, split.sizes, read, name, i, problems, "split size")
        if got is None:
            return []
        sizes = got
        if sum(sizes) != n or any(s <= 0 for s in sizes):
            problems.append(
                bad(
                    name,
                    read,
                    f"split sizes {tuple(sizes)} (sum {sum(sizes)}) do not cut axis {ax} of "
                    f"size {n}",
                    i,
                    hint="the sizes must be positive and add up to the axis",
                )
            )
            return []
    out, start = [], 0
    for part, size in zip(split.names, sizes, strict=True):
        out.append((part, recipe.Slice(read, ax, start, start + size)))
        start += size
    return out


def _sizes(
    mapping: WeightMap,
    entries: Iterable[int | str],
    node: recipe.Node,
    name: str,
    i: int,
    problems: list[Problem],
    what: str,
) -> list[int] | None:
    """Sizes written as ints or names in the mapping's config."""
    sizes: list[int] = []
    for e in entries:
        if isinstance(e, str):
            if e not in mapping.config:
                close = close_match(e, mapping.config, cutoff=0.8)
                known = f"did you mean {close!r}?" if close else None
                problem = bad(
                    name,
                    node,
                    f"{what} {e!r} is not in the mapping's config "
                    f"({known or ', '.join(sorted(mapping.config)) or 'empty'})",
                    i,
                    hint=f"add {e} = <size> to the config",
                )
                problems.append(dataclasses.replace(problem, cause=NO_SIZE))
                return None
            sizes.append(int(mapping.config[e]))
        else:
            sizes.append(int(e))
    return sizes


def join_order(
    stack: Stack | Concat,
    verb: str,
    members: Mapping[str, str],
    i: int,
    path: str,
    problems: list[Problem],
) -> list[str] | None:
    values = list(members)
    if stack.order is not None:
        order = list(stack.order)
        missing = [v for v in order if v not in members]
        extra = [v for v in values if v not in order]
        if missing or extra:
            what = []
            if missing:
                what.append(f"missing {', '.join(map(repr, missing))}")
            if extra:
                what.append(
                    "not in the order: " + ", ".join(f"{members[v]} ({v!r})" for v in extra)
                )
            problems.append(
                Problem(
                    "target",
                    path,
                    f"cannot {verb} by rules[{i}]: {'; '.join(what)} (order {tuple(order)!r})",
                    hint="every value of the order must be stored once",
                )
            )
            return None
        return order
    if not all(v.isdigit() for v in values):
        problems.append(
            Problem(
                "mapping",
                f"rules[{i}]",
                f"{verb} group values {sorted(values)!r} are not numbers: give "
                f"{verb.capitalize()}(order=...)",
            )
        )
        return None
    nums = sorted(int(v) for v in values)
    if nums != list(range(len(nums))):
        gaps = sorted(set(range(max(nums) + 1)) - set(nums))
        problems.append(
            Problem(
                "target",
                path,
                f"cannot {verb} by rules[{i}]: indices {gaps} are missing "
                f"(found {len(nums)} tensors, {nums[0]}..{nums[-1]})",
                hint="every index 0..N-1 must be stored once",
            )
        )
        return None
    by_num = {int(v): v for v in values}
    return [by_num[n] for n in nums]
