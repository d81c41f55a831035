"""How ``shard_jit`` maps a call's arguments onto the function's parameters.

Each distinct call layout (number of positional arguments, keyword names) is resolved once
against the signature into :class:`~modelshard._jit.build.Slot` objects (name, static,
spec, donated), which are then reused, and compared by identity, on every call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import Problem, SpecError
from .build import NOSPEC, Slot

__all__ = ["ArgumentLayout", "invalid"]


def invalid(path: str, what: str, hint: str | None = None) -> SpecError:
    return SpecError(
        [Problem("shard_jit", path, what, hint=hint)], header="invalid shard_jit arguments:"
    )


class ArgumentLayout:
    """Signature handling shared by :class:`~modelshard.ShardJit` (a mixin)."""

    fn: Callable[..., Any]
    in_specs: Sequence[Any] | Mapping[str, Any]
    _sig: inspect.Signature | None
    _donate_nums: tuple[Any, ...]
    _donate_names: tuple[Any, ...]
    _static_nums: tuple[Any, ...]
    _static_names: tuple[Any, ...]
    _layouts: dict[tuple[int, tuple[str, ...]], tuple[Slot, ...]]

    def _check_names(self) -> None:
        if self._sig is None:
            if isinstance(self.in_specs, Mapping) or self._donate_names or self._static_names:
                raise invalid(
                    "in_specs",
                    f"{self.fn!r} has no inspectable signature, so "
                    "arguments can only be given by position",
                    hint="pass in_specs as a tuple and use *_argnums",
                )
            return
        params = self._sig.parameters
        named = [p for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        names = {p.name for p in named}
        varkw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        problems = []
        given = list(self.in_specs) if isinstance(self.in_specs, Mapping) else []
        for what, items in (
            ("in_specs", given),
            ("donate_argnames", self._donate_names),
            ("static_argnames", self._static_names),
        ):
            for n in items:
                if n not in names and not varkw:
                    problems.append(
                        Problem(
                            "shard_jit",
                            f"{what}[{n!r}]",
                            f"{self.fn.__name__} has no parameter {n!r}",
                            hint=f"its parameters are {', '.join(map(repr, names))}",
                        )
                    )
        if problems:
            raise SpecError(problems, header="invalid shard_jit arguments:")

    def _layout(self, npos: int, kwnames: tuple[str, ...]) -> tuple[Slot, ...]:
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
        specs = self.in_specs
        if not isinstance(specs, Mapping) and len(specs) != npos:
            raise invalid(
                "in_specs",
                f"in_specs has {len(specs)} entries but "
                f"{self.fn.__name__} was called with {npos} positional arguments",
                hint="give one entry per positional argument (anything, e.g. None, "
                "for static ones), or a dict of parameter name -> entry",
            )
        for i in range(npos):
            name = posnames[i] if i < len(posnames) else f"{var}[{i - len(posnames)}]"
            static = (
                i in self._static_nums
                or i - npos in self._static_nums
                or name in self._static_names
            )
            spec = specs.get(name, NOSPEC) if isinstance(specs, Mapping) else specs[i]
            donate = i in self._donate_nums or name in self._donate_names
            slots.append(Slot(name, i, None, static, NOSPEC if spec is None else spec, donate))
        for k in kwnames:
            static = k in self._static_names
            spec = specs.get(k, NOSPEC) if isinstance(specs, Mapping) else NOSPEC
            slots.append(
                Slot(k, None, k, static, NOSPEC if spec is None else spec, k in self._donate_names)
            )
        bad = [s.name for s in slots if s.static and s.donate]
        if bad:
            raise invalid("donate_argnums", f"static argument {bad[0]!r} cannot be donated")
        out = self._layouts[key] = tuple(slots)
        return out

    def _bind(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._sig is None:
            if kwargs:
                raise invalid(
                    "kwargs",
                    f"{self.fn!r} has no inspectable signature; pass arguments by position",
                )
            return args, kwargs
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.fn.__name__}(): {e}") from None
        bound.apply_defaults()
        return bound.args, bound.kwargs

    # ---- calling ----------------------------------------------------------------------
