"""Logical axis names: the rules that map them to mesh axes, and the context that sets them.

Logical rules come in two forms, accepted wherever ``logical=`` is (``Rules``, rules files,
[`logical_rules`][modelshard.logical_rules]):

- a mapping ``{"batch": ("data", "fsdp"), "embed": None}``: one target per name. Two names
  of one leaf mapped onto the same mesh axis is an error (the plan says which).
- Flax's ordered list of ``(logical_name, mesh_axes)`` pairs, as ``nn.logical_axis_rules``
  and MaxText's ``logical_axis_rules`` write them: a name may repeat, and for each leaf the
  pairs are tried in order; a pair applies to its dimension only when none of its mesh axes
  is already taken by another dimension, so a later pair is the fallback of an earlier one.
  A name whose every pair is blocked replicates that dimension, as in Flax.

Model code names logical axes only; the script decides what they mean, either with
``Rules(logical=...)`` or with the [`logical_rules`][modelshard.logical_rules] context (a ``ContextVar``, so it is
per thread and per task, and a ``shard_jit`` trace sees the context of its call). Flax's
own ``nn.logical_axis_rules`` context is honoured when no modelshard context is active.

How one spec is resolved through the rules lives in ``modelshard._specs.resolution``; this module
only validates and holds the rules.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

from .._base import Problem, SpecError, toml_entry

Target: TypeAlias = tuple[str, ...]  # the mesh axes one logical name maps to; () replicates
LogicalLike: TypeAlias = Any  # Mapping[str, axes] | Sequence[tuple[str, axes]] | Rules | None


@dataclasses.dataclass(frozen=True, eq=False)
class LogicalRules:
    """Validated logical rules: what the resolver reads.

    Attributes:
        pairs: ``(name, mesh axes)`` in the order given; ``()`` replicates.
        ordered: whether they follow Flax's list semantics (repeats, fallback).
        source: how errors name where the rules came from.
        public: the rules as the user should see them again (a dict, or a tuple of pairs).
        candidates: name -> its targets, in order (one for a mapping).
        file: the TOML rules file they were read from (hints then speak TOML), or None.
    """

    pairs: tuple[tuple[str, Target], ...]
    ordered: bool
    source: str
    public: Any
    candidates: dict[str, tuple[Target, ...]]
    file: str | None = None

    def describe(self) -> str:
        """``the active ms.logical_rules context (names: batch, embed)``, for hints."""
        names = list(self.candidates)
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} names)" if len(names) > 12 else "")
        return f"{self.source} (names: {shown or 'none'})"

    def entry(self, name: str, axis: str | None = None) -> str:
        """One entry mapping ``name`` to ``axis``, written as the user writes these rules:
        a TOML line for a rules file (``heads = "model"``), Python for the others
        (``'heads': 'model'``, or a pair for Flax-style lists); ``axis=None``: a
        placeholder."""
        return logical_entry(name, axis, self.file, self.ordered)


def logical_entry(name: str, axis: str | None, file: str | None, ordered: bool) -> str:
    """``heads = "model"`` (a rules file's [logical] table), ``["heads", "model"]`` (its
    logical array), ``'heads': 'model'`` (a Python mapping), ``('heads', 'model')`` (Flax's
    pairs); without ``axis`` a placeholder names what goes there."""
    if file is not None:
        value = toml_entry(axis if axis is not None else "<mesh axis>")
        return f'["{name}", {value}]' if ordered else f"{name} = {value}"
    value = repr(axis) if axis is not None else "<mesh axes or None>"
    return f"({name!r}, {value})" if ordered else f"{name!r}: {value}"


def add_name_hint(name: str, file: str | None) -> str:
    """How to map a logical name when no logical rules exist yet, in the user's words: the
    ``[logical]`` table to add to their rules file, or the Python."""
    if file is not None:
        return (
            f"to map the logical name {name!r}, add to {file} a [logical] table with the line "
            f"{logical_entry(name, None, file, False)} (a mesh axis, a list of axes, or "
            '"none" to replicate)'
        )
    return (
        f"map logical names with Rules(..., logical={{{logical_entry(name, None, None, False)}}}) "
        f"or inside `with ms.logical_rules({{{name!r}: ...}}):`"
    )


def _target(value: Any) -> Target | None:
    """A logical name's mesh axes as a tuple (``None`` and ``[]`` -> ``()``), or None if bad."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple | list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _public_entry(t: Target) -> str | tuple[str, ...] | None:
    return None if not t else t[0] if len(t) == 1 else t


def compile_logical(
    value: LogicalLike,
    source: str,
    arg: str = "Rules",
    where: str = "logical",
    file: str | None = None,
) -> tuple[LogicalRules | None, list[Problem]]:
    """Validate ``value`` (a mapping or Flax's list of pairs) into ``LogicalRules``
    (``file``: the rules file they come from, so that hints speak TOML).

    Returns:
        The rules (None when ``value`` is None or invalid) and every problem found.
    """
    if value is None:
        return None, []
    problems: list[Problem] = []
    hint = "map to a mesh axis name, a list of names, or None (replicate)"
    items: list[tuple[int, Any, Any]]
    ordered = not isinstance(value, Mapping)
    if not ordered:
        items = [(i, k, v) for i, (k, v) in enumerate(value.items())]
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items = []
        for i, item in enumerate(value):
            if isinstance(item, tuple | list) and len(item) == 2:
                items.append((i, item[0], item[1]))
            else:
                problems.append(
                    Problem(
                        arg,
                        f"{where}[{i}]",
                        f"{item!r} is not a (logical name, mesh axes) pair",
                        hint="each entry is a pair like ('embed', 'model') or "
                        "('batch', ('data', 'fsdp'))",
                    )
                )
    else:
        return None, [
            Problem(
                arg,
                where,
                f"logical must be a mapping of logical name -> mesh axes, or a list of "
                f"(logical name, mesh axes) pairs as Flax's logical_axis_rules, got "
                f"{type(value).__name__}",
                hint="logical={'embed': 'model'} or logical=[('embed', 'model'), ('embed', None)]",
            )
        ]
    pairs: list[tuple[str, Target]] = []
    candidates: dict[str, list[Target]] = {}
    for i, name, target in items:
        t = _target(target)
        if not isinstance(name, str) or t is None:
            at = f"{where}[{name!r}]" if not ordered else f"{where}[{i}]"
            problems.append(
                Problem(
                    arg,
                    at,
                    f"{name!r} -> {target!r} is not a logical name -> mesh axes mapping",
                    hint=hint,
                )
            )
            continue
        pairs.append((name, t))
        candidates.setdefault(name, []).append(t)
    if problems:
        return None, problems
    public = (
        tuple((n, _public_entry(t)) for n, t in pairs)
        if ordered
        else {n: _public_entry(t) for n, t in pairs}
    )
    return (
        LogicalRules(
            tuple(pairs),
            ordered,
            source,
            public,
            {n: tuple(c) for n, c in candidates.items()},
            file,
        ),
        [],
    )


# ---- the context ------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[LogicalRules | None] = contextvars.ContextVar(
    "modelshard_logical_rules", default=None
)
_CLEARED = LogicalRules((), False, "ms.logical_rules(None)", {}, {})
_FLAX_SOURCE = "Flax's nn.logical_axis_rules context"
_flax_last: tuple[Any, LogicalRules | None] = (None, None)


@contextlib.contextmanager
def logical_rules(rules: LogicalLike) -> Iterator[LogicalRules | None]:
    """Set the logical rules for the code inside the ``with`` block.

    Inside it, every logical name that a spec or [`Rules`][modelshard.Rules] does not map
    itself (a ``Rules`` without ``logical=``, a plain ``PartitionSpec``, a spec function's
    result) resolves through ``rules``, in [`constrain`][modelshard.constrain],
    [`shard`][modelshard.shard], [`plan`][modelshard.plan], [`shard_jit`][modelshard.shard_jit]
    (while tracing and planning) and [`shard_map`][modelshard.shard_map]. An explicit
    ``Rules(logical=...)`` wins. Contexts nest (the innermost replaces the outer rules;
    ``None`` clears them); the rules live in a ``ContextVar``, so each thread and task
    sees its own.

    Args:
        rules: a mapping ``{"batch": ("data", "fsdp"), "embed": None}``, Flax's ordered
            list of ``(name, mesh axes)`` pairs (repeats fall back as in Flax), a
            [`Rules`][modelshard.Rules] (its ``logical``), or ``None``.

    Yields:
        The validated rules (``None`` inside ``logical_rules(None)``).

    Raises:
        SpecError: ``rules`` is not logical rules (every bad entry listed).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 2, "model": 4})
        >>> with ms.logical_rules({"batch": "data", "embed": "model"}):
        ...     x = ms.shard(jnp.zeros((8, 16)), P("batch", "embed"), mesh)
        >>> x.sharding.spec
        P('data', 'model')
    """
    compiled = _from_user(rules)
    token = _ACTIVE.set(_CLEARED if compiled is None else compiled)
    try:
        yield compiled
    finally:
        _ACTIVE.reset(token)


def _from_user(rules: LogicalLike) -> LogicalRules | None:
    logical = getattr(rules, "compiled_logical", _NOT_RULES)
    if logical is not _NOT_RULES:  # a Rules: its logical names
        if logical is None:
            return None
        return dataclasses.replace(logical, source="the active ms.logical_rules context")
    compiled, problems = compile_logical(
        rules, "the active ms.logical_rules context", arg="logical_rules", where="rules"
    )
    if problems:
        raise SpecError(problems, header="invalid logical rules:")
    return compiled


_NOT_RULES: Any = object()


def active_logical() -> LogicalRules | None:
    """The logical rules of the innermost active context: modelshard's, else Flax's."""
    got = _ACTIVE.get()
    if got is not None:
        return None if got is _CLEARED else got
    spmd = sys.modules.get("flax.core.spmd")
    if spmd is None:  # Flax not imported: its context cannot be set
        return None
    return _flax_rules(spmd.get_logical_axis_rules())


def _flax_rules(raw: Any) -> LogicalRules | None:
    """Flax's context rules, validated once per rules object."""
    global _flax_last
    if not raw:
        return None
    key = raw if isinstance(raw, Mapping) else tuple(raw)
    last_key, last = _flax_last
    if key == last_key:
        return last
    compiled, problems = compile_logical(
        list(raw) if not isinstance(raw, Mapping) else raw,
        _FLAX_SOURCE,
        arg="nn.logical_axis_rules",
        where="rules",
    )
    if problems:
        raise SpecError(problems, header="invalid rules in Flax's nn.logical_axis_rules context:")
    _flax_last = (key, compiled)
    return compiled
