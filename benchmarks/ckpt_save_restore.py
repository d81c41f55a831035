"""Save and restore only: ``modelshard.save`` / ``restore`` against raw Orbax, same run.

The save and restore rows of ``benchmarks/checkpoint.py`` without its memory and reshard
measurements, so that the two ratios issue 16 sets (verified ``restore`` <= 1.10x raw
Orbax's restore, ``save`` <= 1.0x raw Orbax's save) can be sampled often on a shared
machine. Run from the repository root::

    .venv/bin/python benchmarks/ckpt_save_restore.py                # 1 GiB, 64 leaves, 5 repeats
    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/ckpt_save_restore.py  # another tree

Within each repeat the methods run back to back in an order that rotates from repeat to
repeat, so background load and disk write-back fall on each alike; the ratios are of
medians, and the per-repeat ratios are printed too. Restores read from a warm page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import orbax.checkpoint as ocp  # noqa: E402

import modelshard as ms  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint import _setup  # noqa: E402  (the same 64-leaf state)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--leaves", type=int, default=64, help="number of leaves (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats (default 5)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--only", choices=["save", "restore"], default=None)
    args = parser.parse_args(argv)

    root, mesh, state, nbytes, abstract = _setup(args, "ms-sr-")
    handler = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    pytree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    specs = ms.fsdp("data")

    cpu: dict[str, list[float]] = {}

    def timed(name, fn, setup=None):
        def run():
            if setup is not None:
                setup()
            c, t = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn())
            cpu.setdefault(name, []).append(time.process_time() - c)
            return time.perf_counter() - t

        return run

    saves = {
        "save_modelshard": timed(
            "save_modelshard",
            lambda: ms.save(root / "ms", state),
            lambda: shutil.rmtree(root / "ms", ignore_errors=True),
        ),
        "save_orbax": timed(
            "save_orbax",
            lambda: handler.save(root / "orbax", args=ocp.args.StandardSave(state)),
            lambda: shutil.rmtree(root / "orbax", ignore_errors=True),
        ),
    }
    restores = {
        "restore_modelshard": timed(
            "restore_modelshard",
            lambda: ms.restore(root / "ms", like=abstract, specs=specs, mesh=mesh),
        ),
        "restore_modelshard_noverify": timed(
            "restore_modelshard_noverify",
            lambda: ms.restore(root / "ms", like=abstract, specs=specs, mesh=mesh, verify=False),
        ),
        "restore_orbax": timed(
            "restore_orbax",
            lambda: pytree.restore(
                root / "orbax",
                args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args),
            ),
        ),
    }
    for fn in [*saves.values(), *restores.values()]:
        fn()  # warm: compile the checksum programs, first-use imports
    cpu.clear()
    groups = (
        [saves, restores] if args.only is None else [saves if args.only == "save" else restores]
    )
    times: dict[str, list[float]] = {k: [] for g in groups for k in g}
    for r in range(args.repeats):
        for g in groups:
            names = list(g)
            names = names[r % len(names) :] + names[: r % len(names)]
            for k in names:
                times[k].append(g[k]())
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratios(a, b):
        per = [x / y for x, y in zip(times[a], times[b], strict=True)]
        return med[a] / med[b], per

    out: dict[str, object] = {"state_bytes": nbytes, "load": os.getloadavg()[0]}
    out |= {f"{k}_s": round(v, 3) for k, v in med.items()}
    lines = [f"{args.leaves} float32 leaves, {nbytes / (1 << 30):.2f} GiB, {args.repeats} repeats"]
    for a, b in [
        ("save_modelshard", "save_orbax"),
        ("restore_modelshard", "restore_orbax"),
        ("restore_modelshard_noverify", "restore_orbax"),
    ]:
        if a in med:
            m, per = ratios(a, b)
            out[f"{a}_ratio"] = round(m, 3)
            c = statistics.median(cpu[a]) / statistics.median(cpu[b])
            out[f"{a}_cpu_ratio"] = round(c, 3)
            lines.append(
                f"{a}: {med[a]:.2f} s vs {b} {med[b]:.2f} s -> {m:.2f}x "
                f"(per repeat {' '.join(f'{p:.2f}' for p in per)}; process CPU time {c:.2f}x)"
            )
    print("\n".join(lines))
    print(json.dumps(out))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
