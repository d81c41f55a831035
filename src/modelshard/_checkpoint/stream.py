"""Writing a checkpoint from a stream of leaves, a slab at a time (``reshard``, ``convert``).

Each leaf comes as a `StreamLeaf` (its path, shape, dtype, spec and a function that reads any
box of it) and is copied one slab at a time (laid out by ``slabs.py``) through the writer
``save`` uses (``shards.BlockWriter``), the next slab read while the last is written, so host
memory stays near a few slabs however large a leaf is. Nothing is placed on the mesh's
devices. Checksums are summed slab by slab on the host workers; a leaf given an expected
checksum (``reshard`` passes the source's) is verified, every mismatch reported before
anything is published. Under several processes each writes a share of the leaves.
"""

from __future__ import annotations

import collections
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from .._base import CheckpointError, EarlySync, assign, dtype_name
from .checksum import Checksums, checksum_mismatch_message
from .codec import bitcast, encode, is_empty, parse_dtype
from .reader import read_failure, unreadable
from .record import Record, ValueRecord, mesh_json, versions
from .shards import BlockWriter, Held, write_tree
from .slabs import Layout, StreamLeaf, bits_view, carried, lay_out, logical_dtype, slabs
from .storage import check_names, nest
from .urls import location
from .write import check_compression, write_checkpoint

DEFAULT_SLAB_BYTES = 16 << 20  # a slab's host bytes (the next is read while it is written)
WRITES_IN_FLIGHT = 3  # slabs written at once (each an OCDBT commit, waiting on the disk)
READS_AHEAD = 2  # slabs read ahead of the one in hand, each on a reader thread (six at most)


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


def _copy_all(
    layouts: Sequence[Layout],
    writer: BlockWriter,
    progress: Callable[[int], None],
    source: str,
    read_sums: Checksums[str],
    out_sums: Checksums[str],
) -> None:
    """Write ``layouts`` (``writer``'s arrays, in order) slab by slab, the next slabs read
    while one is written, summing what was read into ``read_sums`` (where ``expect`` is set)
    and what was stored into ``out_sums`` (where it differs or nothing was read). Copying a
    checkpoint (``source``), a failed read raises once every other leaf is copied, naming
    every leaf that could not be read (``reader.unreadable``)."""
    tasks = [
        (i, lay, box, k == len(boxes) - 1)
        for i, lay in enumerate(layouts)
        for boxes in [list(slabs(lay))]
        for k, box in enumerate(boxes)
    ]
    device = jax.local_devices()[0]
    summing: collections.deque[Any] = collections.deque()  # each holds its slab's bytes
    failed: dict[str, Exception] = {}
    with (
        ThreadPoolExecutor(READS_AHEAD, thread_name_prefix="modelshard-read") as pool,
        EarlySync(writer.local_dir) as early,
    ):
        reads: dict[int, Any] = {}
        started = -1  # the last task whose read is started

        def read_ahead(current: int) -> None:
            """Start the reads of the tasks up to ``READS_AHEAD`` past ``current``, none
            past a big slab from ``current`` on (one is read alone and written first)."""
            nonlocal started
            while started + 1 < len(tasks) and started + 1 <= current + READS_AHEAD:
                j = started + 1
                if any(tasks[k][1].big for k in range(current, j)):
                    break
                reads[j] = pool.submit(tasks[j][1].leaf.read, tasks[j][2])
                started = j

        read_ahead(0)
        for t, (i, lay, box, last) in enumerate(tasks):
            leaf, key, shape = lay.leaf, lay.rec.path, lay.rec.stored_shape
            got_read = None
            try:
                got_read = reads.pop(t).result() if leaf.path not in failed else None
            except Exception as e:
                if not source:
                    raise
                failed[leaf.path] = e
            if leaf.path in failed:  # the rest of this leaf is skipped
                read_ahead(t + 1 if lay.big else t)
                continue
            host = _as_array(got_read, lay, box)
            read_ahead(t)
            origin = [b.start for b in box]
            data = bits = bits_view(host, lay)
            if leaf.expect is not None:
                summing.append(read_sums.add_block(key, shape, bits, origin))
            if lay.cast is not None:
                x = bitcast(jax.device_put(bits, device), logical_dtype(leaf))
                data = np.asarray(encode(x.astype(lay.cast)))
                summing.append(out_sums.add_block(key, shape, data, origin))
            elif leaf.expect is None and not carried(lay):
                summing.append(out_sums.add_block(key, shape, bits, origin))
            while len(summing) > 4:
                summing.popleft().result()
            writer.write(i, box, data)
            progress(host.size * lay.src_dtype.itemsize)
            del host, bits, data
            if lay.big:  # one block at a time: its write is done before the next read
                writer.drain()
                read_ahead(t + 1)
            if last and t + 1 < len(tasks):  # the last leaf's files: the writer's sync
                early.kick()
        if failed:
            if len(failed) == 1:
                raise next(iter(failed.values()))
            problems = [(p, read_failure(e.__cause__ or e)) for p, e in failed.items()]
            raise unreadable(source, problems)


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
        # summed on the host workers as slabs pass; every process gathers every leaf's
        read = {lay.rec.path: None for lay in self.layouts if lay.leaf.expect is not None}
        out = {
            lay.rec.path: None
            for lay in self.layouts
            if lay.cast is not None or (lay.leaf.expect is None and not carried(lay))
        }
        self._read_sums = Checksums(read, "modelshard:stream:read", spanning_all=True)
        self._out_sums = Checksums(out, "modelshard:stream:stored", spanning_all=True)
        self.record.pending = self._checksums

    def write(self, directory: Any) -> None:
        """Write every array into the new or empty ``directory`` (each process its share),
        then process 0 Orbax's metadata; the record is left to the caller, its checksums
        ``pending`` (``_checksums``)."""
        process, count = jax.process_index(), jax.process_count()
        owner = assign([lay.nbytes for lay in self.layouts], count)
        # a zero-size leaf is in the record only
        arrays = [lay for lay in self.layouts if not is_empty(lay.rec.stored_shape)]
        mine = [lay for lay, o in zip(self.layouts, owner, strict=True) if o == process]
        mine = [lay for lay in mine if not is_empty(lay.rec.stored_shape)]
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            if self.progress is not None and count == 1:
                self.progress(done[0], self.total)

        def write_mine() -> None:
            held = [_held(lay) for lay in mine]
            with BlockWriter(directory, held, compress=self.compress, window=WRITES_IN_FLIGHT) as w:
                _copy_all(mine, w, step, self.source, self._read_sums, self._out_sums)

        # Every process lists every array, as in an Orbax save (its finalize checks that
        # each process's list is complete and that they agree).
        write_tree(directory, [_held(lay) for lay in arrays], write_mine, name="modelshard:stream")
        if self.progress is not None and count == 1:
            self.progress(self.total, self.total)

    def _checksums(self) -> list[str]:
        """Each leaf's checksum (``Record.resolve``, on every process): the source's where
        carried, else of what was stored. CheckpointError names every leaf whose read
        checksum differs from its ``expect``."""
        read = self._read_sums.collect()  # collectives, in the same order everywhere
        stored = self._out_sums.collect()
        out, bad = [], []
        for lay in self.layouts:
            leaf, path = lay.leaf, lay.rec.path
            out.append(str(leaf.carry) if carried(lay) else stored.get(path, read.get(path)))
            if leaf.expect is not None and read[path] != leaf.expect:
                bad.append((lay.rec, leaf.expect, read[path]))
        if bad:
            raise CheckpointError(
                checksum_mismatch_message(
                    self.source,
                    bad,
                    anyway="copy it anyway (the copy keeps the recorded checksums: restoring "
                    "it reports the damage)",
                )
            )
        return [str(c) for c in out]


def _held(lay: Layout) -> Held:
    """``lay``'s array as the writer creates it (its blocks come from ``_copy_all``)."""
    dtype = parse_dtype(lay.rec.stored_dtype)
    return Held(lay.rec.key, lay.rec.stored_shape, dtype, lay.chunk, lay.sharding, [])


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
    called as ``progress(bytes_done, bytes_total)``. Returns the record written; raises
    CheckpointError for a taken destination, clashing names, damage or bad reads."""
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
