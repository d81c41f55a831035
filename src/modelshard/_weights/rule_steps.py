"""A rule's steps on one stored tensor as recipe nodes; a failing step reports a problem."""

from __future__ import annotations

import dataclasses
import itertools
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


@dataclasses.dataclass
class RuleSteps:
    """Rule ``i`` of ``mapping`` on the stored tensor ``name``; problems go to ``problems``."""

    mapping: WeightMap
    i: int
    name: str
    problems: list[Problem]

    @property
    def rule(self) -> MapRule:
        return self.mapping.rules[self.i]

    def bad(self, node: recipe.Node, what: str, hint: str | None = None, **kw: Any) -> None:
        """Report ``what`` about the tensor (at ``node``'s step); returns ``None``."""
        shape, dtype = node.shape, dtype_name(node.dtype)
        what = f"{what} (rules[{self.i}])"
        self.problems.append(
            Problem("source", self.name, what, shape=shape, dtype=dtype, hint=hint, **kw)
        )

    def piece(self, node: recipe.Node, dtype: Any) -> recipe.Node | None:
        """``node`` through the load's dtype, the rule's operations and its cast."""
        pre = self.pre_cast(node, dtype)
        return None if pre is None else cast(self.rule, pre)

    def pre_cast(self, node: recipe.Node, dtype: Any) -> recipe.Node | None:
        """``node`` through the load's dtype and the rule's operations."""
        rule = self.rule
        if rule.cast is not None and recipe.is_key(node.dtype):
            return self.bad(node, f"a PRNG key cannot be cast (cast = {rule.cast!r})")
        if dtype is not None and jnp.issubdtype(node.dtype, jnp.floating) and node.dtype != dtype:
            node = recipe.Cast(node, np.dtype(dtype))
        for op in rule_ops(rule):
            got = self._apply(op, node)
            if got is None:
                return None
            node = got
        return node

    def _apply(self, op: Op, node: recipe.Node) -> recipe.Node | None:
        """``node`` through one operation, as recipe nodes; ``None`` after a problem."""
        if isinstance(op, Transpose):
            perm = tuple(int(p) for p in op.perm)
            if sorted(perm) != list(range(len(node.shape))):
                n = len(node.shape)
                return self.bad(
                    node, f"transpose{perm} is not a permutation of this tensor's {n} axes"
                )
            return recipe.Permuted(node, perm)
        if isinstance(op, Reshape):
            shape = self._reshape(op.shape, node)
            return None if shape is None else recipe.Reshaped(node, shape)
        if isinstance(op, Rearrange):
            return self._rearrange(op, node)
        what = "add" if isinstance(op, Add) else "scale"
        if not (isinstance(node.dtype, np.dtype) and jnp.issubdtype(node.dtype, jnp.floating)):
            return self.bad(
                node,
                f"{op.text()} needs a floating-point tensor, not {dtype_name(node.dtype)}",
                hint=f"{what} applies to float tensors only",
            )
        return recipe.Arith(node, "add" if isinstance(op, Add) else "mul", float(op.value))

    def _rearrange(self, op: Rearrange, node: recipe.Node) -> recipe.Node | None:
        """A rearrange as reshape, transpose and reshape nodes (each left out when a no-op)."""
        left, right = parse_rearrange(op.pattern)  # checked when the mapping was built
        shape = node.shape
        where = f"rearrange({op.pattern})"
        if len(left) != len(shape):
            return self.bad(node, f"{where} expects {len(left)} axes, the tensor has {len(shape)}")
        given = self._sizes([v for _, v in op.sizes], node, "rearrange size")
        if given is None:
            return None
        known = dict(zip([k for k, _ in op.sizes], given, strict=True))
        sizes: dict[str, int] = {}
        for (names, _), dim in zip(left, shape, strict=True):
            unknown = [n for n in names if n not in known]
            prod = math.prod(known[n] for n in names if n in known)
            if len(unknown) > 1:
                return self.bad(
                    node, f"{where}: give the size of all but one of {', '.join(unknown)}"
                )
            if unknown and (prod <= 0 or dim % prod):
                return self.bad(node, f"{where}: axis of size {dim} does not divide by {prod}")
            if not unknown and prod != dim:
                sizes_text = " * ".join(f"{n}={known[n]}" for n in names) or "()"
                return self.bad(node, f"{where}: axis of size {dim} is not {sizes_text}")
            for n in names:
                sizes[n] = known[n] if n in known else dim // prod
        order = [n for names, _ in left for n in names]
        out: recipe.Node = node
        elementary = tuple(sizes[n] for n in order)
        if elementary != shape:
            out = recipe.Reshaped(out, elementary)
        perm = tuple(order.index(n) for names, _ in right for n in names)
        if perm != tuple(range(len(perm))):
            out = recipe.Permuted(out, perm)
        final = tuple(math.prod(sizes[n] for n in names) for names, _ in right)
        return out if final == out.shape else recipe.Reshaped(out, final)

    def _reshape(self, entries: Iterable[int | str], node: recipe.Node) -> tuple[int, ...] | None:
        sizes = self._sizes(entries, node, "reshape size")
        if sizes is None:
            return None
        total = math.prod(node.shape)
        cannot = f"cannot reshape {list(node.shape)} to {tuple(sizes)}"
        if sizes.count(-1) > 1:
            return self.bad(node, f"reshape{tuple(sizes)} has more than one -1")
        if -1 in sizes:
            known = math.prod(s for s in sizes if s != -1)
            if known <= 0 or total % known:
                return self.bad(node, cannot)
            sizes[sizes.index(-1)] = total // known
        if math.prod(sizes) != total or any(s < 0 for s in sizes):
            return self.bad(node, cannot)
        return tuple(sizes)

    def split_parts(self, read: recipe.Read) -> list[tuple[str, recipe.Node]]:
        """``(part name, Slice of the stored tensor)`` per split part; ``[]`` after a problem."""
        split = self.rule.split
        assert split is not None
        shape, ax = read.shape, split.axis
        if not -len(shape) <= ax < len(shape):
            self.bad(read, f"split axis {ax} is out of range")
            return []
        ax %= len(shape)
        n, k = shape[ax], len(split.names)
        if split.sizes is None:
            if n % k:
                what = f"axis {ax} of size {n} does not split into {k} equal parts {tuple(split.names)!r}"
                self.bad(read, what, hint="give sizes = [...], one per name")
                return []
            sizes = [n // k] * k
        else:
            got = self._sizes(split.sizes, read, "split size")
            if got is None:
                return []
            sizes = got
            if sum(sizes) != n or any(s <= 0 for s in sizes):
                what = f"split sizes {tuple(sizes)} (sum {sum(sizes)}) do not cut axis {ax} of size {n}"
                self.bad(read, what, hint="the sizes must be positive and add up to the axis")
                return []
        ends = [0, *itertools.accumulate(sizes)]
        return [
            (p, recipe.Slice(read, ax, ends[j], ends[j + 1])) for j, p in enumerate(split.names)
        ]

    def _sizes(
        self, entries: Iterable[int | str], node: recipe.Node, what: str
    ) -> list[int] | None:
        """Sizes written as ints or names in the mapping's config."""
        config = self.mapping.config
        sizes: list[int] = []
        for e in entries:
            if isinstance(e, str) and e not in config:
                close = close_match(e, config, cutoff=0.8)
                listed = f"did you mean {close!r}?" if close else ", ".join(sorted(config))
                msg = f"{what} {e!r} is not in the mapping's config ({listed or 'empty'})"
                return self.bad(node, msg, hint=f"add {e} = <size> to the config", cause=NO_SIZE)
            sizes.append(int(config[e]) if isinstance(e, str) else int(e))
        return sizes


def cast(rule: MapRule, node: recipe.Node) -> recipe.Node:
    if rule.cast is not None and np.dtype(rule.cast) != node.dtype:
        return recipe.Cast(node, np.dtype(rule.cast))
    return node


def join_order(
    stack: Stack | Concat, verb: str, members: Mapping[str, str], i: int, path: str
) -> Problem | list[str]:
    """The join's member values in order, or the problem with them."""
    values = list(members)
    if stack.order is not None:
        order = list(stack.order)
        missing = [v for v in order if v not in members]
        extra = [v for v in values if v not in order]
        if not (missing or extra):
            return order
        what = [f"missing {', '.join(map(repr, missing))}"] if missing else []
        if extra:
            what.append("not in the order: " + ", ".join(f"{members[v]} ({v!r})" for v in extra))
        return Problem(
            "target",
            path,
            f"cannot {verb} by rules[{i}]: {'; '.join(what)} (order {tuple(order)!r})",
            hint="every value of the order must be stored once",
        )
    if not all(v.isdigit() for v in values):
        return Problem(
            "mapping",
            f"rules[{i}]",
            f"{verb} group values {sorted(values)!r} are not numbers: give "
            f"{verb.capitalize()}(order=...)",
        )
    nums = sorted(int(v) for v in values)
    if nums != list(range(len(nums))):
        gaps = sorted(set(range(max(nums) + 1)) - set(nums))
        return Problem(
            "target",
            path,
            f"cannot {verb} by rules[{i}]: indices {gaps} are missing "
            f"(found {len(nums)} tensors, {nums[0]}..{nums[-1]})",
            hint="every index 0..N-1 must be stored once",
        )
    by_num = {int(v): v for v in values}
    return [by_num[n] for n in nums]
