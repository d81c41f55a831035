"""The checksum itself, ``fmix32x2``: per-element terms whose sums over a leaf do not depend
on the order they are added in, for ``jax.numpy`` and NumPy alike (``u32`` is either's
``uint32``).

Two sums modulo 2**32 over each leaf's bits (``uint32`` lanes): each value times a hashed
odd weight of its position, and a hash of (value, position). ``checksum`` sums them on the
devices, ``host_sums`` on the host; both give the same numbers.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

CHECKSUM = "fmix32x2"


def bits(dt: Any) -> int:
    """The significant bits of one element of ``dt`` (4 for ``int4``, 8 for ``float8``)."""
    try:
        info = jnp.finfo(dt) if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo(dt)
        return int(info.bits)
    except (TypeError, ValueError):
        return dt.itemsize * 8


def fmix(h: Any, u32: Any) -> Any:
    """MurmurHash3's 32-bit finaliser: a bijective, non-linear mix (jnp or np uint32)."""
    h = h ^ (h >> 16)
    h = h * u32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * u32(0xC2B2AE35)
    return h ^ (h >> 16)


def weights(idx: Any, u32: Any) -> tuple[Any, Any]:
    """The position-only parts of ``terms``: a hashed odd weight and a position hash."""
    return fmix(idx ^ u32(0x9E3779B9), u32) | u32(1), fmix(idx + u32(0x7F4A7C15), u32)


def terms(v: Any, idx: Any, u32: Any) -> tuple[Any, Any]:
    """Per-element terms of the two lanes: value times a hashed position weight, and a hash
    of (value, position). Sums of either over all elements do not depend on order."""
    w, h = weights(idx, u32)
    return v * w, fmix(v ^ h, u32)
