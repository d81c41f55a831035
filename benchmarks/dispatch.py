"""Per-call overhead of ``shard_jit`` versus raw ``jax.jit``, ``eqx.filter_jit`` and ``nnx.jit``.

A state of 1,000 small leaves, each sharded over an (8,) CPU mesh, goes through a function
that does almost nothing, so what is timed is dispatch: flattening, cache lookup, argument
handling and rebuilding the output. Every variant runs in the same process, interleaved
round by round so machine noise hits them alike; each number is the median of many calls.

Run: ``python benchmarks/dispatch.py [--leaves 1000] [--rounds 15] [--calls 40] [--repeats 3]
[--markdown]`` (about a minute per repeat on 2 cores). Each repeat measures every variant
again, interleaved; a time is the median over the repeats, a ratio the median of the
repeats' ratios, and ``shard_jit``'s ratios of each repeat are recorded too (``..._per_repeat``).
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


def _read_tree(state: Any) -> Any:
    return state["p0000"][0, 0] * 2.0


def _update_tree(state: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: x + 1.0, state)


def _read_nnx(m: Stack) -> Any:
    return m.params[0][...][0, 0] * 2.0


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
    # Each NNX variant has a module of its own: ``nnx.jit`` replaces every Variable's
    # array with its outputs on every call, a read too, and a module shared with it would
    # hand ``shard_jit`` those arrays, which cost more to pass to any jit (measured: raw
    # ``jax.jit`` on them against the same call on the arrays ``ms.shard`` placed).
    module = ms.shard(Stack(n), spec, mesh)
    nnx_module = ms.shard(Stack(n), spec, mesh)

    raw_read = jax.jit(lambda *xs: xs[0][0, 0] * 2.0, in_shardings=shs)
    raw_update = jax.jit(
        lambda *xs: tuple(x + 1.0 for x in xs), in_shardings=shs, out_shardings=tuple(shs)
    )
    tree_shardings = jax.tree_util.tree_map(lambda _: sharding, tree)
    jit_read = jax.jit(_read_tree, in_shardings=(tree_shardings,))
    jit_update = jax.jit(_update_tree, in_shardings=(tree_shardings,), out_shardings=tree_shardings)
    sj_read = ms.shard_jit(_read_tree, mesh=mesh, in_specs=(spec,))
    sj_update = ms.shard_jit(_update_tree, mesh=mesh, in_specs=(spec,))
    eqx_read = eqx.filter_jit(_read_tree)
    eqx_update = eqx.filter_jit(_update_tree)
    sjn_read = ms.shard_jit(_read_nnx, mesh=mesh, in_specs=(spec,))
    sjn_update = ms.shard_jit(_update_nnx, mesh=mesh, in_specs=(spec,))
    nnx_read = nnx.jit(_read_nnx)
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

    def nnx_upd(f: Callable[[Any], Any], m: Stack) -> Callable[[], Any]:
        def call() -> Any:
            f(m)
            return m.params[0][...]

        return call

    return {
        READ: {
            RAW: lambda: raw_read(*state["leaves"]),
            "jax.jit (the dict)": lambda: jit_read(state["tree"]),
            "shard_jit (the dict)": lambda: sj_read(state["tree"]),
            "eqx.filter_jit (the dict)": lambda: eqx_read(state["tree"]),
            "shard_jit (nnx.Module)": lambda: sjn_read(module),
            "nnx.jit (nnx.Module)": lambda: nnx_read(nnx_module),
        },
        UPDATE: {
            RAW: raw_upd,
            "jax.jit (the dict)": tree_upd(jit_update),
            "shard_jit (the dict)": tree_upd(sj_update),
            "eqx.filter_jit (the dict)": tree_upd(eqx_update),
            "shard_jit (nnx.Module)": nnx_upd(sjn_update, module),
            "nnx.jit (nnx.Module)": nnx_upd(nnx_update, nnx_module),
        },
    }


RAW = "jax.jit (pre-flattened leaves)"
READ = "read: 1,000 leaves in, one scalar out (dispatch only)"
UPDATE = "update: 1,000 leaves in, 1,000 out (x + 1, a train step's shape)"


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


def report(results: dict[str, tuple[dict[str, float], int, int]], n: int, markdown: bool) -> str:
    lines = []
    for workload, (res, rounds, per_round) in results.items():
        base = res[RAW]
        note = f"median of {rounds} rounds x {per_round} calls per variant"
        if markdown:
            lines += [
                f"### {workload}",
                "",
                note,
                "",
                "| variant | median per call | vs raw jax.jit |",
                "|---|---:|---:|",
            ]
            lines += [f"| {k} | {v * 1e6:,.0f} us | {v / base:.2f}x |" for k, v in res.items()]
        else:
            lines += [workload, f"  ({note})"]
            lines += [f"  {k:34s} {v * 1e6:9,.0f} us  {v / base:5.2f}x" for k, v in res.items()]
        d = res["shard_jit (the dict)"]
        ratios = (
            f"shard_jit / jax.jit on the same dict: {d / res['jax.jit (the dict)']:.2f}x; "
            f"shard_jit / eqx.filter_jit: {d / res['eqx.filter_jit (the dict)']:.2f}x; "
            f"shard_jit / nnx.jit on the module: "
            f"{res['shard_jit (nnx.Module)'] / res['nnx.jit (nnx.Module)']:.2f}x"
        )
        lines += ["", ratios if markdown else f"  {ratios}", ""]
    env = (
        f"{n} leaves of f32[8,4] sharded P('data') on an (8,) CPU mesh (simulated devices), "
        f"variants interleaved round by round; jax {jax.__version__}, "
        f"flax {__import__('flax').__version__}, equinox {eqx.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPU cores."
    )
    return "\n".join([env, "", *lines])


def _ratio(r: float) -> float:
    """A ratio to two decimals, or two significant digits below 0.1 (``0.013``)."""
    return round(r, 2) if r >= 0.1 else float(f"{r:.2g}")


def _slug(variant: str) -> str:
    """A figure name for a variant: ``shard_jit (the dict)`` -> ``shard_jit_the_dict``."""
    name = "".join(c if c.isalnum() else "_" for c in variant).strip("_")
    while "__" in name:
        name = name.replace("__", "_")
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40, help="read calls per variant per round")
    ap.add_argument(
        "--update-calls",
        type=int,
        default=4,
        help="update calls per variant per round (each runs 1,000 tiny kernels)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="whole measurements (default 3)")
    ap.add_argument("--read-only", action="store_true", help="skip the update workload")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    work = variants(args.leaves)
    runs: list[dict[str, tuple[dict[str, float], int, int]]] = []
    for _ in range(args.repeats):
        run = {READ: (measure(work[READ], args.rounds, args.calls), args.rounds, args.calls)}
        if not args.read_only:
            run[UPDATE] = (
                measure(work[UPDATE], args.rounds, args.update_calls),
                args.rounds,
                args.update_calls,
            )
        runs.append(run)
    results = {
        w: ({k: statistics.median(r[w][0][k] for r in runs) for k in res}, n, c)
        for w, (res, n, c) in runs[0].items()
    }
    print(report(results, args.leaves, args.markdown))
    per_repeat = {
        (w, k): [_ratio(r[w][0][k] / r[w][0][RAW]) for r in runs]
        for w, (res, _, _) in results.items()
        for k in res
    }
    for (w, k), ratios in per_repeat.items():
        if "shard_jit" in k:
            print(f"  {w.split(':')[0]} {k}: per repeat {ratios}")
    if args.read_only:  # docs/benchmarks/dispatch.md shows both workloads from one run
        print("--read-only: docs/benchmarks/results/dispatch.json left as it was")
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results import write_results

    figures: dict[str, Any] = {
        "leaves": args.leaves,
        "rounds": args.rounds,
        "read_calls": args.calls,
        "update_calls": args.update_calls,
        "repeats": args.repeats,
    }
    for w, (res, _, _) in results.items():
        slug = w.split(":")[0].lower()
        for k, v in res.items():
            name = _slug(k)
            figures[f"{slug}_{name}_us"] = round(v * 1e6)
            # the median of the repeats' ratios (each repeat's variants measured together)
            figures[f"{slug}_{name}_vs_raw_jit"] = statistics.median(per_repeat[(w, k)])
            if "shard_jit" in k:
                figures[f"{slug}_{name}_vs_raw_jit_per_repeat"] = per_repeat[(w, k)]
        d = res["shard_jit (the dict)"]
        figures[f"{slug}_shard_jit_the_dict_vs_jax_jit_the_dict"] = _ratio(
            d / res["jax.jit (the dict)"]
        )
        figures[f"{slug}_shard_jit_the_dict_vs_eqx_filter_jit"] = _ratio(
            d / res["eqx.filter_jit (the dict)"]
        )
        figures[f"{slug}_shard_jit_nnx_Module_vs_nnx_jit"] = _ratio(
            res["shard_jit (nnx.Module)"] / res["nnx.jit (nnx.Module)"]
        )
        figures[f"{slug}_raw_jit_us"] = round(res[RAW] * 1e6)
    figures["load_at_end"] = round(os.getloadavg()[0], 2)
    write_results("dispatch", figures, argv=sys.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
