"""The one writer of a checkpoint's arrays, through ``ocdbt``'s specs: ``save``, a manager
step's ``state`` item, and ``reshard``/``convert`` (``stream.py``) all write with it.

``take`` copies each process's shards off their devices (the first replica of each, so every
shard is written once); a ``BlockWriter`` writes blocks into the process's OCDBT database
(``ocdbt.process_<i>``); ``write_tree`` runs every process's part, then process 0 writes
Orbax's metadata files and merges the databases (``finish_tree``). Orbax is not imported:
the files are Orbax's format, built by ``ocdbt.py``, and plain Orbax reads them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base import CheckpointError, sync_tree
from .._runtime import raise_shared
from .checksum import Checksums
from .chunks import aligned_chunks
from .ocdbt import (
    SHARDING_FILE,
    checkpoint_metadata,
    context,
    merge,
    sharding_file,
    tree_metadata,
    write_array_list,
    write_spec,
)
from .record import Record
from .storage import CHECKPOINT_METADATA, MARKER, TREE_METADATA, orbax_name
from .urls import is_remote, kvstore


@dataclasses.dataclass
class Held:
    """One array of a checkpoint being written, as this process holds it.

    Attributes:
        key: its storage key.
        shape: its global shape.
        dtype: its NumPy dtype (one TensorStore stores: ``codec.encode``'s).
        chunk: the stored chunk shape.
        sharding: its sharding (for Orbax's ``_sharding`` file).
        blocks: ``(box, data)`` of each block this process writes: a host array, or a
            CPU device's array (``take(copy=True)``), read with ``np.asarray``.
    """

    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: Any
    chunk: tuple[int, ...]
    sharding: Any
    blocks: list[tuple[tuple[slice, ...], Any]]


def _box(index: Sequence[slice], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, shape, strict=True))


def take(items: Sequence[tuple[tuple[str, ...], jax.Array]], *, copy: bool) -> list[Held]:
    """This process's blocks of ``items`` (``(key, array)``, none zero-size): the first replica
    of each shard it holds, on the host (every copy started before any is waited for). With
    ``copy`` (the caller may donate the arrays once it returns), an array on CPU devices is
    copied where it is, not waited for; the writer reads those copies on the host."""
    if copy:  # a CPU device's copy runs on the host's threads while the caller goes on
        items = [(k, jnp.copy(x) if _on_cpu(x) else x) for k, x in items]
    shards = [[s for s in x.addressable_shards if s.replica_id == 0] for _, x in items]
    for (_, x), own in zip(items, shards, strict=True):
        if not (copy and _on_cpu(x)):
            for s in own:
                s.data.copy_to_host_async()
    held = []
    for (key, x), own in zip(items, shards, strict=True):
        shape = tuple(int(n) for n in x.shape)
        dtype = np.dtype(x.dtype)
        write_shape = x.sharding.shard_shape(shape)
        if copy and _on_cpu(x):
            blocks = [(_box(s.index, shape), s.data) for s in own]
        else:
            # Off a CPU, the host array is already a copy of its own.
            blocks = [(_box(s.index, shape), np.asarray(s.data)) for s in own]
        chunk = aligned_chunks(shape, write_shape, dtype.itemsize)
        held.append(Held(key, shape, dtype, chunk, x.sharding, blocks))
    return held


def held_sums(
    keys: Sequence[tuple[str, ...]], held: Sequence[Held], name: str
) -> Callable[[], list[str]]:
    """Start the checksums of the leaves stored under ``keys`` from ``held``, this
    process's copy of its blocks on the host: a save sums the bytes it writes, never the
    arrays, which a background save's caller may have donated since. Call the result on
    every process, in the same order, to collect them (a gather under ``name``)."""
    sums = Checksums(dict.fromkeys(keys), f"{name}:checksums", spanning_all=True)
    for h in held:
        for box, data in h.blocks:
            sums.add_block(h.key, h.shape, data, [sl.start for sl in box])
    return lambda: list(sums.collect().values())


def _on_cpu(x: jax.Array) -> bool:
    return next(iter(x.sharding.device_set)).platform == "cpu"


def settle(futures: Sequence[Any]) -> None:
    """Wait for each of ``futures`` (TensorStore's), whatever it ends in."""
    for f in futures:
        with contextlib.suppress(Exception):  # the error on its way out is the one to report
            f.result()


class BlockWriter:
    """Blocks written into this process's OCDBT database under ``directory``: every array of
    ``held`` created at once (OCDBT commits the creations together), then ``write`` a block
    at a time, at most ``window`` writes in flight. On leaving, every write has ended (none
    may land in a staging directory the caller removes next) and, on success, a local
    database is synced once, whole (not at each commit: TensorStore's sync is off)."""

    def __init__(
        self, directory: Any, held: Sequence[Held], *, compress: bool, window: int | None = None
    ) -> None:
        import tensorstore as ts

        process = jax.process_index()
        self.local_dir = (
            None if is_remote(directory) else str(directory / f"ocdbt.process_{process}")
        )
        self._window = window
        tree, ctx = kvstore(directory), context(sync=False)
        self._opening = [
            ts.open(
                write_spec(
                    tree,
                    orbax_name(h.key),
                    shape=h.shape,
                    chunk=h.chunk,
                    dtype=h.dtype,
                    process=process,
                    compress=compress,
                ),
                create=True,
                context=ctx,
            )
            for h in held
        ]
        self._writes: collections.deque[Any] = collections.deque()

    def write(self, i: int, box: tuple[slice, ...], data: Any) -> None:
        """Start writing ``data`` into the box ``box`` of the ``i``-th array."""
        while self._window is not None and len(self._writes) >= self._window:
            self._writes.popleft().result()
        self._writes.append(self._opening[i].result()[box].write(np.asarray(data)))

    def drain(self) -> None:
        """Wait for every write started."""
        while self._writes:
            self._writes.popleft().result()

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        try:
            if kind is None:
                self.drain()
        finally:
            settle([*self._opening, *self._writes])
        if kind is None and self.local_dir is not None and self._opening:
            sync_tree(self.local_dir)


def write_tree(
    directory: Any, arrays: Sequence[Held], write_mine: Callable[[], None], *, name: str
) -> None:
    """Every process ``write_mine``s its blocks of ``arrays`` into ``directory``, then process
    0 finishes Orbax's PyTree checkpoint marked as modelshard's (``finish_tree``); the record
    is left to the caller. A part failing on any process raises one error on every process
    (exchange ``{name}:arrays``)."""
    start_ns = time.time_ns()
    failure: Exception | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_mine()
        process = jax.process_index()
        write_array_list(directory, process, [(orbax_name(h.key), h.chunk) for h in arrays])
    except Exception as e:
        if jax.process_count() == 1:
            raise
        failure = e
    raise_shared(failure, f"{name}:arrays", f"writing {directory}")
    finish_tree(directory, [(h.key, h.chunk, h.sharding) for h in arrays], start_ns)


def write_held(
    directory: Any, held: Sequence[Held], *, compress: bool, name: str = "modelshard:save"
) -> None:
    """Write ``held`` (every process its own blocks) into ``directory`` (``write_tree``)."""

    def write_mine() -> None:
        mine = [h for h in held if h.blocks]
        with BlockWriter(directory, mine, compress=compress) as writer:
            for i, h in enumerate(mine):
                for box, data in h.blocks:
                    writer.write(i, box, data)

    write_tree(directory, held, write_mine, name=name)


def write_and_commit(
    write: Callable[[], None],
    record: Record,
    _commit: Callable[[], None],
    *,
    name: str,
    writing: str,
    committing: str,
) -> None:
    """Every process ``write``s its part and resolves ``record``'s checksums (a collective);
    once every part is written, process 0 runs ``_commit``. A part failing on any process
    raises one error on every process at once (exchanges ``{name}:written``, ``{name}:end``).
    """
    failure: Exception | None = None
    try:
        write()
    except Exception as e:
        failure = e
    try:  # every process, whatever came before: checksums spanning processes are collectives
        record.resolve()
    except Exception as e:
        failure = failure or e
    raise_shared(failure, f"{name}:written", writing)
    if jax.process_index() == 0:
        try:
            _commit()
        except Exception as e:
            failure = e
    raise_shared(failure, f"{name}:end", committing)


def finish_tree(
    directory: Any, arrays: Sequence[tuple[tuple[str, ...], Any, Any]], start_ns: int
) -> None:
    """Process 0, once every process wrote its arrays: Orbax's ``_METADATA`` and ``_sharding``
    of ``arrays`` (``(key, chunk, sharding)``), the merge of the databases, then the marked
    ``_CHECKPOINT_METADATA``, last."""
    if jax.process_index() == 0:
        _finalize(directory, arrays, start_ns)


def _finalize(
    directory: Any, arrays: Sequence[tuple[tuple[str, ...], Any, Any]], start: int
) -> None:
    (directory / TREE_METADATA).write_text(json.dumps(tree_metadata((k, c) for k, c, _ in arrays)))
    shardings = sharding_file((orbax_name(k), s) for k, _, s in arrays)
    (directory / SHARDING_FILE).write_text(json.dumps(shardings))
    try:  # Orbax's finalize: each process's database merged into the checkpoint's
        merge(kvstore(directory), [orbax_name(k) for k, _, _ in arrays])
    except ValueError as e:
        raise CheckpointError(f"cannot write {directory}: {e}") from e
    (directory / CHECKPOINT_METADATA).write_text(json.dumps(marked_metadata(start)))


def marked_metadata(start_ns: int) -> dict[str, Any]:
    """Orbax's ``_CHECKPOINT_METADATA`` of a checkpoint written from ``start_ns`` to now,
    marked as modelshard's."""
    from .._internals import STANDARD_HANDLER_NAME

    return checkpoint_metadata(STANDARD_HANDLER_NAME, start_ns, MARKER)
