"""How each kind of leaf is stored and read back (``encode``, ``decode``): a typed PRNG key as
its key data, a dtype TensorStore cannot store (``STORED_AS``) as its bits in a same-width
one, a zero-size array not at all (Orbax refuses it: the record says all there is)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._base import CheckpointError, dtype_name

STORED_AS = {"float8_e4m3": "uint8", "uint4": "int4", "uint2": "int2"}
"""Dtypes TensorStore has no name for, each stored as its bits in a same-width one it has."""


class Stored(Protocol):
    """What the codec reads of a leaf's record (``record.LeafRecord`` is one)."""

    shape: tuple[int, ...]
    dtype: str
    stored_shape: tuple[int, ...]
    stored_dtype: str
    key_impl: str | None


def parse_dtype(name: str) -> Any:
    """The dtype named by ``_dtypes.dtype_name`` (PRNG key dtypes are not parsed here)."""
    try:
        return jnp.dtype(name)
    except TypeError as e:
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint record") from e


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``key<fry>``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def key_dtype(impl: str) -> Any:
    """The dtype of the typed keys of the PRNG implementation ``impl`` (``"threefry2x32"``)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


@functools.cache
def key_impl(dtype: Any) -> str | None:
    """The PRNG implementation of a typed key dtype, else None (asked of a traced key)."""
    names: list[str] = []
    if is_key(dtype):
        key = jax.ShapeDtypeStruct((), dtype)
        jax.eval_shape(lambda k: names.append(str(jax.random.key_impl(k))), key)
    return names[0] if names else None


def stored_dtype(dtype: Any) -> str:
    """The name of the dtype a leaf of ``dtype`` (a dtype or its name) is stored in."""
    if is_key(dtype):
        return "uint32"  # the key data of every JAX PRNG implementation
    return STORED_AS.get(dtype_name(dtype), dtype_name(dtype))


def storable(dtype: Any) -> bool:
    """Whether a leaf of ``dtype`` can be stored: TensorStore has its stored dtype."""
    import tensorstore as ts

    try:
        ts.dtype(stored_dtype(dtype))
    except ValueError:
        return False
    return True


def logical_dtype(rec: Stored, cast: Any = None) -> Any:
    """The dtype the leaf of ``rec`` is restored as: its own, or ``cast`` for a float one."""
    if rec.key_impl is not None:
        return key_dtype(rec.key_impl)
    dtype = parse_dtype(rec.dtype)
    return jnp.dtype(cast) if cast is not None and jnp.issubdtype(dtype, jnp.floating) else dtype


def bitcast(x: Any, dtype: Any) -> Any:
    """The bits of ``x`` as ``dtype`` of the same width: a NumPy view, or a JAX bitcast."""
    if x.dtype == dtype:
        return x
    if isinstance(x, np.ndarray | np.generic):
        return x.view(dtype)
    # device_put: a zero-size bitcast forgets its sharding
    return jax.device_put(jax.lax.bitcast_convert_type(x, dtype), x.sharding)


def encode(x: Any) -> Any:
    """What is stored for the array leaf ``x``: its key data, its bits, or ``x`` itself."""
    if is_key(x.dtype):
        return jax.random.key_data(x)
    return bitcast(x, jnp.dtype(stored_dtype(x.dtype)))


def decode(stored: Any, rec: Stored, cast: Any = None) -> Any:
    """The leaf ``rec`` records from its stored array as read (JAX, or NumPy on the host):
    key data wrapped as keys, bits given their dtype, a floating-point leaf cast to ``cast``."""
    if rec.key_impl is not None:
        return jax.random.wrap_key_data(stored, impl=rec.key_impl)
    x = bitcast(stored, parse_dtype(rec.dtype))
    want = logical_dtype(rec, cast)
    return x if x.dtype == want else x.astype(want)


def keys_of(shape: Sequence[int], dtype: Any, impl: str) -> jax.ShapeDtypeStruct:
    """The abstract typed keys of ``impl`` with this key data (TypeError or ValueError if none)."""
    wrap = functools.partial(jax.random.wrap_key_data, impl=impl)
    return jax.eval_shape(wrap, jax.ShapeDtypeStruct(tuple(shape), dtype))


def stored_sharding(sharding: Any, extra: int) -> Any:
    """The sharding of a stored array with ``extra`` unsplit trailing dimensions (key data's)."""
    if extra and isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, *([None] * extra)))
    return sharding


def stored_struct(rec: Stored, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """The stored array of ``rec``, placed with ``sharding`` (its own: ``stored_sharding``)."""
    return jax.ShapeDtypeStruct(rec.stored_shape, parse_dtype(rec.stored_dtype), sharding=sharding)


def is_empty(shape: Sequence[int]) -> bool:
    """Whether an array of ``shape`` is zero-size: nothing of it is stored."""
    return math.prod(shape) == 0


def empty(target: jax.ShapeDtypeStruct) -> Any:
    """The stored array of a zero-size leaf, from its record: on ``target.sharding``, or NumPy."""
    if target.sharding is None:
        return np.zeros(target.shape, target.dtype)
    return jnp.zeros(target.shape, target.dtype, device=target.sharding)


def _numeric(name: str) -> np.dtype[Any]:
    dt = np.dtype(parse_dtype(name))
    if dt.kind not in "biufcV":  # bool, ints, floats of every width, complex
        raise CheckpointError(f"dtype {name!r} is not a numeric dtype")
    return dt


def stored_problem(rec: Stored) -> str | None:
    """What is wrong with how a record read from disk says a leaf is stored, or None."""
    try:
        stored = _numeric(rec.stored_dtype)
        if rec.key_impl is None:
            _numeric(rec.dtype)
    except CheckpointError as e:
        return str(e)
    if rec.key_impl is not None:
        impl = str(rec.key_impl)
        try:
            keys = keys_of(rec.stored_shape, stored, impl)
        except (TypeError, ValueError) as e:
            return f"it is not key data of PRNG impl {impl!r}: {str(e).splitlines()[0][:200]}"
        if keys.shape != rec.shape:
            return f"its key data {list(rec.stored_shape)} holds keys {list(keys.shape)}"
        return None
    if rec.stored_shape == rec.shape and rec.stored_dtype in (rec.dtype, stored_dtype(rec.dtype)):
        return None
    leaf, kept = f"{rec.dtype}{list(rec.shape)}", f"{rec.stored_dtype}{list(rec.stored_shape)}"
    return f"a {leaf} leaf is never stored as {kept}"
