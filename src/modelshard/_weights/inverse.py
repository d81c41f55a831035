"""The import mapping run backwards: ``unmap`` and the ``Exporter``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .._base import MappingError, Problem
from .._containers import split
from . import recipe
from .load import MappingLike, as_mapping, target_table
from .mapfile import checkpoint_config
from .multiprocess_writing import SharedPlan, TensorPlan, array_plan, full_leaf
from .resolver import resolve
from .rules import WeightMap
from .safetensors import open_safetensors


def reference_table(
    reference: Any,
) -> tuple[dict[str, tuple[tuple[int, ...], Any]], dict[str, str], dict[str, int]]:
    """``(name -> (shape, dtype), metadata, config.json sizes)`` of a safetensors
    reference, or of a container (its leaves' paths; no metadata, no sizes)."""
    if isinstance(reference, str | os.PathLike):
        with open_safetensors(reference) as ref:
            return ref.table(), dict(ref.metadata), checkpoint_config(ref.path)
    return target_table(reference)[1], {}, {}


class Exporter:
    """A reference's stored tensors computed one at a time (``compute`` in ``order``) from
    target leaves (``load(path)``, each dropped after its last use); one that ``also`` rules
    copied is written from its first rule's leaf (``check_also``, ``untie``)."""

    def __init__(
        self,
        targets: Mapping[str, tuple[tuple[int, ...], Any]],
        load: Callable[[str], np.ndarray],
        table: Mapping[str, tuple[tuple[int, ...], Any]],
        wm: WeightMap,
        dtype: Any,
        *,
        untie: bool = False,
    ):
        res = resolve(wm, table, targets, dtype=dtype, export=True)
        self.load = load
        self.sources = recipe.invert({p: n for p, n in res.recipes.items() if p not in res.also})
        # (stored name, also leaf paths, rule index, the stored tensor from those leaves)
        self.also: list[tuple[str, list[str], int, recipe.Node]] = []
        table = dict(table)
        problems: list[Problem] = []
        by_rule: dict[int, list[str]] = {}
        for path, i in res.also.items():
            by_rule.setdefault(i, []).append(path)
        for i, paths in by_rule.items():
            for name, node in recipe.invert({p: res.recipes[p] for p in paths}).items():
                leaves = [p for p in paths if name in res.recipes[p].reads()]
                if name not in self.sources:  # its first rule skips it: written from here
                    self.sources[name] = node
                elif not untie:
                    self.also.append((name, leaves, i, node))
                elif (untied := wm.format_untied(i, name)) is None:
                    what = (
                        "untie=True, but this also rule names no untied tensor to write "
                        f"{', '.join(leaves)} as"
                    )
                    hint = 'give the rule untied="..." (lm_head.weight)'
                    problems.append(Problem("mapping", f"rules[{i}]", what, hint=hint))
                elif untied in table:
                    what = (
                        f"untie=True writes {', '.join(leaves)} as {untied} (rules[{i}]), but "
                        "the reference already has it"
                    )
                    problems.append(Problem("source", untied, what))
                else:
                    table[untied] = (tuple(node.shape), node.dtype)
                    self.sources[untied] = node
        if problems:
            raise MappingError(problems)
        self.table = table
        self.order = [n for n in table if n in self.sources]
        self._pos = {n: i for i, n in enumerate(self.order)}
        self._last = {k: i for i, n in enumerate(self.order) for k in self.sources[n].reads()}
        self._cache: dict[str, np.ndarray] = {}
        self._fetch = _loading(load, self._cache)
        self.keep_cache = True
        self.values: dict[str, Any] = {}

    @classmethod
    def of_state(
        cls,
        state: Any,
        table: Mapping[str, tuple[tuple[int, ...], Any]],
        wm: WeightMap,
        dtype: Any,
        *,
        untie: bool = False,
    ) -> Exporter:
        """An exporter reading ``state``'s leaves (one held here in part is all-gathered)."""
        flat, targets = target_table(state)
        values = dict(zip(flat.paths, flat.arrays, strict=True))
        ex = cls(targets, lambda p: full_leaf(values[p], p), table, wm, dtype, untie=untie)
        ex.values = values
        if jax.process_count() > 1:
            # A leaf stays cached only within one tensor: which tensors a process computes
            # differs between processes, and a cached leaf must not skip a collective.
            ex.keep_cache = False
        return ex

    def shared_plan(self) -> SharedPlan:
        """A tensor is computed where a process holds its leaves whole, else everywhere in step."""

        def plans() -> dict[str, TensorPlan]:
            leaf = {k: array_plan(x).holders for k, x in self.values.items()}
            out: dict[str, TensorPlan] = {}
            for name in self.order:
                holders: frozenset[int] | None = frozenset(range(jax.process_count()))
                for k in self.sources[name].reads():
                    h = leaf[k]
                    holders = None if h is None or holders is None else holders & h
                out[name] = TensorPlan(holders or None)
            return out

        return SharedPlan(plans)

    def items(self) -> list[tuple[str, tuple[int, ...], Any]]:
        """``(name, shape, dtype)`` of each stored tensor, in writing order."""
        return [(n, *self.table[n]) for n in self.order]

    def compute(self, name: str) -> np.ndarray:
        value = self.sources[name].read(None, self._fetch)
        i = self._pos[name]
        for k in self.sources[name].reads():
            if self._last[k] <= i or not self.keep_cache:
                self._cache.pop(k, None)
        return value

    def check_also(self) -> None:
        """``MappingError``: every ``also`` leaf no longer equal, bit for bit, to its tensor."""
        problems: list[Problem] = []
        for name, leaves, i, node in self.also:
            fetch = _loading(self.load, {})
            want = recipe.contiguous(self.sources[name].read(None, fetch))
            got = recipe.contiguous(node.read(None, fetch))
            a, b = (x.reshape(-1).view(np.uint8).reshape(x.size, x.itemsize) for x in (want, got))
            differ = int(np.count_nonzero((a != b).any(axis=1)))
            if differ:
                problems.append(
                    Problem(
                        "target",
                        ", ".join(leaves),
                        f"filled from {name} by rules[{i}] (also=True), but no longer "
                        f"equals it: {differ} of {want.size} elements of {name} differ; "
                        f"the export writes {name} once, from its first rule's leaf",
                        hint="tie the two in training, or export untied "
                        "(untie=True and the rule's untied= name)",
                        cause="an also leaf no longer equals its stored tensor",
                    )
                )
        if problems:
            raise MappingError(problems)


def unmap(
    state: Any,
    *,
    reference: Any,
    mapping: MappingLike = None,
    dtype: Any = None,
    untie: bool = False,
) -> Any:
    r"""``state`` in the layout of ``reference``: the mapping that imports ``reference`` into
    ``state``, run backwards, on this host.

    Args:
        state: the container in the target layout (an NNX model).
        reference: the source layout: a container (concrete or abstract, e.g. a linen
            model's ``jax.eval_shape(init)``; the result has its type) or a safetensors
            file (the result is a dict of stored name -> array).
        mapping: the import mapping (a [`WeightMap`][modelshard.WeightMap] or a TOML path).
        dtype: the ``dtype`` the import was given.
        untie: as for [`save_safetensors`][modelshard.save_safetensors] (a safetensors
            reference: the untied tensor is one more entry of the result).

    Returns:
        The reference's container with NumPy leaves computed from ``state``; write it with
        [`save`][modelshard.save] to get a checkpoint the other code base restores. Leaves a
        rule skips keep the reference's (concrete) values.

    Raises:
        MappingError: the mapping does not fit ``reference`` and ``state``; an ``also``
            leaf no longer equals the stored tensor it was loaded from (without ``untie``).

    Example:
        >>> import jax, numpy as np, modelshard as ms
        >>> wm = ms.WeightMap([ms.MapRule(r"params/layers/(\w+)", "layers/{i}/{1}",
        ...                               unstack=ms.Unstack("i"))])
        >>> scanned = {"params": {"layers": {"w": jax.ShapeDtypeStruct((2, 3), np.float32)}}}
        >>> state = {"layers": {"0": {"w": np.zeros(3, np.float32)}, "1": {"w": np.ones(3, np.float32)}}}
        >>> ms.unmap(state, reference=scanned, mapping=wm)["params"]["layers"]["w"].tolist()
        [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    wm = as_mapping(mapping, split_dots=isinstance(reference, str | os.PathLike))
    table, _, sizes = reference_table(reference)
    ex = Exporter.of_state(state, table, wm.with_config(sizes), dtype, untie=untie)
    ex.check_also()
    if isinstance(reference, str | os.PathLike):
        return {n: ex.compute(n) for n in ex.order}
    flat = split(reference)
    problems = [
        Problem(
            "source",
            n,
            "untie=True writes this tensor, but the reference container has no such leaf",
            hint="untie a safetensors reference, or give the container the leaf",
        )
        for n in ex.order
        if n not in table  # table: the container's paths
    ]
    problems += [
        Problem(
            "source",
            p,
            "a rule skips this leaf, and the reference holds no value for it",
            hint="pass a concrete reference, or map the leaf",
        )
        for p, x in zip(flat.paths, flat.arrays, strict=True)
        if p not in ex.sources and isinstance(x, jax.ShapeDtypeStruct)
    ]
    if problems:
        raise MappingError(problems)
    pairs = zip(flat.paths, flat.arrays, strict=True)
    return flat.rebuild([ex.compute(p) if p in ex.sources else x for p, x in pairs])


def _loading(load: Callable[[str], np.ndarray], cache: dict[str, np.ndarray]) -> recipe.Fetch:
    """A recipe ``fetch`` loading each target leaf once into ``cache``."""

    def fetch(key: str, index: tuple[slice, ...]) -> np.ndarray:
        if key not in cache:
            cache[key] = load(key)
        return cache[key][index]

    return fetch
