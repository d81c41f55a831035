"""The rule language; every malformed rule is reported when its ``WeightMap`` is built."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from .._base import LIST_IN_FULL, MappingError, Problem, caller_stacklevel
from .ops import Op, Reshape, Transpose, check_op

_FIELD = re.compile(r"\{(\w+)\}")


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


def rule_ops(rule: MapRule) -> tuple[Op, ...]:
    """The rule's ``ops``, or its ``transpose=``/``reshape=`` shorthand as operations."""
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
        optional: the rule may match nothing, even under ``strict``: a tensor some
            checkpoints of a family have and others lack (``lm_head.weight``, absent
            where the embeddings are tied, whose model then has no head leaf either).
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
    optional: bool = False

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
        optional: regexes like ``keep``'s, for leaves a model may or may not have
            (the LoRA adapters a fine-tune adds): a pattern that matches nothing is no
            error, so one mapping serves the plain model and the adapted one.

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
        optional: Sequence[str] = (),
    ):
        self.rules = tuple(rules)
        self.keep = tuple(keep)
        self.optional = tuple(optional)
        self.config = dict(config or {})
        self.strict = strict
        self.split_dots = False
        problems: list[Problem] = []
        self._compiled = [_compile(i, r, problems) for i, r in enumerate(self.rules)]
        self._keep = []
        for field, patterns in (("keep", self.keep), ("optional", self.optional)):
            for i, k in enumerate(patterns):
                try:
                    self._keep.append(re.compile(k))
                except re.error as e:
                    problems.append(
                        Problem("mapping", f"{field}[{i}]", f"{k!r} is not a regex: {e}")
                    )
        if problems:
            raise MappingError(problems, header=header(problems))

    @classmethod
    def identity(cls, *, split_dots: bool = False) -> WeightMap:
        """Every stored tensor under its own name (``split_dots``: ``a.b.c`` -> ``a/b/c``)."""
        wm = cls([MapRule("(.*)", "{1}")], strict=False)
        wm.split_dots = split_dots
        return wm

    def _matches(self, name: str, also: bool) -> Iterator[tuple[int, re.Match[str]]]:
        for i, pattern in enumerate(self._compiled):
            m = None if pattern is None else pattern.fullmatch(name)
            if m is not None and self.rules[i].also == also:
                yield i, m

    def match(self, name: str) -> tuple[int, re.Match[str]] | None:
        """The first rule (not an ``also`` rule) matching ``name``, and the match."""
        return next(self._matches(name, False), None)

    def also_matches(self, name: str) -> list[tuple[int, re.Match[str]]]:
        """Every ``also`` rule matching ``name``, with its match."""
        return list(self._matches(name, True))

    def with_config(self, sizes: Mapping[str, int], source: str = "config.json") -> WeightMap:
        """This mapping with ``sizes`` under its ``config`` (which wins, with a warning)."""
        if not sizes:
            return self
        for name, value in self.config.items():
            if name in sizes and sizes[name] != value:
                warnings.warn(
                    f"the mapping's config sets {name} = {value}, but {source} has "
                    f"{name} = {sizes[name]}; using the mapping's {value} (remove {name} "
                    f"from the mapping's config to take {source}'s)",
                    stacklevel=caller_stacklevel(),
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

    def __repr__(self) -> str:
        optional = f", optional={list(self.optional)!r}" if self.optional else ""
        return f"WeightMap({len(self.rules)} rules, keep={list(self.keep)!r}{optional})"


def _field(m: re.Match[str], name: str, extra: Mapping[str, str]) -> str:
    if name in extra:
        return extra[name]
    value = m.group(int(name)) if name.isdigit() else m.group(name)
    return "" if value is None else value


def header(problems: Sequence[Problem]) -> str:
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

    def bad(text: str, hint: str | None = None) -> None:
        problems.append(Problem("mapping", where, text, hint=hint))

    try:
        pattern = re.compile(rule.source)
    except re.error as e:
        bad(f"source {rule.source!r} is not a regex: {e}")
        return None
    groups = {str(n) for n in range(pattern.groups + 1)} | set(pattern.groupindex)
    fields = set(_FIELD.findall(rule.target or ""))
    for what, cut in (("unstack", rule.unstack), ("split", rule.split)):
        if cut is None:
            continue
        if cut.key not in fields:
            bad(
                f"{what} key {{{cut.key}}} is not in the target {rule.target!r}",
                hint="the target template must name each piece, e.g. layers/{layer}/...",
            )
        fields.discard(cut.key)
    if rule.split is not None:
        names = rule.split.names
        if not names or len(set(names)) != len(names):
            bad(f"split names {tuple(names)!r} must be distinct and at least one")
        elif rule.split.sizes is not None and len(rule.split.sizes) != len(names):
            bad(
                f"split has {len(names)} names {tuple(names)!r} but "
                f"{len(rule.split.sizes)} sizes {tuple(rule.split.sizes)!r}",
                hint="give one size per name, or none for equal parts",
            )
    for f in sorted(fields - groups):
        bad(
            f"target {rule.target!r} uses {{{f}}} but the source regex "
            f"{rule.source!r} has no group {f!r}",
            hint="name a group of the regex ({1}, {name}) or write the text literally",
        )
    join = rule.join
    verb = "stack" if rule.stack is not None else "concat"
    if join is not None:
        g = str(join.group)
        if g not in groups or g == "0":
            bad(f"{verb} group {join.group!r} is not a group of {rule.source!r}")
        elif g in fields or (g in pattern.groupindex and str(pattern.groupindex[g]) in fields):
            joined = "stacked" if rule.stack is not None else "concatenated"
            bad(
                f"the target {rule.target!r} uses the {joined} group {{{g}}}",
                hint=f"the {joined} tensors share one target: leave the group out of it",
            )
    steps = [n for n in ("stack", "concat", "unstack", "split") if getattr(rule, n) is not None]
    if len(steps) > 1:
        bad(
            f"a rule cannot both {steps[0]} and {steps[1]}",
            hint="one rule joins or cuts tensors in one way; write two rules",
        )
    if rule.target is None and (rule.transpose or rule.reshape or rule.ops or steps):
        bad("a skip rule (target None) takes no transforms")
    if rule.ops is not None:
        if rule.transpose is not None or rule.reshape is not None:
            bad(
                "a rule takes ops or transpose/reshape, not both",
                hint="write Transpose(...) and Reshape(...) into ops",
            )
        if isinstance(rule.ops, tuple):
            for j, op in enumerate(rule.ops):
                check_op(op, f"{where}.ops[{j}]", problems)
        else:
            bad(f"ops {rule.ops!r} is not a list of operations")
    if rule.also:
        if rule.target is None:
            bad("an also rule needs a target (it fills another leaf)")
        if join is not None:
            bad(
                f"an also rule cannot {verb}",
                hint="an also rule copies one stored tensor into one more leaf",
            )
    elif rule.untied is not None:
        bad(
            f"untied {rule.untied!r} needs also=True",
            hint="untied names the stored tensor an untied export writes an also leaf as",
        )
    if rule.untied is not None:
        for f in sorted(set(_FIELD.findall(rule.untied)) - groups):
            bad(f"untied {rule.untied!r} uses {{{f}}} but the source regex has no such group")
    if rule.cast is not None:
        try:
            np.dtype(rule.cast)
        except TypeError:
            bad(f"cast {rule.cast!r} is not a dtype name")
    return pattern
