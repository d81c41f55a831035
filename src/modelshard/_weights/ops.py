"""A rule's ``ops`` and the checks each needs before any tensor is seen."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base import Problem


@dataclasses.dataclass(frozen=True, init=False)
class Rearrange:
    """Regroup and permute axes in einops notation: ``"(h d) e -> h e d"``.

    Each side names the axes of the tensor; parentheses group several into one (their
    sizes multiply), ``()`` is an axis of size 1. Every name appears once on each side;
    sizes of grouped axes are given as keywords (ints, or names in the mapping's
    ``config``), one per group may be left out and is inferred. It becomes a reshape, a
    transpose and a reshape of the recipe (each left out when it does nothing), so a
    pure permutation (``"a b -> b a"``) still reads each device's slice only.

    Hugging Face's ``q_proj.weight`` ``[heads * head_dim, embed]`` into Google's Gemma
    ``q_einsum`` ``[heads, embed, head_dim]``: ``Rearrange("(h d) e -> h e d", h="heads")``.

    Args:
        pattern: ``"left -> right"``.
        **sizes: the sizes of axes inside groups.

    Example:
        >>> import modelshard as ms
        >>> ms.Rearrange("(h d) e -> h e d", h="heads")
        Rearrange('(h d) e -> h e d', h='heads')
    """

    pattern: str
    sizes: tuple[tuple[str, int | str], ...]

    def __init__(self, pattern: str, /, **sizes: int | str):
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "sizes", tuple(sizes.items()))

    def __repr__(self) -> str:
        kw = "".join(f", {k}={v!r}" for k, v in self.sizes)
        return f"Rearrange({self.pattern!r}{kw})"

    def text(self) -> str:
        kw = "".join(f", {k}={v}" for k, v in self.sizes)
        return f"rearrange({self.pattern}{kw})"


@dataclasses.dataclass(frozen=True)
class Transpose:
    """Permute the axes: ``Transpose((1, 0))`` turns PyTorch's ``[out, in]`` linear weight
    into a JAX ``[in, out]`` kernel. A device still reads only its slice.

    Attributes:
        perm: the new order of the axes (``numpy.transpose``'s ``axes``).
    """

    perm: tuple[int, ...]

    def text(self) -> str:
        return f"transpose{tuple(self.perm)}"


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Reshape (C order): ints, one ``-1`` (inferred), or names in the mapping's
    ``config``. Needs the whole stored tensor on the host.

    Attributes:
        shape: the new shape.
    """

    shape: tuple[int | str, ...]

    def text(self) -> str:
        return f"reshape{tuple(self.shape)}"


@dataclasses.dataclass(frozen=True)
class Add:
    """Add a constant to every element; the export subtracts it. MaxText's Gemma norm
    scales are Hugging Face's plus one: ``Add(1.0)``.

    Computed in float32 (float64 for a float64 tensor) and rounded to the tensor's dtype,
    so import then export is bit-exact only where the leaf holds ``x + value`` exactly:
    a bfloat16 file into float32 leaves (``dtype="float32"``) gives back every value with
    ``|x| >= |value| * 2**-16`` and +0 (-0 comes back as +0); in bfloat16 leaves
    ``x + 1`` rounds (see the mapping guide). Floating-point tensors only.

    Attributes:
        value: the constant.
    """

    value: float

    def text(self) -> str:
        return f"add({self.value!r})"


@dataclasses.dataclass(frozen=True)
class Scale:
    """Multiply every element by a constant; the export divides by it. Computed like
    [`Add`][modelshard.Add]: a bfloat16 file into float32 leaves round-trips every value
    whose product stays finite; a power of two is exact in any float dtype (barring
    overflow and subnormals). Floating-point tensors only.

    Attributes:
        value: the factor (not zero).
    """

    value: float

    def text(self) -> str:
        return f"scale({self.value!r})"


Op = Rearrange | Transpose | Reshape | Add | Scale
"""One operation of a rule's ``ops``."""

_NAME = re.compile(r"[A-Za-z_]\w*")

Side = list[tuple[tuple[str, ...], bool]]
"""One side of a rearrange pattern: per axis, its names and whether it is a group."""


def parse_rearrange(pattern: str) -> tuple[Side, Side]:
    """``"(h d) e -> h e d"`` as ``(left, right)``; ``ValueError`` says how it is malformed."""
    if not isinstance(pattern, str) or pattern.count("->") != 1:
        raise ValueError("needs exactly one '->' between the input and output axes")
    left, right = pattern.split("->")
    sides = (_side(left, "input"), _side(right, "output"))
    lnames, rnames = ([n for names, _ in side for n in names] for side in sides)
    for what, names in (("input", lnames), ("output", rnames)):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            s = "s" if len(dup) == 1 else ""
            raise ValueError(f"{', '.join(dup)} appear{s} twice in the {what}")
    only = [
        f"{', '.join(alone)} only in the {what}"
        for what, alone in (
            ("input", [n for n in lnames if n not in rnames]),
            ("output", [n for n in rnames if n not in lnames]),
        )
        if alone
    ]
    if only:
        raise ValueError("every axis must be on both sides: " + "; ".join(only))
    return sides


def _side(text: str, what: str) -> Side:
    out: Side = []
    group: list[str] | None = None
    for tok in re.findall(r"[()]|[^\s()]+", text):
        if tok == "(":
            if group is not None:
                raise ValueError(f"nested parentheses in the {what}")
            group = []
        elif tok == ")":
            if group is None:
                raise ValueError(f"')' without '(' in the {what}")
            out.append((tuple(group), True))
            group = None
        elif not _NAME.fullmatch(tok):
            raise ValueError(
                f"{tok!r} in the {what} is not an axis name (names are identifiers; give "
                "sizes as keywords)"
            )
        elif group is None:
            out.append(((tok,), False))
        else:
            group.append(tok)
    if group is not None:
        raise ValueError(f"'(' without ')' in the {what}")
    return out


def check_op(op: Any, where: str, problems: list[Problem]) -> None:
    """The problems of one operation that need no tensor (its pattern, its arguments)."""

    def bad(what: str, hint: str | None = None) -> None:
        problems.append(Problem("mapping", where, what, hint=hint))

    if isinstance(op, Rearrange):
        try:
            left, right = parse_rearrange(op.pattern)
        except ValueError as e:
            bad(f"rearrange {op.pattern!r}: {e}", hint='einops notation: "(h d) e -> h e d"')
            return
        grouped = {n for names, g in left + right if g for n in names}
        for k, v in op.sizes:
            if k not in grouped:
                bad(
                    f"rearrange {op.pattern!r}: size {k}={v!r} is not an axis inside a group",
                    hint="sizes are given for the axes inside parentheses",
                )
            elif not (isinstance(v, str) or (is_int(v) and v > 0)):
                bad(f"rearrange {op.pattern!r}: size {k}={v!r} is not a positive int or a name")
    elif isinstance(op, Transpose):
        perm = op.perm
        if not (isinstance(perm, Sequence) and all(is_int(p) for p in perm)):
            bad(f"transpose {perm!r} is not a sequence of ints")
        elif sorted(perm) != list(range(len(perm))):
            bad(f"transpose {tuple(perm)!r} is not a permutation of 0..{len(perm) - 1}")
    elif isinstance(op, Reshape):
        shape = op.shape
        if not (
            isinstance(shape, Sequence)
            and not isinstance(shape, str)
            and all(is_int(e) or isinstance(e, str) for e in shape)
        ):
            bad(f"reshape {shape!r} is not a sequence of ints and config names")
    elif isinstance(op, Add | Scale):
        v = op.value
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            bad(f"{op.text()}: the value must be a finite number")
        elif isinstance(op, Scale) and v == 0:
            bad("scale(0): multiplying by zero cannot be undone on export")
    else:
        bad(
            f"{op!r} is not an operation",
            hint="use Rearrange, Transpose, Reshape, Add or Scale",
        )


def is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)
