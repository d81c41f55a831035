"""Writing a checkpoint from a stream of leaves, a slab at a time, through TensorStore.

``write_stream`` is what ``reshard`` (and ``modelshard convert``) write with. Each leaf comes
as a `StreamLeaf` (its path, shape, dtype, spec and a function that reads any box of it) and
is copied one slab at a time (laid out by ``slabs.py``), the next slab read while the last is
written, so host memory stays near a few slabs however large a leaf is. Nothing is placed on
the mesh's devices. The result is the checkpoint ``save`` writes, Orbax's format through
``ocdbt.py``'s specs; each process's store is synced once, whole, after its last slab.

Checksums are summed slab by slab on the host workers; a leaf given an expected checksum
(``reshard`` passes the source's) is verified, and every mismatch is reported before
anything is published. Under several processes each writes a share of the leaves, and
process 0 the metadata and the record once all are done.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from .._base import CheckpointError, EarlySync, assign, dtype_name, sync_tree
from .._runtime import barrier, raise_shared
from .checksum import box_sums, checksum_mismatch_message, format_sums, host_workers
from .codec import bitcast, encode, is_empty, parse_dtype
from .ocdbt import context, write_array_list, write_spec
from .reader import read_failure, unreadable
from .record import Record, ValueRecord, mesh_json, versions
from .shards import finish_tree, settle
from .slabs import (
    Layout,
    StreamLeaf,
    bits_view,
    carried,
    lay_out,
    logical_dtype,
    slabs,
)
from .storage import PART_FILE, check_names, nest, orbax_name
from .urls import is_remote, kvstore, location
from .write import check_compression, write_checkpoint

DEFAULT_SLAB_BYTES = 16 << 20
"""Host bytes of one slab of a leaf being copied (the next is read while it is written)."""

WRITES_IN_FLIGHT = 3
"""Slabs being written at once (each an OCDBT commit, which waits on the file system)."""

READS_AHEAD = 2
"""Slabs read ahead of the one in hand, each on a reader thread (six held at most in all)."""


class _Sums:
    """The running checksum of one array, summed slab by slab on the host workers."""

    def __init__(self) -> None:
        self.parts: list[Any] = []  # futures of (s1, s2), then the pairs themselves

    def add(self, x: Any, origin: Sequence[int], shape: Sequence[int]) -> None:
        """Start the sums of ``x``, the box at ``origin`` (two slabs at most in flight:
        each holds its slab's bytes)."""
        if len(self.parts) >= 2:
            self.parts[-2] = self.parts[-2].result()
        self.parts.append(host_workers().submit(box_sums, np.asarray(x), origin, shape))

    def value(self) -> str:
        both = [p if isinstance(p, tuple) else p.result() for p in self.parts]
        return format_sums(sum(a for a, _ in both), sum(b for _, b in both))


def _as_array(x: Any, lay: Layout, box: tuple[slice, ...]) -> np.ndarray:
    a = np.asarray(x)
    want = tuple(b.stop - b.start for b in box)
    if tuple(a.shape) != want and a.size == math.prod(want) and a.dtype == lay.src_dtype:
        return a.reshape(want)  # a 0-d leaf read as one element
    if a.dtype != lay.src_dtype or tuple(a.shape) != want:
        where = ", ".join(f"{b.start}:{b.stop}" for b in box)
        raise CheckpointError(
            f"leaf {lay.rec.path or '<root>'!r}: the box [{where}] was read as "
            f"{dtype_name(a.dtype)}{list(a.shape)}, not {dtype_name(lay.src_dtype)}{list(want)}."
        )
    return a


@dataclasses.dataclass
class _Open:
    """A leaf being copied: its destination store and running checksums."""

    store: Any
    read_sums: _Sums
    out_sums: _Sums


def _copy_all(
    layouts: Sequence[Layout],
    directory: Any,
    process: int,
    device: Any,
    progress: Callable[[int], None],
    compress: bool,
    source: str = "",
) -> dict[str, tuple[str, str | None]]:
    """Write ``layouts`` slab by slab, the next slabs read while one is written; per path, the
    checksum of what was stored and, where ``expect`` is set, of what was read (else None).
    Copying a checkpoint (``source``), a failed read raises once every other leaf is copied,
    naming every leaf that could not be read (``reader.unreadable``)."""
    import tensorstore as ts

    # Not TensorStore's sync at each commit (a slab's write): locally, a commit's files are
    # synced on a thread of their own (``EarlySync``), the store whole at the end.
    local = not is_remote(directory)
    ctx = context(sync=False)
    tree = kvstore(directory)
    tasks = [
        (lay, box, i == len(boxes) - 1)
        for lay in layouts
        for boxes in [list(slabs(lay))]
        for i, box in enumerate(boxes)
    ]
    out: dict[str, tuple[str, str | None]] = {}
    # every array created at once, before any write: OCDBT commits the creations together
    opening: list[Any] = []
    store_dir = str(directory / f"ocdbt.process_{process}")
    writing: collections.deque[tuple[Any, Any]] = collections.deque()  # (future, store)
    try:
        for lay in layouts:
            spec = write_spec(
                tree,
                orbax_name(lay.rec.key),
                shape=lay.rec.stored_shape,
                chunk=lay.chunk,
                dtype=parse_dtype(lay.rec.stored_dtype),
                process=process,
                compress=compress,
            )
            opening.append(ts.open(spec, create=True, context=ctx))
        with (
            ThreadPoolExecutor(READS_AHEAD, thread_name_prefix="modelshard-read") as pool,
            EarlySync(store_dir if local else None) as early,
        ):
            opened = {
                lay.leaf.path: _Open(f.result(), _Sums(), _Sums())
                for lay, f in zip(layouts, opening, strict=True)
            }
            reads: dict[int, Any] = {}
            started = -1  # the last task whose read is started

            def read_ahead(current: int) -> None:
                """Start the reads of the tasks up to ``READS_AHEAD`` past ``current``, none
                past a big slab from ``current`` on (one is read alone and written first)."""
                nonlocal started
                while started + 1 < len(tasks) and started + 1 <= current + READS_AHEAD:
                    j = started + 1
                    if any(tasks[k][0].big for k in range(current, j)):
                        break
                    reads[j] = pool.submit(tasks[j][0].leaf.read, tasks[j][1])
                    started = j

            read_ahead(0)
            failed: dict[str, Exception] = {}
            for i, (lay, box, last) in enumerate(tasks):
                leaf = lay.leaf
                got_read = None
                try:
                    got_read = reads.pop(i).result() if leaf.path not in failed else None
                except Exception as e:
                    if not source:
                        raise
                    failed[leaf.path] = e
                if leaf.path in failed:  # the rest of this leaf is skipped
                    read_ahead(i + 1 if lay.big else i)
                    if last:
                        del opened[leaf.path]
                    continue
                host = _as_array(got_read, lay, box)
                read_ahead(i)
                here = opened[leaf.path]
                shape = lay.rec.stored_shape
                origin = [b.start for b in box]
                bits = bits_view(host, lay)
                x = bits if lay.cast is None else jax.device_put(bits, device)
                if leaf.expect is not None:
                    here.read_sums.add(bits, origin, shape)
                if lay.cast is not None:
                    data = np.asarray(encode(bitcast(x, logical_dtype(leaf)).astype(lay.cast)))
                    here.out_sums.add(data, origin, shape)
                else:
                    if leaf.expect is None and not carried(lay):
                        here.out_sums.add(bits, origin, shape)
                    data = bits
                while len(writing) >= WRITES_IN_FLIGHT:
                    writing.popleft()[0].result()
                writing.append((here.store[box].write(data), here.store))
                progress(host.size * lay.src_dtype.itemsize)
                del x, host, bits, data
                if lay.big:  # one block at a time: its write is done before the next read
                    while writing:
                        writing.popleft()[0].result()
                    read_ahead(i + 1)
                if last:
                    del opened[leaf.path]
                    got = here.read_sums.value() if leaf.expect is not None else None
                    separate = lay.cast is not None or leaf.expect is None
                    stored = here.out_sums.value() if separate else str(got)
                    out[leaf.path] = (str(leaf.carry) if carried(lay) else stored, got)
                    if i + 1 < len(tasks):  # the last leaf's files: sync_tree's, just below
                        early.kick()
            while writing:
                writing.popleft()[0].result()
    finally:
        # none may land in the staging directory after the caller has removed it
        settle([*opening, *(f for f, _ in writing)])
    if failed:
        if len(failed) == 1:
            raise next(iter(failed.values()))
        raise unreadable(source, [(p, read_failure(e.__cause__ or e)) for p, e in failed.items()])
    if local and layouts:
        sync_tree(store_dir)
    return out


def _stored(layouts: Sequence[Layout]) -> list[Layout]:
    """The layouts of arrays with elements (a zero-size leaf is in the record only)."""
    return [lay for lay in layouts if not is_empty(lay.rec.stored_shape)]


class Stream:
    """A checkpoint being written by ``write_stream``: its leaves laid out, then written
    into one directory by ``write`` (each process its share), all checked first."""

    def __init__(
        self,
        leaves: Iterable[StreamLeaf],
        *,
        mesh: Any,
        dtype: Any = None,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        whole_bytes: int | None = None,
        kind: str = "pytree",
        metadata: dict[str, Any] | None = None,
        source: str = "",
        progress: Callable[[int, int], None] | None = None,
        compression: str | None = None,
        values: Sequence[ValueRecord] | None = (),
    ) -> None:
        self.compress = check_compression(compression)
        whole = 4 * slab_bytes if whole_bytes is None else whole_bytes
        self.layouts = lay_out(leaves, mesh, dtype, slab_bytes, whole)
        if not self.layouts:
            raise CheckpointError("nothing to write: the stream has no leaves.")
        check_names([(lay.rec.path, lay.rec.key) for lay in self.layouts], "cannot write")
        # the arrays and the record's Python values (None: a source that predates them)
        kept = None if values is None else list(values)
        nest(
            [(lay.rec.key, 0) for lay in self.layouts] + [(v.key, 0) for v in kept or ()],
            "cannot write",
        )
        self.record = Record(
            kind=kind,
            leaves=[lay.rec for lay in self.layouts],
            mesh=mesh_json(mesh),
            versions=versions(),
            metadata=dict(metadata or {}),
            values=kept,
        )
        self.source = source
        self.progress = progress
        self.total = sum(lay.nbytes for lay in self.layouts)

    def write(self, directory: Any) -> None:
        """Write every array into the new or empty ``directory`` (each process its share), then
        process 0 Orbax's metadata; the record is left to the caller. CheckpointError names
        every leaf whose read checksum differs from its ``expect``."""
        start_ns = time.time_ns()
        process, count = jax.process_index(), jax.process_count()
        owner = assign([lay.nbytes for lay in self.layouts], count)
        mine = _stored([lay for lay, o in zip(self.layouts, owner, strict=True) if o == process])
        # Every process lists every array, as in an Orbax save (its finalize checks that
        # each process's list is complete and that they agree).
        arrays = _stored(self.layouts)
        directory.mkdir(parents=True, exist_ok=True)
        device = jax.local_devices()[0]
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            if self.progress is not None and count == 1:
                self.progress(done[0], self.total)

        failure: Exception | None = None
        sums: dict[str, Any] = {}
        try:
            sums = _copy_all(mine, directory, process, device, step, self.compress, self.source)
            for lay in self.layouts:
                if is_empty(lay.rec.stored_shape) and process == 0:
                    sums[lay.rec.path] = self._empty_sums(lay)
            names = [(orbax_name(lay.rec.key), lay.chunk) for lay in arrays]
            write_array_list(directory, process, names)
            if count > 1:
                (directory / PART_FILE.format(process)).write_text(json.dumps(sums))
        except Exception as e:
            if count == 1:
                raise
            failure = e
        if count > 1:  # every process's part written (the barrier), or all raise at once
            raise_shared(failure, "modelshard:stream:written", f"writing {directory}")
            for p in range(count):
                part = json.loads((directory / PART_FILE.format(p)).read_text())
                sums.update({k: (v[0], v[1]) for k, v in part.items()})
            barrier("modelshard:stream:read")
            # Past the last barrier only process 0 touches the directory: it commits it
            # next (a rename), which a late unlink on another process would race.
            if process == 0:
                for p in range(count):
                    (directory / PART_FILE.format(p)).unlink()
        bad = []
        for lay in self.layouts:
            stored, got = sums[lay.rec.path]
            lay.rec.checksum = stored
            if lay.leaf.expect is not None and got is not None and got != lay.leaf.expect:
                bad.append((lay.rec, lay.leaf.expect, got))
        if bad:
            raise CheckpointError(
                checksum_mismatch_message(
                    self.source or str(directory),
                    bad,
                    anyway="copy it anyway (the copy keeps the recorded checksums: restoring "
                    "it reports the damage)",
                )
            )
        finish_tree(directory, [(lay.rec.key, lay.chunk, lay.sharding) for lay in arrays], start_ns)
        if self.progress is not None and count == 1:
            self.progress(self.total, self.total)

    def _empty_sums(self, lay: Layout) -> tuple[str, str | None]:
        zero = format_sums(0, 0)
        return zero, (zero if lay.leaf.expect is not None else None)


def write_stream(
    directory: str | os.PathLike[str],
    leaves: Iterable[StreamLeaf],
    *,
    mesh: Any,
    kind: str = "pytree",
    metadata: dict[str, Any] | None = None,
    dtype: Any = None,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
    whole_bytes: int | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    compression: str | None = None,
) -> Record:
    """Write a checkpoint (what ``save`` writes) from ``leaves`` (`StreamLeaf`, in container
    order), one slab at a time: host memory stays near a few ``slab_bytes`` (or one
    ``whole_bytes`` block, default ``4 * slab_bytes``, read whole rather than cut), nothing
    is put on ``mesh``'s devices, and the checkpoint appears only when complete. ``kind``,
    ``metadata``: the record's; ``dtype``: floating-point leaves cast to it; ``progress``:
    called as ``progress(bytes_done, bytes_total)``. Returns the record written.

    Raises:
        CheckpointError: the destination exists (without ``overwrite``), two leaves share a
            stored name, a leaf's read checksum differs from its ``expect``, ``read``
            returned the wrong rows, or ``compression`` is not None or ``"zstd"``.
    """
    stream = Stream(
        leaves,
        mesh=mesh,
        dtype=dtype,
        slab_bytes=slab_bytes,
        whole_bytes=whole_bytes,
        kind=kind,
        metadata=metadata,
        progress=progress,
        compression=compression,
    )
    path = location(directory)
    write_checkpoint(path, stream.write, stream.record, overwrite=overwrite)
    return stream.record
