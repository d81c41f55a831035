"""Every error modelshard raises on purpose, and how each one formats its message."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping, Sequence
from os.path import commonprefix
from typing import Any

from jax.sharding import PartitionSpec

from .folding import fold
from .text import format_mesh, format_spec, natural_key, spec_json, toml_spec, vocabulary


class ModelshardError(Exception):
    """Base class of modelshard's own errors (each also subclasses ValueError or TypeError)."""

    __module__ = "modelshard"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__ == __name__:  # this module's errors: modelshard.SpecError
            cls.__module__ = "modelshard"

    def to_json(self) -> dict[str, Any]:
        """The error as a JSON-ready dict: ``{"type": "SpecError", "message": ...}``
        (``SpecError`` adds ``problems``); what the CLI prints with ``--json``."""
        return {"type": type(self).__name__, "message": str(self)}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One offending leaf (or prefix-tree entry) found while expanding and validating specs.

    Attributes:
        arg: which argument the leaf belongs to (``"tree"`` for a single tree).
        path: canonical path of the leaf inside the argument (``""`` for a root leaf), or
            None when the problem concerns no single leaf.
        what: one sentence saying what is wrong.
        shape: the leaf's shape, if it is an array leaf.
        dtype: the leaf's dtype name, if it is an array leaf.
        spec: the spec produced for the leaf, formatted (give the ``PartitionSpec`` itself).
        rule: which rule produced it (``"rule 0 'kernel$'"``, ``"metadata"``, ...).
        mesh: the mesh axis sizes, formatted (give the ``{"axis": size}`` mapping itself).
        hint: how to fix it.
        cause: the cause in words that groups problems (default: ``what`` less its numbers).
        dimension: the leaf's dimension the problem is about, or None.
        logical_name: the logical axis name the problem is about (``"heads"``), or None.
        logical_rule: the entry of logical rules that mapped it (``"rules['heads']"``), or None.
        spec_json: the spec as every JSON output spells it (``[None, "model"]``), or None.
        mesh_sizes: the mesh as ``{"axis": size}``, or None.
    """

    arg: str
    path: str | None
    what: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    spec: str | PartitionSpec | None = None
    rule: str | None = None
    mesh: str | Mapping[str, int] | None = None
    hint: str | None = None
    cause: str | None = None
    dimension: int | None = None
    logical_name: str | None = None
    logical_rule: str | None = None
    spec_json: list[Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    mesh_sizes: dict[str, int] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # one value, two spellings: the text people read, the JSON scripts read
        if isinstance(self.spec, PartitionSpec):
            object.__setattr__(self, "spec_json", spec_json(self.spec))
        if self.spec is not None and not isinstance(self.spec, str):
            object.__setattr__(self, "spec", format_spec(self.spec))  # Rules, fsdp: repr
        if isinstance(self.mesh, Mapping):
            object.__setattr__(self, "mesh_sizes", dict(self.mesh))
            object.__setattr__(self, "mesh", format_mesh(self.mesh))

    def to_json(self) -> dict[str, Any]:
        """The problem as JSON (``spec`` a list, ``mesh`` an object, as every JSON output)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        shape = None if self.shape is None else list(self.shape)
        return out | {"shape": shape, "spec": self.spec_json, "mesh": self.mesh_sizes}

    def spec_text(self) -> str | None:
        """The spec as people read it: ``P(None, 'model')``, or as a rules file writes it."""
        if vocabulary() == "cli" and self.spec_json is not None:
            return toml_spec(self.spec_json)
        return None if self.spec is None else str(self.spec)

    def label(self) -> str:
        """``arg:path`` (``arg:<root>`` for a root leaf), or ``arg`` when ``path`` is None."""
        return self.arg if self.path is None else f"{self.arg}:{self.path or '<root>'}"

    def lines(self) -> list[str]:
        head = f"  {self.label()}"
        if self.shape is not None:
            head += f" {self.dtype}{list(self.shape)}"
        out = [head, f"    problem: {self.what}"]
        if self.spec is not None:
            out.append(
                f"    spec: {self.spec_text()}" + (f" (from {self.rule})" if self.rule else "")
            )
        if self.mesh is not None:
            out.append(f"    mesh: {self.mesh}")
        if self.hint:
            out.append(f"    hint: {self.hint}")
        return out


LIST_IN_FULL = 8
"""Errors with at most this many problems list each in full; larger ones group by cause."""

_DIGITS = re.compile(r"\d+")
_PARENS_WITH_DIGITS = re.compile(r"\s*\([^()]*\d[^()]*\)")
_NOT_IN_MESH = re.compile(r"axis '([^']+)' .*is not in the mesh")


@dataclasses.dataclass(frozen=True)
class Cause:
    """Problems with one cause: a summary, how many, an example, and the hint that fits."""

    what: str
    problems: tuple[Problem, ...]
    hint: str | None

    @property
    def count(self) -> int:
        return len(self.problems)

    @property
    def example(self) -> Problem:
        """The problem shown: a parameter rather than its optimizer moments."""
        return _example(self.problems)

    @property
    def mirrors(self) -> tuple[Problem, ...]:
        """The example's optimizer moments: paths ending with its path below the first component."""
        e = self.example
        _, _, tail = (e.path or "").partition("/")
        if "/" not in tail:  # a one-component tail (``bias``) names no parameter
            return ()
        depth = (e.path or "").count("/")
        return tuple(
            p
            for p in self.problems
            if (p.path or "").count("/") > depth and (p.path or "").endswith("/" + tail)
        )

    @property
    def numbers_differ(self) -> bool:
        return any(p.what != self.example.what for p in self.problems)

    def folded(self) -> list[Any]:
        return fold(self.problems, lambda p: p.label())

    def head_lines(self, index: int = 0) -> list[str]:
        e = self.example
        leaves = f"{self.count} lea{'ves' if self.count != 1 else 'f'}"
        if self.what == e.what and self.numbers_differ:
            leaves += " like it (their numbers differ)"
        out = [f"  [{index}] {self.what}: {leaves}"]
        detail = e.label()
        if e.shape is not None:
            detail += f" {e.dtype}{list(e.shape)}"
        if e.spec is not None:
            detail += f", spec {e.spec_text()}" + (f" from {e.rule}" if e.rule else "")
        if e.mesh is not None:
            detail += f", mesh ({e.mesh})"
        mirrors = self.mirrors
        if mirrors:
            detail += (
                f" (and {len(mirrors)} lea{'ves' if len(mirrors) != 1 else 'f'} mirroring its "
                f"path, e.g. {mirrors[0].label()})"
            )
        out.append(f"      e.g. {detail}" + ("" if e.what == self.what else f": {e.what}"))
        if self.hint:
            out.append(f"      hint: {self.hint}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "numbers_differ": self.numbers_differ,
            "count": self.count,
            "hint": self.hint,
            "example": self.example.path,
            "mirrors": [p.path for p in self.mirrors],
            "paths": [{"path": g.path, "count": g.count} for g in self.folded()],
        }


def _fitting_hint(problems: Sequence[Problem]) -> str | None:
    """The hint that fits a whole cause, else the problems' own (``_joined_hints``)."""
    e = problems[0]
    m = _NOT_IN_MESH.search(e.what)
    if m is not None and e.rule is not None and e.rule.startswith("fsdp("):
        axes = list(e.mesh_sizes or {})
        instead = f"fsdp({axes[0]!r})" if axes else "fsdp(<mesh axis>)"
        return (
            f"{e.rule} shards over the mesh axis {m.group(1)!r}, which this mesh "
            f"({e.mesh or 'no axes'}) does not have: write {instead}, or build the mesh with "
            f"an {m.group(1)!r} axis"
        )
    if e.what == "no rule matches this leaf" and len(problems) > 1:
        parents = [(p.path or "").split("/")[:-1] for p in problems]
        prefix = "/".join(commonprefix(parents))  # noqa: RUF071 (lists: by component)
        if prefix:
            if vocabulary() == "cli":  # the command's rules come from a TOML file
                return (
                    f"no rule covers anything under {prefix + '/'!r}: add [[rules]] tables "
                    f"for it to the rules file, e.g. pattern = '^{prefix}/' with spec = [] to "
                    "replicate it, a catch-all last (pattern = '.*', spec = []), or "
                    "strict = false to replicate unmatched leaves"
                )
            return (
                f"no rule covers anything under {prefix + '/'!r}: add rules for it, e.g. "
                f"(r'^{prefix}/', P()) to replicate it, a catch-all (r'.*', P()) last, or "
                "Rules(..., strict=False) to replicate unmatched leaves"
            )
    return _joined_hints(problems)


# distinct fixes a cause's hint lists before "and N more"
_MAX_FIXES = 6


def _joined_hints(problems: Sequence[Problem]) -> str | None:
    """The problems' hints: a shared advice once, then each rule's own fix."""
    hints = list(dict.fromkeys(p.hint for p in problems if p.hint))
    if len(hints) <= 1:
        return problems[0].hint
    lo, hi = min(hints), max(hints)  # their shared start is every hint's
    same = next((i for i, (a, b) in enumerate(zip(lo, hi, strict=False)) if a != b), len(lo))
    cut = lo[:same].rfind(": ")
    if cut < 0:
        return problems[0].hint
    fixes = sorted((h[cut + 2 :] for h in hints), key=natural_key)  # rules[2] before rules[10]
    more = len(fixes) - _MAX_FIXES
    return (
        hints[0][: cut + 2]
        + "; ".join(fixes[:_MAX_FIXES])
        + (f"; and {more} more (each problem has its own)" if more > 0 else "")
    )


def _example(problems: Sequence[Problem]) -> Problem:
    """The first problem whose path others mirror below their first components, else the first."""
    paths = [(p.path or "").split("/") for p in problems]
    # what a deeper path ends with, below two or more components
    deeper = {"/".join(parts[i:]) for parts in paths for i in range(2, len(parts))}
    for p in problems:
        _, _, tail = (p.path or "").partition("/")
        if "/" in tail and tail in deeper:  # ``bias`` alone is every module's, no mirror
            return p
    return problems[0]


def group_problems(problems: Sequence[Problem]) -> list[Cause]:
    """``problems`` grouped by cause, largest group first (ties: first seen)."""
    groups: dict[str, list[Problem]] = {}
    for p in problems:
        # what problems of one cause share: the sentence without its numbers
        key = _DIGITS.sub("#", _PARENS_WITH_DIGITS.sub("", p.what)).strip()
        groups.setdefault(key if p.cause is None else p.cause, []).append(p)
    out = [
        Cause(ps[0].cause or _example(ps).what, tuple(ps), _fitting_hint(ps))
        for ps in groups.values()
    ]
    return sorted(out, key=lambda c: -c.count)  # stable: ties keep the order first seen


class SpecError(ModelshardError, ValueError):
    """Specs that do not fit the tree or the mesh; lists every offending leaf at once.

    Attributes:
        problems: one [`Problem`][modelshard.Problem] per offending leaf or prefix entry.
        site: where in the user's code the specs were applied, when not the call that raised.
    """

    noun = "sharding problem"  # what a problem is called in the summary line

    def __init__(
        self, problems: Sequence[Problem], header: str | None = None, site: str | None = None
    ):
        self.problems = tuple(problems)
        self.header = header
        self.site = site
        listed = "found (every offending leaf is listed; paths are arg:path):"
        full = len(self.problems) <= LIST_IN_FULL
        super().__init__(self._listed(listed) if full else self._grouped())

    @property
    def causes(self) -> list[Cause]:
        """The problems grouped by cause, largest group first (see ``Cause``)."""
        return group_problems(self.problems)

    def report(self) -> str:
        """Every problem in full, one block per leaf (``str(err)`` summarises large lists)."""
        return self._listed("(every one):")

    def _listed(self, tail: str) -> str:
        n = len(self.problems)
        head = self.header or f"{n} {self.noun}{'s' if n != 1 else ''} {tail}"
        lines = [f"{self.site}: {head}" if self.site else head]
        for p in self.problems:
            lines.extend(p.lines())
        return "\n".join(lines)

    def _grouped(self, max_lines: int = 36) -> str:
        causes = self.causes
        n, k = len(self.problems), len(causes)
        lines = [
            (f"{self.site}: " if self.site else "")
            + (self.header + " " if self.header else "")
            + f"{n} {self.noun}s, {k} cause{'s' if k != 1 else ''} "
            "(paths are arg:path; numbered layers folded as {0..N}):"
        ]
        budget = max_lines - 2 - sum(len(c.head_lines()) for c in causes[:8])
        shown = causes[:8]
        per_cause = max(2, budget // max(len(shown), 1))
        for i, c in enumerate(shown, 1):
            lines.extend(c.head_lines(index=i))
            groups = c.folded()
            for g in groups[:per_cause]:
                lines.append(f"      {g.path}" + (f"  ({g.count} leaves)" if g.count > 1 else ""))
            rest = groups[per_cause:]
            if rest:
                leaves = sum(g.count for g in rest)
                lines.append(f"      ... {len(rest)} more paths ({leaves} leaves)")
        if len(causes) > len(shown):
            more = causes[len(shown) :]
            lines.append(f"... {len(more)} more causes ({sum(c.count for c in more)} problems)")
        if vocabulary() == "cli":
            lines.append(f"All {n} problems, each in full: the same command with --json.")
        else:
            lines.append(
                f"All {n} problems are on this error: err.problems (structured), err.causes, "
                "print(err.report()) for every one in full."
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """``{"type", "message", "site", "problems": [one dict per Problem], "causes"}``."""
        out = super().to_json()
        out["site"] = self.site
        out["problems"] = [p.to_json() for p in self.problems]
        out["causes"] = [c.to_json() for c in self.causes]
        return out


def spec_error(
    arg: str, path: str | None, what: str, header: str | None = None, **fields: Any
) -> SpecError:
    """A ``SpecError`` of one problem (``fields``: the ``Problem``'s other fields)."""
    return SpecError([Problem(arg, path, what, **fields)], header=header)


class FitError(SpecError):
    """A step needs more memory per device than its budget
    ([`FitAdvice.check`][modelshard.FitAdvice.check]).

    Attributes:
        advice: the ``FitAdvice`` (its JSON is ``to_json``'s ``advice``).
    """

    def __init__(self, problems: Sequence[Problem], advice: Any, header: str | None = None):
        super().__init__(problems, header=header)
        self.advice = advice

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["advice"] = self.advice.to_json()
        return out


class ShardingMismatchError(SpecError):
    """An input's current sharding differs from the planned one and moving it was refused."""


class MappingError(SpecError):
    """A weight mapping that does not fit its source or target, every problem listed (paths
    are ``source:NAME``, ``target:PATH`` and ``mapping:rules[i]``)."""

    noun = "mapping problem"


class AdapterError(ModelshardError, TypeError):
    """A container type is unknown, registered twice, or its adapter misbehaved."""


class MeshError(ModelshardError, ValueError):
    """A mesh cannot be built, or an operation needs a concrete mesh and got another."""


class AssembleError(ModelshardError, ValueError):
    """Local pieces that cannot form one global array (mismatched structure, shape or dtype)."""


class CheckpointError(ModelshardError, ValueError):
    """A checkpoint that is missing, damaged, or does not match the requested target."""


class ForeignStepError(CheckpointError):
    """A ``CheckpointManager`` refused a step number another tool's step holds: it never
    removes or replaces what it did not write (``CheckpointManager.delete(step)`` does).

    Attributes:
        step: the step number refused.
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class ForeignStepsWarning(UserWarning):
    """A ``CheckpointManager`` was opened on a root holding entries another tool wrote that it
    does not restore; it leaves them alone."""

    __module__ = "modelshard"


class DistributedError(ModelshardError, ValueError):
    """A malformed or late multi-process setting, or a value spanning other processes'
    devices where this process needs all of it."""


class PartialRestoreWarning(UserWarning):
    """``restore(partial=True)`` left leaves the checkpoint lacks as ``like`` had them, and
    did not read those the target lacks.

    Attributes:
        restored: paths of the target's leaves read from the checkpoint.
        kept: paths of the target's leaves that kept ``like``'s value.
        skipped: paths of the checkpoint's leaves the target has no place for.

    Example:
        >>> import warnings
        >>> import modelshard as ms
        >>> w = ms.PartialRestoreWarning("", restored=("a",), kept=("b",), skipped=())
        >>> w.kept
        ('b',)
    """

    __module__ = "modelshard"

    def __init__(
        self, message: str, *, restored: Sequence[str], kept: Sequence[str], skipped: Sequence[str]
    ) -> None:
        super().__init__(message)
        self.restored = tuple(restored)
        self.kept = tuple(kept)
        self.skipped = tuple(skipped)


def caller_stacklevel() -> int:
    """``stacklevel`` naming the first frame outside modelshard (as 3.12's skip_file_prefixes)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("modelshard."):
        level, frame = level + 1, frame.f_back
    return level
