"""Every error modelshard raises on purpose, and how each one formats its message."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = [
    "AdapterError",
    "AssembleError",
    "CheckpointError",
    "DistributedError",
    "MeshError",
    "ModelshardError",
    "Problem",
    "ShardingMismatchError",
    "SpecError",
]


class ModelshardError(Exception):
    """Base class of modelshard's own errors (each also subclasses ValueError or TypeError)."""

    __module__ = "modelshard"

    def to_json(self) -> dict[str, Any]:
        """The error as a JSON-ready dict: ``{"type": "SpecError", "message": ...}``
        (``SpecError`` adds ``problems``); what the CLI prints with ``--json``."""
        return {"type": type(self).__name__, "message": str(self)}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One offending leaf (or prefix-tree entry) found while expanding and validating specs.

    Attributes:
        arg: which argument the leaf belongs to (``"tree"`` for a single tree).
        path: canonical path of the leaf inside the argument.
        what: one sentence saying what is wrong.
        shape: the leaf's shape, if it is an array leaf.
        dtype: the leaf's dtype name, if it is an array leaf.
        spec: the spec that was produced for the leaf, formatted.
        rule: which rule produced it (``"rule 0 'kernel$'"``, ``"metadata"``, ...).
        mesh: the mesh axis sizes, formatted (``"data=2, model=4"``).
        hint: how to fix it.
    """

    arg: str
    path: str
    what: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    spec: str | None = None
    rule: str | None = None
    mesh: str | None = None
    hint: str | None = None

    def lines(self) -> list[str]:
        where = f"{self.arg}:{self.path or '<root>'}"
        head = f"  {where}"
        if self.shape is not None:
            head += f" {self.dtype}{list(self.shape)}"
        out = [head, f"    problem: {self.what}"]
        if self.spec is not None:
            out.append(f"    spec: {self.spec}" + (f" (from {self.rule})" if self.rule else ""))
        if self.mesh is not None:
            out.append(f"    mesh: {self.mesh}")
        if self.hint:
            out.append(f"    hint: {self.hint}")
        return out


class SpecError(ModelshardError, ValueError):
    """Specs that do not fit the tree or the mesh; lists every offending leaf at once.

    Attributes:
        problems: one :class:`Problem` per offending leaf or prefix entry.
    """

    __module__ = "modelshard"

    def __init__(self, problems: Sequence[Problem], header: str | None = None):
        self.problems = tuple(problems)
        n = len(self.problems)
        header = header or (
            f"{n} sharding problem{'s' if n != 1 else ''} found "
            f"(every offending leaf is listed; paths are arg:path):"
        )
        lines = [header]
        for p in self.problems:
            lines.extend(p.lines())
        super().__init__("\n".join(lines))

    def to_json(self) -> dict[str, Any]:
        """``{"type", "message", "problems": [one dict per Problem]}``."""
        out = super().to_json()
        out["problems"] = [
            {**dataclasses.asdict(p), "shape": None if p.shape is None else list(p.shape)}
            for p in self.problems
        ]
        return out


class ShardingMismatchError(SpecError):
    """An input's current sharding differs from the planned one and moving it was refused."""

    __module__ = "modelshard"


class AdapterError(ModelshardError, TypeError):
    """A container type is unknown, registered twice, or its adapter misbehaved."""

    __module__ = "modelshard"


class MeshError(ModelshardError, ValueError):
    """A mesh cannot be built, or an operation needs a concrete mesh and got another."""

    __module__ = "modelshard"


class AssembleError(ModelshardError, ValueError):
    """Local pieces that cannot form one global array (mismatched structure, shape or dtype)."""

    __module__ = "modelshard"


class CheckpointError(ModelshardError, ValueError):
    """A checkpoint that is missing, damaged, or does not match the requested target."""

    __module__ = "modelshard"


class DistributedError(ModelshardError, ValueError):
    """A multi-process setting that is malformed or comes too late, or a value that spans
    devices of other processes where this process needs all of it."""

    __module__ = "modelshard"
