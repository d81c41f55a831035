"""First call of ``shard_jit`` on a new signature (trace + plan + compile) versus ``jax.jit``.

A 1,000-leaf state goes through an update step (``x * 0.9 + 1``) compiled for the first
time: ``shard_jit`` with one spec for the state, against ``jax.jit`` with the same
``in_shardings``/``out_shardings`` on the same dict. Every repetition builds a fresh
function (nothing cached), the two variants alternate, and the medians are compared.

Run: ``python benchmarks/first_call.py [--leaves 1000] [--reps 7]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import modelshard as ms  # noqa: E402


def _step():
    # A new function object each time: jax.jit's and shard_jit's caches start empty.
    def step(state):
        return jax.tree_util.tree_map(lambda x: x * 0.9 + 1.0, state)

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    mesh = ms.make_mesh({"data": 8})
    state = ms.shard({f"p{i:04d}": jnp.ones((8, 4)) for i in range(args.leaves)}, P("data"), mesh)
    shardings = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P("data")), state)
    times: dict[str, list[float]] = {"jax.jit": [], "shard_jit": []}
    for _ in range(args.reps):
        t = time.perf_counter()
        jf = jax.jit(_step(), in_shardings=(shardings,), out_shardings=shardings)
        jax.block_until_ready(jf(state))
        times["jax.jit"].append(time.perf_counter() - t)
        t = time.perf_counter()
        sj = ms.shard_jit(_step(), mesh=mesh, in_specs=(P("data"),))
        jax.block_until_ready(sj(state))
        times["shard_jit"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"first call, {args.leaves} leaves, median of {args.reps} alternating repetitions "
        f"(jax {jax.__version__}, {os.cpu_count()} CPU cores):"
    )
    for k, v in med.items():
        print(f"  {k:10s} {v * 1e3:8.1f} ms  {v / med['jax.jit']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
