"""Every dtype on disk and back bit for bit (``_checkpoint/stored.py`` and the record's
``stored_as``): what TensorStore lacks stored as bits, 64-bit under x64, resharded as stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DTYPES, assert_bit_exact, values

SCRIPTS = Path(__file__).parent / "ckpt_scripts"


KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


def every_dtype_state(mesh: Any) -> dict[str, Any]:
    """Each dtype sharded (8, 3), as a scalar and zero-size; typed keys; odd NumPy inputs."""
    rows = NamedSharding(mesh, P("data"))
    tree: dict[str, Any] = {}
    for dt in DTYPES:
        tree[f"{dt}/sharded"] = jax.device_put(values(dt, (8, 3)), rows)
        tree[f"{dt}/scalar"] = jnp.asarray(values(dt, (), seed=1))
        tree[f"{dt}/empty"] = jax.device_put(values(dt, (0, 4)), rows)
    for dt in ["float32", "bfloat16", "int4", "int8", "bool", "complex64"]:
        tree[f"{dt}/numpy_strided"] = values(dt, (6, 10), seed=2)[::2, 1::3]
    for impl in KEY_IMPLS:
        keys = jax.random.split(jax.random.key(7, impl=impl), 8)
        tree[f"key_{impl}/sharded"] = jax.device_put(keys, rows)
        tree[f"key_{impl}/scalar"] = jax.random.key(3, impl=impl)
        tree[f"key_{impl}/empty"] = jax.random.split(jax.random.key(1, impl=impl), 0)
    f32 = np.arange(60, dtype=np.float32).reshape(6, 10)
    tree["numpy/transposed"] = f32.T
    tree["numpy/fortran"] = np.asfortranarray(f32)
    tree["numpy/negative_stride"] = f32[::-1, ::-2]
    tree["numpy/broadcast"] = np.broadcast_to(np.arange(3, dtype=np.int32), (4, 3))
    tree["numpy/scalar"] = np.float32(2.5)
    return {k.replace("/", "_"): v for k, v in tree.items()}


def test_every_dtype_round_trips_bit_exact(tmp_path):
    mesh8 = ms.make_mesh({"data": 8})
    mesh24 = ms.make_mesh({"data": 2, "model": 4}, axis_types="explicit")
    state = every_dtype_state(mesh8)
    path = ms.save(tmp_path / "c", state)
    assert_bit_exact(state, ms.restore(path))
    # onto another mesh, through the planning pipeline, every leaf sharded where it divides
    specs = ms.fsdp("model", min_size=0)
    out = ms.restore(path, like=state, specs=specs, mesh=mesh24)
    assert_bit_exact(state, out)
    for name, want in zip(
        sorted(state), ms.plan(out, specs, mesh24).flat_shardings(0), strict=True
    ):
        assert out[name].sharding.is_equivalent_to(want, out[name].ndim), name
    assert out["float8_e4m3fn_sharded"].sharding.spec == P("model")
    # and through CheckpointManager's two-item layout
    with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
        mngr.save(1, state)
        assert_bit_exact(state, mngr.restore(1))


def test_dtype_list_covers_what_jax_has():
    for name in ["float8_e4m3", "float8_e5m2", "float4_e2m1fn", "int4", "uint4", "bfloat16"]:
        assert hasattr(jnp, name) == (name in DTYPES), name


def test_dtypes_tensorstore_lacks_are_stored_as_bits(tmp_path):
    import json

    state = {dt: jnp.asarray(values(dt, (5,))) for dt in ["float8_e4m3", "uint4", "uint2"]}
    ms.save(tmp_path / "c", state)
    rec = json.loads((tmp_path / "c" / "modelshard.json").read_text())
    stored = {leaf["path"]: (leaf["dtype"], leaf["stored_dtype"]) for leaf in rec["leaves"]}
    assert stored == {
        "float8_e4m3": ("float8_e4m3", "uint8"),
        "uint4": ("uint4", "int4"),
        "uint2": ("uint2", "int2"),
    }
    assert_bit_exact(state, ms.restore(tmp_path / "c"))
    out = ms.restore(tmp_path / "c", dtype=jnp.float32)
    assert out["float8_e4m3"].dtype == jnp.float32
    np.testing.assert_array_equal(out["float8_e4m3"], state["float8_e4m3"].astype(jnp.float32))
    assert out["uint4"].dtype == jnp.uint4  # integers are never cast


def test_64_bit_dtypes_round_trip_under_x64_in_a_subprocess(zygote):
    """float64, int64, uint64, complex128 need ``jax_enable_x64``, which is process-wide: a
    child forked from the zygote turns it on before it first uses JAX."""
    assert zygote.x64(timeout_s=120) == (
        "X64 OK ['complex128', 'float64', 'float64', 'int64', 'int64', 'uint64', 'uint64']"
    )


def test_reshard_keeps_bitcast_and_zero_size_leaves_bit_exact(tmp_path):
    from modelshard._checkpoint.resharding import reshard

    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = {
        "f8": jnp.asarray(values("float8_e4m3", (8, 4))),
        "u4": jnp.asarray(values("uint4", (8, 4))),
        "empty": jnp.zeros((0, 8), jnp.bfloat16),
        "key": jax.random.split(jax.random.key(2), 8),
        "w": jnp.arange(32.0).reshape(8, 4),
    }
    ms.save(tmp_path / "src", state)
    reshard(tmp_path / "src", tmp_path / "dst", mesh=mesh, specs=P("model"), chunk_bytes=1)
    out = ms.restore(tmp_path / "dst")
    assert_bit_exact(state, out)
    assert out["f8"].sharding.spec == P("model")
