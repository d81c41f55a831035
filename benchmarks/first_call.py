"""First call of ``shard_jit`` on a new signature (trace + plan + compile) versus ``jax.jit``.

Two workloads, each compiled for the first time in every repetition:

- ``leaves``: a 1,000-leaf dict through an update step (``x * 0.9 + 1``), one spec for the
  state;
- ``demo``: the demo's transformer training step (``examples/demo.py``: an NNX character
  model's parameters and AdamW state, FSDP over 8 devices, with a batch of token ids).

``shard_jit`` gets the spec; ``jax.jit`` gets the same ``in_shardings``/``out_shardings``
(taken from ``ms.plan`` beforehand, outside the timed region) on the same values. Every
repetition builds a fresh function (nothing cached), the two variants alternate, and the
medians are compared.

Run: ``python benchmarks/first_call.py [--workload leaves|demo|both] [--leaves 1000]
[--reps 7]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from results import write_results  # noqa: E402

import modelshard as ms  # noqa: E402

Variant = Callable[[], Any]  # builds a fresh jitted function and runs its first call


def _leaves(n: int) -> dict[str, tuple[Variant, Variant]]:
    mesh = ms.make_mesh({"data": 8})
    state = ms.shard({f"p{i:04d}": jnp.ones((8, 4)) for i in range(n)}, P("data"), mesh)
    shardings = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P("data")), state)

    def step():  # a new function object each time: both caches start empty
        def f(s):
            return jax.tree_util.tree_map(lambda x: x * 0.9 + 1.0, s)

        return f

    def raw():
        jf = jax.jit(step(), in_shardings=(shardings,), out_shardings=shardings)
        return jf(state)

    def ours():
        return ms.shard_jit(step(), mesh=mesh, in_specs=(P("data"),))(state)

    return {f"{n} leaves": (raw, ours)}


def _demo() -> dict[str, tuple[Variant, Variant]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import optax
    from demo import FSDP, CharLM, Config, make_train_step  # pyright: ignore[reportMissingImports]
    from flax import nnx

    cfg = Config()
    tx = optax.adamw(cfg.lr)
    mesh = ms.make_mesh({"data": 8})

    def init_state() -> dict[str, Any]:
        params = nnx.state(CharLM(cfg, nnx.Rngs(0)), nnx.Param)
        return {"params": params, "opt": tx.init(params)}

    state = ms.shard_jit(init_state, mesh=mesh, in_specs=(), out_specs=FSDP)()
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: CharLM(cfg, nnx.Rngs(0))))
    batch = ms.shard(jnp.zeros((cfg.batch, cfg.seq), jnp.int32), P("data"), mesh)
    state_sh = ms.plan(state, FSDP, mesh).shardings
    batch_sh = NamedSharding(mesh, P("data"))
    out_sh = (state_sh, NamedSharding(mesh, P()))

    def raw():
        jf = jax.jit(
            make_train_step(graphdef, tx),
            in_shardings=(state_sh, batch_sh, batch_sh),
            out_shardings=out_sh,
        )
        return jf(state, batch, batch)

    def ours():
        sj = ms.shard_jit(
            make_train_step(graphdef, tx), mesh=mesh, in_specs=(FSDP, P("data"), P("data"))
        )
        return sj(state, batch, batch)

    n = len(jax.tree_util.tree_leaves(state))
    return {f"demo transformer step ({n} leaves)": (raw, ours)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workload", choices=("leaves", "demo", "both"), default="both")
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    workloads: dict[str, tuple[Variant, Variant]] = {}
    if args.workload in ("leaves", "both"):
        workloads.update(_leaves(args.leaves))
    if args.workload in ("demo", "both"):
        workloads.update(_demo())
    print(
        f"first call, median of {args.reps} alternating repetitions "
        f"(jax {jax.__version__}, {os.cpu_count()} CPU cores):"
    )
    figures: dict[str, float | int] = {"reps": args.reps}
    for name, (raw, ours) in workloads.items():
        times: dict[str, list[float]] = {"jax.jit": [], "shard_jit": []}
        for _ in range(args.reps):
            for label, fn in (("jax.jit", raw), ("shard_jit", ours)):
                t = time.perf_counter()
                jax.block_until_ready(fn())
                times[label].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name}:")
        for k, v in med.items():
            print(f"  {k:10s} {v * 1e3:8.1f} ms  {v / med['jax.jit']:.2f}x")
        key = "demo" if name.startswith("demo") else "leaves"
        figures[f"{key}_jax_jit_ms"] = round(med["jax.jit"] * 1e3, 1)
        figures[f"{key}_shard_jit_ms"] = round(med["shard_jit"] * 1e3, 1)
        figures[f"{key}_shard_jit_vs_jax_jit"] = round(med["shard_jit"] / med["jax.jit"], 2)
    write_results("first_call", figures, argv=sys.argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
