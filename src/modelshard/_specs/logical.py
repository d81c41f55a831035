"""Logical axis names: the rules that map them to mesh axes, and the context that sets them."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._base import Problem, SpecError, close_match, constrain_array, format_mesh, toml_entry

Target: TypeAlias = tuple[str, ...]  # the mesh axes one logical name maps to; () replicates
LogicalLike: TypeAlias = Any  # Mapping[str, axes] | Sequence[tuple[str, axes]] | Rules | None


@dataclasses.dataclass(frozen=True, eq=False)
class LogicalRules:
    """Validated logical rules: what the resolver reads."""

    pairs: tuple[tuple[str, Target], ...]
    ordered: bool
    source: str
    file: str | None = None
    labels: tuple[str, ...] = ()  # how errors name each pair's entry: rules['heads']
    declared: tuple[tuple[str, str], ...] = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LogicalRules):
            return NotImplemented
        return (self.pairs, self.ordered) == (other.pairs, other.ordered)

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        # hashed on every jax.jit call inside a logical_rules block (the cache key): once
        return hash((self.pairs, self.ordered))

    @property
    def flax_rules(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """The rules as Flax's ``(name, mesh axes)`` pairs, in layered order (what
        ``nn.logical_to_mesh_axes`` and ``nn.logical_axis_rules`` take)."""
        return tuple((n, public_entry(t)) for n, t in self.pairs)

    @functools.cached_property
    def public(self) -> Any:
        """The rules as the user gives them: a mapping, or Flax's ordered pairs."""
        return self.flax_rules if self.ordered else dict(self.flax_rules)

    @functools.cached_property
    def candidates(self) -> dict[str, tuple[Target, ...]]:
        """Each name's targets, in order (a name repeats in Flax-style pairs)."""
        out: dict[str, tuple[Target, ...]] = {}
        for n, t in self.pairs:
            out[n] = (*out.get(n, ()), t)
        return out

    def label(self, name: str, target: Target | None = None) -> str:
        """The entry that maps ``name`` (to ``target``, where a Flax-style name repeats)."""
        for (n, t), lab in zip(self.pairs, self.labels, strict=True):
            if n == name and (target is None or t == target):
                return lab
        return self.source

    def describe(self) -> str:
        """``the active ms.logical_rules context (names: batch, embed)``, for hints."""
        names = list(self.candidates)
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} names)" if len(names) > 12 else "")
        return f"{self.source} (names: {shown or 'none'})"

    def entry(self, name: str, axis: str | None = None) -> str:
        """One entry mapping ``name`` to ``axis`` (None: a placeholder) as the user writes them."""
        return logical_entry(name, axis, self.file, self.ordered)

    def written(self, name: str, as_name: str | None = None) -> str:
        """``name``'s first entry as the user wrote it, under ``as_name`` when given."""
        value = public_entry(self.candidates[name][0])
        text = toml_entry(value) if self.file is not None else repr(value)
        return _entry(name if as_name is None else as_name, text, self.file, self.ordered)


def logical_entry(name: str, axis: str | None, file: str | None, ordered: bool) -> str:
    """``heads = "model"``, ``["heads", "model"]``, ``'heads': 'model'`` or ``('heads', 'model')``:
    as a rules file's table or array, a Python mapping or Flax's pairs write it."""
    if file is not None:
        value = toml_entry(axis if axis is not None else "<mesh axis>")
    else:
        value = repr(axis) if axis is not None else "<mesh axes or None>"
    return _entry(name, value, file, ordered)


def _entry(name: str, value: str, file: str | None, ordered: bool) -> str:
    """``logical_entry`` of a value already written."""
    if file is not None:
        return f'["{name}", {value}]' if ordered else f"{name} = {value}"
    return f"({name!r}, {value})" if ordered else f"{name!r}: {value}"


def add_name_hint(name: str, file: str | None) -> str:
    """How to map a logical name where no logical rules exist yet, in the user's words."""
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


def public_entry(t: Sequence[str]) -> str | tuple[str, ...] | None:
    """Mesh axes as a spec entry: ``()`` -> None, one axis -> its name, else a tuple."""
    return None if not t else t[0] if len(t) == 1 else tuple(t)


def compile_logical(
    value: LogicalLike,
    source: str,
    arg: str = "Rules",
    where: str = "logical",
    file: str | None = None,
) -> tuple[LogicalRules | None, list[Problem]]:
    """Validate ``value`` (a mapping or Flax's pairs) into ``LogicalRules`` (``file``: hints speak TOML)."""
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
                what = f"{item!r} is not a (logical name, mesh axes) pair"
                pair = "each entry is a pair like ('embed', 'model') or ('batch', ('data', 'fsdp'))"
                problems.append(Problem(arg, f"{where}[{i}]", what, hint=pair))
    else:
        what = "logical must be a mapping of logical name -> mesh axes, or a list of (logical "
        what += f"name, mesh axes) pairs as Flax's logical_axis_rules, got {type(value).__name__}"
        hint = "logical={'embed': 'model'} or logical=[('embed', 'model'), ('embed', None)]"
        return None, [Problem(arg, where, what, hint=hint)]
    pairs: list[tuple[str, Target]] = []
    labels: list[str] = []
    for i, name, target in items:
        t = _target(target)
        if not isinstance(name, str) or t is None:
            at = f"{where}[{name!r}]" if not ordered else f"{where}[{i}]"
            what = f"{name!r} -> {target!r} is not a logical name -> mesh axes mapping"
            problems.append(Problem(arg, at, what, hint=hint))
            continue
        pairs.append((name, t))
        if file is not None:  # how errors name the entry, in the words the user wrote it in
            labels.append(f"logical[{i}] of {file}" if ordered else f"[logical] {name} of {file}")
        else:
            labels.append(f"{where}[{i}]" if ordered else f"{where}[{name!r}]")
    if problems:
        return None, problems
    return LogicalRules(tuple(pairs), ordered, source, file, tuple(labels)), []


# ---- a library's declared names --------------------------------------------------------


@dataclasses.dataclass(frozen=True, init=False)
class LogicalAxes:
    """The logical axis names a model library uses, and the mesh axes it suggests for them.

    A library that names logical axes only declares them once; its users pass the
    declaration to [`logical_rules`][modelshard.logical_rules] as the first layer, their own
    overrides after it, and every name is checked when the ``with`` block is entered.

    Args:
        library: the library's name, as errors should say it (``"tinylm"``).
        names: every logical name the library uses, parameters' and activations'.
        defaults: suggested mesh axes for some of them (a mesh axis name, a tuple of names,
            or None to replicate); a name without a default must be mapped by the user.

    Raises:
        SpecError: a default for an undeclared name, or one that is not mesh axes.

    Example:
        >>> import modelshard as ms
        >>> AXES = ms.LogicalAxes(
        ...     "tinylm",
        ...     names=("batch", "embed", "heads"),
        ...     defaults={"batch": "data", "embed": None},
        ... )
        >>> with ms.logical_rules(AXES, {"heads": "model"}) as rules:
        ...     print(rules.public)
        {'batch': 'data', 'embed': None, 'heads': 'model'}
    """

    library: str
    names: tuple[str, ...]
    # compared and hashed through ``compiled`` (the same entries), which a dict cannot be
    defaults: dict[str, Any] = dataclasses.field(compare=False)
    compiled: LogicalRules

    def __init__(
        self, library: str, names: Sequence[str], defaults: Mapping[str, Any] | None = None
    ):
        names = tuple(names)
        defaults = dict(defaults or {})
        hint = "name each logical axis with a string, such as 'embed'"
        what = "is not a logical name (a string)"
        problems = [
            Problem("LogicalAxes", f"names[{i}]", f"{n!r} {what}", hint=hint)
            for i, n in enumerate(names)
            if not isinstance(n, str)
        ]
        problems += [
            Problem(
                "LogicalAxes",
                f"defaults[{name!r}]",
                f"{name!r} has a default but is not among the declared names",
                hint=did_you_mean(name, names, f"add {name!r} to names"),
                logical_name=name if isinstance(name, str) else None,
            )
            for name in defaults
            if name not in names
        ]
        compiled, bad = compile_logical(
            defaults, f"{library}'s defaults", arg="LogicalAxes", where=f"{library} defaults"
        )
        problems.extend(bad)
        if problems:
            raise SpecError(problems, header=f"invalid LogicalAxes for {library}:")
        assert compiled is not None  # a mapping always compiles
        declared = tuple((n, library) for n in names)
        object.__setattr__(self, "library", library)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "defaults", defaults)
        object.__setattr__(self, "compiled", dataclasses.replace(compiled, declared=declared))

    def __repr__(self) -> str:
        return f"LogicalAxes({self.library!r}, names={self.names!r}, defaults={self.defaults!r})"


def did_you_mean(name: Any, options: Sequence[str], otherwise: str) -> str:
    # logical names are short words: a swapped pair of letters ('mpl') is still a typo
    strings = [o for o in options if isinstance(o, str)]
    close = close_match(name, strings, cutoff=0.6) if isinstance(name, str) else None
    return f"did you mean {close!r}? (or {otherwise})" if close is not None else otherwise


# ---- the context ------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[LogicalRules | None] = contextvars.ContextVar(
    "modelshard_logical_rules", default=None
)
_CLEARED = LogicalRules((), False, "ms.logical_rules(None)")
_CONTEXT = "the active ms.logical_rules context"
_FLAX_SOURCE = "Flax's nn.logical_axis_rules context"
_flax_last: tuple[Any, LogicalRules | None] = (None, None)
# jax.jit keys its caches on this context, as on the mesh: a function traced under one set
# of rules (its constraints, Flax's included, depend on them) is traced again under another.
_JIT_KEY = jax.make_user_context(None)


@contextlib.contextmanager
def logical_rules(*layers: Any, flax: bool = True) -> Iterator[LogicalRules | None]:
    """Set the logical rules for the code inside the ``with`` block, layer on layer.

    Inside it, every logical name that a spec does not map itself (a plain
    ``PartitionSpec``, a [`Rules`][modelshard.Rules] without ``logical=``, parameters'
    metadata) resolves through the rules, in [`constrain`][modelshard.constrain],
    [`shard`][modelshard.shard], [`plan`][modelshard.plan],
    [`shard_jit`][modelshard.shard_jit] and [`shard_map`][modelshard.shard_map]; an explicit
    ``Rules(logical=...)`` wins. Each thread and task sees its own rules.

    Each layer's entries replace the earlier layers' for the same names; a nested
    ``logical_rules`` is one more layer, and a ``None`` layer drops everything below it. When
    a layer is a library's [`LogicalAxes`][modelshard.LogicalAxes], every name a user's layer
    maps must be declared, and every declared name must end up mapped.

    With ``flax=True`` the rules are also Flax's ``nn.logical_axis_rules`` inside the block,
    and linen's constraints reshard as ``constrain`` does. The rules in force are part of
    ``jax.jit``'s cache key: a function called under other rules is traced again.

    Args:
        *layers: each a mapping ``{"batch": ("data", "fsdp"), "embed": None}``, Flax's
            ordered list of ``(name, mesh axes)`` pairs (repeats fall back as in Flax), a
            [`Rules`][modelshard.Rules] (its ``logical``), a
            [`LogicalAxes`][modelshard.LogicalAxes] (its declared names and defaults), or
            ``None``.
        flax: also set Flax's ``nn.logical_axis_rules`` context to the rules (when Flax
            is installed).

    Yields:
        The layered, validated rules (``None`` when they are cleared); their
        ``flax_rules`` are the same rules as the ``(name, mesh axes)`` pairs Flax's own
        functions take (``nn.logical_to_mesh_axes(names, rules.flax_rules)``).

    Raises:
        SpecError: a layer is not logical rules (every bad entry listed), the rules do
            not fit the declared names (every unknown and every unmapped name listed), or,
            under ``jax.set_mesh``, a rule maps to a typo of one of the mesh's axes
            (``'modle'``: "did you mean 'model'?"; ``shard_jit`` checks its mesh too).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 2, "model": 4})
        >>> with ms.logical_rules({"batch": "data", "embed": "model"}):
        ...     with ms.logical_rules({"embed": None}):  # one entry overridden
        ...         x = ms.shard(jnp.zeros((8, 16)), P("batch", "embed"), mesh)
        >>> x.sharding.spec
        P('data', None)
    """
    compiled = layered(layers, _ACTIVE.get())
    if compiled is not None:
        check_mesh_axes(compiled, jax.sharding.get_abstract_mesh())
    token = _ACTIVE.set(_CLEARED if compiled is None else compiled)
    try:
        with (
            _JIT_KEY("cleared" if compiled is None else (compiled, flax)),
            _flax_bridge(compiled, flax),
        ):
            yield compiled
    finally:
        _ACTIVE.reset(token)


def layered(layers: Sequence[Any], base: LogicalRules | None) -> LogicalRules | None:
    """``layers`` on ``base`` (the enclosing context's), validated against the declared names."""
    out = None if base is None or base is _CLEARED else base
    user: list[tuple[str, str]] = []  # (name, label) of every entry a user's layer wrote
    if not layers:
        layers = (None,)
    for layer in layers:
        if layer is None:
            out = None
            user = []
            continue
        top = _from_user(layer)
        if top is None:
            continue
        if not isinstance(layer, LogicalAxes):
            user.extend((n, lab) for (n, _), lab in zip(top.pairs, top.labels, strict=True))
        out = top if out is None else _merge(out, top)
    if out is not None and out.declared:
        _check_declared(out, user)
    return out


def _merge(base: LogicalRules, top: LogicalRules) -> LogicalRules:
    """``top``'s entries replace ``base``'s for the same names, in place; new names follow."""
    new = list(zip(top.pairs, top.labels, strict=True))
    entries: list[tuple[tuple[str, Target], str]] = []
    placed: set[str] = set()
    for pair, lab in zip(base.pairs, base.labels, strict=True):
        if pair[0] not in top.candidates:
            entries.append((pair, lab))
        elif pair[0] not in placed:
            placed.add(pair[0])
            entries += [(p, tl) for p, tl in new if p[0] == pair[0]]
    entries += [(p, tl) for p, tl in new if p[0] not in placed]
    pairs, labels = tuple(p for p, _ in entries), tuple(lab for _, lab in entries)
    declared = tuple({**dict(base.declared), **dict(top.declared)}.items())
    ordered = base.ordered or top.ordered
    file = top.file or base.file
    return LogicalRules(pairs, ordered, _CONTEXT, file, labels, declared)


def _check_declared(rules: LogicalRules, user: Sequence[tuple[str, str]]) -> None:
    """Every name a user's layer maps is declared; every declared name is mapped."""
    declared = dict(rules.declared)
    libraries = ", ".join(dict.fromkeys(declared.values()))
    names = list(declared)
    problems = []
    for name, label in user:
        if name not in declared:
            what = f"{name!r} is not a logical name {libraries} declares (declared: {', '.join(names)})"
            hint = did_you_mean(
                name, names, f"remove the entry, or declare {name!r} in a ms.LogicalAxes"
            )
            named: dict[str, Any] = {"logical_name": name, "logical_rule": label}
            problems.append(Problem("logical_rules", label, what, hint=hint, **named))
    for name, library in declared.items():
        if name not in rules.candidates:
            what = f"{library} declares the logical name {name!r} without a default, and no rule maps it"
            hint = f"add {logical_entry(name, None, None, rules.ordered)} to your rules "
            hint += "(a mesh axis, a tuple of axes, or None to replicate)"
            problems.append(
                Problem("logical_rules", f"names[{name!r}]", what, hint=hint, logical_name=name)
            )
    if problems:
        raise SpecError(
            problems, header=f"logical rules that do not fit the names {libraries} declares:"
        )


def check_mesh_axes(rules: LogicalRules | None, mesh: Any) -> None:
    """Raise for every mesh axis ``rules`` map to that misspells one of ``mesh``'s."""
    if rules is None or mesh is None or getattr(mesh, "empty", False) or not mesh.axis_names:
        return
    axes = [str(a) for a in mesh.axis_names]
    shown = ", ".join(map(repr, axes))
    problems = []
    for (name, target), label in zip(rules.pairs, rules.labels, strict=True):
        for axis in target:
            close = close_match(axis, axes) if axis not in axes else None
            if close is not None:
                what = f"{name!r} maps to mesh axis {axis!r}, which is not in the mesh"
                hint = f"did you mean {close!r}? (mesh axes are {shown})"
                named: dict[str, Any] = {"logical_name": name, "logical_rule": label}
                problems.append(Problem("logical_rules", label, what, hint=hint, **named))
    if problems:
        sizes = format_mesh(dict(zip(axes, mesh.axis_sizes, strict=True)))
        raise SpecError(
            problems, header=f"logical rules that misspell an axis of the mesh ({sizes}):"
        )


@contextlib.contextmanager
def _flax_bridge(rules: LogicalRules | None, on: bool) -> Iterator[None]:
    """Flax's ``nn.logical_axis_rules`` context set to ``rules`` for the block."""
    spmd = _flax_spmd() if on else None
    if spmd is None:
        yield
        return
    _hook_linen()
    token = _BRIDGED.set(True)
    try:
        with spmd.logical_axis_rules(() if rules is None else rules.flax_rules):
            yield
    finally:
        _BRIDGED.reset(token)


# Where Flax's context holds modelshard's rules, linen applies its logical constraints as
# ``constrain`` does; elsewhere linen's functions run exactly as Flax wrote them.
_BRIDGED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "modelshard_flax_bridged", default=False
)
_linen_hooked = False
_linen_hooking = threading.Lock()


def _hook_linen() -> None:
    """Wrap linen's two constraint points, once (both are Flax's own outside a bridged context)."""
    global _linen_hooked
    with _linen_hooking:
        if not _linen_hooked:
            from .._internals import wrap_linen_constraint, wrap_linen_unbox

            wrap_linen_unbox(_bridged_unbox)
            wrap_linen_constraint(_bridged_constraint)
            _linen_hooked = True


def _bridged_unbox(unbox: Any) -> Any:
    @functools.wraps(unbox)
    def bridged_unbox(self: Any, apply_constraint: bool = True) -> Any:
        if apply_constraint and _BRIDGED.get():
            ndim = getattr(self.value, "ndim", None)
            if ndim is not None and ndim < len(self.names):
                return self.value
        return unbox(self, apply_constraint)

    return bridged_unbox


def _bridged_constraint(constraint: Any) -> Any:
    @functools.wraps(constraint)
    def bridged_constraint(x: Any, axis_resources: Any, mesh: Any = None) -> Any:
        target = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        if (
            not _BRIDGED.get()
            or target.empty  # no mesh: Flax's own does nothing
            or axis_resources is None
            or any(e is PartitionSpec.UNCONSTRAINED for e in axis_resources)
        ):
            return constraint(x, axis_resources, mesh)
        sharding = axis_resources if mesh is None else NamedSharding(mesh, axis_resources)
        return constrain_array(x, sharding, target)

    return bridged_constraint


def _flax_spmd() -> Any:
    """``flax.core.spmd`` when Flax is installed (imported here on first use), else None."""
    return importlib.import_module("flax.core.spmd") if importlib.util.find_spec("flax") else None


def _from_user(rules: LogicalLike) -> LogicalRules | None:
    if isinstance(rules, LogicalAxes):
        return rules.compiled
    if hasattr(rules, "compiled_logical"):  # a Rules: its logical names
        logical = rules.compiled_logical
        return None if logical is None else dataclasses.replace(logical, source=_CONTEXT)
    compiled, problems = compile_logical(rules, _CONTEXT, arg="logical_rules", where="rules")
    if problems:
        raise SpecError(problems, header="invalid logical rules:")
    return compiled


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
        key, _FLAX_SOURCE, arg="nn.logical_axis_rules", where="rules"
    )
    if problems:
        raise SpecError(problems, header="invalid rules in Flax's nn.logical_axis_rules context:")
    _flax_last = (key, compiled)
    return compiled
