"""Per-call overhead of ``shard_jit`` versus raw ``jax.jit``, ``eqx.filter_jit`` and ``nnx.jit``.

A state of 1,000 small leaves, each sharded over an (8,) CPU mesh, goes through a function
that does almost nothing, so what is timed is dispatch: flattening, cache lookup, argument
handling and rebuilding the output. Every variant runs in the same process, interleaved
round by round so machine noise hits them alike; each number is the median of many calls.

Run: ``python benchmarks/dispatch.py [--leaves 1000] [--rounds 15] [--calls 40] [--markdown]``
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import modelshard as ms  # noqa: E402


class Stack(nnx.Module):
    """An NNX module holding ``n`` parameters."""

    def __init__(self, n: int):
        self.params = nnx.List([nnx.Param(jnp.ones((8, 4))) for _ in range(n)])


def _loss_tree(state: Any) -> Any:
    return sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(state))


def _update_tree(state: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x + 1.0, state)


def _loss_nnx(m: Stack) -> Any:
    return sum(jnp.sum(p[...]) for p in m.params)


def _update_nnx(m: Stack) -> None:
    for p in m.params:
        p[...] = p[...] + 1.0


def variants(n: int) -> dict[str, dict[str, Callable[[], Any]]]:
    """Workload -> variant -> a zero-argument call (its result is blocked on)."""
    mesh = ms.make_mesh({"data": 8})
    spec = P("data")
    sharding = NamedSharding(mesh, spec)
    tree = ms.shard({f"p{i:04d}": jnp.ones((8, 4)) for i in range(n)}, spec, mesh)
    leaves, _ = jax.tree_util.tree_flatten(tree)
    shs = [sharding] * len(leaves)
    module = Stack(n)
    ms.shard(module, spec, mesh)

    raw_loss = jax.jit(lambda *xs: _loss_tree(list(xs)), in_shardings=shs)
    raw_update = jax.jit(
        lambda *xs: tuple(x + 1.0 for x in xs), in_shardings=shs, out_shardings=tuple(shs)
    )
    sj_loss = ms.shard_jit(_loss_tree, mesh=mesh, in_specs=(spec,))
    sj_update = ms.shard_jit(_update_tree, mesh=mesh, in_specs=(spec,))
    eqx_loss = eqx.filter_jit(_loss_tree)
    eqx_update = eqx.filter_jit(_update_tree)
    sjn_loss = ms.shard_jit(_loss_nnx, mesh=mesh, in_specs=(spec,))
    sjn_update = ms.shard_jit(_update_nnx, mesh=mesh, in_specs=(spec,))
    nnx_loss = nnx.jit(_loss_nnx)
    nnx_update = nnx.jit(_update_nnx)

    state = {"tree": tree, "leaves": leaves}

    def raw_upd() -> Any:
        state["leaves"] = list(raw_update(*state["leaves"]))
        return state["leaves"][0]

    def tree_upd(f: Callable[[Any], Any]) -> Callable[[], Any]:
        def call() -> Any:
            state["tree"] = f(state["tree"])
            return state["tree"]["p0000"]

        return call

    def nnx_upd(f: Callable[[Any], Any]) -> Callable[[], Any]:
        def call() -> Any:
            f(module)
            return module.params[0][...]

        return call

    return {
        "loss (1,000 leaves in, scalar out)": {
            "jax.jit (pre-flattened leaves)": lambda: raw_loss(*state["leaves"]),
            "shard_jit (dict)": lambda: sj_loss(state["tree"]),
            "eqx.filter_jit (dict)": lambda: eqx_loss(state["tree"]),
            "shard_jit (nnx.Module)": lambda: sjn_loss(module),
            "nnx.jit (nnx.Module)": lambda: nnx_loss(module),
        },
        "update (1,000 leaves in, 1,000 out)": {
            "jax.jit (pre-flattened leaves)": raw_upd,
            "shard_jit (dict)": tree_upd(sj_update),
            "eqx.filter_jit (dict)": tree_upd(eqx_update),
            "shard_jit (nnx.Module)": nnx_upd(sjn_update),
            "nnx.jit (nnx.Module)": nnx_upd(nnx_update),
        },
    }


def measure(calls: dict[str, Callable[[], Any]], rounds: int, per_round: int) -> dict[str, float]:
    """Median seconds per call of each variant, interleaved round by round."""
    for f in calls.values():  # compile and warm up
        for _ in range(3):
            jax.block_until_ready(f())
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for name, f in calls.items():
            for _ in range(per_round):
                t = time.perf_counter()
                jax.block_until_ready(f())
                times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def report(
    results: dict[str, dict[str, float]], n: int, rounds: int, per_round: int, markdown: bool
) -> str:
    lines = []
    for workload, res in results.items():
        base = res["jax.jit (pre-flattened leaves)"]
        if markdown:
            lines += [
                f"### {workload}",
                "",
                "| variant | median per call | vs raw jax.jit |",
                "|---|---:|---:|",
            ]
            lines += [f"| {k} | {v * 1e6:,.0f} µs | {v / base:.2f}x |" for k, v in res.items()]
            lines.append("")
        else:
            lines.append(workload)
            lines += [f"  {k:34s} {v * 1e6:9,.0f} us  {v / base:5.2f}x" for k, v in res.items()]
        sj_d, sj_n = res["shard_jit (dict)"], res["shard_jit (nnx.Module)"]
        lines.append(
            f"{'- ' if markdown else '  '}shard_jit (dict) / eqx.filter_jit: "
            f"{sj_d / res['eqx.filter_jit (dict)']:.2f}x; shard_jit (nnx) / nnx.jit: "
            f"{sj_n / res['nnx.jit (nnx.Module)']:.2f}x"
        )
        lines.append("")
    env = (
        f"{n} leaves of f32[8,4] sharded P('data') on an (8,) CPU mesh; median of "
        f"{rounds}x{per_round} calls per variant, interleaved; jax {jax.__version__}, "
        f"flax {nnx.__name__ and __import__('flax').__version__}, equinox {eqx.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPU cores."
    )
    return "\n".join([env, "", *lines])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40, help="calls per variant per round")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    results = {
        w: measure(calls, args.rounds, args.calls) for w, calls in variants(args.leaves).items()
    }
    print(report(results, args.leaves, args.rounds, args.calls, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
