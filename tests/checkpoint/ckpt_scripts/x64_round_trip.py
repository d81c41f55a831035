"""64-bit dtypes round trip bit-exact. ``main(root)`` turns ``jax_enable_x64`` on, so it must
run in a process that has not used JAX yet (the crash test's zygote forks one); it prints
``X64 OK <dtypes>``."""

from __future__ import annotations


def main(root: str) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import modelshard as ms

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
    path = ms.save(f"{root}/x64", state)
    for out in [ms.restore(path), ms.restore(path, like=state, specs=P(), mesh=mesh)]:
        for k, v in state.items():
            a, b = np.asarray(v), np.asarray(out[k])
            assert (a.dtype, a.shape) == (b.dtype, b.shape), (k, a.dtype, b.dtype)
            assert a.tobytes() == np.ascontiguousarray(b).tobytes(), k
    print("X64 OK", sorted(str(np.asarray(v).dtype) for v in state.values()), flush=True)
