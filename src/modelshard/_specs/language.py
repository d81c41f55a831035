"""The spec language: what may be given as the sharding of one argument."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import jax
from jax.sharding import PartitionSpec

from .._base import (
    Problem,
    SpecError,
    format_spec,
    quote_pattern,
    spec_error,
    toml_entry,
    toml_spec,
)
from .logical import LogicalRules, compile_logical

AxisEntry: TypeAlias = str | tuple[str, ...] | None
SpecLike: TypeAlias = Any  # PartitionSpec | Rules | FSDP | Callable | prefix tree of these

_P = PartitionSpec


def partial_axes(spec: PartitionSpec) -> frozenset[str]:
    """The mesh axes ``spec`` marks ``unreduced`` or ``reduced`` (empty for plain specs)."""
    return frozenset(getattr(spec, "unreduced", ())) | frozenset(getattr(spec, "reduced", ()))


def to_spec(value: Any, where: str) -> PartitionSpec:
    """Normalise a rule's spec: a ``PartitionSpec``, or a tuple/list of axis entries."""
    if isinstance(value, PartitionSpec):
        return value
    if isinstance(value, tuple | list) and all(is_entry(e) for e in value):
        return PartitionSpec(*value)
    what = f"{value!r} ({type(value).__name__}) is not a PartitionSpec"
    hint = "write P('data', None) (or a tuple such as ('data', None)); P() replicates"
    raise spec_error("spec", where, what, hint=hint)


def is_axes_entry(e: Any) -> bool:
    """Whether ``e`` names axes as a spec entry may: a name or a tuple of names (not ``None``)."""
    return isinstance(e, str) or (isinstance(e, tuple) and all(isinstance(x, str) for x in e))


def is_entry(e: Any) -> bool:
    """Whether ``e`` is a spec entry: ``None``, a name, or a tuple of names."""
    return e is None or is_axes_entry(e)


def entry_axes(e: Any) -> tuple[str, ...]:
    """The axis names a spec entry names, in order: ``None`` -> ``()``, ``"a"`` -> ``("a",)``."""
    return () if e is None else (e,) if isinstance(e, str) else tuple(e)


_MISS = object()
_ZEROS = bytes.maketrans(b"123456789", b"000000000")


@dataclasses.dataclass(frozen=True, eq=False)
class Rules:
    """Regex rules over canonical leaf paths; the first rule whose pattern matches wins.

    Patterns use ``re.search`` (anchor with ``^`` or ``$``). Rank-0 leaves replicate; a leaf
    no rule matches takes the axis names its metadata carries, if any. Spec entries are mesh
    axis names or logical names mapped through ``logical``; anything else is an error.

    Args:
        rules: ``(pattern, spec)`` pairs; a spec is a ``PartitionSpec`` or a tuple of entries.
        logical: logical names -> mesh axes: a mapping (``{"embed": "model"}``, ``None``
            replicates) or Flax's ordered ``(name, mesh axes)`` pairs (as
            ``flax.linen.logical_to_mesh_axes`` reads them). ``None``: the active
            [`logical_rules`][modelshard.logical_rules] context (or Flax's), if any.
        strict: a leaf no rule matches (without metadata), and a rule that matches no leaf,
            are errors; if false, such leaves replicate.
        file: the TOML rules file these rules were read from (hints then give its lines).

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> rules = Rules([(r"embedding$", P("vocab", "embed")), (r"kernel$", P("embed", "mlp")),
        ...                (r".*", P())], logical={"vocab": "model", "embed": None, "mlp": "model"})
        >>> rules.match("layers/0/mlp/kernel")
        (1, P('embed', 'mlp'))
    """

    rules: Sequence[tuple[str, Any]] = ()
    logical: Mapping[str, AxisEntry] | Sequence[tuple[str, AxisEntry]] | None = None
    strict: bool = True
    file: str | None = dataclasses.field(default=None, repr=False)
    compiled_logical: LogicalRules | None = dataclasses.field(init=False, repr=False, default=None)
    _compiled: tuple[tuple[re.Pattern[str], PartitionSpec], ...] = dataclasses.field(
        init=False, repr=False
    )
    _digit_blind: bool = dataclasses.field(init=False, repr=False, default=False)
    _blind: dict[bytes, tuple[int, PartitionSpec] | None] = dataclasses.field(
        init=False, repr=False, default_factory=dict
    )
    _cache: dict[str, tuple[int, PartitionSpec] | None] = dataclasses.field(
        init=False, repr=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        compiled = []
        rules = self.rules
        if isinstance(rules, Mapping):
            rules = list(rules.items())
        if isinstance(rules, str | bytes) or not isinstance(rules, Iterable):
            what = f"rules must be a list of (pattern, spec) pairs, got {type(self.rules).__name__}"
            raise spec_error("Rules", "", what, hint="Rules([(r'kernel$', P('data', None))])")
        for i, item in enumerate(list(rules)):
            where = f"rule {i}"
            if not (isinstance(item, tuple | list) and len(item) == 2):
                hint = "each rule is a 2-tuple like (r'kernel$', P('data'))"
                problems.append(
                    Problem("Rules", where, f"{item!r} is not a (pattern, spec) pair", hint=hint)
                )
                continue
            pattern, spec = item
            if not isinstance(pattern, str):
                problems.append(Problem("Rules", where, f"pattern {pattern!r} is not a string"))
                continue
            try:
                rx = re.compile(pattern)
            except re.error as e:
                what = f"pattern {pattern!r} is not a valid regular expression: {e}"
                problems.append(Problem("Rules", where, what))
                continue
            try:
                compiled.append((rx, to_spec(spec, where)))
            except SpecError as e:
                problems.extend(dataclasses.replace(p, arg="Rules", path=where) for p in e.problems)
        if self.file is None:
            source = "Rules(logical=...)"
        else:  # a rules file: its [logical] table, or its logical array of pairs
            table = isinstance(self.logical, Mapping)
            source = f"the {'[logical] table' if table else 'logical array'} of {self.file}"
        logical, bad = compile_logical(self.logical, source, file=self.file)
        problems.extend(bad)
        if problems:
            raise SpecError(problems, header="invalid Rules:")
        object.__setattr__(self, "rules", tuple((p.pattern, s) for p, s in compiled))
        object.__setattr__(self, "compiled_logical", logical)
        if logical is not None:
            object.__setattr__(self, "logical", logical.public)
        object.__setattr__(self, "_compiled", tuple(compiled))
        blind = not any(ch.isdigit() for rx, _ in compiled for ch in rx.pattern)
        object.__setattr__(self, "_digit_blind", blind)

    def match(self, path: str) -> tuple[int, PartitionSpec] | None:
        """``(index, spec)`` of the first rule whose pattern is found in ``path``, or None.

        Matches are cached per path; where no pattern mentions a digit, paths that differ
        only in digits (``layers/0/...`` .. ``layers/199/...``) share one search.
        """
        return self.match_all((path,))[0]

    def match_all(self, paths: Sequence[str]) -> list[tuple[int, PartitionSpec] | None]:
        """``match`` of every path in ``paths`` (one loop: plans match 10,000 paths)."""
        cache, blind, search = self._cache, self._blind, self._search
        out: list[tuple[int, PartitionSpec] | None] = []
        append = out.append
        zeros = _ZEROS if self._digit_blind else None
        for path in paths:
            hit = cache.get(path, _MISS)
            if hit is _MISS:
                if zeros is not None:
                    key = path.encode().translate(zeros)
                    hit = blind.get(key, _MISS)
                    if hit is _MISS:
                        hit = blind[key] = search(path)
                else:
                    hit = search(path)
                if len(cache) < 1_000_000:
                    cache[path] = hit  # type: ignore[assignment]
            append(hit)  # type: ignore[arg-type]
        return out

    def _search(self, path: str) -> tuple[int, PartitionSpec] | None:
        for i, (rx, spec) in enumerate(self._compiled):
            if rx.search(path):
                return i, spec
        return None

    def to_toml(self) -> str:
        """These rules as a TOML rules file, which [`load_rules`][modelshard.load_rules]
        reads back as the same rules.

        Example:
            >>> from jax.sharding import PartitionSpec as P
            >>> print(Rules([("kernel$", P(None, "model"))]).to_toml().strip())
            strict = true
            <BLANKLINE>
            [[rules]]
            pattern = 'kernel$'
            spec = ["none", "model"]
        """
        lines = [f"strict = {'true' if self.strict else 'false'}", ""]
        for pattern, spec in self.rules:
            quoted = f"'{pattern}'" if "'" not in pattern else toml_entry(pattern)
            lines += ["[[rules]]", f"pattern = {quoted}", f"spec = {toml_spec(spec)}", ""]
        logical = self.logical
        if isinstance(logical, Mapping) and logical:
            lines.append("[logical]")
            lines += [f'"{k}" = {toml_entry(v)}' for k, v in logical.items()]
        elif logical:  # Flax's ordered pairs: a top-level array, before the first [[rules]]
            pairs = [f'  ["{k}", {toml_entry(v)}],' for k, v in logical]
            lines[1:1] = ["logical = [", *pairs, "]"]
        return "\n".join(lines) + "\n"

    def describe(self, index: int) -> str:
        """``rule 0 'kernel$'``: how plans and errors name a rule."""
        return f"rule {index} {quote_pattern(self.rules[index][0])}"

    def __repr__(self) -> str:
        inner = ", ".join(f"({p!r}, {format_spec(s)})" for p, s in self.rules)
        extra = "" if self.logical is None else f", logical={self.logical!r}"
        return f"Rules([{inner}]{extra}, strict={self.strict})"


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Fully-sharded data parallel: shard each leaf's largest dimension divisible by ``axis``.

    Built by [`fsdp`][modelshard.fsdp]. Small, rank-0 and indivisible leaves replicate.
    """

    axis: str | tuple[str, ...] = "data"
    min_size: int = 2**14

    def __post_init__(self) -> None:
        axes = self.axis if isinstance(self.axis, tuple) else (self.axis,)
        if not axes or not all(isinstance(a, str) for a in axes):
            what = f"axis must be a mesh axis name or a tuple of names, got {self.axis!r}"
            raise spec_error("fsdp", "axis", what)
        # Checked here, not per leaf: with no big or divisible leaf it would pass silently.
        twice = sorted({a for a in self.axes if self.axes.count(a) > 1})
        if twice:
            what = f"mesh axis {twice[0]!r} is used twice in {self.axis!r}"
            hint = "each mesh axis may shard at most one dimension of a leaf"
            raise spec_error("fsdp", "axis", what, hint=hint)
        size = self.min_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise spec_error("fsdp", "min_size", f"min_size must be an int >= 0, got {size!r}")

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else self.axis

    def spec_for(
        self, shape: tuple[int, ...], sizes: Mapping[str, int]
    ) -> tuple[PartitionSpec, str]:
        """The spec for a leaf of ``shape`` and a note saying how it was chosen."""
        if not shape:
            return _P(), "scalar"
        if any(a not in sizes for a in self.axes):
            # Let validation report the unknown axis on the first shardable leaf.
            dim = max(range(len(shape)), key=lambda d: shape[d])
            return _P(*([None] * dim), self.axis), str(self)
        n = math.prod(sizes[a] for a in self.axes)
        if math.prod(shape) < self.min_size:
            return _P(), f"{self} (size < min_size={self.min_size}: replicated)"
        order = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
        for d in order:
            if shape[d] % n == 0 and shape[d] > 0:
                return _P(*([None] * d), self.axis), str(self)
        return _P(), f"{self} (no dimension divisible by {n}: replicated)"

    def __str__(self) -> str:
        return f"fsdp({self.axis!r})"


def fsdp(axis: str | tuple[str, ...] = "data", min_size: int = 2**14) -> FSDP:
    """Shard every leaf over ``axis`` along its largest divisible dimension.

    Args:
        axis: the mesh axis (or tuple of axes, sharded together) to shard over.
        min_size: leaves with fewer elements replicate: biases and norm scales cost more
            in collectives sharded than they save in memory.

    Returns:
        An [`FSDP`][modelshard.FSDP] spec-like, usable wherever a spec is accepted.

    Example:
        >>> fsdp("data").spec_for((1024, 4096), {"data": 8})
        (P(None, 'data'), "fsdp('data')")
    """
    return FSDP(axis, min_size)


def is_leaf_spec(x: Any) -> bool:
    """Whether ``x`` is a single spec-like (as opposed to a prefix tree of them)."""
    return (
        x is None
        or isinstance(x, PartitionSpec | Rules | FSDP)
        or (
            callable(x)
            and not isinstance(x, type)
            and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))
        )
    )
