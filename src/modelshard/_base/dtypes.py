"""Dtype vocabulary shared by planning, steps and checkpoints: one spelling, one canonical form."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def dtype_name(dtype: Any) -> str:
    """``float32``, ``bfloat16``, ``key<fry>``: how plans, errors and records spell a dtype."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def canonical_dtype(dtype: Any) -> Any:
    """The dtype JAX computes in: without ``jax_enable_x64``, ``float64`` is ``float32`` (and
    likewise for int64/uint64/complex128); extended dtypes (PRNG keys) are canonical already."""
    if getattr(dtype, "itemsize", 0) < 8:  # the fast path: nothing narrower changes
        return dtype
    try:
        return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)
    except Exception:  # not a dtype JAX knows: leave it for the caller's own check
        return dtype
