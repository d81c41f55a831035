"""Every dtype JAX supports here is placed by ``shard`` exactly as ``device_put`` places it,
and planned with the right bytes per device: floats down to float4, sub-byte and 8-64 bit
integers, bool, complex, typed PRNG keys; scalars, zero-size and non-contiguous inputs.

64-bit dtypes need ``jax_enable_x64``, which is process-wide: they run in a subprocess so the
rest of the suite keeps JAX's default.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DTYPES, values


def _bytes(x: Any) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def _ways(entry: Any, sizes: dict[str, int]) -> int:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(sizes[a] for a in axes)


def placed_like_device_put(tree: dict[str, Any], specs: dict[str, P], mesh: Any) -> None:
    """``shard`` matches ``device_put`` leaf by leaf; ``plan`` counts each shard's bytes."""
    p = ms.plan(tree, specs, mesh)
    out = ms.shard(tree, specs, mesh)
    assert set(out) == set(tree)
    for name, x in tree.items():
        want = jax.device_put(x, NamedSharding(mesh, specs[name]))
        got = out[name]
        assert isinstance(got, jax.Array), name
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        assert got.dtype == x.dtype, name  # nothing here is canonicalized away
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), name
        assert _bytes(got) == _bytes(want) == _bytes(x), f"{name}: values changed"
        shard = got.addressable_shards[0].data
        assert p.bytes_per_device(p[name]) == shard.nbytes, name
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        entries = (*specs[name], *[None] * x.ndim)[: x.ndim]
        local = [d // _ways(e, sizes) for d, e in zip(x.shape, entries, strict=True)]
        assert shard.shape == tuple(local), name
        assert p[name].dtype == x.dtype, name


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_placed_and_planned(dtype: str) -> None:
    # Auto and Explicit axes alternate over the dtypes: each is covered, the suite stays fast.
    kind = "explicit" if DTYPES.index(dtype) % 2 else "auto"
    mesh24 = ms.make_mesh({"data": 2, "model": 4}, axis_types=kind)
    x = values(dtype, (16, 16))
    tree = {
        "w": x,
        "jax": jax.device_put(x),
        "scalar": x[3, 5],  # a NumPy scalar (np.generic)
        "zero": x[:0, :8],
        "strided": x[:, ::4],  # non-contiguous: (16, 4) with a stride of 4 elements
        "transposed": x.T,  # non-contiguous: Fortran order
        "reversed": x[::-1],  # negative strides
    }
    assert not tree["strided"].flags.c_contiguous and not tree["transposed"].flags.c_contiguous
    specs = {
        "w": P("data", "model"),
        "jax": P(None, ("data", "model")),
        "scalar": P(),
        "zero": P("data", "model"),
        "strided": P(None, "model"),
        "transposed": P("model", "data"),
        "reversed": P(("model", "data")),
    }
    placed_like_device_put(tree, specs, mesh24)


def test_sub_byte_and_float8_dtypes_exist_here() -> None:
    """The dtype list above is not silently empty: this JAX has int4/uint4 and float8."""
    assert {"int4", "uint4", "float8_e4m3fn", "float8_e5m2"} <= set(DTYPES)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_prng_keys(impl: str, mesh24) -> None:
    key = jax.random.key(0, impl=impl)
    keys = jax.random.split(key, 16)
    tree = {
        "key": key,
        "keys": keys,
        "grid": jax.random.split(key, (8, 4)),
        "none": keys[:0],
        "legacy": jax.random.PRNGKey(0),  # raw uint32 key data
    }
    specs = {
        "key": P(),
        "keys": P(("data", "model")),
        "grid": P("model", "data"),
        "none": P("data"),
        "legacy": P("data"),
    }
    placed_like_device_put(tree, specs, mesh24)
    out = ms.shard(tree, specs, mesh24)
    assert jax.random.key_impl(out["keys"]) == jax.random.key_impl(keys)
    # The placed keys still draw the same numbers.
    assert np.array_equal(jax.random.bits(out["key"]), jax.random.bits(key))
    assert np.array_equal(jax.random.bits(out["keys"][5]), jax.random.bits(keys[5]))


def test_shapes_with_zero_and_prime_sizes(mesh24) -> None:
    x = values("float32", (7, 0, 3))
    tree = {"prime": values("float32", (13,)), "empty": x, "one": values("int8", (1, 1))}
    specs = {"prime": P(), "empty": P(None, ("data", "model")), "one": P(None, None)}
    placed_like_device_put(tree, specs, mesh24)
    with pytest.raises(ms.SpecError) as e:
        ms.shard(tree, {**specs, "prime": P("data")}, mesh24)
    assert [(p.arg, p.path) for p in e.value.problems] == [("tree", "prime")]
    assert (
        "dimension 0 (size 13) is partitioned 2 times (data=2), but 13 is not divisible by 2"
        in str(e.value)
    )


def test_abstract_leaves_of_every_dtype_are_planned(mesh24) -> None:
    tree = {d: jax.ShapeDtypeStruct((16, 12), jnp.dtype(d)) for d in DTYPES}
    tree["key"] = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), (16, 12)))
    p = ms.plan(tree, P("data", "model"), mesh24)
    out = ms.shard(tree, P("data", "model"), mesh24)
    for name, leaf in tree.items():
        itemsize = leaf.dtype.itemsize
        assert p.bytes_per_device(p[name]) == 8 * 3 * itemsize, name
        assert out[name].sharding.is_equivalent_to(NamedSharding(mesh24, P("data", "model")), 2)
        assert out[name].dtype == leaf.dtype


_X64_SCRIPT = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    assert jax.config.jax_enable_x64
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import modelshard as ms

    mesh = ms.make_mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(0)
    tree = {
        "float64": rng.standard_normal((16, 12)),
        "int64": rng.integers(-2**62, 2**62, (16, 12)),
        "uint64": rng.integers(0, 2**63, (16, 12)).astype(np.uint64),
        "complex128": rng.standard_normal((16, 12)) + 1j * rng.standard_normal((16, 12)),
    }
    tree["strided"] = tree["float64"][:, ::3]
    tree["scalar"] = tree["int64"][0, 0]
    specs = {k: P("data", "model") for k in tree}
    specs["scalar"] = P()
    p = ms.plan(tree, specs, mesh)
    out = ms.shard(tree, specs, mesh)
    for k, x in tree.items():
        want = jax.device_put(x, NamedSharding(mesh, specs[k]))
        got = out[k]
        assert got.dtype == x.dtype == want.dtype, (k, got.dtype)
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), k
        assert np.asarray(got).tobytes() == np.ascontiguousarray(x).tobytes(), k
        assert p.bytes_per_device(p[k]) == got.addressable_shards[0].data.nbytes, k
        assert p[k].dtype == x.dtype, k
    print("x64 ok", sorted(tree))
    """
)


def test_64_bit_dtypes_with_x64_in_a_subprocess() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", _X64_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "x64 ok" in run.stdout


def test_bytes_per_device_sums_over_leaves(mesh24) -> None:
    tree = {d: values(d, (16, 12)) for d in DTYPES}
    p = ms.plan(tree, P("data", "model"), mesh24)
    want = sum(8 * 3 * jnp.dtype(d).itemsize for d in DTYPES)
    assert p.bytes_per_device() == want
    assert p.total_bytes == sum(math.prod((16, 12)) * jnp.dtype(d).itemsize for d in DTYPES)
