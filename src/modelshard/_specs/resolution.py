"""One leaf's spec, resolved to mesh axes and validated: the per-leaf half of the pipeline."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeAlias

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._base import Problem, close_match, dtype_name, format_mesh, toml_spec, vocabulary
from .._containers import LeafInfo
from .language import FSDP, Rules, entry_axes, format_spec, is_axes_entry, partial_axes
from .logical import LogicalRules, active_logical, add_name_hint, public_entry

Via: TypeAlias = tuple[tuple[tuple[str, tuple[str, ...], str], ...], ...]
"""Per dimension of a spec, each logical name in it with its mesh axes and the entry of
the rules that mapped it: ``((("batch", ("data",), "rules['batch']"),), (), ...)``."""


Checked: TypeAlias = tuple[PartitionSpec, str, list[tuple[str, str, dict[str, Any]]], Via]
"""One leaf's resolution: spec, rule text, problems as (what, hint, Problem fields), ``Via``."""


class Ctx:
    """State shared across all arguments of one expansion (rule usage, problems)."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes
        self.mesh_text = format_mesh(sizes)
        self.problems: list[Problem] = []
        self.used: dict[int, tuple[Rules, set[int]]] = {}
        self.resolved: dict[tuple[Any, ...], Checked] = {}
        self.placed: dict[Any, Any] = {}  # dtype -> the dtype it has once placed
        # The context's logical rules, read once: every leaf of one plan sees the same.
        self.logical = active_logical()

    def used_by(self, rules: Rules) -> set[int]:
        """The indices of ``rules``' rules that matched a leaf so far (filled by the caller)."""
        return self.used.setdefault(id(rules), (rules, set()))[1]

    def problem(
        self,
        arg: str,
        path: str,
        leaf: Any,
        what: str,
        spec: Any = None,
        rule: str | None = None,
        hint: str | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        shape = tuple(getattr(leaf, "shape", ())) if leaf is not None else None
        dtype = dtype_name(leaf.dtype) if leaf is not None and hasattr(leaf, "dtype") else None
        fields = fields or {}
        problem = Problem(arg, path, what, shape, dtype, spec, rule, self.sizes, hint, **fields)
        self.problems.append(problem)


def resolve_names(
    spec: PartitionSpec, logical: LogicalRules | None
) -> tuple[PartitionSpec, str | None, Via]:
    """Map the logical names of ``spec`` through ``logical``: (mesh-axis spec, problem, ``Via``)."""
    if logical is None or partial_axes(spec):  # partial specs are left for check to report
        return spec, None, ()
    entries = list(spec)
    known = logical.candidates
    via: list[tuple[tuple[str, tuple[str, ...], str], ...]] = [()] * len(entries)
    if not logical.ordered:
        for dim, entry in enumerate(entries):
            if is_axes_entry(entry) and any(n in known for n in entry_axes(entry)):
                names = entry_axes(entry)
                mapped = [a for n in names for a in (known[n][0] if n in known else (n,))]
                entries[dim] = public_entry(mapped)
                via[dim] = tuple((n, known[n][0], logical.label(n)) for n in names if n in known)
        return PartitionSpec(*entries), None, tuple(via)
    # Flax's priority rules: (dim, position) slots of logical names, filled pair by pair.
    slots: dict[str, tuple[int, int]] = {}
    taken: set[str] = set()
    parts: list[list[Any]] = []
    for dim, entry in enumerate(entries):
        if not is_axes_entry(entry):
            parts.append([entry])
            continue
        names = entry_axes(entry)
        for i, n in enumerate(names):
            if n in known:
                if n in slots:
                    what = f"logical name {n!r} names dimensions {slots[n][0]} and {dim}; "
                    what += "Flax-style logical rules map each name to one dimension"
                    return spec, what, ()
                slots[n] = (dim, i)
            else:
                taken.add(n)
        parts.append(list(names))
    if not slots:
        return spec, None, ()
    assigned: dict[str, tuple[str, ...]] = {}
    for name, target in logical.pairs:
        if name in slots and name not in assigned and taken.isdisjoint(target):
            assigned[name] = target
            taken.update(target)
    for name, (dim, i) in slots.items():
        got = assigned.get(name, ())
        parts[dim][i] = got
        label = logical.label(name, got) if name in assigned else "every pair blocked"
        via[dim] = (*via[dim], (name, got, label))
    for dim, entry in enumerate(entries):
        if is_axes_entry(entry):
            entries[dim] = public_entry(
                [a for p in parts[dim] for a in (p if isinstance(p, tuple) else (p,))]
            )
    return PartitionSpec(*entries), None, tuple(via)


class Found(NamedTuple):
    """One thing ``check`` finds wrong; ``kind`` and ``dim`` name the two problems of a dimension."""

    what: str
    hint: str
    kind: str | None = None  # "axis" (not in the mesh) or "indivisible"
    dim: int = -1
    axis: str = ""


def check(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    sizes: Mapping[str, int],
    logical: LogicalRules | None = None,
    file: str | None = None,
) -> list[Found]:
    """Everything wrong with placing ``shape`` by ``spec`` on a mesh of ``sizes``."""
    partial = partial_axes(spec)
    if partial:  # JAX cannot device_put these (unreduced) or only on Explicit axes (reduced)
        what = f"the spec marks mesh axes {', '.join(map(repr, sorted(partial)))} unreduced or "
        what += "reduced, which placing arrays does not support"
        hint = "place with a plain PartitionSpec; unreduced/reduced shardings belong inside a "
        return [Found(what, hint + "jitted computation")]
    out: list[Found] = []
    entries = tuple(spec)
    if len(entries) > len(shape):
        what = f"spec has {len(entries)} entries but the leaf has rank {len(shape)}"
        hint = f"give at most {len(shape)} entries for this leaf (a rule with a shorter spec, "
        out.append(Found(what, hint + "or P() to replicate it)"))
    seen: dict[str, int] = {}
    for dim, entry in enumerate(entries):
        if entry is None:
            continue
        if not is_axes_entry(entry):
            what = f"entry {dim} is {entry!r}, not a mesh axis name, tuple of names or None"
            hint = "spec entries are mesh axis names such as 'data', tuples of them, or None"
            out.append(Found(what, hint))
            continue
        axes = entry_axes(entry)
        for a in axes:
            if a not in sizes:
                what = f"axis {a!r} (dimension {dim}) is not in the mesh"
                out.append(Found(what, _unknown(a, sizes, logical, file), "axis", dim, a))
            elif a in seen:
                what = f"mesh axis {a!r} is used twice (dimensions {seen[a]} and {dim})"
                out.append(Found(what, "each mesh axis may shard at most one dimension of a leaf"))
            else:
                seen[a] = dim
        if dim < len(shape) and all(a in sizes for a in axes):
            n = math.prod(sizes[a] for a in axes)
            if shape[dim] % n:
                by = " x ".join(f"{a}={sizes[a]}" for a in axes)
                what = f"dimension {dim} (size {shape[dim]}) is partitioned {n} times ({by}), "
                what += f"but {shape[dim]} is not divisible by {n}"
                hint = "shard this dimension over axes whose sizes divide it, pad it, or replicate "
                out.append(Found(what, hint + "it with None", "indivisible", dim))
    return out


def unmatched_key(
    arg: str, info: LeafInfo, leaf: Any, s: Rules, shape: tuple[int, ...], ctx: Ctx
) -> tuple[Any, ...] | None:
    """The resolution-cache key of a leaf no rule matches; None once reported (``strict``)."""
    if not shape:
        return (id(s), "scalar")  # scalars always replicate
    if info.names is not None:
        return (id(s), "metadata", info.names, info.box, shape)
    if s.strict:
        if s.file is None and vocabulary() == "python":
            hint = f"add a rule whose pattern matches {info.path!r}, a catch-all (r'.*', P()), "
            hint += "or use Rules(..., strict=False) to replicate unmatched leaves"
        else:
            hint = f"add to {s.file or 'the rules file'} a [[rules]] table whose pattern matches "
            hint += f"{info.path!r}, a catch-all last (pattern = '.*', spec = []), or strict = "
            hint += "false to replicate unmatched leaves"
        ctx.problem(arg, info.path, leaf, "no rule matches this leaf", hint=hint)
        return None
    return (id(s), "unmatched")


def resolve_checked(
    arg: str, info: LeafInfo, leaf: Any, s: Any, shape: tuple[int, ...], ctx: Ctx
) -> Checked | None:
    """Resolve one leaf's spec and validate it; None after reporting a problem."""
    got = resolve(arg, info, leaf, s, shape, ctx)
    if got is None:
        return None
    spec, rule, logical = got
    file = s.file if isinstance(s, Rules) else None
    named = spec
    via: Via = ()
    if logical is not None:
        spec, twice, via = resolve_names(spec, logical)
        if twice is not None:
            hint = "give each dimension its own logical name"
            ctx.problem(arg, info.path, leaf, twice, spec=spec, rule=rule, hint=hint)
            return None
    try:
        found = check(spec, shape, ctx.sizes, logical, file)
    except TypeError:  # junk inside a spec from a function: report, never crash
        found = [Found(f"{format_spec(spec)} is not a valid PartitionSpec", "")]
    problems = []
    for f in found:
        what, hint, fields = _in_logical_terms(f, named, shape, ctx.sizes, logical, via)
        if vocabulary() == "cli" and f.kind == "indivisible" and "logical_rule" not in fields:
            hint = _cli_hint(f.dim, named, rule, file)
        problems.append((what, hint, fields))
    return spec, rule, problems, via


_RULE_INDEX = re.compile(r"rule (\d+) ")


def _cli_hint(dim: int, named: PartitionSpec, rule: str, file: str | None) -> str:
    """An indivisible dimension's hint in the command line's words: the TOML spec to write."""
    entries = list(tuple(named)) + [None] * (dim + 1 - len(tuple(named)))
    entries[dim] = None
    fixed = toml_spec(PartitionSpec(*entries))
    base = "shard this dimension over axes whose sizes divide it, pad it, or replicate it "
    base += 'with "none"'
    index = _RULE_INDEX.match(rule)
    if file is not None and index is not None:
        return f"{base}: in {file} set rules[{index.group(1)}].spec = {fixed}"
    if file is not None:  # the spec came from the leaf's metadata, under the file's rules
        return (
            f"{base}: add to {file} a [[rules]] table whose pattern matches this leaf, "
            f"spec = {fixed}"
        )
    return f"{base}: pass --rules RULES.toml with a rule for this leaf, spec = {fixed}"


def _in_logical_terms(
    f: Found,
    named: PartitionSpec,
    shape: tuple[int, ...],
    sizes: Mapping[str, int],
    logical: LogicalRules | None,
    via: Via,
) -> tuple[str, str, dict[str, Any]]:
    """A problem with a dimension a logical name mapped, said in the user's terms."""
    what, hint, dim = f.what, f.hint, f.dim
    if f.kind is None:
        return what, hint, {}
    fields: dict[str, Any] = {"dimension": dim}
    entry = tuple(named)[dim] if dim < len(tuple(named)) else None
    if logical is None or not is_axes_entry(entry):
        return what, hint, fields
    mapped = via[dim] if dim < len(via) else ()
    if f.kind == "axis":
        return _not_in_mesh(f, entry_axes(entry), mapped, sizes, logical, fields)
    if len(mapped) != 1 or len(entry_axes(entry)) != 1:
        return what, hint, fields  # several names or axes in one dimension: JAX's words
    name, target, label = mapped[0]
    size, n = shape[dim], math.prod(sizes[a] for a in target)
    by = str(n) if len(target) == 1 else " x ".join(str(sizes[a]) for a in target) + f" = {n}"
    onto = repr(target[0]) if len(target) == 1 else repr(target)
    fields.update(logical_name=name, logical_rule=label)
    what = f"{name!r} (dimension {dim}, size {size}) maps to {onto} ({by}) by {label}: "
    what += f"{size} is not divisible by {n}"
    divides = f"map {name} to an axis whose size divides {size}, or replicate it: "
    if logical.file is not None and label.startswith("[logical] "):
        hint = divides + f'in {logical.file}, [logical] {name} = "none"'
    elif logical.file is not None and label.startswith("logical["):  # the file's pairs
        set_ = f"set {label.split(' of ', 1)[0]} = {logical.entry(name, 'none')}"
        hint = divides + f"in {logical.file}, {set_}"
    else:
        none = '"none"' if vocabulary() == "cli" else "None"
        hint = f"map {name!r} to an axis whose size divides {size}, or to {none}"
    return what, hint, fields


def _not_in_mesh(
    f: Found,
    axes: tuple[str, ...],
    mapped: tuple[tuple[str, tuple[str, ...], str], ...],
    sizes: Mapping[str, int],
    logical: LogicalRules,
    fields: dict[str, Any],
) -> tuple[str, str, dict[str, Any]]:
    """A mesh axis (of ``axes``, one dimension's) not in the mesh that came from a logical name."""
    names = [n for n in axes if n not in sizes and n != f.axis]
    if not names:
        return f.what, f.hint, fields
    name, axis = names[0], f.axis
    label = next((lab for n, _, lab in mapped if n == name), None)
    fields.update(logical_name=name, logical_rule=label)
    shown = ", ".join(map(repr, sizes)) or "none"
    what = f"logical name {name!r} (dimension {f.dim}) maps to mesh axis {axis!r}, which is not "
    what += "in the mesh"
    close = close_match(axis, sizes)
    if close is not None:
        hint = f"did you mean {close!r}? write {logical.entry(name, close)} in "
        hint += f"{logical.source} (mesh axes are {shown})"
    else:
        none = '"none"' if logical.file is not None else "None"
        hint = f"mesh axes are {shown}: map {name!r} to one of them (or {none} to replicate) "
        hint += f"in {logical.describe()}"
    return what, hint, fields


def _unknown(
    name: str, sizes: Mapping[str, int], logical: LogicalRules | None, file: str | None
) -> str:
    """The hint for a name that is neither a mesh axis nor a known logical name."""
    axes = f"mesh axes are {', '.join(map(repr, sizes)) or 'none'}"
    close = close_match(name, sizes)
    if close is not None:
        return f"did you mean {close!r}? ({axes})"
    if logical is not None:
        add = f"add {logical.entry(name)} there"
        # logical names are short words: a swapped pair of letters ('hedas') is a typo
        typo = close_match(name, logical.candidates, cutoff=0.6)
        if typo is not None:  # the rules' entry is the misspelt one: show it and its fix
            add = (
                f"it has {logical.written(typo)}: did you mean "
                f"{logical.written(typo, as_name=name)}? (or {add})"
            )
        return f"{axes}, and {name!r} is not a logical name of {logical.describe()}; {add}"
    if file is None and vocabulary() == "cli":  # the command's saved specs: no rules file yet
        return (
            f"{axes}; give --mesh an axis {name!r}, or pass --rules RULES.toml (its [logical] "
            f'table can map {name!r}: {name} = "<mesh axis>")'
        )
    return f"{axes}; {add_name_hint(name, file)}"


_REFUSED: dict[Any, tuple[str, str] | None] = {}


def refused_by_jax(leaf: np.ndarray | np.generic) -> tuple[str, str] | None:
    """(what, hint) if JAX cannot hold this NumPy leaf: the plan says so, not ``device_put``."""
    if isinstance(leaf, np.ma.MaskedArray):
        return (
            "a NumPy masked array cannot be placed on devices",
            "JAX does not support masked arrays; pass arr.filled(...) instead",
        )
    if leaf.dtype not in _REFUSED:
        try:
            jax.typeof(np.zeros((), leaf.dtype))  # JAX's own check, once per dtype
            _REFUSED[leaf.dtype] = None
        except TypeError:
            _REFUSED[leaf.dtype] = (
                f"dtype {leaf.dtype} cannot be placed on devices",
                "JAX arrays hold booleans and numbers; convert it with .astype(...) or keep "
                "it out of the container",
            )
    return _REFUSED[leaf.dtype]


UNMATCHED = "unmatched (replicated, strict=False)"  # a plan row's rule: nothing placed it


def resolve(
    arg: str, info: LeafInfo, leaf: Any, s: Any, shape: tuple[int, ...], ctx: Ctx
) -> tuple[PartitionSpec, str, LogicalRules | None] | None:
    """(spec, rule text, logical rules) of one leaf; explicit ``Rules(logical=...)`` wins."""
    if isinstance(s, PartitionSpec):
        return s, f"{format_spec(s)} for the whole argument", ctx.logical
    if isinstance(s, Rules):
        if not shape:
            return PartitionSpec(), "scalar (replicated)", None
        hit = s.match(info.path)
        if hit is not None:
            spec, rule = hit[1], s.describe(hit[0])
        elif info.names is not None:
            spec, rule = PartitionSpec(*info.names), f"metadata ({info.box})"
        else:
            return PartitionSpec(), UNMATCHED, None
        return spec, rule, s.compiled_logical if s.logical is not None else ctx.logical
    if isinstance(s, FSDP):
        return *s.spec_for(shape, ctx.sizes), None
    fail = functools.partial(ctx.problem, arg, info.path, leaf)
    if s is None:
        fail("the spec is None", hint="use P() to replicate; None is not a spec in modelshard")
        return None
    if callable(s):
        name = getattr(s, "__name__", type(s).__name__)
        try:
            got = s(info.path, leaf)
        except Exception as e:
            fail(f"spec function {name} raised {type(e).__name__}: {e}")
            return None
        if not isinstance(got, PartitionSpec):
            hint = "return P(...) for every leaf (P() replicates)"
            fail(f"spec function {name} returned {got!r}, not a PartitionSpec", hint=hint)
            return None
        # a spec function may say in words where its specs come from (``spec_source``)
        return got, getattr(s, "spec_source", None) or f"function {name}", ctx.logical
    fail(
        f"{s!r} ({type(s).__name__}) is not a spec",
        hint="give a PartitionSpec, Rules, fsdp(...), a function (path, leaf) -> "
        "PartitionSpec, or a prefix tree of these",
    )
    return None
