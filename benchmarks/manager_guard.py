"""Cost of the CheckpointManager exit guard on code that raises exceptions through frames.

Run from the repository root::

    .venv/bin/python benchmarks/manager_guard.py

The guard watches the ``__main__`` module's end with ``sys.monitoring``: the module's
return is a local event (free elsewhere); its unwinding is a global ``PY_UNWIND`` event,
which calls back for every frame that exits by an exception, so it is switched on only
while a save is pending (or a stop was requested). This times a loop whose every iteration
raises through one frame and catches it (the worst case for that event), in this process:
with no manager, with an idle manager, with an asynchronous save pending, and after
``wait_until_finished``. It prints each as a ratio to the loop without a manager (median
of ``--repeats``, interleaved) and writes them to ``docs/benchmarks/results/manager_guard.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

from results import write_results

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _raise() -> None:
    raise KeyError(1)


def _catch() -> None:
    with contextlib.suppress(KeyError):
        _raise()


def _loop(n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        _catch()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import jax.numpy as jnp

    import modelshard as ms

    n = args.iterations
    base, idle, pending, after = [], [], [], []
    for r in range(args.repeats):
        base.append(_loop(n))
        mngr = ms.CheckpointManager(tempfile.mkdtemp(), handle_signals=False)
        idle.append(_loop(n))
        mngr.save(r, {"w": jnp.ones(1 << 16)})
        pending.append(_loop(n))
        mngr.wait_until_finished()
        after.append(_loop(n))
        mngr.close()
    b = statistics.median(base)
    print(f"raise-and-catch loop, {n} iterations, median of {args.repeats}:")
    print(f"  no manager            1.00x  ({b * 1e9 / n:.0f} ns per iteration)")
    figures: dict[str, float | int] = {
        "iterations": n,
        "repeats": args.repeats,
        "baseline_ns_per_iteration": round(b * 1e9 / n),
    }
    for name, key, times in [
        ("idle manager", "idle", idle),
        ("save pending", "pending", pending),
        ("after wait", "after_wait", after),
    ]:
        print(f"  {name:<20}  {statistics.median(times) / b:.2f}x")
        figures[f"{key}_vs_baseline"] = round(statistics.median(times) / b, 2)
    write_results("manager_guard", figures, argv=sys.argv)


if __name__ == "__main__":
    main()
