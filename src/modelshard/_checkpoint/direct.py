"""A restore's reads straight from TensorStore, without Orbax: modelshard's own checkpoints
on a local disk.

A process that restores once (a job resuming) paid for Orbax's import, about 0.2 s of
its first restore, although the bytes come from TensorStore either way: Orbax's read path
opens each stored array with a TensorStore spec and reads it. ``read_direct`` opens the
same spec (``ocdbt.read_spec``: zarr v2 chunks in the checkpoint's OCDBT database, as
Orbax's ``ArrayReadSpec`` builds it) in a context like Orbax's, and reads
each distinct shard this process holds into the buffer its device keeps, as
``arrival.read_placed`` does inside Orbax's handler. Reads are started first come, first
served, while the bytes in flight stay under the restore's cap (an array whose reads fit
under it reserved whole, its reads run together; a larger one shard by shard), and each
array is handed to ``on_read`` as soon as its reads are in, in the order they were
started, on the calling thread.

What this does not read (a plain Orbax checkpoint, object storage, a checkpoint outside
OCDBT or in zarr v3) goes through Orbax (``read.read_arrays``), as before.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .arrival import place_boxes, shard_boxes, start_read
from .ocdbt import array_keys, context, read_spec
from .sources import Source, store_format
from .storage import TREE_METADATA, orbax_name
from .urls import is_remote


def listed_arrays(source: Source) -> set[tuple[str, ...]]:
    """The storage keys of the arrays Orbax's ``_METADATA`` lists: what plain Orbax reads
    the checkpoint by. The file must be sound (a ``ValueError`` where it is not: damaged
    metadata is a damaged checkpoint, though these reads do not need it)."""
    path = source.tree_dir / TREE_METADATA
    meta = source.tree_metadata()
    try:
        return set(array_keys(meta))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not Orbax's tree metadata ({type(e).__name__}: {e})") from e


def readable(source: Source) -> bool:
    """Whether ``read_direct`` reads ``source``: a modelshard checkpoint on a local disk,
    its arrays zarr v2 in OCDBT."""
    return (
        source.template is None
        and not is_remote(source.path)
        and store_format(source) == (True, False)
    )


@dataclass
class _Array:
    """One array being read: its open store, its shards and what is read so far."""

    path: str
    target: Any
    store: Any
    boxes: list[tuple[tuple[int, int], ...]]
    devices: list[list[Any]]
    placed: list[list[Any]] = field(default_factory=list)
    left: int = 0


def read_direct(
    source: Source,
    targets: Mapping[str, Any],
    on_read: Callable[[str, Any], None] | None,
    cap: int,
    sizes: Mapping[str, list[int]],
    cache_bytes: int,
) -> dict[str, Any]:
    """Each of ``targets`` (path -> sharded ``ShapeDtypeStruct`` of the stored shape and
    dtype) read from ``source`` (``readable``) into its sharding.

    ``sizes``: the bytes each array's reads reserve, one entry per distinct shard of this
    process (``read.read_sizes``); at most ``cap`` bytes are reserved at once, and a read
    larger than ``cap`` waits until it runs alone. ``cache_bytes``: the cache of decoded
    chunks (``read.read_arrays`` sizes it: ``chunks.shares_chunks``). A stored array whose
    shape or dtype
    differs from its target is a ``ValueError`` naming it; TensorStore's errors (a missing
    or damaged chunk) are raised as they are.
    """
    import jax
    import numpy as np
    import tensorstore as ts

    boxes = {p: shard_boxes(t.sharding, tuple(t.shape)) for p, t in targets.items()}
    # decoded chunks cached, so that a chunk two local shards need is read once
    ctx = context(cache_bytes)
    recs = source.record.by_path()
    listed = listed_arrays(source)
    for p in targets:
        if recs[p].key not in listed:
            raise ValueError(
                f"{source.tree_dir / TREE_METADATA} does not list the stored array "
                f"{orbax_name(recs[p].key)}"
            )
    tree_dir = str(source.tree_dir)
    opening = {
        p: ts.open(read_spec(tree_dir, orbax_name(recs[p].key)), open=True, context=ctx)
        for p in targets
    }
    arrays = []
    for p, t in targets.items():
        store = opening[p].result()
        shape, dtype = tuple(t.shape), np.dtype(t.dtype)
        stored = (tuple(store.shape), np.dtype(store.dtype.numpy_dtype))
        if stored != (shape, dtype):
            raise ValueError(
                f"stored array {orbax_name(recs[p].key)} is {stored[1]}{list(stored[0])}, "
                f"the record says {dtype}{list(shape)}"
            )
        arrays.append(_Array(p, t, store, list(boxes[p]), list(boxes[p].values())))

    # units of reservation, in order: a whole array whose reads fit under the cap, else
    # each of its shards
    units: list[tuple[_Array, list[int], int]] = []
    for a in arrays:
        per_box = sizes[a.path]
        whole = sum(per_box)
        if 0 < whole < cap:
            units.append((a, list(range(len(a.boxes))), whole))
        else:
            units += [(a, [i], n) for i, n in enumerate(per_box)]
        a.left = len(a.boxes)
        a.placed = [[] for _ in a.boxes]

    out: dict[str, Any] = {}
    in_flight: collections.deque[tuple[_Array, list[int], int, list[Any]]] = collections.deque()
    reserved = 0

    def finish_oldest() -> None:
        nonlocal reserved
        a, idx, n, reads = in_flight.popleft()
        bufs = [r.result() for r in reads]
        reserved -= n
        placed = place_boxes(bufs, [a.devices[i] for i in idx], a.target.sharding)
        at = 0
        for i in idx:  # one array per device, box after box
            a.placed[i] = placed[at : at + len(a.devices[i])]
            at += len(a.devices[i])
        a.left -= len(idx)
        if a.left == 0:
            flat = [x for group in a.placed for x in group]
            x = jax.make_array_from_single_device_arrays(a.target.shape, a.target.sharding, flat)
            out[a.path] = x
            if on_read is not None:
                on_read(a.path, x)

    for a, idx, n in units:
        while in_flight and reserved + n >= cap:
            finish_oldest()
        reads = []
        for i in idx:
            view = a.store[tuple(slice(lo, hi) for lo, hi in a.boxes[i])]
            reads.append(_Read(*start_read(view)))
        in_flight.append((a, idx, n, reads))
        reserved += n
    while in_flight:
        finish_oldest()
    return out


@dataclass
class _Read:
    """One shard's read into ``buf``: ``result()`` waits for it and gives the buffer."""

    buf: Any
    future: Any

    def result(self) -> Any:
        self.future.result()
        return self.buf
