"""How a streamed leaf is laid out before a byte is written: its stored dtype, shape and
sharding, the slabs it is copied in and the chunks it is stored in (``slab_plan``), which
process writes it, and which checksums its slabs are given (``stream.py`` copies them).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._base import dtype_name
from .chunks import aligned_chunks
from .codec import bitcast, keys_of, parse_dtype, stored_dtype
from .record import LeafRecord
from .storage import storage_key


@dataclasses.dataclass(frozen=True)
class StreamLeaf:
    """One leaf of a checkpoint being written by ``write_stream``.

    Attributes:
        path: canonical path (``"layers/0/kernel"``).
        shape: the shape of the array ``read`` gives (for typed PRNG keys: the key data,
            with its trailing dimensions).
        dtype: its dtype (a NumPy/ml_dtypes dtype or its name: ``bfloat16``, ``float8_e4m3``
            and ``uint4`` are fine; for keys ``uint32``).
        read: ``read(index)`` -> the box ``index`` (a ``slice(start, stop)`` per dimension)
            as a NumPy array of that shape and ``dtype``; once per slab, on a worker thread.
        spec: the ``PartitionSpec`` of the leaf on the mesh (of the logical leaf; key data's
            trailing dimensions are never split). None: replicated.
        key_impl: for typed PRNG keys, the implementation name (``"threefry2x32"``).
        names: logical axis names to record (linen/NNX boxes), if any.
        chunks: the block shape reads suit best (the source's stored chunk shape): slabs
            are whole blocks where the budget allows.
        expect: the checksum the array read must have (``reshard`` passes the source's);
            a mismatch is reported as damage of the source.
        logical_dtype: the dtype the record gives the leaf, where ``read`` gives its bits
            in another (a float8 leaf read as uint8); default ``dtype``.
        carry: a checksum recorded unchecked where no cast changes the bits
            (``reshard(verify=False)`` passes the source's); nothing is summed then.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    read: Callable[[tuple[slice, ...]], Any]
    spec: PartitionSpec | None = None
    key_impl: str | None = None
    names: tuple[Any, ...] | None = None
    chunks: tuple[int, ...] | None = None
    expect: str | None = None
    logical_dtype: Any = None
    carry: str | None = None


@dataclasses.dataclass
class Layout:
    """Where and how one leaf is stored: decided before any byte is written."""

    leaf: StreamLeaf
    rec: LeafRecord  # checksum filled in once written
    src_dtype: Any  # dtype of what ``read`` gives
    cast: Any  # dtype the stored bits are cast to (None: stored as read)
    sharding: NamedSharding
    chunk: tuple[int, ...]
    slab: tuple[int, ...]
    big: bool  # a slab over the budget (one whole source block): not read ahead

    @property
    def nbytes(self) -> int:
        """Bytes read (what ``progress`` counts)."""
        return math.prod(self.rec.stored_shape) * self.src_dtype.itemsize


def logical_dtype(leaf: StreamLeaf) -> Any:
    return parse_dtype(dtype_name(leaf.dtype if leaf.logical_dtype is None else leaf.logical_dtype))


def slab_plan(
    shape: Sequence[int],
    itemsize: int,
    shard: Sequence[int],
    slab_bytes: int,
    whole_bytes: int,
    chunks: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(slab shape, stored chunk shape)`` for a leaf of ``shape`` whose new shards are
    ``shard``, read best in blocks of ``chunks`` (default: whole rows): a slab is whole
    blocks within ``slab_bytes`` (a larger block whole within ``whole_bytes``, else cut along
    its leading dimensions); the chunk divides slab and shard (``chunks.aligned_chunks``)."""
    shape = tuple(int(d) for d in shape)
    if not shape or not math.prod(shape):
        return shape, shape
    base = [1, *shape[1:]] if chunks is None or len(chunks) != len(shape) else list(chunks)
    slab = [max(1, min(int(c), d)) for c, d in zip(base, shape, strict=True)]

    def size() -> int:
        return math.prod(slab) * itemsize

    if size() > whole_bytes:
        for d in range(len(shape)):  # cut the leading dimensions first
            other = size() // slab[d]
            slab[d] = max(1, min(slab[d], slab_bytes // max(1, other)))
            if size() <= slab_bytes:
                break
    elif size() <= slab_bytes:
        for d in range(len(shape) - 1, -1, -1):  # grow the trailing dimensions first
            times = max(1, slab_bytes // size())
            slab[d] = min(shape[d], slab[d] * times)
            if slab[d] < shape[d]:
                break
    chunk = tuple(math.gcd(a, max(1, int(b))) for a, b in zip(slab, shard, strict=True))
    return tuple(slab), aligned_chunks(shape, chunk, itemsize)


def lay_out(
    leaves: Iterable[StreamLeaf], mesh: Any, dtype: Any, slab_bytes: int, whole_bytes: int
) -> list[Layout]:
    out = []
    for leaf in leaves:
        src = parse_dtype(dtype_name(leaf.dtype))
        logical = logical_dtype(leaf)
        cast = None
        floating = leaf.key_impl is None and jnp.issubdtype(logical, jnp.floating)
        if floating and dtype is not None and jnp.dtype(dtype) != logical:
            cast = jnp.dtype(dtype)
        final = cast if cast is not None else logical
        stored_name = stored_dtype(final)
        shape = tuple(int(d) for d in leaf.shape)
        if leaf.key_impl is not None:
            keys = keys_of(shape, jnp.uint32, leaf.key_impl)
            logical_shape, logical_name = tuple(keys.shape), dtype_name(keys.dtype)
        else:
            logical_shape, logical_name = shape, dtype_name(final)
        spec = leaf.spec if leaf.spec is not None else PartitionSpec()
        extra = len(shape) - len(logical_shape)
        stored_spec = PartitionSpec(*spec, *([None] * (len(logical_shape) - len(spec) + extra)))
        sharding = NamedSharding(mesh, stored_spec)
        shard = sharding.shard_shape(shape) if shape else ()
        itemsize = parse_dtype(stored_name).itemsize
        width = max(itemsize, src.itemsize)
        slab, chunk = slab_plan(shape, width, shard, slab_bytes, whole_bytes, leaf.chunks)
        big = math.prod(slab) * width > slab_bytes
        rec = LeafRecord(
            path=leaf.path,
            key=storage_key(leaf.path),
            shape=logical_shape,
            dtype=logical_name,
            stored_shape=shape,
            stored_dtype=stored_name,
            key_impl=leaf.key_impl,
            spec=spec if leaf.spec is not None else None,
            names=leaf.names,
        )
        out.append(Layout(leaf, rec, src, cast, sharding, chunk, slab, big))
    return out


def slabs(lay: Layout) -> Iterator[tuple[slice, ...]]:
    """The boxes of ``lay.slab`` that tile the leaf, in C order."""
    shape = lay.rec.stored_shape
    starts = [range(0, n, s) for n, s in zip(shape, lay.slab, strict=True)]
    for origin in itertools.product(*starts):
        yield tuple(
            slice(o, min(n, o + s)) for o, n, s in zip(origin, shape, lay.slab, strict=True)
        )


def carried(lay: Layout) -> bool:
    """Whether ``lay``'s checksum is its leaf's ``carry``, recorded as it is (unsummed)."""
    return lay.leaf.carry is not None and lay.leaf.expect is None and lay.cast is None


def bits_view(host: np.ndarray, lay: Layout) -> np.ndarray:
    """``host`` as the dtype it is stored in, when that is not the dtype it was read as
    (no cast: the bits are stored as they are)."""
    return host if lay.cast is not None else bitcast(host, parse_dtype(lay.rec.stored_dtype))
