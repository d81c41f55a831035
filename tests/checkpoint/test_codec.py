"""The leaf codec: what is stored for each kind of leaf (typed PRNG keys, dtypes TensorStore
lacks, zero-size arrays) and the leaf read back, on real arrays and through save/restore."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DTYPES, array_bits, assert_bit_exact, values
from modelshard._base import dtype_name
from modelshard._checkpoint.codec import (
    decode,
    empty,
    encode,
    is_empty,
    is_key,
    key_dtype,
    key_impl,
    keys_of,
    logical_dtype,
    stored_dtype,
    stored_problem,
    stored_struct,
)
from modelshard._checkpoint.mapped import host_leaves
from modelshard._checkpoint.ocdbt import array_keys
from modelshard._checkpoint.record import LeafRecord
from modelshard._checkpoint.sources import locate

BITS = {"float8_e4m3": "uint8", "uint4": "int4", "uint2": "int2"}  # stored as their bits
BIT_STORED = [d for d in ["float8_e4m3", "uint4", "uint2"] if hasattr(jnp, d)]
KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


@pytest.fixture
def axis_type():
    """One axis type for conftest's ``mesh8``: the codec does not depend on it."""
    return "auto"


@pytest.fixture
def rows(mesh8):
    return NamedSharding(mesh8, P("data"))


def _rec(x, stored, impl=None):
    return LeafRecord(
        path="x",
        key=("x",),
        shape=tuple(x.shape),
        dtype=dtype_name(x.dtype),
        stored_shape=tuple(stored.shape),
        stored_dtype=dtype_name(stored.dtype),
        key_impl=impl,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_is_stored_in_one_tensorstore_has_and_decoded_bit_exact(dtype, rows):
    x = jax.device_put(values(dtype, (8, 3)), rows)
    stored = encode(x)
    assert stored_dtype(x.dtype) == stored_dtype(dtype) == dtype_name(stored.dtype)
    assert dtype_name(stored.dtype) == BITS.get(dtype, dtype)
    ts.array(np.asarray(stored))  # raises for a dtype TensorStore has no name for
    rec = _rec(x, stored)
    assert stored_problem(rec) is None and logical_dtype(rec) == x.dtype
    back = decode(stored, rec)
    assert array_bits(back) == array_bits(x) and back.sharding == x.sharding
    host = decode(np.asarray(stored), rec)  # an export's read: stays a NumPy array
    assert isinstance(host, np.ndarray) and array_bits(host) == array_bits(x)


@pytest.mark.parametrize("dtype", BIT_STORED)
def test_every_bit_pattern_of_a_bit_stored_dtype_comes_back(dtype):
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.integer):  # every value of a sub-byte integer
        x = jnp.arange(int(jnp.iinfo(dt).min), int(jnp.iinfo(dt).max) + 1).astype(dt)
    else:
        x = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), dt)
    with pytest.raises(ValueError, match="No TensorStore data type"):
        ts.array(np.asarray(x))  # why it is stored as its bits
    stored = encode(x)
    assert stored.dtype == jnp.dtype(BITS[dtype])
    assert array_bits(decode(stored, _rec(x, stored))) == array_bits(x)
    # cast on the way back for a floating-point leaf only
    assert decode(stored, _rec(x, stored), jnp.float32).dtype == (
        jnp.float32 if dtype.startswith("float") else jnp.dtype(dtype)
    )


@pytest.mark.parametrize("impl", KEY_IMPLS)
def test_typed_keys_are_stored_as_key_data_and_wrapped_with_their_impl(impl, rows):
    keys = jax.device_put(jax.random.split(jax.random.key(7, impl=impl), 8), rows)
    data = encode(keys)
    assert dtype_name(data.dtype) == stored_dtype(keys.dtype) == "uint32"
    np.testing.assert_array_equal(data, jax.random.key_data(keys))
    assert is_key(keys.dtype) and not is_key(data.dtype)
    assert key_impl(keys.dtype) == impl and key_dtype(impl) == keys.dtype
    assert key_impl(jax.ShapeDtypeStruct((2,), keys.dtype).dtype) == impl
    assert key_impl(data.dtype) is None
    abstract = keys_of(data.shape, data.dtype, impl)
    assert (abstract.shape, abstract.dtype) == (keys.shape, keys.dtype)
    rec = _rec(keys, data, impl)
    assert stored_problem(rec) is None and logical_dtype(rec, jnp.bfloat16) == keys.dtype
    back = decode(data, rec, jnp.bfloat16)  # a cast never touches keys
    assert array_bits(back) == array_bits(keys)
    assert back.sharding.is_equivalent_to(keys.sharding, keys.ndim)
    problem = stored_problem(_rec(keys, data[..., :1], impl))  # key data cut short
    assert str(problem).startswith(f"it is not key data of PRNG impl {impl!r}")


@pytest.mark.parametrize(
    ("dtype", "stored", "ok"),
    [
        ("float8_e4m3", "uint8", True),
        ("float8_e4m3", "int8", False),
        ("uint4", "int4", True),
        ("uint4", "uint8", False),
        ("bfloat16", "bfloat16", True),
        ("bfloat16", "uint16", False),
    ],
)
def test_a_record_says_how_a_leaf_is_stored_only_as_encode_stores_it(dtype, stored, ok):
    rec = LeafRecord("x", ("x",), (4,), dtype, (4,), stored)
    want = None if ok else f"a {dtype}[4] leaf is never stored as {stored}[4]"
    assert stored_problem(rec) == want


def test_zero_size_leaves_are_not_stored_and_come_back_from_the_record(tmp_path, rows):
    state = {
        "w": jax.device_put(jnp.arange(8.0), rows),
        "f8": jax.device_put(jnp.zeros((8, 0), jnp.float8_e4m3), rows),
        "keys": jax.random.split(jax.random.key(1, impl="rbg"), 0),
        "n": jnp.zeros((0,), jnp.int32),
    }
    assert [is_empty(x.shape) for x in state.values()] == [False, True, True, True]
    assert not is_empty(())  # a scalar has one element
    path = ms.save(tmp_path / "c", state)
    source = locate(path)
    assert array_keys(source.tree_metadata()) == [("w",)]  # Orbax lists the one stored array
    rec = source.record.by_path()["f8"]
    assert (rec.stored_shape, rec.stored_dtype) == ((8, 0), "uint8")
    host = empty(stored_struct(rec))
    assert isinstance(host, np.ndarray) and (host.shape, host.dtype) == ((8, 0), np.uint8)
    assert empty(stored_struct(rec, rows)).sharding == rows
    out = ms.restore(path, like=state)
    assert_bit_exact(state, out)
    assert out["f8"].sharding == rows
    assert_bit_exact(state, ms.restore(path))  # from the record alone
    table, load = host_leaves(source)
    assert sorted(table) == ["f8", "n", "w"]  # typed keys are left out of an export
    assert array_bits(load("f8")) == array_bits(state["f8"])


def test_bit_stored_dtypes_and_keys_round_trip_through_save_and_restore(tmp_path, rows):
    state = {d: jax.device_put(values(d, (8, 3)), rows) for d in [*BIT_STORED, "bfloat16"]}
    for impl in KEY_IMPLS:
        state[f"key_{impl}"] = jax.device_put(
            jax.random.split(jax.random.key(3, impl=impl), 8), rows
        )
    path = ms.save(tmp_path / "c", state)
    recs = locate(path).record.by_path()
    for name, x in state.items():
        assert (recs[name].stored_dtype, recs[name].key_impl) == (
            stored_dtype(x.dtype),
            key_impl(x.dtype),
        )
    out = ms.restore(path, like=state)
    assert_bit_exact(state, out)
    for name, x in out.items():
        assert x.sharding.is_equivalent_to(rows, x.ndim), name
    assert_bit_exact(state, ms.restore(path))
    cast = ms.restore(path, dtype=jnp.float32)  # bits given their dtype before the cast
    np.testing.assert_array_equal(cast["float8_e4m3"], state["float8_e4m3"].astype(jnp.float32))
    assert cast["uint4"].dtype == jnp.uint4  # integers are never cast
    table, load = host_leaves(locate(path))  # an export: each leaf read to the host
    for name in table:
        assert array_bits(load(name)) == array_bits(state[name]), name
