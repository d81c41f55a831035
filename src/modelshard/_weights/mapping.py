"""The mapping language: stored tensor names -> canonical target paths, with transforms.

A [`WeightMap`][modelshard.WeightMap] is an ordered list of [`MapRule`][modelshard.MapRule]; each stored tensor takes the
first rule whose ``source`` regex matches its whole name. The rule's ``target`` template
names the leaf (``{1}`` or ``{name}`` insert the regex's groups) and its transforms say how
the stored tensor becomes that leaf. ``resolve`` turns a mapping, the stored tensors'
names, shapes and dtypes, and (optionally) the target's leaves into one recipe per target
leaf (``.transforms``), reading nothing, and reports every problem at once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._base import (
    LIST_IN_FULL,
    MappingError,
    Problem,
    close_match,
    dtype_name,
    literal,
    vocabulary,
)
from . import transforms as T

_FIELD = re.compile(r"\{(\w+)\}")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Stack:
    """Several stored tensors into one target leaf, along a new axis.

    Stored tensors matched by one rule whose names differ only in regex group ``group``
    (the target template must not use it) are stacked along ``axis`` of the target, in
    ``order`` of that group's values (default: numeric, ``0..N-1``, every index present).
    Numbered layers into a scanned axis: ``Stack(1)``; fused gate and up projections:
    ``Stack(2, order=("gate", "up"))``.

    Attributes:
        group: the regex group (number or name) that varies between the stacked tensors.
        axis: where the new axis goes in the target (after the rule's transforms).
        order: the group's values in stacking order; ``None`` for numbers.
    """

    group: int | str
    axis: int = 0
    order: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Unstack:
    """One stored tensor into several target leaves, one per index of ``axis``.

    The inverse of [`Stack`][modelshard.Stack]: a scanned checkpoint (``layers/mlp/kernel`` of shape
    ``[L, ...]``) into an unscanned model (``layers/{layer}/mlp/kernel``).

    Attributes:
        key: the name of the index in the target template (``{layer}``).
        axis: the stored tensor's axis to split (before the rule's transforms).
    """

    key: str
    axis: int = 0


@dataclasses.dataclass(frozen=True)
class Concat:
    """Several stored tensors into one target leaf, joined along an existing axis.

    Like [`Stack`][modelshard.Stack], but the tensors are concatenated along an axis they
    already have: separate q, k and v projections into one fused ``[embed, (q+k+v)]``
    kernel, ``Concat(2, axis=1, order=("q", "k", "v"))``. Their sizes along ``axis`` may
    differ (grouped-query attention); every other dimension must agree.

    Attributes:
        group: the regex group (number or name) that varies between the joined tensors.
        axis: the axis to join along (after the rule's transforms).
        order: the group's values in joining order; ``None`` for numbers.
    """

    group: int | str
    axis: int = 0
    order: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Split:
    """One stored tensor into several target leaves, cut along an existing axis.

    The inverse of [`Concat`][modelshard.Concat]: a fused checkpoint tensor (``qkv_proj``,
    ``gate_up_proj``) into separate leaves. The target template names each part
    ``{key}``, taking the values ``names``.

    Attributes:
        key: the name of the part in the target template (``{part}``).
        names: the parts' names, in stored order (``("q", "k", "v")``).
        axis: the stored tensor's axis to cut (before the rule's transforms).
        sizes: each part's size along ``axis``: ints or names in the mapping's ``config``;
            ``None``: equal parts.
    """

    key: str
    names: tuple[str, ...]
    axis: int = 0
    sizes: tuple[int | str, ...] | None = None


# ---- operations (a rule's ``ops``) ----------------------------------------------------------


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
_TOKEN = re.compile(r"\s*(\(|\)|[A-Za-z_]\w*|[^\s()]+)")

Side = list[tuple[tuple[str, ...], bool]]
"""One side of a rearrange pattern: per axis, its names and whether it is a group."""


def parse_rearrange(pattern: str) -> tuple[Side, Side]:
    """``"(h d) e -> h e d"`` as ``(left, right)``, each a list of ``(names, grouped)``.

    Raises:
        ValueError: the pattern is malformed (the message says how).
    """
    if not isinstance(pattern, str) or pattern.count("->") != 1:
        raise ValueError("needs exactly one '->' between the input and output axes")
    left, right = pattern.split("->")
    sides = (_side(left.strip(), "input"), _side(right.strip(), "output"))
    lnames = [n for names, _ in sides[0] for n in names]
    rnames = [n for names, _ in sides[1] for n in names]
    for what, names in (("input", lnames), ("output", rnames)):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(
                f"{', '.join(dup)} appear{'s' if len(dup) == 1 else ''} twice in the {what}"
            )
    only_l = [n for n in lnames if n not in rnames]
    only_r = [n for n in rnames if n not in lnames]
    if only_l or only_r:
        parts = []
        if only_l:
            parts.append(f"{', '.join(only_l)} only in the input")
        if only_r:
            parts.append(f"{', '.join(only_r)} only in the output")
        raise ValueError("every axis must be on both sides: " + "; ".join(parts))
    return sides


def _side(text: str, what: str) -> Side:
    out: Side = []
    group: list[str] | None = None
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:  # only trailing whitespace is left
            break
        tok, pos = m.group(1), m.end()
        if tok == "(":
            if group is not None:
                raise ValueError(f"nested parentheses in the {what}")
            group = []
        elif tok == ")":
            if group is None:
                raise ValueError(f"')' without '(' in the {what}")
            out.append((tuple(group), True))
            group = None
        elif _NAME.fullmatch(tok):
            if group is None:
                out.append(((tok,), False))
            else:
                group.append(tok)
        else:
            raise ValueError(
                f"{tok!r} in the {what} is not an axis name (names are identifiers; give "
                "sizes as keywords)"
            )
    if group is not None:
        raise ValueError(f"'(' without ')' in the {what}")
    return out


def rule_ops(rule: MapRule) -> tuple[Op, ...]:
    """The rule's operations in order: ``transpose=``/``reshape=`` (the shorthand) or
    ``ops``."""
    if rule.ops is not None:
        return tuple(rule.ops)
    out: list[Op] = []
    if rule.transpose is not None:
        out.append(Transpose(tuple(rule.transpose)))
    if rule.reshape is not None:
        out.append(Reshape(tuple(rule.reshape)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class MapRule:
    """One rule of a [`WeightMap`][modelshard.WeightMap].

    Steps apply in this order: ``unstack`` or ``split`` (on the stored tensor), ``ops``
    (on each piece, in order), ``stack`` or ``concat`` (across tensors), then ``cast``.
    ``transpose=`` and ``reshape=`` are shorthand for ``ops=[Transpose(...)]`` and
    ``ops=[Reshape(...)]`` (both: that order); a rule takes either them or ``ops``.

    Attributes:
        source: regex matched against the whole stored name (``re.fullmatch``).
        target: the target path template (``layers/{1}/attn/q/kernel``); ``None`` skips
            the matched tensors (rotary caches, tied copies), if any: a skip rule that
            matches nothing is no error, even under ``strict``.
        transpose: a permutation of the axes (``(1, 0)``: PyTorch's ``[out, in]`` linear
            weight to a JAX ``[in, out]`` kernel).
        reshape: the new shape: ints, ``-1`` (inferred), or names looked up in the
            mapping's ``config`` (``("embed", "heads", -1)``).
        stack: several tensors into one leaf along a new axis ([`Stack`][modelshard.Stack]).
        unstack: one tensor into one leaf per index of an axis ([`Unstack`][modelshard.Unstack]).
        cast: the dtype the leaf is cast to (``"float32"``).
        concat: several tensors into one leaf along an existing axis
            ([`Concat`][modelshard.Concat]).
        split: one tensor into several leaves along an existing axis
            ([`Split`][modelshard.Split]).
        ops: operations applied in order to each piece: [`Rearrange`][modelshard.Rearrange],
            [`Transpose`][modelshard.Transpose], [`Reshape`][modelshard.Reshape],
            [`Add`][modelshard.Add], [`Scale`][modelshard.Scale]; each is inverted on
            export.
        also: the rule applies in addition to the first matching rule, so one stored
            tensor fills several leaves (tied embeddings into a separate head kernel).
            The export writes the tensor once, from the first rule's leaf, and refuses
            (``MappingError`` naming the leaf) when this rule's leaf no longer equals it
            (both computed back to the stored tensor's dtype, compared bit for bit),
            unless asked to untie.
        untied: with ``also``: the stored name an untied export
            (``save_safetensors(..., untie=True)``) writes this rule's leaf under
            (``"lm_head.weight"``; ``{1}`` and ``{name}`` insert the source's groups).
    """

    source: str
    target: str | None
    transpose: tuple[int, ...] | None = None
    reshape: tuple[int | str, ...] | None = None
    stack: Stack | None = None
    unstack: Unstack | None = None
    cast: str | None = None
    concat: Concat | None = None
    split: Split | None = None
    ops: Sequence[Op] | None = None
    also: bool = False
    untied: str | None = None

    def __post_init__(self) -> None:
        if self.ops is not None and not isinstance(self.ops, tuple):
            with contextlib.suppress(TypeError):  # not iterable: reported by WeightMap
                object.__setattr__(self, "ops", tuple(self.ops))

    @property
    def join(self) -> Stack | Concat | None:
        """The rule's ``stack`` or ``concat``: several stored tensors into one leaf."""
        return self.stack or self.concat

    def transforms_text(self) -> str:
        parts = []
        if self.unstack:
            parts.append(f"unstack(axis {self.unstack.axis} -> {{{self.unstack.key}}})")
        if self.split:
            names = "|".join(self.split.names)
            parts.append(f"split(axis {self.split.axis} -> {{{self.split.key}}} = {names})")
        parts.extend(op.text() for op in rule_ops(self) if isinstance(op, Op))
        for verb, join in (("stack", self.stack), ("concat", self.concat)):
            if join is not None:
                order = "" if join.order is None else " = " + "|".join(join.order)
                parts.append(f"{verb}(group {join.group}{order}, axis {join.axis})")
        if self.cast:
            parts.append(f"cast({self.cast})")
        if self.also:
            parts.append("also")
        return ", ".join(parts) or ("skip" if self.target is None else "-")


class WeightMap:
    """Stored tensor names to target paths, with transforms; first matching rule wins.

    The same mapping reads a checkpoint into a model ([`load_safetensors`][modelshard.load_safetensors],
    [`restore`][modelshard.restore] with ``mapping=``) and writes the model back in the
    checkpoint's names, shapes and dtypes ([`save_safetensors`][modelshard.save_safetensors]).

    Args:
        rules: the rules, tried in order.
        keep: regexes over target paths (``re.search``): target leaves they match may have
            no stored tensor and keep ``like``'s values (a new head, LoRA adapters). Every
            other target leaf must be mapped.
        config: sizes named in ``reshape``, ``Split`` and ``Rearrange``
            (``{"heads": 32, "head_dim": 128}``). Loading from a directory with a
            ``config.json`` (Hugging Face's) adds its integer entries
            (``num_attention_heads``, ``head_dim``; ``text_config.head_dim`` for a
            nested one) under these: a name given here wins, with a warning where
            ``config.json`` says otherwise.
        strict: a rule (or ``keep`` pattern) that matches nothing is an error; a skip
            rule (target ``None``) never is: it ignores the tensors that are there.

    Raises:
        MappingError: a rule is malformed (bad regex, a template naming a group the regex
            lacks, a stack group used in the template, ...); every one is listed.

    Example:
        >>> import modelshard as ms
        >>> wm = ms.WeightMap([
        ...     ms.MapRule(r"model\\.layers\\.(\\d+)\\.mlp\\.down_proj\\.weight",
        ...                "layers/{1}/mlp/down/kernel", transpose=(1, 0)),
        ...     ms.MapRule(r".*\\.rotary_emb\\.inv_freq", None),
        ... ], keep=["lora"])
        >>> wm.target_of("model.layers.3.mlp.down_proj.weight")
        'layers/3/mlp/down/kernel'
    """

    def __init__(
        self,
        rules: Sequence[MapRule],
        *,
        keep: Sequence[str] = (),
        config: Mapping[str, int] | None = None,
        strict: bool = True,
    ):
        self.rules = tuple(rules)
        self.keep = tuple(keep)
        self.config = dict(config or {})
        self.strict = strict
        self.split_dots = False
        problems: list[Problem] = []
        self._compiled = [_compile(i, r, problems) for i, r in enumerate(self.rules)]
        self._keep = []
        for i, k in enumerate(self.keep):
            try:
                self._keep.append(re.compile(k))
            except re.error as e:
                problems.append(Problem("mapping", f"keep[{i}]", f"{k!r} is not a regex: {e}"))
        if problems:
            raise MappingError(problems, header=_header(problems))

    @classmethod
    def identity(cls, *, split_dots: bool = False) -> WeightMap:
        """Every stored tensor under its own name (``split_dots``: ``a.b.c`` -> ``a/b/c``)."""
        wm = cls([MapRule("(.*)", "{1}")], strict=False)
        wm.split_dots = split_dots
        return wm

    def match(self, name: str) -> tuple[int, re.Match[str]] | None:
        """The index of the first rule (not an ``also`` rule) matching ``name`` and the
        match, or ``None``."""
        for i, pattern in enumerate(self._compiled):
            if pattern is None or self.rules[i].also:
                continue
            m = pattern.fullmatch(name)
            if m is not None:
                return i, m
        return None

    def also_matches(self, name: str) -> list[tuple[int, re.Match[str]]]:
        """Every ``also`` rule matching ``name``, with its match."""
        out = []
        for i, pattern in enumerate(self._compiled):
            if pattern is not None and self.rules[i].also:
                m = pattern.fullmatch(name)
                if m is not None:
                    out.append((i, m))
        return out

    def with_config(self, sizes: Mapping[str, int], source: str = "config.json") -> WeightMap:
        """This mapping with ``sizes`` (a checkpoint's ``config.json``, read from
        ``source``) under its own ``config``: a name the mapping sets keeps its value, with
        a warning naming both values where ``sizes`` says otherwise."""
        if not sizes:
            return self
        for name, value in self.config.items():
            if name in sizes and sizes[name] != value:
                warnings.warn(
                    f"the mapping's config sets {name} = {value}, but {source} has "
                    f"{name} = {sizes[name]}; using the mapping's {value} (remove {name} "
                    f"from the mapping's config to take {source}'s)",
                    skip_file_prefixes=(_PACKAGE,),  # points at the caller's line
                )
        out = copy.copy(self)
        out.config = {**sizes, **self.config}
        return out

    def format_untied(self, i: int, name: str) -> str | None:
        """Rule ``i``'s ``untied`` name for the stored tensor ``name``."""
        rule, pattern = self.rules[i], self._compiled[i]
        m = None if pattern is None else pattern.fullmatch(name)
        if rule.untied is None or m is None:
            return None
        return _FIELD.sub(lambda f: _field(m, f.group(1), {}), rule.untied)

    def target_of(self, name: str) -> str | None:
        """The target path of one stored tensor (for stacked rules, the stacked leaf)."""
        hit = self.match(name)
        if hit is None or self.rules[hit[0]].target is None:
            return None
        rule = self.rules[hit[0]]
        extra = {rule.unstack.key: "0"} if rule.unstack else {}
        if rule.split and rule.split.names:
            extra = {rule.split.key: rule.split.names[0]}
        return self._format(rule, hit[1], extra)

    def _format(self, rule: MapRule, m: re.Match[str], extra: Mapping[str, str]) -> str:
        assert rule.target is not None
        out = _FIELD.sub(lambda f: _field(m, f.group(1), extra), rule.target)
        return out.replace(".", "/") if self.split_dots else out

    def kept(self, path: str) -> bool:
        return any(k.search(path) for k in self._keep)

    def __repr__(self) -> str:
        return f"WeightMap({len(self.rules)} rules, keep={list(self.keep)!r})"


def _field(m: re.Match[str], name: str, extra: Mapping[str, str]) -> str:
    if name in extra:
        return extra[name]
    value = m.group(int(name)) if name.isdigit() else m.group(name)
    return "" if value is None else value


def _header(problems: Sequence[Problem]) -> str:
    n = len(problems)
    where = "paths are source:NAME, target:PATH, mapping:rules[i]"
    if n > LIST_IN_FULL:  # SpecError adds the count and the causes
        return f"the weight mapping does not fit ({where}):"
    return (
        f"{n} mapping problem{'s' if n != 1 else ''} found (every offending tensor, leaf and "
        f"rule is listed; {where}):"
    )


def _compile(i: int, rule: MapRule, problems: list[Problem]) -> re.Pattern[str] | None:
    where = f"rules[{i}]"
    try:
        pattern = re.compile(rule.source)
    except re.error as e:
        problems.append(Problem("mapping", where, f"source {rule.source!r} is not a regex: {e}"))
        return None
    groups = {str(n) for n in range(pattern.groups + 1)} | set(pattern.groupindex)
    fields = set(_FIELD.findall(rule.target or ""))
    for what, cut in (("unstack", rule.unstack), ("split", rule.split)):
        if cut is None:
            continue
        if cut.key not in fields:
            problems.append(
                Problem(
                    "mapping",
                    where,
                    f"{what} key {{{cut.key}}} is not in the target {rule.target!r}",
                    hint="the target template must name each piece, e.g. layers/{layer}/...",
                )
            )
        fields.discard(cut.key)
    if rule.split is not None:
        names = rule.split.names
        if not names or len(set(names)) != len(names):
            problems.append(
                Problem(
                    "mapping",
                    where,
                    f"split names {tuple(names)!r} must be distinct and at least one",
                )
            )
        elif rule.split.sizes is not None and len(rule.split.sizes) != len(names):
            problems.append(
                Problem(
                    "mapping",
                    where,
                    f"split has {len(names)} names {tuple(names)!r} but "
                    f"{len(rule.split.sizes)} sizes {tuple(rule.split.sizes)!r}",
                    hint="give one size per name, or none for equal parts",
                )
            )
    for f in sorted(fields - groups):
        problems.append(
            Problem(
                "mapping",
                where,
                f"target {rule.target!r} uses {{{f}}} but the source regex "
                f"{rule.source!r} has no group {f!r}",
                hint="name a group of the regex ({1}, {name}) or write the text literally",
            )
        )
    join = rule.join
    verb = "stack" if rule.stack is not None else "concat"
    if join is not None:
        g = str(join.group)
        if g not in groups or g == "0":
            problems.append(
                Problem(
                    "mapping",
                    where,
                    f"{verb} group {join.group!r} is not a group of {rule.source!r}",
                )
            )
        elif g in fields or (g in pattern.groupindex and str(pattern.groupindex[g]) in fields):
            joined = "stacked" if rule.stack is not None else "concatenated"
            problems.append(
                Problem(
                    "mapping",
                    where,
                    f"the target {rule.target!r} uses the {joined} group {{{g}}}",
                    hint=f"the {joined} tensors share one target: leave the group out of it",
                )
            )
    steps = [
        n
        for n, v in (
            ("stack", rule.stack),
            ("concat", rule.concat),
            ("unstack", rule.unstack),
            ("split", rule.split),
        )
        if v is not None
    ]
    if len(steps) > 1:
        problems.append(
            Problem(
                "mapping",
                where,
                f"a rule cannot both {steps[0]} and {steps[1]}",
                hint="one rule joins or cuts tensors in one way; write two rules",
            )
        )
    if rule.target is None and (rule.transpose or rule.reshape or rule.ops or steps):
        problems.append(Problem("mapping", where, "a skip rule (target None) takes no transforms"))
    if rule.ops is not None:
        if rule.transpose is not None or rule.reshape is not None:
            problems.append(
                Problem(
                    "mapping",
                    where,
                    "a rule takes ops or transpose/reshape, not both",
                    hint="write Transpose(...) and Reshape(...) into ops",
                )
            )
        if isinstance(rule.ops, tuple):
            for j, op in enumerate(rule.ops):
                _check_op(op, f"{where}.ops[{j}]", problems)
        else:
            problems.append(
                Problem("mapping", where, f"ops {rule.ops!r} is not a list of operations")
            )
    if rule.also:
        if rule.target is None:
            problems.append(
                Problem("mapping", where, "an also rule needs a target (it fills another leaf)")
            )
        if join is not None:
            problems.append(
                Problem(
                    "mapping",
                    where,
                    f"an also rule cannot {verb}",
                    hint="an also rule copies one stored tensor into one more leaf",
                )
            )
    elif rule.untied is not None:
        problems.append(
            Problem(
                "mapping",
                where,
                f"untied {rule.untied!r} needs also=True",
                hint="untied names the stored tensor an untied export writes an also leaf as",
            )
        )
    if rule.untied is not None:
        for f in sorted(set(_FIELD.findall(rule.untied)) - groups):
            problems.append(
                Problem(
                    "mapping",
                    where,
                    f"untied {rule.untied!r} uses {{{f}}} but the source regex has no such group",
                )
            )
    if rule.cast is not None:
        try:
            np.dtype(rule.cast)
        except TypeError:
            problems.append(Problem("mapping", where, f"cast {rule.cast!r} is not a dtype name"))
    return pattern


def _check_op(op: Any, where: str, problems: list[Problem]) -> None:
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
            elif not (isinstance(v, str) or (_is_int(v) and v > 0)):
                bad(f"rearrange {op.pattern!r}: size {k}={v!r} is not a positive int or a name")
    elif isinstance(op, Transpose):
        perm = op.perm
        if not (isinstance(perm, Sequence) and all(_is_int(p) for p in perm)):
            bad(f"transpose {perm!r} is not a sequence of ints")
        elif sorted(perm) != list(range(len(perm))):
            bad(f"transpose {tuple(perm)!r} is not a permutation of 0..{len(perm) - 1}")
    elif isinstance(op, Reshape):
        shape = op.shape
        if not (
            isinstance(shape, Sequence)
            and not isinstance(shape, str)
            and all(_is_int(e) or isinstance(e, str) for e in shape)
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


# ---- resolution ----------------------------------------------------------------------------


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

    recipes: dict[str, T.Node]
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
            src = ", ".join(r.sources[:1]) + (
                f" and {len(r.sources) - 1} more" if len(r.sources) > 1 else ""
            )
            shape = "-" if r.shape is None else str(list(r.shape))
            t.add_row(
                literal(r.target or "<root>"),
                shape,
                r.dtype or "-",
                literal(src or "-"),
                literal(r.how),
            )
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


def resolve(
    mapping: WeightMap,
    sources: Tensors,
    targets: Tensors | None,
    *,
    dtype: Any = None,
    export: bool = False,
) -> Resolution:
    """Resolve ``mapping`` against stored tensors ``sources`` (name -> (shape, dtype)) and
    target leaves ``targets`` (path -> (shape, dtype); ``None``: whatever the mapping makes).

    ``dtype``: floating-point stored tensors are cast to it (before the rules' ``cast``).
    ``export``: resolving for an export, where kept leaves are not written, so a ``keep``
    pattern matching nothing is no error (the state may have no adapters at all).

    Raises:
        MappingError: every unmapped stored tensor, every target leaf with no source,
            every shape or dtype that does not fit, every rule that matched nothing.
    """
    problems: list[Problem] = []
    used: set[int] = set()
    plain: list[tuple[int, str, re.Match[str]]] = []
    stacks: dict[tuple[int, str], dict[str, str]] = {}
    clashed: set[tuple[int, str]] = set()
    skipped: list[str] = []
    for name in sources:
        hit = mapping.match(name)
        shape, dt = sources[name]
        alsos = mapping.also_matches(name)
        for j, m in alsos:
            used.add(j)
            plain.append((j, name, m))
        if hit is None and alsos:
            continue  # only also rules map it: the export writes it from their leaf
        if hit is None:
            problems.append(
                Problem(
                    "source",
                    name,
                    "no rule maps this stored tensor",
                    shape=tuple(shape),
                    dtype=dtype_name(dt),
                    hint="add a rule for it, or a skip rule (target None / skip = true)",
                    cause="no rule maps this stored tensor",
                )
            )
            continue
        i, m = hit
        used.add(i)
        rule = mapping.rules[i]
        if rule.target is None:
            skipped.append(name)
        elif rule.join is not None:
            key = mapping._format(rule, m, {})
            members = stacks.setdefault((i, key), {})
            value = m.group(rule.join.group) or ""
            verb = "stack" if rule.stack is not None else "concat"
            if value in members:
                problems.append(
                    Problem(
                        "target",
                        key,
                        f"stored tensors {members[value]}, {name} all map to this leaf, both "
                        f"at {verb} index {value!r} (rules[{i}] {verb}s by group "
                        f"{rule.join.group!r})",
                        hint="another group varies too: put it in the target template, or "
                        "stack by it",
                        cause="several stored tensors map to one leaf",
                    )
                )
                clashed.add((i, key))
            else:
                members[value] = name
        else:
            plain.append((i, name, m))

    made: dict[str, tuple[T.Node, int, tuple[str, ...]]] = {}
    failed: set[str] = set()  # leaves whose stored tensor has a problem of its own

    def add(path: str, node: T.Node | None, i: int, names: tuple[str, ...]) -> None:
        if node is None:
            failed.add(path)
            return
        if path in made:
            other = made[path][2]
            problems.append(
                Problem(
                    "target",
                    path,
                    f"stored tensors {', '.join(other + names)} all map to this leaf "
                    f"(rules[{made[path][1]}] and rules[{i}])",
                    hint="give them distinct targets, or Stack(...) them into one leaf",
                    cause="several stored tensors map to one leaf",
                )
            )
            return
        made[path] = (node, i, names)

    for i, name, m in plain:
        rule = mapping.rules[i]
        shape, dt = sources[name]
        read = T.Read(name, tuple(shape), T.as_dtype(dt))
        if rule.unstack is not None:
            ax = rule.unstack.axis
            if not -len(shape) <= ax < len(shape):
                problems.append(_bad(name, read, f"unstack axis {ax} is out of range", i))
                continue
            ax %= len(shape)
            for k in range(shape[ax]):
                path = mapping._format(rule, m, {rule.unstack.key: str(k)})
                piece = _piece(mapping, rule, i, T.Take(read, ax, k), name, dtype, problems)
                if piece is None:  # the same problem for every piece: reported once
                    failed.update(
                        mapping._format(rule, m, {rule.unstack.key: str(j)})
                        for j in range(shape[ax])
                    )
                    break
                add(path, piece, i, (name,))
        elif rule.split is not None:
            parts = _split_parts(mapping, rule, i, read, name, problems)
            for part, cut in parts:
                path = mapping._format(rule, m, {rule.split.key: part})
                leaf = _piece(mapping, rule, i, cut, name, dtype, problems)
                if leaf is None:  # the same problem for every part: reported once
                    failed.update(mapping._format(rule, m, {rule.split.key: p}) for p, _ in parts)
                    break
                add(path, leaf, i, (name,))
        else:
            path = mapping._format(rule, m, {})
            add(path, _piece(mapping, rule, i, read, name, dtype, problems), i, (name,))

    for (i, path), members in stacks.items():
        if (i, path) in clashed:
            continue
        rule = mapping.rules[i]
        join = rule.join
        assert join is not None
        verb = "stack" if rule.stack is not None else "concat"
        order = _stack_order(join, verb, members, i, path, problems)
        if order is None:
            continue
        names = tuple(members[v] for v in order)
        pieces = []
        for name in names:
            shape, dt = sources[name]
            read = T.Read(name, tuple(shape), T.as_dtype(dt))
            pieces.append(_pre_cast(mapping, rule, i, read, name, dtype, problems))
        nodes = [p for p in pieces if p is not None]
        if len(nodes) < len(pieces):
            failed.add(path)
            continue
        ndim = len(nodes[0].shape) + (1 if rule.stack is not None else 0)
        ax = join.axis
        if not -ndim <= ax < ndim:
            problems.append(Problem("mapping", f"rules[{i}]", f"{verb} axis {ax} is out of range"))
            failed.add(path)
            continue
        ax %= ndim

        if rule.stack is not None:  # what must agree between the pieces
            agree = {(p.shape, p.dtype) for p in nodes}
        else:
            agree = {(len(p.shape), p.shape[:ax], p.shape[ax + 1 :], p.dtype) for p in nodes}
        if len(agree) > 1:
            detail = ", ".join(
                f"{n} {dtype_name(p.dtype)}{list(p.shape)}"
                for n, p in zip(names, nodes, strict=True)
            )
            if rule.stack is not None:
                what, hint = "shape or dtype", "only tensors of one shape and dtype stack"
            else:
                what = f"dtype or shape outside axis {ax}"
                hint = f"only tensors of one dtype, equal in every axis but {ax}, concatenate"
            problems.append(
                Problem(
                    "target",
                    path,
                    f"the {'stacked' if rule.stack is not None else 'concatenated'} tensors differ "
                    f"in {what}: {detail}",
                    hint=hint,
                )
            )
            continue
        node: T.Node = T.Stack(nodes, ax) if rule.stack is not None else T.Concat(nodes, ax)
        add(path, _cast(rule, node), i, names)

    if mapping.strict:
        for i, rule in enumerate(mapping.rules):
            if i not in used and rule.target is not None:  # skip: "ignore if present"
                problems.append(_unused(mapping, i, sources))

    kept: list[str] = []
    rows: list[Row] = []
    if targets is not None:
        keep_used: set[int] = set()
        for path, (shape, dt) in targets.items():
            hit = made.get(path)
            if hit is None and path in failed:
                continue  # its stored tensor's problem is reported
            if hit is None:
                ks = [j for j, k in enumerate(mapping._keep) if k.search(path)]
                if ks:
                    keep_used.update(ks)
                    kept.append(path)
                    rows.append(Row(path, (), "kept (like's value)", tuple(shape), dtype_name(dt)))
                    continue
                problems.append(
                    Problem(
                        "target",
                        path,
                        "no stored tensor maps to this leaf",
                        shape=tuple(shape),
                        dtype=dtype_name(dt),
                        hint="add a rule producing it, or list it in keep=[...] to keep "
                        "like's value (a new head, LoRA adapters)",
                        cause="no stored tensor maps to this leaf",
                    )
                )
                continue
            node, i, names = hit
            want = f"{dtype_name(dt)}{list(shape)}"
            got = f"{dtype_name(node.dtype)}{list(node.shape)}"
            if tuple(shape) != node.shape or dtype_name(dt) != dtype_name(node.dtype):
                hints = []
                if tuple(shape) != node.shape:
                    hints.append("fix the rule's transpose/reshape/stack")
                if dtype_name(dt) != dtype_name(node.dtype):
                    hints.append(f"add cast = {dtype_name(dt)!r} to rules[{i}] or pass dtype=")
                problems.append(
                    Problem(
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
                )
                continue
            rows.append(_row(path, node, mapping.rules[i]))
        for path in made:
            if path not in targets:
                node, i, names = made[path]
                problems.append(
                    Problem(
                        "target",
                        path,
                        f"rules[{i}] maps {', '.join(names)} here, but the target has no such leaf",
                        hint="fix the target template; target paths are canonical "
                        "(modelshard.plan(like, ...) lists them)",
                        cause="mapped to a path the target does not have",
                    )
                )
        if mapping.strict and not export:
            for j, k in enumerate(mapping.keep):
                if j not in keep_used:
                    problems.append(
                        Problem(
                            "mapping",
                            f"keep[{j}]",
                            f"keep pattern {k!r} matched no unmapped target leaf",
                            hint="fix or remove the pattern",
                        )
                    )
    else:
        rows = [_row(p, made[p][0], mapping.rules[made[p][1]]) for p in sorted(made, key=_natural)]
    if problems:
        problems = _once_per_rule(problems)
        raise MappingError(problems, header=_header(problems))
    also = {p: i for p, (_, i, _) in made.items() if mapping.rules[i].also}
    return Resolution({p: n for p, (n, _, _) in made.items()}, kept, skipped, rows, also)


_NO_SIZE = "a size the mapping's config lacks"


def _once_per_rule(problems: list[Problem]) -> list[Problem]:
    """A size missing from the config is one problem of its rule, not one per stored
    tensor: the first tensor's is kept, its hint counting the others."""
    first: dict[str, int] = {}
    more: dict[str, int] = {}
    out: list[Problem] = []
    for p in problems:
        if p.cause != _NO_SIZE:
            out.append(p)
        elif p.what in first:
            more[p.what] = more.get(p.what, 0) + 1
        else:
            first[p.what] = len(out)
            out.append(p)
    for what, n in more.items():
        j = first[what]
        out[j] = dataclasses.replace(
            out[j], hint=f"{out[j].hint} (the rule needs it for {_count(n, 'more stored tensor')})"
        )
    return out


def _unused(mapping: WeightMap, i: int, sources: Iterable[str]) -> Problem:
    """The problem of rule ``i``, which no stored tensor took: its regex matches none, or
    earlier rules took every tensor it matches (first match wins)."""
    rule, pattern = mapping.rules[i], mapping._compiled[i]
    taken: dict[int, int] = {}
    for name in sources:
        hit = mapping.match(name) if pattern is not None and pattern.fullmatch(name) else None
        if hit is not None:
            taken[hit[0]] = taken.get(hit[0], 0) + 1
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


def _natural(path: str) -> list[tuple[int, int | str]]:
    """A sort key reading numbers as numbers (``layers/2`` before ``layers/10``)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", path) if p]


def _row(path: str, node: T.Node, rule: MapRule) -> Row:
    return Row(
        path, tuple(node.reads()), rule.transforms_text(), node.shape, dtype_name(node.dtype)
    )


def _bad(name: str, read: T.Node, what: str, i: int, hint: str | None = None) -> Problem:
    return Problem(
        "source",
        name,
        f"{what} (rules[{i}])",
        shape=read.shape,
        dtype=dtype_name(read.dtype),
        hint=hint,
    )


def _pre_cast(
    mapping: WeightMap,
    rule: MapRule,
    i: int,
    node: T.Node,
    name: str,
    dtype: Any,
    problems: list[Problem],
) -> T.Node | None:
    """``node`` through the load's dtype and the rule's operations."""
    if rule.cast is not None and T.is_key(node.dtype):
        problems.append(_bad(name, node, f"a PRNG key cannot be cast (cast = {rule.cast!r})", i))
        return None
    if dtype is not None and jnp.issubdtype(node.dtype, jnp.floating) and node.dtype != dtype:
        node = T.Cast(node, np.dtype(dtype))
    for op in rule_ops(rule):
        got = _apply(mapping, op, node, name, i, problems)
        if got is None:
            return None
        node = got
    return node


def _apply(
    mapping: WeightMap, op: Op, node: T.Node, name: str, i: int, problems: list[Problem]
) -> T.Node | None:
    """``node`` through one operation, as recipe nodes; ``None`` after a problem."""
    if isinstance(op, Transpose):
        perm = tuple(int(p) for p in op.perm)
        if sorted(perm) != list(range(len(node.shape))):
            problems.append(
                _bad(
                    name,
                    node,
                    f"transpose{perm} is not a permutation of this tensor's {len(node.shape)} axes",
                    i,
                )
            )
            return None
        return T.Transpose(node, perm)
    if isinstance(op, Reshape):
        shape = _reshape(mapping, op.shape, node, name, i, problems)
        return None if shape is None else T.Reshape(node, shape)
    if isinstance(op, Rearrange):
        return _rearrange(mapping, op, node, name, i, problems)
    what = "add" if isinstance(op, Add) else "scale"
    if not (isinstance(node.dtype, np.dtype) and jnp.issubdtype(node.dtype, jnp.floating)):
        problems.append(
            _bad(
                name,
                node,
                f"{op.text()} needs a floating-point tensor, not {dtype_name(node.dtype)}",
                i,
                hint=f"{what} applies to float tensors only",
            )
        )
        return None
    return T.Arith(node, "add" if isinstance(op, Add) else "mul", float(op.value))


def _rearrange(
    mapping: WeightMap, op: Rearrange, node: T.Node, name: str, i: int, problems: list[Problem]
) -> T.Node | None:
    """A rearrange as reshape -> transpose -> reshape nodes (each left out when it does
    nothing)."""
    left, right = parse_rearrange(op.pattern)  # checked when the mapping was built
    shape = node.shape
    where = f"rearrange({op.pattern})"
    if len(left) != len(shape):
        problems.append(
            _bad(name, node, f"{where} expects {len(left)} axes, the tensor has {len(shape)}", i)
        )
        return None
    given = _sizes(mapping, [v for _, v in op.sizes], node, name, i, problems, "rearrange size")
    if given is None:
        return None
    known = dict(zip([k for k, _ in op.sizes], given, strict=True))
    sizes: dict[str, int] = {}
    for (names, _), dim in zip(left, shape, strict=True):
        unknown = [n for n in names if n not in known]
        prod = math.prod(known[n] for n in names if n in known)
        if len(unknown) > 1:
            problems.append(
                _bad(
                    name,
                    node,
                    f"{where}: give the size of all but one of {', '.join(unknown)}",
                    i,
                )
            )
            return None
        if unknown and (prod <= 0 or dim % prod):
            problems.append(
                _bad(name, node, f"{where}: axis of size {dim} does not divide by {prod}", i)
            )
            return None
        if not unknown and prod != dim:
            sizes_text = " * ".join(f"{n}={known[n]}" for n in names) or "()"
            problems.append(_bad(name, node, f"{where}: axis of size {dim} is not {sizes_text}", i))
            return None
        for n in names:
            sizes[n] = known[n] if n in known else dim // prod
    order = [n for names, _ in left for n in names]
    out: T.Node = node
    elementary = tuple(sizes[n] for n in order)
    if elementary != shape:
        out = T.Reshape(out, elementary)
    target_order = [n for names, _ in right for n in names]
    perm = tuple(order.index(n) for n in target_order)
    if perm != tuple(range(len(perm))):
        out = T.Transpose(out, perm)
    final = tuple(math.prod(sizes[n] for n in names) for names, _ in right)
    if final != out.shape:
        out = T.Reshape(out, final)
    return out


def _piece(
    mapping: WeightMap,
    rule: MapRule,
    i: int,
    node: T.Node,
    name: str,
    dtype: Any,
    problems: list[Problem],
) -> T.Node | None:
    pre = _pre_cast(mapping, rule, i, node, name, dtype, problems)
    return None if pre is None else _cast(rule, pre)


def _cast(rule: MapRule, node: T.Node) -> T.Node:
    if rule.cast is not None and np.dtype(rule.cast) != node.dtype:
        return T.Cast(node, np.dtype(rule.cast))
    return node


def _reshape(
    mapping: WeightMap,
    entries: Iterable[int | str],
    node: T.Node,
    name: str,
    i: int,
    problems: list[Problem],
) -> tuple[int, ...] | None:
    got = _sizes(mapping, entries, node, name, i, problems, "reshape size")
    if got is None:
        return None
    sizes = got
    total = math.prod(node.shape)
    if sizes.count(-1) > 1:
        problems.append(_bad(name, node, f"reshape{tuple(sizes)} has more than one -1", i))
        return None
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if known <= 0 or total % known:
            problems.append(
                _bad(name, node, f"cannot reshape {list(node.shape)} to {tuple(sizes)}", i)
            )
            return None
        sizes[sizes.index(-1)] = total // known
    if math.prod(sizes) != total or any(s < 0 for s in sizes):
        problems.append(_bad(name, node, f"cannot reshape {list(node.shape)} to {tuple(sizes)}", i))
        return None
    return tuple(sizes)


def _split_parts(
    mapping: WeightMap, rule: MapRule, i: int, read: T.Read, name: str, problems: list[Problem]
) -> list[tuple[str, T.Node]]:
    """``(part name, Slice of the stored tensor)`` for a rule's ``split``; ``[]`` after a
    problem."""
    split = rule.split
    assert split is not None
    shape, ax = read.shape, split.axis
    if not -len(shape) <= ax < len(shape):
        problems.append(_bad(name, read, f"split axis {ax} is out of range", i))
        return []
    ax %= len(shape)
    n = shape[ax]
    if split.sizes is None:
        if n % len(split.names):
            problems.append(
                _bad(
                    name,
                    read,
                    f"axis {ax} of size {n} does not split into {len(split.names)} equal parts "
                    f"{tuple(split.names)!r}",
                    i,
                    hint="give sizes = [...], one per name",
                )
            )
            return []
        sizes = [n // len(split.names)] * len(split.names)
    else:
        got = _sizes(mapping, split.sizes, read, name, i, problems, "split size")
        if got is None:
            return []
        sizes = got
        if sum(sizes) != n or any(s <= 0 for s in sizes):
            problems.append(
                _bad(
                    name,
                    read,
                    f"split sizes {tuple(sizes)} (sum {sum(sizes)}) do not cut axis {ax} of "
                    f"size {n}",
                    i,
                    hint="the sizes must be positive and add up to the axis",
                )
            )
            return []
    out, start = [], 0
    for part, size in zip(split.names, sizes, strict=True):
        out.append((part, T.Slice(read, ax, start, start + size)))
        start += size
    return out


def _sizes(
    mapping: WeightMap,
    entries: Iterable[int | str],
    node: T.Node,
    name: str,
    i: int,
    problems: list[Problem],
    what: str,
) -> list[int] | None:
    """Sizes written as ints or names in the mapping's config."""
    sizes: list[int] = []
    for e in entries:
        if isinstance(e, str):
            if e not in mapping.config:
                close = close_match(e, mapping.config, cutoff=0.8)
                known = f"did you mean {close!r}?" if close else None
                problem = _bad(
                    name,
                    node,
                    f"{what} {e!r} is not in the mapping's config "
                    f"({known or ', '.join(sorted(mapping.config)) or 'empty'})",
                    i,
                    hint=f"add {e} = <size> to the config",
                )
                problems.append(dataclasses.replace(problem, cause=_NO_SIZE))
                return None
            sizes.append(int(mapping.config[e]))
        else:
            sizes.append(int(e))
    return sizes


def _stack_order(
    stack: Stack | Concat,
    verb: str,
    members: Mapping[str, str],
    i: int,
    path: str,
    problems: list[Problem],
) -> list[str] | None:
    values = list(members)
    if stack.order is not None:
        order = list(stack.order)
        missing = [v for v in order if v not in members]
        extra = [v for v in values if v not in order]
        if missing or extra:
            what = []
            if missing:
                what.append(f"missing {', '.join(map(repr, missing))}")
            if extra:
                what.append(
                    "not in the order: " + ", ".join(f"{members[v]} ({v!r})" for v in extra)
                )
            problems.append(
                Problem(
                    "target",
                    path,
                    f"cannot {verb} by rules[{i}]: {'; '.join(what)} (order {tuple(order)!r})",
                    hint="every value of the order must be stored once",
                )
            )
            return None
        return order
    if not all(v.isdigit() for v in values):
        problems.append(
            Problem(
                "mapping",
                f"rules[{i}]",
                f"{verb} group values {sorted(values)!r} are not numbers: give "
                f"{verb.capitalize()}(order=...)",
            )
        )
        return None
    nums = sorted(int(v) for v in values)
    if nums != list(range(len(nums))):
        gaps = sorted(set(range(max(nums) + 1)) - set(nums))
        problems.append(
            Problem(
                "target",
                path,
                f"cannot {verb} by rules[{i}]: indices {gaps} are missing "
                f"(found {len(nums)} tensors, {nums[0]}..{nums[-1]})",
                hint="every index 0..N-1 must be stored once",
            )
        )
        return None
    by_num = {int(v): v for v in values}
    return [by_num[n] for n in nums]
