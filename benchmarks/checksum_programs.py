"""Checksum programs: what their first call costs (tracing, compiling) and what each later
call costs, by number of leaves.

Run from the repository root::

    .venv/bin/python benchmarks/checksum_programs.py            # 3 repeats
    .venv/bin/python benchmarks/checksum_programs.py --no-write # print only

The leaves are float32 arrays on a (2, 4) mesh of 8 simulated CPU devices, alternately
``P("data", "model")`` and ``P(None, "model")``. Three ways to sum them:

- ``unrolled``: one program per mesh whose body repeats each leaf's block sums, traced
  leaf by leaf (how a save summed its leaves before);
- ``save``: ``checksum.dispatch_sums``, one program per mesh whose body calls one jitted
  block-sum function per shape and layout (traced once, called for every leaf alike);
- ``restore``: ``checksum.dispatch_leaf_sums``, a program per shape and layout, called
  once per leaf, and one all-reduce per mesh adding their block sums.

For each case and way: the first call (trace, lower, compile, run, fetch), after every
cache of JAX and of modelshard was cleared, and the median of 20 later calls (dispatch,
run, fetch); medians over ``--repeats``, the ways' order rotating. For 64 leaves the first
call of ``unrolled`` and ``save`` is also split into tracing and lowering against
compiling. Figures go to ``docs/benchmarks/results/checksum_programs.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import modelshard as ms  # noqa: E402
from modelshard._checkpoint import checksum as cs  # noqa: E402

CASES = {"61_small": (61, (64, 128)), "300_small": (300, (64, 128)), "32_big": (32, (1024, 1024))}
SPECS = (P("data", "model"), P(None, "model"))


@functools.cache
def _unrolled(mesh: Any, specs: tuple[Any, ...], shapes: tuple[tuple[int, ...], ...]) -> Any:
    """The save's program as it was: every leaf's block sums traced in the body."""

    def blocks(*xs: jax.Array) -> jax.Array:
        rows = [cs._block_sums(mesh, s, sh, x) for x, s, sh in zip(xs, specs, shapes, strict=True)]
        return jax.lax.psum(jnp.stack(rows), tuple(mesh.axis_names))

    mapped = jax.shard_map(blocks, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    return jax.jit(mapped)


def _unrolled_sums(xs: list[jax.Array]) -> list[Any]:
    mesh = xs[0].sharding.mesh
    program = _unrolled(mesh, tuple(x.sharding.spec for x in xs), tuple(x.shape for x in xs))
    return jax.device_get(program(*xs)).tolist()


WAYS: dict[str, Callable[[list[jax.Array]], Any]] = {
    "unrolled": _unrolled_sums,
    "save": lambda xs: cs.dispatch_sums(xs)(),
    "restore": lambda xs: cs.dispatch_leaf_sums(xs)(),
}


def _clear() -> None:
    jax.clear_caches()
    _unrolled.cache_clear()
    for f in (cs._mesh_program, cs._leaf_blocks, cs._block_program, cs._add_blocks):
        f.cache_clear()


def _leaves(mesh: Any, n: int, shape: tuple[int, int]) -> list[jax.Array]:
    return [
        jax.device_put(jnp.full(shape, float(i), jnp.float32), NamedSharding(mesh, SPECS[i % 2]))
        for i in range(n)
    ]


def _split(mesh: Any, n: int) -> dict[str, float]:
    """Tracing and lowering against compiling, for ``unrolled`` and ``save``'s program."""
    out = {}
    t = jax.ShapeDtypeStruct((1024, 1032), jnp.float32, sharding=NamedSharding(mesh, SPECS[0]))
    args = (tuple([SPECS[0]] * n), tuple([t.shape] * n))
    for way, make in (("unrolled", _unrolled), ("save", cs._mesh_program)):
        _clear()
        start = time.perf_counter()
        lowered = make(mesh, *args).lower(*[t] * n)
        mid = time.perf_counter()
        lowered.compile()
        out[f"{way}_{n}_trace_lower_s"] = mid - start
        out[f"{way}_{n}_compile_s"] = time.perf_counter() - mid
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="repeats (default 3)")
    ap.add_argument("--no-write", action="store_true", help="print only, write no results file")
    args = ap.parse_args(argv)
    cs._settle_config()
    mesh = ms.make_mesh({"data": 2, "model": 4})
    warm = _leaves(mesh, 2, (64, 128))
    cs.dispatch_sums(warm)()  # the process's first lowering (MLIR context and the like)
    runs: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for case, (n, shape) in CASES.items():
            xs = _leaves(mesh, n, shape)
            ways = list(WAYS)
            for way in ways[r % 3 :] + ways[: r % 3]:
                _clear()
                start = time.perf_counter()
                got = WAYS[way](xs)
                runs.setdefault(f"{case}_{way}_first_s", []).append(time.perf_counter() - start)
                later = []
                for _ in range(20):
                    start = time.perf_counter()
                    WAYS[way](xs)
                    later.append(time.perf_counter() - start)
                runs.setdefault(f"{case}_{way}_later_ms", []).append(1e3 * statistics.median(later))
                if [tuple(map(int, s)) for s in got] != cs.dispatch_sums(xs)():
                    raise SystemExit(f"{case}/{way}: sums differ from dispatch_sums'")
        for k, v in _split(mesh, 64).items():
            runs.setdefault(k, []).append(v)
    figures: dict[str, Any] = {"repeats": args.repeats}
    for k, v in runs.items():
        figures[k] = round(statistics.median(v), 3 if k.endswith("_s") else 1)
    for case in CASES:
        figures[f"{case}_save_first_vs_unrolled"] = round(
            figures[f"{case}_save_first_s"] / figures[f"{case}_unrolled_first_s"], 2
        )
        figures[f"{case}_restore_first_vs_save"] = round(
            figures[f"{case}_restore_first_s"] / figures[f"{case}_save_first_s"], 2
        )
    width = max(map(len, figures))
    for k, v in figures.items():
        print(f"{k:<{width}}  {v}")
    if not args.no_write:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from results import write_results

        write_results("checksum_programs", figures, argv=sys.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
