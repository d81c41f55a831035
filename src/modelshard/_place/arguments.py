"""How ``shard_jit`` and ``shard_map`` map a call's arguments onto the function's parameters."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._base import Problem, SpecError, spec_error


class _NoSpec:
    def __repr__(self) -> str:
        return "<no spec>"


NOSPEC: Any = _NoSpec()
"""The spec of an argument ``in_specs`` says nothing about (or gives ``None``)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Slot:
    """One argument of a call: where it comes from and how it is treated."""

    name: str
    pos: int | None
    kw: str | None
    static: bool
    spec: Any
    donate: bool


def invalid(who: str, path: str, what: str, hint: str | None = None) -> SpecError:
    """The error for an argument of ``who`` (``shard_jit``, ``shard_map``) that cannot work."""
    return spec_error(who, path, what, f"invalid {who} arguments:", hint=hint)


def _as_tuple(v: int | str | Sequence[Any]) -> tuple[Any, ...]:
    return (v,) if isinstance(v, int | str) else tuple(v)


class ArgumentLayout:
    """``fn``'s signature with the specs, donated and static arguments, as ``Slot`` objects per
    call; ``who`` is the wrapper its errors name (it checks ``fn`` and ``in_specs`` first)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        in_specs: Sequence[Any] | Mapping[str, Any],
        *,
        who: str,
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
    ):
        if not callable(fn):
            raise TypeError(
                f"{who} needs a callable, got {fn!r} ({type(fn).__name__}); pass the function, "
                f"or use @{who}(in_specs=..., ...) as a decorator"
            )
        if not isinstance(in_specs, Mapping | tuple | list):
            raise invalid(
                who,
                "in_specs",
                "in_specs must be a tuple (one spec-like per positional argument) or a dict "
                f"(parameter name -> spec-like), got {type(in_specs).__name__}",
                hint="write in_specs=(rules, P('data')) or in_specs={'state': rules}",
            )
        self._fn = fn
        self._name = getattr(fn, "__name__", "fn")
        self._who = who
        self._in_specs = in_specs
        self._donate_nums = _as_tuple(donate_argnums)
        self._donate_names = _as_tuple(donate_argnames)
        self._static_nums = _as_tuple(static_argnums)
        self._static_names = _as_tuple(static_argnames)
        try:
            self._sig: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self._sig = None
        self._check_names()
        params = list(self._sig.parameters.values()) if self._sig else []
        plain = self._sig is not None and all(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
        )
        self.plain_arity = len(params) if plain else -1
        self._layouts: dict[tuple[int, tuple[str, ...]], tuple[Slot, ...]] = {}

    def _check_names(self) -> None:
        if self._sig is None:
            if isinstance(self._in_specs, Mapping) or self._donate_names or self._static_names:
                argnums = " and use *_argnums" if self._who == "shard_jit" else ""
                raise invalid(
                    self._who,
                    "in_specs",
                    f"{self._fn!r} has no inspectable signature, so "
                    "arguments can only be given by position",
                    hint=f"pass in_specs as a tuple{argnums}",
                )
            return
        params = self._sig.parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return
        names = [p.name for p in params if p.kind is not p.VAR_POSITIONAL]
        hint = f"its parameters are {', '.join(map(repr, names))}"
        given = list(self._in_specs) if isinstance(self._in_specs, Mapping) else []
        problems = [
            Problem(self._who, f"{what}[{n!r}]", f"{self._name} has no parameter {n!r}", hint=hint)
            for what, items in (
                ("in_specs", given),
                ("donate_argnames", self._donate_names),
                ("static_argnames", self._static_names),
            )
            for n in items
            if n not in names
        ]
        if problems:
            raise SpecError(problems, header=f"invalid {self._who} arguments:")

    def slots(self, npos: int, kwnames: tuple[str, ...]) -> tuple[Slot, ...]:
        """The slots of a call with ``npos`` positionals and these keywords (cached per layout)."""
        key = (npos, kwnames)
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        params = list(self._sig.parameters.values()) if self._sig else []
        posnames = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        var = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "args")
        slots = []
        specs = self._in_specs
        if not isinstance(specs, Mapping) and len(specs) != npos:
            raise invalid(
                self._who,
                "in_specs",
                f"in_specs has {len(specs)} entries but "
                f"{self._name} was called with {npos} positional arguments",
                hint="give one entry per positional argument (None for one that needs no "
                "spec), or a dict of parameter name -> entry",
            )
        for i in range(npos):
            name = posnames[i] if i < len(posnames) else f"{var}[{i - len(posnames)}]"
            static = (
                any(j in self._static_nums for j in (i, i - npos)) or name in self._static_names
            )
            spec = specs.get(name, NOSPEC) if isinstance(specs, Mapping) else specs[i]
            donate = i in self._donate_nums or name in self._donate_names
            slots.append(Slot(name, i, None, static, NOSPEC if spec is None else spec, donate))
        for k in kwnames:
            spec = specs.get(k, NOSPEC) if isinstance(specs, Mapping) else NOSPEC
            static, donate = k in self._static_names, k in self._donate_names
            slots.append(Slot(k, None, k, static, NOSPEC if spec is None else spec, donate))
        bad = [s.name for s in slots if s.static and s.donate]
        if bad:
            raise invalid(
                self._who, "donate_argnums", f"static argument {bad[0]!r} cannot be donated"
            )
        out = self._layouts[key] = tuple(slots)
        return out

    def bind(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` bound to the signature, defaults applied."""
        if self._sig is None:
            if kwargs:
                raise invalid(
                    self._who,
                    "kwargs",
                    f"{self._fn!r} has no inspectable signature; pass arguments by position",
                )
            return args, kwargs
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self._name}(): {e}") from None
        bound.apply_defaults()
        return bound.args, bound.kwargs
