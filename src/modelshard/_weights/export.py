"""``save_safetensors`` and ``unmap``: pretrained weights out, through the import mapping
run backwards.

Export runs the same resolution as an import (``.resolution.resolve``) against a reference
checkpoint's header (the names, shapes and dtypes to write), inverts every recipe and
writes one stored tensor at a time; without a reference every leaf is written under its
own path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._base import CheckpointError, DistributedError, MappingError, Problem, Progress, reporter
from .._base import split as split_path
from .._containers import split
from .._runtime import barrier, gather, require_addressable
from . import recipe
from .load import MappingLike, as_mapping, target_table
from .mapfile import checkpoint_config
from .model_dir import finish_model_directory, is_model_directory, shard_size_for
from .resolution import Resolution, resolve
from .rules import WeightMap
from .safetensors import (
    Entry,
    Layout,
    dtype_code,
    open_safetensors,
    plan_layout,
    sharded_layout,
    sharded_names,
    write_layout,
)
from .shared import (
    Block,
    TensorPlan,
    array_plan,
    bytes_of,
    local_block,
    whole_here,
    write_shared,
)


def save_safetensors(
    path: str | os.PathLike[str],
    state: Any,
    *,
    reference: Any = None,
    mapping: MappingLike = None,
    dtype: Any = None,
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str | None = None,
    progress: Progress = True,
    untie: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write ``state`` as safetensors: in its own names, or in a checkpoint's names, shapes
    and dtypes (the import mapping run backwards).

    Without ``reference``, every leaf is written under its canonical path with ``.`` for
    ``/`` (``layers/0/up/kernel`` -> ``layers.0.up.kernel``), as it is: what
    ``load_safetensors`` with the default mapping reads back as the same tree, bit for
    bit. With ``reference``, the tensors ``mapping`` imports from it, computed from
    ``state``, one at a time.

    In a multi-process run every process calls it, with the same state and path, as every
    other save is called: the processes write one export together, the same files a
    one-process export of the same state writes, byte for byte. Each leaf is written by
    the processes holding it: a replicated leaf by one of them, a leaf split across
    processes block by block by its owners, a process-local leaf (NumPy) from process 0's
    value, as [`save`][modelshard.save] keeps it. The path must be on a file system
    every process sees; every process returns once the export is complete, and a failure
    on one process is raised on all.

    Args:
        path: the ``.safetensors`` file to write (missing parent directories are created,
            as ``save_pretrained`` creates its directory). With
            ``max_shard_size``: a directory, a ``name.safetensors`` or a
            ``name.safetensors.index.json`` (see ``max_shard_size``). A path that names
            neither a ``.safetensors`` file nor an index is a model directory, what
            ``from_pretrained`` loads: the weights (sharded above ``max_shard_size``,
            default ``"5GB"``) and, from ``reference``'s directory, ``config.json`` with
            its dtype set to the one written, the generation config and the tokenizer's
            files copied unchanged. The way to publish a fine-tune.
        state: the container (a fine-tuned model); its leaves may be sharded (each is
            gathered to the host on its own, when written).
        reference: the checkpoint the mapping was written for (a file, index, directory
            or ``hf://org/name[@revision]`` whose headers give the names, shapes and dtypes
            to write), or a container of those (``{"fc.weight": jax.ShapeDtypeStruct(...)}``).
            Default: none, ``state`` in its own names.
        mapping: the same mapping that imports ``reference`` into ``state`` (needs
            ``reference``).
        dtype: without ``reference``: write floating-point leaves in this dtype
            (``"bfloat16"``); with it: the ``dtype`` the import was given (the export
            casts back to the reference's dtypes).
        metadata: ``__metadata__`` strings for the header (default: the reference's;
            without one ``{"format": "pt"}``, which ``transformers`` expects).
        max_shard_size: write Hugging Face's sharded layout, as ``save_pretrained`` does:
            files ``model-00001-of-0000n.safetensors`` of at most this many bytes each (an
            int, or ``"5GB"``, ``"500MB"``, ``"2GiB"``; a larger tensor gets a file of its
            own) and ``model.safetensors.index.json`` (``metadata.total_size``,
            ``weight_map``), in the directory ``path`` (or beside ``path`` when it names
            a ``.safetensors`` file or an index, whose stem replaces ``model``). When
            everything fits one file it is ``model.safetensors`` alone. Shards of an
            earlier layout under the same names are removed once the new one is
            complete.
        progress: ``True``: a progress bar in bytes on stderr when stderr is a terminal
            and the export is 256 MiB or more; ``False``: none; a callable: called as
            ``progress(bytes_done, bytes_total)`` after each tensor instead.
        untie: with ``reference``: leaves an ``also`` rule filled from a stored tensor (a
            head tied to the embedding) are written under their rule's ``untied`` name
            (``lm_head.weight``) instead of being checked against that tensor.
        overwrite: replace what is at ``path`` (the file; with ``max_shard_size`` the
            index, a lone ``{stem}.safetensors`` or shards of the same stem). Without it an
            existing export is refused, as [`save`][modelshard.save] refuses an existing
            checkpoint. Either way the old files stay whole until the new ones are complete
            (each written to a temporary of its own, synced, then renamed).

    Returns:
        The path written: the file, or the index of a sharded checkpoint. Importing it
        again gives ``state`` back bit for bit (casts that lose precision aside).

    Raises:
        MappingError: the mapping does not fit the reference and the state (the same
            checks as an import); without a reference, leaves that cannot be written in
            their own names (a ``.`` inside a path component, a dtype safetensors has no
            code for, such as a PRNG key), every one listed; an ``also`` leaf that no
            longer equals the stored tensor it was loaded from (without ``untie``; nothing
            is written).
            A leaf that is not an array (``{"w": object()}``) in a dict, list or tuple,
            every one listed (what a registered container holds besides arrays, an
            Equinox module's functions, is not a weight and is left out).
        CheckpointError: ``state`` holds no array; ``path`` exists and not
            ``overwrite``; ``path`` ends ``.index.json`` without ``max_shard_size``; a
            parent of ``path`` is a file; a malformed ``max_shard_size``; several
            processes: one does not see the files process 0 created (not a shared
            directory).
        DistributedError: several processes: they would write different exports, or one
            of them failed (raised on every process).

    Example:
        >>> import tempfile, jax, numpy as np, jax.numpy as jnp, modelshard as ms
        >>> table = {"fc.weight": jax.ShapeDtypeStruct((4, 8), np.float32)}  # [out, in]
        >>> wm = ms.WeightMap([ms.MapRule(r"(\\w+)\\.weight", "{1}/kernel", transpose=(1, 0))])
        >>> state = {"fc": {"kernel": jnp.ones((8, 4))}}
        >>> p = ms.save_safetensors(tempfile.mkdtemp() + "/out.safetensors", state,
        ...                         reference=table, mapping=wm)
        >>> ms.load_safetensors(p, like=state, mapping=wm)["fc"]["kernel"].shape
        (8, 4)

        Without a reference, sharded:

        >>> state = {"layers": [{"w": jnp.zeros((64, 64))}, {"w": jnp.ones((64, 64))}]}
        >>> p = ms.save_safetensors(tempfile.mkdtemp(), state, max_shard_size="20KB")
        >>> p.name, sorted(f.name for f in p.parent.glob("*.safetensors"))
        ('model.safetensors.index.json', ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
        >>> ms.load_safetensors(p)["layers"]["1"]["w"].sum()
        Array(4096., dtype=float32)
    """
    check_state(state)
    if reference is None:
        if mapping is not None:
            raise MappingError(
                [
                    Problem(
                        "mapping",
                        "",
                        "a mapping exports to a reference's names, shapes and dtypes, and "
                        "no reference= was given",
                        hint="pass reference= (the checkpoint the mapping imports), or drop "
                        "mapping= to write the state in its own names",
                    )
                ]
            )
        items, compute, shared = canonical_export(state, dtype)
        meta: Mapping[str, str] = {"format": "pt"}
    else:
        wm = as_mapping(mapping, split_dots=True)
        table, meta, sizes = reference_table(reference)
        wm = wm.with_config(sizes)
        ex = Exporter.of_state(state, table, wm, dtype, untie=untie)
        error: BaseException | None = None
        try:
            ex.check_also()  # a refused export writes nothing
        except MappingError as e:
            error = e
        if jax.process_count() > 1:  # refused on every process, or on none
            outcomes = gather(None if error is None else str(error), "modelshard:export:also")
            if error is None and any(outcomes):
                p = next(p for p, o in enumerate(outcomes) if o)
                raise DistributedError(f"save_safetensors: process {p} refused: {outcomes[p]}")
        if error is not None:
            raise error
        items = [(n, ex.table[n][0], ex.table[n][1]) for n in ex.order]
        compute = ex.compute
        shared = ex.shared_plan()
    out = write_export(
        path,
        items,
        compute,
        metadata if metadata is not None else meta,
        max_shard_size=shard_size_for(path, max_shard_size),
        progress=progress,
        overwrite=overwrite,
        shared=shared,
    )
    if is_model_directory(path):
        finish_model_directory(out, reference, items)
        if jax.process_count() > 1:  # every process returns once the directory is complete
            barrier("modelshard:export:model-files")
    return out


def check_state(state: Any) -> None:
    """Refuse a state an export would write nothing of, or only part of.

    Raises:
        CheckpointError: no array leaf at all.
        MappingError: every leaf that is not an array in a dict, list or tuple (the
            user's data; what a registered container holds besides arrays, an Equinox
            module's functions, a dataclass's settings, is not a weight and passes).
    """
    flat = split(state)
    problems = [
        Problem(
            "state",
            path,
            f"a {type(x).__module__}.{type(x).__qualname__}, not an array: safetensors "
            "holds arrays only",
            hint="make it an array (np.asarray(x)), or leave it out of the exported state",
            cause="a leaf that is not an array",
        )
        for path, x in non_arrays(state, flat)
    ]
    if problems:
        raise MappingError(problems)
    if not flat.arrays:
        raise CheckpointError(
            f"nothing to export: the {type(state).__name__} has no array leaves "
            "(save_safetensors writes arrays only)"
        )


def non_arrays(state: Any, flat: Any) -> list[tuple[str, Any]]:
    """The leaves of ``state`` that are not arrays and sit in a dict, list or tuple
    (a pytree's plain nodes), with their paths."""
    if not flat.adapter.follows_pytree or len(flat.array_index) == len(flat.leaves):
        return []
    from jax.tree_util import DictKey, SequenceKey

    with_path = jax.tree_util.tree_flatten_with_path(state)[0]
    if len(with_path) != len(flat.leaves):  # nested containers: their adapters decide
        return []
    paths = [info.path for info in flat.adapter.describe(flat.obj)]
    arrays = set(flat.array_index)
    return [
        (paths[i], x)
        for i, (keys, x) in enumerate(with_path)
        if i not in arrays and (not keys or isinstance(keys[-1], DictKey | SequenceKey))
    ]


def canonical_export(
    state: Any, dtype: Any = None
) -> tuple[list[Entry], Callable[[str], Any], SharedPlan]:
    """Every leaf of ``state`` as a stored tensor named by its canonical path with ``.``
    for ``/`` (floating leaves cast to ``dtype``), ``compute(name)``: that leaf on the
    host, gathered from its devices when asked (one leaf at a time), and how several
    processes share the writing (a leaf no process holds whole: block by block).

    Raises:
        MappingError: every leaf whose name would not read back (a ``.`` in a path
            component) or whose dtype safetensors cannot store.
    """
    flat, targets = target_table(state)
    cast = None if dtype is None else np.dtype(dtype)
    items: list[Entry] = []
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for (path, (shape, dt)), x in zip(targets.items(), flat.arrays, strict=True):
        dotted = [c for c in split_path(path) if "." in c]
        if dotted:
            problems.append(
                Problem(
                    "state",
                    path,
                    f"path component {dotted[0]!r} holds a '.', which loading reads as '/'",
                    hint="rename it, or export with reference= and mapping=",
                )
            )
            continue
        try:
            floating = np.issubdtype(np.dtype(dt), np.floating)
            out = cast if cast is not None and floating else np.dtype(dt)
            dtype_code(out)
        except (TypeError, CheckpointError):
            problems.append(
                Problem(
                    "state",
                    path,
                    f"dtype {dt} has no safetensors code",
                    hint="export the parameters only (nnx.state(model, nnx.Param)), or "
                    "convert this leaf first",
                )
            )
            continue
        name = path.replace("/", ".")
        items.append((name, tuple(shape), out))
        values[name] = x
    if problems:
        raise MappingError(problems)

    want = {name: dt for name, _, dt in items}

    def compute(name: str) -> list[np.ndarray]:
        return [
            a if a.dtype == want[name] else a.astype(want[name])
            for a in host_rows(values[name], name)
        ]

    def read_block(name: str, block: Block) -> np.ndarray:
        return local_block(values[name], block)

    def plans() -> dict[str, TensorPlan]:
        return {name: array_plan(values[name]) for name, _, _ in items}

    return items, compute, SharedPlan(plans, read_block)


@dataclasses.dataclass(frozen=True)
class SharedPlan:
    """How the processes of a run share an export's writing (``shared.write_shared``).

    Attributes:
        plans: ``plans()``: per stored tensor, who can write it (asked only when there
            are several processes).
        read_block: ``read_block(name, block)``: this process's copy of one block of a
            stored tensor that no process holds whole (not cast yet).
    """

    plans: Callable[[], dict[str, TensorPlan]]
    read_block: Callable[[str, Block], np.ndarray]


def check_destination(
    path: str | os.PathLike[str],
    max_shard_size: int | str | None,
    *,
    overwrite: bool,
    flag: str = "overwrite=True",
) -> None:
    """Refuse to replace an existing export without consent (``flag`` names it: the
    argument, or the CLI's option): the file, or with ``max_shard_size`` the index, the
    lone file or shards of the same stem.

    Raises:
        CheckpointError: something is there and not ``overwrite``.
    """
    if overwrite:
        return
    dest = Path(path)
    if max_shard_size is None:
        # a directory is refused by the writer itself (not a file it could replace)
        there = [dest] if dest.is_file() or dest.is_symlink() else []
    else:
        there = sharded_layout(*sharded_names(dest))
    if there:
        what = str(there[0]) if there[0] == dest else f"{dest} ({there[0].name})"
        raise CheckpointError(f"{what} already exists; pass {flag} to replace it")


def host_rows(x: Any, name: str = "") -> list[np.ndarray]:
    """One leaf on the host as blocks of whole rows, in order: a leaf sharded along its
    first axis only is its shards' own buffers, written one after the other without
    assembling the leaf; any other leaf is ``[host_leaf(x)]``."""
    if isinstance(x, jax.Array) and x.ndim > 0 and whole_here(x):
        blocks: dict[tuple[int, int], Any] = {}
        for shard in x.addressable_shards:
            idx = [s.indices(d)[:2] for s, d in zip(shard.index, x.shape, strict=True)]
            if any(lo != 0 or hi != d for (lo, hi), d in zip(idx[1:], x.shape[1:], strict=True)):
                break
            blocks.setdefault(idx[0], shard.data)
        else:
            spans = sorted(blocks)
            if (
                spans
                and spans[0][0] == 0
                and spans[-1][1] == x.shape[0]
                and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            ):
                return [np.asarray(blocks[s]) for s in spans]
    return [host_leaf(x, name)]


def host_leaf(x: Any, name: str = "") -> np.ndarray:
    """One leaf as a fresh NumPy array, assembled from this process's shards (each
    distinct block copied once), so that nothing stays attached to the ``jax.Array``:
    ``np.asarray(x)`` / ``jax.device_get(x)`` cache the host copy on the array, which
    keeps every leaf written so far alive, and an export would peak at twice the state.

    Raises:
        DistributedError: this process holds only part of the array (it is split across
            processes).
    """
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if not whole_here(x):
        require_addressable(x, name or "a leaf")
    out = np.empty(x.shape, x.dtype)
    done: set[tuple[tuple[int, int], ...]] = set()
    for shard in x.addressable_shards:
        key = tuple(s.indices(d)[:2] for s, d in zip(shard.index, x.shape, strict=True))
        if key not in done:
            done.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


def _full_leaf(x: Any, name: str) -> np.ndarray:
    """``host_leaf``, or where this process holds only part of ``x`` its all-gathered
    value (a collective: every process must ask for the same leaves in the same order)."""
    if whole_here(x):
        return host_leaf(x, name)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def write_export(
    path: str | os.PathLike[str],
    items: list[Entry],
    compute: Callable[[str], Any],
    metadata: Mapping[str, str] | None,
    *,
    max_shard_size: int | str | None = None,
    progress: Progress = True,
    overwrite: bool = False,
    flag: str = "overwrite=True",
    shared: SharedPlan | None = None,
) -> Path:
    """Write ``items`` (name, shape, dtype), each computed when written: one file, or
    Hugging Face's sharded layout with ``max_shard_size``; progress in bytes (this
    process's). An existing export is replaced only with ``overwrite`` (``flag`` names
    it in the refusal). With several processes and ``shared``, every process writes its
    part (``shared.write_shared``); every process must call it."""
    layout = plan_layout(path, items, max_shard_size)

    def refuse(layout: Layout) -> None:
        check_destination(path, max_shard_size, overwrite=overwrite, flag=flag)

    several = jax.process_count() > 1 and shared is not None
    plans = shared.plans() if several and shared is not None else {}
    if several:  # this process's bytes
        total = bytes_of(jax.process_index(), layout, plans, jax.process_count())
    else:
        total = sum(math.prod(shape) * np.dtype(dt).itemsize for _, shape, dt in items)
    with reporter(progress, total, "Writing safetensors") as report:
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            if report is not None:
                report(done[0], total)

        if several and shared is not None:
            return write_shared(layout, plans, compute, shared.read_block, metadata, refuse, step)
        refuse(layout)
        return write_layout(layout, compute, metadata, step)


def reference_table(
    reference: Any,
) -> tuple[dict[str, tuple[tuple[int, ...], Any]], dict[str, str], dict[str, int]]:
    """``(name -> (shape, dtype), metadata, config sizes)`` of an export's reference: a
    safetensors file/index/directory (its headers, and the ``config.json`` beside it), or
    any container (its leaves' paths; no metadata, no sizes)."""
    if isinstance(reference, str | os.PathLike):
        with open_safetensors(reference) as ref:
            return ref.table(), dict(ref.metadata), checkpoint_config(ref.path)
    return target_table(reference)[1], {}, {}


class Exporter:
    """The stored tensors of a reference computed from target leaves by the inverted
    mapping, one at a time (``compute`` in ``order``); each target leaf is loaded to the
    host once (``load(path)``) and dropped when no later tensor reads it.

    A stored tensor that an ``also`` rule copied into more leaves is written once, from
    its first rule's leaf; ``check_also`` (run by every export before anything is
    written) refuses an ``also`` leaf that no longer equals it. With ``untie`` each such
    leaf is written instead under its rule's ``untied`` name.

    Args:
        targets: the target leaves, path -> (shape, dtype).
        load: ``load(path)``: that target leaf as a NumPy array (from a state on the
            devices, or from a checkpoint one leaf at a time).
        table: the reference's stored tensors, name -> (shape, dtype).
        wm: the import mapping.
        dtype: the import's ``dtype``.
        untie: write ``also`` leaves under their rules' ``untied`` names.

    Raises:
        MappingError: the mapping does not fit; ``untie`` with an ``also`` rule that
            names no ``untied`` tensor.
    """

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
        self.sources = invert_resolution(res)
        # (stored name, also leaf paths, rule index, the stored tensor from those leaves)
        self.also: list[tuple[str, list[str], int, recipe.Node]] = []
        table = dict(table)
        problems: list[Problem] = []
        for i, (paths, inverse) in invert_also(res).items():
            for name, node in inverse.items():
                leaves = [p for p in paths if name in res.recipes[p].reads()]
                if name not in self.sources:  # its first rule skips it: written from here
                    self.sources[name] = node
                elif untie:
                    untied = wm.format_untied(i, name)
                    if untied is None:
                        problems.append(
                            Problem(
                                "mapping",
                                f"rules[{i}]",
                                f"untie=True, but this also rule names no untied tensor to "
                                f"write {', '.join(leaves)} as",
                                hint='give the rule untied="..." (lm_head.weight)',
                            )
                        )
                        continue
                    if untied in table:
                        problems.append(
                            Problem(
                                "source",
                                untied,
                                f"untie=True writes {', '.join(leaves)} as {untied} "
                                f"(rules[{i}]), but the reference already has it",
                            )
                        )
                        continue
                    table[untied] = (tuple(node.shape), node.dtype)
                    self.sources[untied] = node
                else:
                    self.also.append((name, leaves, i, node))
        if problems:
            raise MappingError(problems)
        self.table = table
        self.order = [n for n in table if n in self.sources]
        self._pos = {n: i for i, n in enumerate(self.order)}
        last: dict[str, int] = {}
        for i, n in enumerate(self.order):
            for k in self.sources[n].reads():
                last[k] = i
        self._last = last
        self._cache: dict[str, np.ndarray] = {}
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
        """An exporter reading the leaves of ``state`` (fetched from its devices; with
        several processes, a leaf this process holds only part of is all-gathered: a
        collective, so every process computes the same tensors in the same order)."""
        flat, targets = target_table(state)
        values = dict(zip(flat.paths, flat.arrays, strict=True))
        ex = cls(targets, lambda p: _full_leaf(values[p], p), table, wm, dtype, untie=untie)
        ex.values = values
        if jax.process_count() > 1:
            # A leaf stays cached only within one tensor: which tensors a process computes
            # differs between processes, and a cached leaf must not skip a collective.
            ex.keep_cache = False
        return ex

    def shared_plan(self) -> SharedPlan:
        """How several processes share writing this export: a stored tensor whose leaves
        some process holds whole is computed there; any other on every process, in
        step (its leaves all-gathered), and written by one."""

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

        def no_blocks(name: str, block: Block) -> np.ndarray:
            raise AssertionError(f"{name}: a mapped export is never written block by block")

        return SharedPlan(plans, no_blocks)

    def _fetch(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        whole = self._cache.get(key)
        if whole is None:
            whole = self._cache[key] = self.load(key)
        return whole[index]

    def compute(self, name: str) -> np.ndarray:
        value = self.sources[name].read(None, self._fetch)
        i = self._pos[name]
        for k in self.sources[name].reads():
            if self._last[k] <= i or not self.keep_cache:
                self._cache.pop(k, None)
        return value

    def check_also(self) -> None:
        """Refuse ``also`` leaves that no longer equal the tensor they were loaded from
        (each compared, bit for bit, with what its first rule's leaf writes).

        Raises:
            MappingError: every such leaf, named, with how many elements differ.
        """
        problems: list[Problem] = []
        for name, leaves, i, node in self.also:
            cache: dict[str, np.ndarray] = {}

            def fetch(key: str, index: tuple[slice, ...], cache: dict = cache) -> np.ndarray:
                whole = cache.get(key)
                if whole is None:
                    whole = cache[key] = self.load(key)
                return whole[index]

            want = recipe.contiguous(self.sources[name].read(None, fetch))
            got = recipe.contiguous(node.read(None, fetch))
            cache.clear()
            bits = np.dtype(f"u{want.dtype.itemsize}") if want.dtype.itemsize <= 8 else None
            if bits is None:
                same = want.tobytes() == got.tobytes()
                differ = 0 if same else want.size
            else:
                differ = int(np.count_nonzero(want.view(bits) != got.view(bits)))
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
    wm = wm.with_config(sizes)
    ex = Exporter.of_state(state, table, wm, dtype, untie=untie)
    ex.check_also()
    if isinstance(reference, str | os.PathLike):
        return {n: ex.compute(n) for n in ex.order}
    flat = split(reference)
    homeless = [n for n in ex.order if n not in table]  # table: the container's paths
    if homeless:  # untie=True: the untied tensors have no leaf in a container
        raise MappingError(
            [
                Problem(
                    "source",
                    n,
                    "untie=True writes this tensor, but the reference container has no such leaf",
                    hint="untie a safetensors reference, or give the container the leaf",
                )
                for n in homeless
            ]
        )
    out = []
    for path, x in zip(flat.paths, flat.arrays, strict=True):
        if path in ex.sources:
            out.append(ex.compute(path))
        else:
            out.append(_no_value(path) if isinstance(x, jax.ShapeDtypeStruct) else x)
    return flat.rebuild(out)


def _no_value(path: str) -> Any:
    raise MappingError(
        [
            Problem(
                "source",
                path,
                "a rule skips this leaf, and the reference holds no value for it",
                hint="pass a concrete reference, or map the leaf",
            )
        ]
    )


def invert_resolution(res: Resolution) -> dict[str, recipe.Node]:
    """For each stored tensor the resolution reads, the recipe computing it from targets
    (from the first rule's leaf; ``also`` leaves: ``invert_also``)."""
    out: dict[str, recipe.Node] = {}
    pieces: dict[int, dict[str, Any]] = {}
    for path, node in res.recipes.items():
        if path not in res.also:
            recipe.invert(path, node, out, pieces)
    recipe.finish_inverse(out, pieces)
    return out


def invert_also(res: Resolution) -> dict[int, tuple[list[str], dict[str, recipe.Node]]]:
    """Per ``also`` rule: its leaves, and for each stored tensor it reads, the recipe
    computing that tensor from those leaves."""
    by_rule: dict[int, list[str]] = {}
    for path, i in res.also.items():
        by_rule.setdefault(i, []).append(path)
    out: dict[int, tuple[list[str], dict[str, recipe.Node]]] = {}
    for i, paths in by_rule.items():
        inverse: dict[str, recipe.Node] = {}
        pieces: dict[int, dict[str, Any]] = {}
        for path in paths:
            recipe.invert(path, res.recipes[path], inverse, pieces)
        recipe.finish_inverse(inverse, pieces)
        out[i] = (paths, inverse)
    return out
