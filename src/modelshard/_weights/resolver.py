"""A mapping resolved to one recipe per target leaf, reading nothing; all problems at once."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from .._base import MappingError, Problem, dtype_name, literal, natural_key, vocabulary
from . import recipe
from .rule_steps import NO_SIZE, RuleSteps, cast, join_order
from .rules import MapRule, WeightMap, header


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the mapping table: target leaf, where it comes from, how."""

    target: str
    sources: tuple[str, ...]
    how: str
    shape: tuple[int, ...] | None
    dtype: str | None


@dataclasses.dataclass
class Resolution:
    """A mapping resolved against stored tensors (and a target): nothing read yet.

    Attributes:
        recipes: target path -> the recipe computing it.
        kept: target paths with no stored tensor that keep ``like``'s values.
        skipped: stored tensors skipped by a rule.
        rows: the mapping table: in the target's flatten order (``like``'s leaves), or
            without a target sorted by target path, numbers as numbers.
        also: target paths filled by an ``also`` rule -> that rule's index.
    """

    recipes: dict[str, recipe.Node]
    kept: list[str]
    skipped: list[str]
    rows: list[Row]
    also: dict[str, int] = dataclasses.field(default_factory=dict)

    def table(self, max_rows: int | None = None) -> Any:
        """The mapping table as a ``rich.table.Table``."""
        from rich.table import Table

        t = Table(title="weight mapping", caption=self.summary())
        for col in ("target", "shape", "dtype", "from", "transforms"):
            t.add_column(col)
        rows = self.rows if max_rows is None else self.rows[:max_rows]
        for r in rows:
            more = f" and {len(r.sources) - 1} more" if len(r.sources) > 1 else ""
            src = literal(", ".join(r.sources[:1]) + more or "-")
            shape = "-" if r.shape is None else str(list(r.shape))
            t.add_row(literal(r.target or "<root>"), shape, r.dtype or "-", src, literal(r.how))
        if len(rows) < len(self.rows) and vocabulary() == "python":  # the CLI says it below
            t.add_row(
                f"... {_count(len(self.rows) - len(rows), 'more leaf', 'more leaves')}", *[""] * 4
            )
        return t

    def summary(self) -> str:
        """One line: leaves mapped from how many stored tensors, kept, skipped."""
        read = len({n for r in self.rows for n in r.sources})
        # ``like`` is the Python argument; the command line has no such name
        kept = "kept" if vocabulary() == "cli" else "kept (like's values)"
        return (
            f"{_count(len(self.recipes), 'leaf', 'leaves')} mapped from "
            f"{_count(read, 'stored tensor')}, {len(self.kept)} {kept}, "
            f"{_count(len(self.skipped), 'stored tensor')} skipped"
        )

    def __str__(self) -> str:
        import io

        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=160, color_system=None).print(self.table())
        return buf.getvalue()


Tensors = Mapping[str, tuple[tuple[int, ...], Any]]
"""Name or path -> (shape, dtype)."""


def resolve(
    mapping: WeightMap,
    sources: Tensors,
    targets: Tensors | None,
    *,
    dtype: Any = None,
    export: bool = False,
) -> Resolution:
    """Resolve ``mapping`` against stored tensors ``sources`` and target leaves ``targets``
    (``None``: whatever the mapping makes). ``dtype``: floating-point stored tensors are
    cast to it first. ``export``: kept leaves are not written, so a ``keep`` pattern that
    matches nothing is no error.

    Raises:
        MappingError: every unmapped stored tensor, every target leaf with no source,
            every shape or dtype that does not fit, every rule that matched nothing.
    """
    r = _Resolver(mapping, sources, dtype)
    r.match_sources()
    r.build_single()
    r.build_joined()
    if mapping.strict:  # a skip rule means "ignore if present", as an optional rule does
        r.problems += [
            _unused(mapping, i, sources)
            for i, rule in enumerate(mapping.rules)
            if i not in r.used and rule.target is not None and not rule.optional
        ]
    if targets is not None:
        kept, rows = r.fit_targets(targets, export)
    else:
        kept = []
        rows = [
            _row(p, node, mapping.rules[i])
            for p, (node, i, _) in sorted(r.made.items(), key=lambda kv: natural_key(kv[0]))
        ]
    if r.problems:
        problems = _once_per_rule(r.problems)
        raise MappingError(problems, header=header(problems))
    also = {p: i for p, (_, i, _) in r.made.items() if mapping.rules[i].also}
    recipes = {p: n for p, (n, _, _) in r.made.items()}
    return Resolution(recipes, kept, r.skipped, rows, also)


class _Resolver:
    """One resolution under way: which rule takes each stored tensor (``single`` tensors
    make leaves alone; ``joins``: (rule, leaf) -> group value -> name), the leaves ``made``
    (path -> recipe, rule, stored names) and those ``failed`` (their problem reported)."""

    def __init__(self, mapping: WeightMap, sources: Tensors, dtype: Any):
        self.mapping, self.sources, self.dtype = mapping, sources, dtype
        self.problems: list[Problem] = []
        self.single: list[tuple[int, str, re.Match[str]]] = []
        self.joins: dict[tuple[int, str], dict[str, str]] = {}
        self.clashed: set[tuple[int, str]] = set()
        self.skipped: list[str] = []
        self.used: set[int] = set()
        self.made: dict[str, tuple[recipe.Node, int, tuple[str, ...]]] = {}
        self.failed: set[str] = set()

    def report(self, arg: str, path: str, what: str, **kw: Any) -> None:
        self.problems.append(Problem(arg, path, what, **kw))

    def read(self, name: str) -> recipe.Read:
        shape, dt = self.sources[name]
        return recipe.Read(name, tuple(shape), recipe.as_dtype(dt))

    def add(self, path: str, node: recipe.Node, i: int, names: tuple[str, ...]) -> None:
        if path in self.made:
            other = self.made[path][2]
            self.report(
                "target",
                path,
                f"stored tensors {', '.join(other + names)} all map to this leaf "
                f"(rules[{self.made[path][1]}] and rules[{i}])",
                hint="give them distinct targets, or Stack(...) them into one leaf",
                cause="several stored tensors map to one leaf",
            )
        else:
            self.made[path] = (node, i, names)

    def match_sources(self) -> None:
        mapping = self.mapping
        for name, (shape, dt) in self.sources.items():
            hit = mapping.match(name)
            alsos = mapping.also_matches(name)
            for j, m in alsos:
                self.used.add(j)
                self.single.append((j, name, m))
            if hit is None and alsos:
                continue  # only also rules map it: the export writes it from their leaf
            if hit is None:
                self.report(
                    "source",
                    name,
                    "no rule maps this stored tensor",
                    shape=tuple(shape),
                    dtype=dtype_name(dt),
                    hint="add a rule for it, or a skip rule (target None / skip = true)",
                    cause="no rule maps this stored tensor",
                )
                continue
            i, m = hit
            self.used.add(i)
            rule = mapping.rules[i]
            if rule.target is None:
                self.skipped.append(name)
            elif rule.join is None:
                self.single.append((i, name, m))
            else:
                key = mapping._format(rule, m, {})
                members = self.joins.setdefault((i, key), {})
                value = m.group(rule.join.group) or ""
                if value not in members:
                    members[value] = name
                    continue
                verb = "stack" if rule.stack is not None else "concat"
                self.report(
                    "target",
                    key,
                    f"stored tensors {members[value]}, {name} all map to this leaf, both "
                    f"at {verb} index {value!r} (rules[{i}] {verb}s by group "
                    f"{rule.join.group!r})",
                    hint="another group varies too: put it in the target template, or stack by it",
                    cause="several stored tensors map to one leaf",
                )
                self.clashed.add((i, key))

    def build_single(self) -> None:
        """The leaves each tensor makes alone: one, or one per unstacked index or split part."""
        for i, name, m in self.single:
            rule, steps = self.mapping.rules[i], RuleSteps(self.mapping, i, name, self.problems)
            read = self.read(name)
            parts: list[tuple[str, recipe.Node]] = [("", read)]
            key: str | None = None
            if rule.unstack is not None:
                key, ax, n = rule.unstack.key, rule.unstack.axis, len(read.shape)
                if not -n <= ax < n:
                    steps.bad(read, f"unstack axis {ax} is out of range")
                    continue
                ax %= n
                parts = [(str(k), recipe.Take(read, ax, k)) for k in range(read.shape[ax])]
            elif rule.split is not None:
                key, parts = rule.split.key, steps.split_parts(read)
            fmt = self.mapping._format
            paths = [fmt(rule, m, {} if key is None else {key: part}) for part, _ in parts]
            for path, (_, cut) in zip(paths, parts, strict=True):
                node = steps.piece(cut, self.dtype)
                if node is None:  # the same problem for every piece: reported once
                    self.failed.update(paths)
                    break
                self.add(path, node, i, (name,))

    def build_joined(self) -> None:
        """One leaf per stack or concat: its members through the rule's ops, checked, joined."""
        for (i, path), members in self.joins.items():
            if (i, path) in self.clashed:
                continue
            rule = self.mapping.rules[i]
            join = rule.join
            assert join is not None
            stack = rule.stack is not None
            verb = "stack" if stack else "concat"
            order = join_order(join, verb, members, i, path)
            if isinstance(order, Problem):
                self.problems.append(order)
                continue
            names = tuple(members[v] for v in order)
            pieces = [
                RuleSteps(self.mapping, i, n, self.problems).pre_cast(self.read(n), self.dtype)
                for n in names
            ]
            nodes = [p for p in pieces if p is not None]
            if len(nodes) < len(pieces):
                self.failed.add(path)
                continue
            ndim, ax = len(nodes[0].shape) + stack, join.axis
            if not -ndim <= ax < ndim:
                self.report("mapping", f"rules[{i}]", f"{verb} axis {ax} is out of range")
                self.failed.add(path)
                continue
            ax %= ndim
            if stack:  # what must agree between the pieces
                agree = {(p.shape, p.dtype) for p in nodes}
                what, hint = "shape or dtype", "only tensors of one shape and dtype stack"
            else:
                agree = {(len(p.shape), p.shape[:ax], p.shape[ax + 1 :], p.dtype) for p in nodes}
                what = f"dtype or shape outside axis {ax}"
                hint = f"only tensors of one dtype, equal in every axis but {ax}, concatenate"
            if len(agree) > 1:
                detail = ", ".join(
                    f"{n} {dtype_name(p.dtype)}{list(p.shape)}"
                    for n, p in zip(names, nodes, strict=True)
                )
                joined = "stacked" if stack else "concatenated"
                what = f"the {joined} tensors differ in {what}: {detail}"
                self.report("target", path, what, hint=hint)
                continue
            node = recipe.Stacked(nodes, ax) if stack else recipe.Joined(nodes, ax)
            self.add(path, cast(rule, node), i, names)

    def fit_targets(self, targets: Tensors, export: bool) -> tuple[list[str], list[Row]]:
        """Every target leaf made with its shape and dtype, or kept by a ``keep`` pattern;
        every leaf made that the target lacks. The kept paths and the rows, in order."""
        mapping, made = self.mapping, self.made
        kept: list[str] = []
        rows: list[Row] = []
        keep_used: set[int] = set()
        for path, (shape, dt) in targets.items():
            hit = made.get(path)
            if hit is None and path in self.failed:
                continue  # its stored tensor's problem is reported
            if hit is None:
                ks = [j for j, k in enumerate(mapping._keep) if k.search(path)]
                if ks:
                    keep_used.update(ks)
                    kept.append(path)
                    rows.append(Row(path, (), "kept (like's value)", tuple(shape), dtype_name(dt)))
                    continue
                self.report(
                    "target",
                    path,
                    "no stored tensor maps to this leaf",
                    shape=tuple(shape),
                    dtype=dtype_name(dt),
                    hint="add a rule producing it, or list it in keep=[...] to keep "
                    "like's value (a new head, LoRA adapters)",
                    cause="no stored tensor maps to this leaf",
                )
                continue
            node, i, names = hit
            want = f"{dtype_name(dt)}{list(shape)}"
            got = f"{dtype_name(node.dtype)}{list(node.shape)}"
            bad_shape = tuple(shape) != node.shape
            bad_dtype = dtype_name(dt) != dtype_name(node.dtype)
            if bad_shape or bad_dtype:
                hints = ["fix the rule's transpose/reshape/stack"] if bad_shape else []
                if bad_dtype:
                    hints.append(f"add cast = {dtype_name(dt)!r} to rules[{i}] or pass dtype=")
                self.report(
                    "target",
                    path,
                    f"the mapped value is {got} but the target leaf is {want} "
                    f"(from {', '.join(names)} by rules[{i}]: "
                    f"{mapping.rules[i].transforms_text()})",
                    shape=tuple(shape),
                    dtype=dtype_name(dt),
                    hint="; ".join(hints),
                    cause="shape or dtype does not fit",
                )
                continue
            rows.append(_row(path, node, mapping.rules[i]))
        for path, (_, i, names) in made.items():
            if path not in targets:
                self.report(
                    "target",
                    path,
                    f"rules[{i}] maps {', '.join(names)} here, but the target has no such leaf",
                    hint="fix the target template; target paths are canonical "
                    "(modelshard.plan(like, ...) lists them)",
                    cause="mapped to a path the target does not have",
                )
        if mapping.strict and not export:  # optional patterns follow keep's in _keep
            for j in sorted(set(range(len(mapping.keep))) - keep_used):
                what = f"keep pattern {mapping.keep[j]!r} matched no unmapped target leaf"
                self.report("mapping", f"keep[{j}]", what, hint="fix or remove the pattern")
        return kept, rows


def _once_per_rule(problems: list[Problem]) -> list[Problem]:
    """A size the config lacks is one problem per rule: the first tensor's, counting the rest."""
    counts = Counter(p.what for p in problems if p.cause == NO_SIZE)
    out: list[Problem] = []
    for p in problems:
        n = counts.pop(p.what, None) if p.cause == NO_SIZE else 0
        if n is None:
            continue  # a later tensor's: counted in the first one's hint
        if n > 1:
            more = _count(n - 1, "more stored tensor")
            p = dataclasses.replace(p, hint=f"{p.hint} (the rule needs it for {more})")
        out.append(p)
    return out


def _unused(mapping: WeightMap, i: int, sources: Iterable[str]) -> Problem:
    """Rule ``i`` took no stored tensor: its regex matches none, or earlier rules took them."""
    rule, pattern = mapping.rules[i], mapping._compiled[i]
    matched = [n for n in sources if pattern is not None and pattern.fullmatch(n)]
    taken = Counter(hit[0] for n in matched if (hit := mapping.match(n)) is not None)
    if not taken:
        return Problem(
            "mapping",
            f"rules[{i}]",
            f"source {rule.source!r} matched no stored tensor",
            hint="fix the regex (it must match the whole name), remove the rule, "
            "or pass strict=False",
            cause="a rule matched no stored tensor",
        )
    n = sum(taken.values())
    by = ", ".join(
        f"rules[{j}] ({mapping.rules[j].source!r}{', skip' if mapping.rules[j].target is None else ''})"
        for j in sorted(taken)
    )
    return Problem(
        "mapping",
        f"rules[{i}]",
        f"source {rule.source!r} matches {_count(n, 'stored tensor')}, but "
        f"{'it was' if n == 1 else 'all were'} taken by an earlier rule: {by} (first match "
        "wins)",
        hint=f"move rules[{i}] before {'it' if len(taken) == 1 else 'them'}, narrow the "
        "earlier regex, or give this rule also=True to fill its leaf in addition",
        cause="a rule was shadowed by an earlier rule",
    )


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _row(path: str, node: recipe.Node, rule: MapRule) -> Row:
    return Row(
        path, tuple(node.reads()), rule.transforms_text(), node.shape, dtype_name(node.dtype)
    )
