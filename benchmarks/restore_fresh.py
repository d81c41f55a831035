"""A restore in a fresh process: ``modelshard.restore`` vs plain Orbax vs the disk floor.

Run from the repository root::

    .venv/bin/python benchmarks/restore_fresh.py                    # 384 MiB, 48 leaves, 3 repeats
    .venv/bin/python benchmarks/restore_fresh.py --mib 128 --leaves 16  # quick look

A job that resumes restores once, in a process that has done nothing else, so what it waits
for includes every first-call cost: importing the library, compiling its programs, setting up
Orbax's handlers, reading the metadata. Each repeat starts one fresh process per method
(the order rotating from repeat to repeat), which starts JAX with 8 CPU devices and then
times, from before it imports the library until the arrays are ready:

- ``modelshard``: ``import modelshard``; ``ms.restore(path, specs=fsdp("data"), mesh)``
  (checksums verified, as by default);
- ``unverified``: the same with ``verify=False`` (what the checksums cost a first call);
- ``orbax``: ``import orbax.checkpoint``; ``StandardCheckpointer().restore`` onto the same
  sharded ``ShapeDtypeStruct`` targets, from Orbax's own checkpoint of the same state;
- ``floor``: ``np.load`` of one ``.npy`` file per leaf + ``jax.device_put`` onto the same
  shardings.

Each process then restores a second time and reports both times, so that what the first call
alone costs is visible. Reads are from a warm page cache: the parent reads the method's
files, untimed, just before starting its process (``checkpoint.warm``: this machine pages
out file data left untouched, so files written minutes earlier may come from disk again).
Each process also reports its CPU time (``time.process_time``, all threads), less
sensitive than wall time to the other work on a shared machine. "Of the floor" is the floor's time
over the method's time (a throughput fraction; issue 34's target for modelshard: >= 0.6).
Medians over the repeats go to ``docs/benchmarks/results/restore_fresh.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.devices()
    method, root, shapes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    mesh = jax.make_mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    t0, c0 = time.perf_counter(), time.process_time()
    if method in ("modelshard", "unverified"):
        import modelshard as ms
        def restore():
            return ms.restore(root + "/ms", specs=ms.fsdp("data"), mesh=mesh,
                              verify=method == "modelshard")
    elif method == "orbax":
        import orbax.checkpoint as ocp
        target = {k: {"w": jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=sharding)}
                  for k, s in shapes.items()}
        def restore():
            return ocp.StandardCheckpointer().restore(root + "/orbax", target)
    else:
        def restore():
            host = {k: {"w": np.load(f"{root}/np/{k}.npy")} for k in shapes}
            return jax.device_put(host, jax.tree.map(lambda _: sharding, host))
    t_import = time.perf_counter()
    jax.block_until_ready(restore())
    t1, c1 = time.perf_counter(), time.process_time()
    jax.block_until_ready(restore())
    t2, c2 = time.perf_counter(), time.process_time()
    print(json.dumps({"first_s": t1 - t0, "import_s": t_import - t0, "second_s": t2 - t1,
                      "first_cpu_s": c1 - c0, "second_cpu_s": c2 - c1,
                      "imports_orbax": int("orbax.checkpoint" in sys.modules)}))
    """
)

METHODS = ("modelshard", "unverified", "orbax", "floor")
READS = {"modelshard": "ms", "unverified": "ms", "orbax": "orbax", "floor": "np"}  # its files


def _setup(root: Path, mib: float, leaves: int) -> dict[str, list[int]]:
    """The three checkpoints of one state; returns each leaf's shape."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    import modelshard as ms

    rows = 2048
    cols = max(8, int(mib * (1 << 20) / 4 / leaves / rows) // 8 * 8)
    keys = jax.random.split(jax.random.key(0), leaves)
    mesh = ms.make_mesh({"data": 8})
    state = ms.shard(
        {
            f"layer{i:03d}": {"w": jax.random.normal(k, (rows, cols), jnp.float32)}
            for i, k in enumerate(keys)
        },
        ms.fsdp("data"),
        mesh,
    )
    ms.save(root / "ms", state)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(root / "orbax", state)
    ckptr.wait_until_finished()
    (root / "np").mkdir()
    for name, leaf in state.items():
        np.save(root / "np" / f"{name}.npy", np.asarray(leaf["w"]))
    return {name: [rows, cols] for name in state}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=384, help="state size in MiB (default 384)")
    ap.add_argument("--leaves", type=int, default=48, help="number of leaves (default 48)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per method (3)")
    ap.add_argument("--notes", default="", help="recorded in the results file")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from checkpoint import warm

    root = Path(tempfile.mkdtemp(prefix="ms-restore-fresh-"))
    try:
        shapes = _setup(root, args.mib, args.leaves)
        child = root / "child.py"
        child.write_text(CHILD)
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for r in range(args.repeats):
            k = r % len(METHODS)
            for m in METHODS[k:] + METHODS[:k]:
                warm(root / READS[m])
                out = subprocess.run(
                    [sys.executable, str(child), m, str(root), json.dumps(shapes)],
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if out.returncode != 0:
                    print(out.stderr[-3000:])
                    return 1
                runs[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(r * c * 4 for r, c in shapes.values())
    figures: dict[str, object] = {
        "state_mib": round(nbytes / (1 << 20)),
        "leaves": args.leaves,
        "repeats": args.repeats,
    }
    print(f"{nbytes / (1 << 20):.0f} MiB in {args.leaves} leaves, {args.repeats} repeats")
    for m in METHODS:
        for k in ("first_s", "import_s", "second_s", "first_cpu_s", "second_cpu_s"):
            figures[f"{m}_{k}"] = round(statistics.median(x[k] for x in runs[m]), 2)
        print(
            f"  {m:10s} first call {figures[f'{m}_first_s']} s (of which import "
            f"{figures[f'{m}_import_s']} s), second {figures[f'{m}_second_s']} s"
        )
    figures["modelshard_imports_orbax"] = max(x["imports_orbax"] for x in runs["modelshard"])
    for m in ("modelshard", "unverified", "orbax"):
        for k in ("first", "second"):
            per = [f[f"{k}_s"] / x[f"{k}_s"] for f, x in zip(runs["floor"], runs[m], strict=True)]
            figures[f"{m}_{k}_of_floor"] = round(statistics.median(per), 2)
            figures[f"{m}_{k}_of_floor_per_repeat"] = [round(p, 2) for p in per]
            print(f"  {m} {k} call of the floor: {statistics.median(per):.2f} ({per})")
            cpu = [
                f[f"{k}_cpu_s"] / x[f"{k}_cpu_s"]
                for f, x in zip(runs["floor"], runs[m], strict=True)
            ]
            figures[f"{m}_{k}_of_floor_cpu"] = round(statistics.median(cpu), 2)
            print(f"  {m} {k} call of the floor, process CPU time: {statistics.median(cpu):.2f}")
    per = [
        x["first_s"] / o["first_s"] for x, o in zip(runs["modelshard"], runs["orbax"], strict=True)
    ]
    figures["modelshard_first_vs_orbax"] = round(statistics.median(per), 2)
    figures["modelshard_first_vs_orbax_per_repeat"] = [round(p, 2) for p in per]
    figures["load_at_end"] = round(os.getloadavg()[0], 2)
    sys.path.insert(0, str(HERE))
    from results import write_results

    write_results("restore_fresh", figures, argv=sys.argv, notes=args.notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
