"""``save_safetensors`` and ``write_export``, the writer every export shares."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._base import CheckpointError, MappingError, Problem, Progress
from .._base import split as split_path
from .._containers import split
from .._runtime import raise_shared
from .inverse import Exporter, reference_table
from .load import MappingLike, as_mapping, target_table
from .model_dir import finish_model_directory, is_model_directory, shard_size_for
from .multiprocess_writing import SharedPlan, array_plan, host_rows, local_block, write_layout
from .safetensors import dtype_code
from .writing import Entry, plan_layout, sharded_layout, sharded_names


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

    Without ``reference`` each leaf is written under its path with ``.`` for ``/``
    (``layers.0.up.kernel``), as it is: what ``load_safetensors`` reads back bit for bit.
    In a multi-process run every process calls it with the same state and path, on a file
    system every process sees: they write one export together (the files one process
    writes, byte for byte), each leaf by processes holding it, and a failure on one
    process is raised on all.

    Args:
        path: the ``.safetensors`` file (missing parent directories are created); with
            ``max_shard_size``, a directory, a ``name.safetensors`` or a
            ``name.safetensors.index.json``. Any other path is a model directory, what
            ``from_pretrained`` loads: the weights (sharded above ``"5GB"`` by default)
            and, from ``reference``'s directory, ``config.json`` with its dtype set to the
            one written, the generation config and the tokenizer's files.
        state: the container (a fine-tuned model); sharded leaves are gathered to the host
            one at a time.
        reference: the checkpoint the mapping imports (a file, index, directory or
            ``hf://org/name[@revision]``, whose headers give the names, shapes and dtypes),
            or a container of those (``{"fc.weight": jax.ShapeDtypeStruct(...)}``).
        mapping: the mapping that imports ``reference`` into ``state``.
        dtype: without ``reference``: floating-point leaves are written in it; with it: the
            ``dtype`` the import was given (the export casts back to the reference's).
        metadata: ``__metadata__`` strings (default: the reference's, else
            ``{"format": "pt"}``, which ``transformers`` expects).
        max_shard_size: Hugging Face's sharded layout, as ``save_pretrained`` writes it:
            ``model-0000k-of-0000n.safetensors`` files of at most this many bytes (an int,
            ``"5GB"``, ``"500MB"``, ``"2GiB"``; a larger tensor alone) and
            ``model.safetensors.index.json``, or ``model.safetensors`` alone when all fits
            (a file or index ``path`` names the stem). An earlier layout's shards are
            removed once the new one is complete.
        progress: ``True``: a bar in bytes on stderr when it is a terminal and the export
            is 256 MiB or more; ``False``: none; a callable: called as
            ``progress(bytes_done, bytes_total)`` after each tensor.
        untie: leaves an ``also`` rule filled (a head tied to the embedding) are written
            under their rule's ``untied`` name instead of checked against that tensor.
        overwrite: replace the export at ``path``, which is refused without it. Either way
            the old files stay whole until the new ones are complete.

    Returns:
        The file, or the index of a sharded export.

    Raises:
        MappingError: the mapping does not fit the reference and the state; without a
            reference, leaves that cannot be written in their own names (a ``.`` in a
            path component, a dtype with no safetensors code); a leaf that is not an
            array in a dict, list or tuple; an ``also`` leaf that no longer equals its
            stored tensor (without ``untie``; nothing is written). Every one is listed.
        CheckpointError: ``state`` holds no array; an export at ``path`` without
            ``overwrite``; an index name without ``max_shard_size``; a parent of ``path``
            is a file; a malformed ``max_shard_size``; several processes: one does not see
            the files process 0 created, or one failed (the same error on each).
        DistributedError: several processes would write different exports.

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
            problem = Problem(
                "mapping",
                "",
                "a mapping exports to a reference's names, shapes and dtypes, and "
                "no reference= was given",
                hint="pass reference= (the checkpoint the mapping imports), or drop "
                "mapping= to write the state in its own names",
            )
            raise MappingError([problem])
        items, compute, shared = canonical_export(state, dtype)
        meta: Mapping[str, str] = {"format": "pt"}
    else:
        wm = as_mapping(mapping, split_dots=True)
        table, meta, sizes = reference_table(reference)
        ex = Exporter.of_state(state, table, wm.with_config(sizes), dtype, untie=untie)
        error: BaseException | None = None
        try:
            ex.check_also()  # a refused export writes nothing
        except MappingError as e:
            error = e
        raise_shared(error, "modelshard:export:also", "save_safetensors: checking tied leaves")
        items, compute, shared = ex.items(), ex.compute, ex.shared_plan()
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
        failure: Exception | None = None
        try:  # process 0 writes the files; the others return once it did, or raise its error
            finish_model_directory(out, reference, items)
        except Exception as e:
            failure = e
        raise_shared(failure, "modelshard:export:model-files", f"writing the files beside {out}")
    return out


def check_state(state: Any) -> None:
    """Refuse a state with no array (``CheckpointError``) or a non-array leaf in a dict, list
    or tuple (``MappingError``); a registered container's other fields pass (not weights)."""
    flat = split(state)
    if flat.adapter.follows_pytree and len(flat.array_index) < len(flat.leaves):
        from jax.tree_util import DictKey, SequenceKey

        with_path = jax.tree_util.tree_flatten_with_path(state)[0]
        paths = [info.path for info in flat.adapter.describe(flat.obj)]
        arrays = set(flat.array_index)
        problems = [
            Problem(
                "state",
                paths[i],
                f"a {type(x).__module__}.{type(x).__qualname__}, not an array: safetensors "
                "holds arrays only",
                hint="make it an array (np.asarray(x)), or leave it out of the exported state",
                cause="a leaf that is not an array",
            )
            for i, (keys, x) in enumerate(with_path)
            if len(with_path) == len(flat.leaves)  # else nested containers: theirs to decide
            and i not in arrays
            and (not keys or isinstance(keys[-1], DictKey | SequenceKey))
        ]
        if problems:
            raise MappingError(problems)
    if not flat.arrays:
        raise CheckpointError(
            f"nothing to export: the {type(state).__name__} has no array leaves "
            "(save_safetensors writes arrays only)"
        )


def canonical_export(
    state: Any, dtype: Any = None
) -> tuple[list[Entry], Callable[[str], Any], SharedPlan]:
    """Every leaf under its path with ``.`` for ``/`` (floating ones cast to ``dtype``):
    entries, ``compute(name)`` and the shared plan; ``MappingError``: names, dtypes unwritable."""
    flat, targets = target_table(state)
    cast = None if dtype is None else np.dtype(dtype)
    items: list[Entry] = []
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for (path, (shape, dt)), x in zip(targets.items(), flat.arrays, strict=True):
        dotted = [c for c in split_path(path) if "." in c]
        if dotted:
            what = f"path component {dotted[0]!r} holds a '.', which loading reads as '/'"
            hint = "rename it, or export with reference= and mapping="
            problems.append(Problem("state", path, what, hint=hint))
            continue
        try:
            floating = np.issubdtype(np.dtype(dt), np.floating)
            out = cast if cast is not None and floating else np.dtype(dt)
            dtype_code(out)
        except (TypeError, CheckpointError):
            what = f"dtype {dt} has no safetensors code"
            hint = "export the parameters only (nnx.state(model, nnx.Param))"
            problems.append(
                Problem("state", path, what, hint=f"{hint}, or convert this leaf first")
            )
            continue
        name = path.replace("/", ".")
        items.append((name, tuple(shape), out))
        values[name] = x
    if problems:
        raise MappingError(problems)

    want = {name: dt for name, _, dt in items}

    def compute(name: str) -> list[np.ndarray]:
        return [a.astype(want[name], copy=False) for a in host_rows(values[name], name)]

    shared = SharedPlan(
        lambda: {name: array_plan(values[name]) for name, _, _ in items},
        lambda name, block: local_block(values[name], block),
    )
    return items, compute, shared


def check_destination(
    path: str | os.PathLike[str],
    max_shard_size: int | str | None,
    *,
    overwrite: bool,
    flag: str = "overwrite=True",
) -> None:
    """``CheckpointError`` where an export is already there (the file; sharded: the index,
    the lone file or shards of the stem) and not ``overwrite`` (``flag`` names it)."""
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
    """Write ``items``, each computed when written, as one file or HF's shards, refusing an
    existing export without ``overwrite``; with ``shared``, every process calls and writes."""
    refuse = functools.partial(
        check_destination, path, max_shard_size, overwrite=overwrite, flag=flag
    )
    layout = plan_layout(path, items, max_shard_size)
    return write_layout(layout, compute, metadata, shared=shared, progress=progress, refuse=refuse)


def write_safetensors(
    path: str | os.PathLike[str],
    entries: Iterable[Entry],
    compute: Callable[[str], Any],
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """``write_export`` from this process alone, replacing what is there, with no bar."""
    layout = plan_layout(path, list(entries), max_shard_size)
    return write_layout(layout, compute, metadata)
