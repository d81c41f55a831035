"""Checkpoint reliability: bit-exact round trips of every dtype, SIGKILLed saves, damaged and
hostile checkpoints, and two writers on one directory.

Every case ends either bit-exact or in a ``CheckpointError``; nothing else may escape and no
wrong value may come back. The numbers these tests measure are in ``docs/reliability.md``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from test_dtypes import DTYPES, values

SCRIPTS = Path(__file__).parent / "ckpt_scripts"
KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


def _bits(x: Any) -> tuple[str, tuple[int, ...], bytes]:
    """dtype, shape and raw bytes: what "bit-exact" compares (typed keys by their data)."""
    dtype = str(x.dtype)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        dtype = f"{dtype}:{jax.random.key_impl(x)}"
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return dtype, a.shape, np.ascontiguousarray(a).tobytes()


def assert_bit_exact(want: dict[str, Any], got: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if _bits(want[k]) != _bits(got[k])]
    assert not bad, f"not bit-exact: {bad}"


# ---- every dtype -------------------------------------------------------------------------


def every_dtype_state(mesh: Any) -> dict[str, Any]:
    """Each dtype sharded (8, 3), as a scalar and zero-size; typed keys; odd NumPy inputs."""
    tree: dict[str, Any] = {}
    for dt in DTYPES:
        tree[f"{dt}/sharded"] = ms.shard(jnp.asarray(values(dt, (8, 3))), P("data"), mesh)
        tree[f"{dt}/scalar"] = jnp.asarray(values(dt, (), seed=1))
        tree[f"{dt}/empty"] = ms.shard(jnp.asarray(values(dt, (0, 4))), P("data"), mesh)
    for dt in ["float32", "bfloat16", "int4", "int8", "bool", "complex64"]:
        tree[f"{dt}/numpy_strided"] = values(dt, (6, 10), seed=2)[::2, 1::3]
    for impl in KEY_IMPLS:
        keys = jax.random.split(jax.random.key(7, impl=impl), 8)
        tree[f"key_{impl}/sharded"] = ms.shard(keys, P("data"), mesh)
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


def test_zero_size_only_state_is_refused_clearly(tmp_path):
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", {"a": jnp.zeros((0, 3)), "b": jnp.zeros(0, jnp.int8)})
    assert str(e.value) == "nothing to save: every array leaf of the dict is zero-size."
    assert not (tmp_path / "c").exists()


_X64 = """
import sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 8)
import modelshard as ms
from jax.sharding import PartitionSpec as P
assert jax.config.jax_enable_x64
mesh = ms.make_mesh({"data": 8})
rng = np.random.default_rng(0)
state = {
    "f64": ms.shard(jnp.asarray(rng.standard_normal((8, 5))), P("data"), mesh),
    "i64": jnp.asarray(rng.integers(-(2**62), 2**62, (3, 4)), jnp.int64),
    "u64": jnp.asarray(rng.integers(0, 2**63, 7, dtype=np.uint64) * 2 + 1),
    "c128": jnp.asarray(rng.standard_normal(6) + 1j * rng.standard_normal(6)),
    "f64_scalar": jnp.float64(np.pi),
    "i64_empty": jnp.zeros((0, 2), jnp.int64),
    "u64_strided": (np.arange(40, dtype=np.uint64) * (2**40 + 3))[::3],
}
path = ms.save(sys.argv[1], state)
for out in [ms.restore(path), ms.restore(path, like=state, specs=P(), mesh=mesh)]:
    for k, v in state.items():
        a, b = np.asarray(v), np.asarray(out[k])
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (k, a.dtype, b.dtype)
        assert a.tobytes() == np.ascontiguousarray(b).tobytes(), k
print("X64 OK", sorted(str(np.asarray(v).dtype) for v in state.values()))
"""


def test_64_bit_dtypes_round_trip_under_x64_in_a_subprocess(tmp_path):
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", _X64, str(tmp_path / "c")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == (
        "X64 OK ['complex128', 'float64', 'float64', 'int64', 'int64', 'uint64', 'uint64']"
    )
