"""A save every step: what the checksums cost, and whether memory stays flat.

Run from the repository root::

    .venv/bin/python benchmarks/save_every_step.py                 # 2 processes x 4 devices, 200 saves
    .venv/bin/python benchmarks/save_every_step.py --saves 1000    # the memory figure of issue 34
    .venv/bin/python benchmarks/save_every_step.py --glibc-arenas  # glibc's default arenas

Under ``modelshard launch -n 2 --devices-per-process 4`` each process trains a ~2 MB NNX
model (10 ``nnx.Linear(128, 128)``) with ``nnx.Optimizer(adam)``: 62 leaves, kernels and
biases split over ``model`` on a ``data=2, model=4`` mesh, so every leaf spans both
processes. Each step runs a ``shard_jit`` step and ``CheckpointManager(max_to_keep=3)``
saves asynchronously. The launcher starts the processes with one glibc malloc arena
(``MALLOC_ARENA_MAX=1``, its default when the caller's environment does not set it).

Measured per save, on each process: the wall time of ``mngr.save`` (what the training loop
waits for: the previous step's background write, then this step's copy off the devices), and
within it the time spent on checksums (dispatching them, ``start_checksums``, and collecting
them, ``Record.resolve``), timed by wrapping those two functions. Reported: the median
checksum share of a save (target <= 10%), the median save time, and resident memory
(``VmRSS``) after save 50 and after the last save, as growth per save and as a fraction of the
RSS at save 50 (target: <= 2% over 1,000 saves), and the median time of the training step
itself (what one arena could cost: every thread allocates from it). Figures go to
``docs/benchmarks/results/save_every_step.json``; with ``--glibc-arenas`` the processes run
with glibc's own default, up to 8 arenas per core (``MALLOC_ARENA_MAX`` set to that number,
so the launcher keeps it), and the figures go to ``save_every_step_glibc_arenas.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(args: argparse.Namespace) -> None:
    import modelshard as ms

    ms.distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from modelshard._checkpoint import record as record_mod
    from modelshard._checkpoint import write as write_mod

    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t

        return wrapper

    # prepare() calls start_checksums through write's namespace; resolve is a method
    write_mod.start_checksums = timed(write_mod.start_checksums)
    record_mod.Record.resolve = timed(record_mod.Record.resolve)

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List([nnx.Linear(128, 128, rngs=rngs) for _ in range(10)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    mesh = ms.make_mesh({"data": 2, "model": 4})
    rules = ms.Rules([(r"kernel$", P(None, "model")), (r"bias$", P("model")), (r".*", P())])
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    ms.shard({"model": model, "opt": opt}, rules, mesh)

    @ms.shard_jit(mesh=mesh, in_specs=(rules, rules, P("data")))
    def train_step(model: Model, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    rows = ms.distributed.local_slice((32,), P("data"), mesh)[0]
    x = np.random.default_rng(0).normal(size=(32, 128)).astype(np.float32)
    xb = ms.assemble_process_local(x[rows], P("data"), mesh)
    leaves = len(ms.adapters.split({"model": model, "opt": opt}).arrays)
    saves, sums, rss, steps = [], [], [], []
    with ms.CheckpointManager(args.dir, max_to_keep=3, handle_signals=False) as mngr:
        for step in range(args.saves):
            # the step finishes before the save starts: the checksums wait for the state
            # they sum, which would count the step's own time as theirs
            t = time.perf_counter()
            jax.block_until_ready((train_step(model, opt, xb), nnx.state(model), nnx.state(opt)))
            steps.append(time.perf_counter() - t)
            spent[0] = 0.0
            t = time.perf_counter()
            mngr.save(step, {"model": model, "opt": opt})
            saves.append(time.perf_counter() - t)
            sums.append(spent[0])
            rss.append(_rss_kib())
        mngr.wait_until_finished()
    print(
        "RESULT "
        + json.dumps(
            {
                "process": jax.process_index(),
                "leaves": leaves,
                "save_s": saves,
                "checksum_s": sums,
                "rss_kib": rss,
                "step_s": steps,
                "arenas": os.environ.get("MALLOC_ARENA_MAX"),
            }
        ),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=200, help="saves per run (default 200)")
    ap.add_argument("--warmup", type=int, default=50, help="saves before RSS is compared (50)")
    ap.add_argument(
        "--glibc-arenas",
        action="store_true",
        help="run the processes with glibc's default number of malloc arenas (8 per core)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ms-every-step-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "modelshard",
            "launch",
            "-n",
            "2",
            "--devices-per-process",
            "4",
            "--timeout",
            str(60 + 5 * args.saves),
            "--",
            sys.executable,
            __file__,
            "--child",
            "--saves",
            str(args.saves),
            "--dir",
            str(Path(tmp) / "run"),
        ]
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        if args.glibc_arenas:
            # glibc's own limit on 64-bit, from the CPUs the process may run on
            env["MALLOC_ARENA_MAX"] = str(8 * len(os.sched_getaffinity(0)))
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120 + 5 * args.saves, env=env
        )
    runs = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in out.stdout.splitlines()
        if "RESULT {" in line
    ]
    if out.returncode != 0 or len(runs) != 2:
        print(out.stdout[-4000:], out.stderr[-4000:], sep="\n")
        return 1
    w = min(args.warmup, args.saves - 1)
    figures: dict[str, object] = {"leaves": runs[0]["leaves"], "saves": args.saves}
    print(f"{args.saves} saves, {runs[0]['leaves']} leaves, load {load:.2f} at start")
    for r in sorted(runs, key=lambda r: r["process"]):
        p = r["process"]
        steady = slice(5, None)  # the first saves compile
        share = statistics.median(
            c / s for c, s in zip(r["checksum_s"][steady], r["save_s"][steady], strict=True)
        )
        save = statistics.median(r["save_s"][steady])
        step = statistics.median(r["step_s"][steady])
        checksum = statistics.median(r["checksum_s"][steady])
        at_w, last = r["rss_kib"][w - 1], r["rss_kib"][-1]
        growth = (last - at_w) / at_w
        per_save = (last - at_w) / max(1, args.saves - w)
        print(
            f"  process {p} (MALLOC_ARENA_MAX={r['arenas']}): step {step * 1e3:.1f} ms, "
            f"save {save * 1e3:.1f} ms (medians), checksums {checksum * 1e3:.2f} ms"
            f" = {share:.1%} of the save; RSS {at_w / 1024:.1f} MiB after save {w}, "
            f"{last / 1024:.1f} MiB after save {args.saves} ({growth:+.2%}, "
            f"{per_save:+.1f} KiB per save)"
        )
        figures[f"p{p}_step_ms"] = round(step * 1e3, 2)
        figures[f"p{p}_save_ms"] = round(save * 1e3, 1)
        figures[f"p{p}_checksum_ms"] = round(checksum * 1e3, 2)
        figures[f"p{p}_checksum_share"] = round(share, 4)
        figures[f"p{p}_rss_growth_after_{w}"] = round(growth, 4)
        figures[f"p{p}_rss_kib_per_save"] = round(per_save, 2)
    figures["load_at_start"] = round(load, 2)
    sys.path.insert(0, str(HERE))
    from results import write_results

    figures["malloc_arena_max"] = int(runs[0]["arenas"] or 0)  # 0: not set
    name = "save_every_step_glibc_arenas" if args.glibc_arenas else "save_every_step"
    write_results(name, figures, argv=sys.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
