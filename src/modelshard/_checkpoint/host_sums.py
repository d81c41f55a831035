"""Checksums summed on the host with NumPy: nothing compiled, nothing gathered.

A leaf too small to be worth compiling a program for (every leaf, with ``checksums(...,
host=True)``) is summed here, shard by shard where it lives (a
zero-copy view on CPU devices), ``HOST_BLOCK_ELEMENTS`` elements at a time. The position
terms of blocks laid out alike are kept for reuse (``HOST_WEIGHT_CACHE_BYTES``). The sums
are ``fmix``'s, as the devices take them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .fmix import bits, fmix, weights


def _np_lanes(a: np.ndarray) -> np.ndarray:
    dt = a.dtype
    if dt == np.bool_:
        return a.astype(np.uint32)
    if np.issubdtype(dt, np.complexfloating):
        return np.stack([_np_lanes(np.real(a)), _np_lanes(np.imag(a))], axis=-1)
    size = dt.itemsize
    if bits(dt) < size * 8:
        wide = np.float32 if jnp.issubdtype(dt, jnp.floating) else np.int32
        return a.astype(wide).view(np.uint32)
    a = np.ascontiguousarray(a)
    if size == 8:
        return a.view(np.uint32).reshape(*a.shape, 2)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(np.uint32)


# Elements per step of a host checksum: its temporaries stay a few hundred KiB.
HOST_BLOCK_ELEMENTS = 1 << 14


def _np_sums(a: np.ndarray, origin: Sequence[int], shape: Sequence[int]) -> tuple[int, int]:
    """The two sums over the lanes of ``a``, the block at ``origin`` of an array of
    ``shape``, taken ``HOST_BLOCK_ELEMENTS`` elements at a time."""
    if a.size == 0:
        return 0, 0
    if a.ndim == 0:
        a, origin, shape = a.reshape(1), (0,), (1,)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    row_base = np.full(1, origin[-1], np.int64)  # global index of each row's first element
    for d in range(a.ndim - 1):
        along = (origin[d] + np.arange(a.shape[d], dtype=np.int64)) * strides[d]
        row_base = (row_base[:, None] + along[None, :]).reshape(-1)
    rows = a.reshape(-1, a.shape[-1])
    cols = rows.shape[1]
    step_r, step_c = max(1, HOST_BLOCK_ELEMENTS // cols), min(cols, HOST_BLOCK_ELEMENTS)
    layout = (tuple(origin), a.shape, tuple(shape), a.dtype.str, step_r, step_c)
    s1 = s2 = 0
    for r in range(0, rows.shape[0], step_r):
        for c in range(0, cols, step_c):
            v = _np_lanes(rows[r : r + step_r, c : c + step_c])
            key = (*layout, r, c)
            wh = _WEIGHTS.get(key)
            if wh is None:
                per = math.prod(v.shape[2:])  # lanes per element
                e = row_base[r : r + step_r, None] + np.arange(c, c + v.shape[1], dtype=np.int64)
                idx = e[..., None] * per + np.arange(per, dtype=np.int64)
                idx = (idx.reshape(v.shape) & 0xFFFFFFFF).astype(np.uint32)
                wh = weights(idx, np.uint32)
                _remember(key, wh)
            w, h = wh
            s1 += int(np.sum(v * w, dtype=np.uint32))
            s2 += int(np.sum(fmix(v ^ h, np.uint32), dtype=np.uint32))
    return s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF


# Host checksums of leaves laid out alike (every layer's kernel, each shard at its origin)
# share their position terms: they are kept for reuse, up to this many bytes.
HOST_WEIGHT_CACHE_BYTES = 16 << 20
_WEIGHTS: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
_weight_bytes = [0]


def _remember(key: tuple[Any, ...], wh: tuple[np.ndarray, np.ndarray]) -> None:
    size = wh[0].nbytes + wh[1].nbytes
    if _weight_bytes[0] + size > HOST_WEIGHT_CACHE_BYTES:
        _WEIGHTS.clear()
        _weight_bytes[0] = 0
    if size <= HOST_WEIGHT_CACHE_BYTES:
        _WEIGHTS[key] = wh
        _weight_bytes[0] += size


def np_checksum(a: np.ndarray) -> tuple[int, int]:
    return _np_sums(a, (0,) * a.ndim, a.shape)


def np_box_sums(a: np.ndarray, origin: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """``checksum.box_sums`` on the host: the two sums (``uint32[2]``) over ``a``, the box
    at ``origin`` of a leaf of ``shape``."""
    return np.asarray(_np_sums(a, origin, shape), np.uint32)


def shard_checksum(x: jax.Array) -> tuple[int, int]:
    """``np_checksum`` of a fully addressable array, summed shard by shard (one replica
    of each) where the shards live: zero-copy views on CPU devices, nothing gathered."""
    s1 = s2 = 0
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            origin = [sl.indices(d)[0] for sl, d in zip(shard.index, x.shape, strict=True)]
            a, b = _np_sums(np.asarray(shard.data), origin, x.shape)
            s1, s2 = s1 + a, s2 + b
    return s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF
