"""Checkpoint save/restore throughput: modelshard vs raw Orbax vs the disk floor.

The save and restore rows of ``benchmarks/checkpoint.py`` without its memory and reshard
measurements, sampled often enough on a shared machine to quote ratios. Run from the
repository root::

    .venv/bin/python benchmarks/ckpt_save_restore.py               # 384 MiB, 24 leaves, 3 repeats
    .venv/bin/python benchmarks/ckpt_save_restore.py --gib 1 --leaves 64 --repeats 5
    .venv/bin/python benchmarks/ckpt_save_restore.py --compression zstd   # ms.save(compression=)
    PYTHONPATH=/tmp/base/src .venv/bin/python benchmarks/ckpt_save_restore.py  # another tree

Rows (the state: float32 matrices of random normals, ``fsdp("data")`` over 8 CPU devices):

- save: ``modelshard.save`` (record, checksums, atomic rename); raw Orbax
  ``StandardCheckpointHandler`` (its default: zstd chunks); raw Orbax
  ``PyTreeCheckpointHandler(use_compression=False)``; the floor, ``np.save`` of each leaf
  gathered to the host + ``fsync``, one file per leaf;
- restore onto the saved layout (warm page cache: each row's files are read, untimed, just
  before it, as this machine pages out file data left untouched; ``checkpoint.warm``): ``modelshard.restore`` verified and with
  ``verify=False``; raw Orbax restoring the same sharded targets from its own (zstd)
  checkpoint; the floor, ``np.load`` + ``jax.device_put`` onto the same shardings;
- restore onto a new layout: the checkpoints read as ``P(None, "model")`` on a (2, 4) mesh:
  ``modelshard.restore`` (verified) of its checkpoint and of Orbax's zstd one, against
  Orbax's ``StandardCheckpointer.restore`` with those target shardings of its zstd and its
  raw checkpoint (issue 28's relayout case; the fair pair is the one whose chunks use the
  same codec as ``ms.save``'s).

Each save starts ``checkpoint.SETTLE_S`` after its old output was removed (see there).
Within each repeat the methods run back to back in an order that rotates from repeat to
repeat, so background load and disk write-back fall on each alike. Printed: medians, the
throughput of each row as a fraction of its floor (``floor time / row time``, higher is
better), the time ratios to raw Orbax, each repeat's ratios, process CPU time ratios, the
load average, and a JSON line.
"""

from __future__ import annotations

import argparse
import inspect
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
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import modelshard as ms  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint import SETTLE_S, _np_load, _np_save, _setup, warm  # noqa: E402  (the same state)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=0.375, help="state size (default 0.375)")
    parser.add_argument("--leaves", type=int, default=24, help="number of leaves (default 24)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats (default 3)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--only", choices=["save", "restore", "relayout"], default=None)
    parser.add_argument(
        "--compression",
        default=None,
        help="ms.save(compression=...) where the library has it (default: its default)",
    )
    parser.add_argument("--notes", default="", help="recorded in the results file")
    parser.add_argument(
        "--results-name",
        default=None,
        help="results file name (default ckpt_save_restore, _<compression> appended if given)",
    )
    args = parser.parse_args(argv)

    root, mesh, state, nbytes, abstract = _setup(args, "ms-sr-")
    shardings = jax.tree.map(lambda x: x.sharding, state)
    standard = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    raw = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    pytree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    specs = ms.fsdp("data")
    mesh24 = ms.make_mesh({"data": 2, "model": 4})
    cols = NamedSharding(mesh24, P(None, "model"))
    relaid = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cols), state)
    has_compression = "compression" in inspect.signature(ms.save).parameters
    save_kw = {"compression": args.compression} if has_compression and args.compression else {}
    # the codec of ms.save's chunks: zstd before save(compression=), raw by default since
    ms_codec = save_kw.get("compression") if has_compression else "zstd"
    same_codec = "relayout_orbax" if ms_codec == "zstd" else "relayout_orbax_raw"

    cpu: dict[str, list[float]] = {}
    # the checkpoint each read row reads, read untimed just before it (``warm``): every
    # restore row is from a warm page cache, the floor's included
    reads = {
        "restore_modelshard": "ms",
        "restore_modelshard_noverify": "ms",
        "restore_orbax": "orbax",
        "restore_orbax_raw": "orbax_raw",
        "restore_np": "np",
        "relayout_modelshard": "ms",
        "relayout_modelshard_of_orbax": "orbax",
        "relayout_orbax": "orbax",
        "relayout_orbax_raw": "orbax_raw",
    }

    def timed(name, fn, setup=None):
        def run():
            if setup is not None:
                setup()
            if name in reads and (root / reads[name]).exists():
                warm(root / reads[name])
            c, t = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn())
            cpu.setdefault(name, []).append(time.process_time() - c)
            return time.perf_counter() - t

        return run

    def fresh(name):
        """Remove ``name``'s old output, then wait ``SETTLE_S``: every save writes into
        memory the hypervisor has taken back alike (``checkpoint.SETTLE_S``; unsettled,
        one save wrote into pages freed moments before and the next did not, and the same
        save's time moved threefold from repeat to repeat)."""

        def setup():
            shutil.rmtree(root / name, ignore_errors=True)
            time.sleep(SETTLE_S)

        return setup

    saves = {
        "save_modelshard": timed(
            "save_modelshard", lambda: ms.save(root / "ms", state, **save_kw), fresh("ms")
        ),
        "save_orbax": timed(
            "save_orbax",
            lambda: standard.save(root / "orbax", args=ocp.args.StandardSave(state)),
            fresh("orbax"),
        ),
        "save_orbax_raw": timed(
            "save_orbax_raw",
            lambda: raw.save(root / "orbax_raw", args=ocp.args.PyTreeSave(state)),
            fresh("orbax_raw"),
        ),
        "save_np": timed("save_np", lambda: _np_save(root / "np", state), fresh("np")),
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
        "restore_orbax_raw": timed(
            "restore_orbax_raw",
            lambda: pytree.restore(
                root / "orbax_raw",
                args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args),
            ),
        ),
        "restore_np": timed("restore_np", lambda: _np_load(root / "np", shardings)),
    }
    relayouts = {
        "relayout_modelshard": timed(
            "relayout_modelshard", lambda: ms.restore(root / "ms", like=relaid)
        ),
        "relayout_modelshard_of_orbax": timed(
            "relayout_modelshard_of_orbax", lambda: ms.restore(root / "orbax", like=relaid)
        ),
        "relayout_orbax": timed(
            "relayout_orbax", lambda: ocp.StandardCheckpointer().restore(root / "orbax", relaid)
        ),
        "relayout_orbax_raw": timed(
            "relayout_orbax_raw",
            lambda: ocp.StandardCheckpointer().restore(root / "orbax_raw", relaid),
        ),
    }
    for fn in [*saves.values(), *restores.values(), *relayouts.values()]:
        fn()  # warm: compile the checksum programs, first-use imports; writes the checkpoints
    cpu.clear()
    groups = {"save": saves, "restore": restores, "relayout": relayouts}
    if args.only is not None:
        groups = {args.only: groups[args.only]}
    times: dict[str, list[float]] = {k: [] for g in groups.values() for k in g}
    for r in range(args.repeats):
        for g in groups.values():
            names = list(g)
            names = names[r % len(names) :] + names[: r % len(names)]
            for k in names:
                times[k].append(g[k]())
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(a, b):
        per = [x / y for x, y in zip(times[a], times[b], strict=True)]
        c = statistics.median(cpu[a]) / statistics.median(cpu[b])
        return med[a] / med[b], per, c

    load = os.getloadavg()
    out: dict[str, object] = {
        "state_bytes": nbytes,
        "load": [round(x, 2) for x in load],
        "compression": ms_codec,
        "library": str(Path(ms.__file__).parent),
    }
    out |= {f"{k}_s": round(v, 3) for k, v in med.items()}
    lines = [
        f"{args.leaves} float32 leaves, {nbytes / (1 << 20):.0f} MiB, {args.repeats} repeats, "
        f"load average {load[0]:.1f} / {load[1]:.1f}, library {out['library']}, "
        f"ms.save compression: {out['compression']}"
    ]
    floors = [
        ("save_modelshard", "save_np"),
        ("save_orbax", "save_np"),
        ("save_orbax_raw", "save_np"),
        ("restore_modelshard", "restore_np"),
        ("restore_modelshard_noverify", "restore_np"),
        ("restore_orbax", "restore_np"),
        ("restore_orbax_raw", "restore_np"),
    ]
    for a, b in floors:
        if a in med and b in med:
            m, per, c = ratio(b, a)  # throughput fraction of the floor = floor time / time
            out[f"{a}_of_floor"] = round(m, 2)
            out[f"{a}_of_floor_per_repeat"] = [round(p, 2) for p in per]
            out[f"{a}_of_floor_cpu"] = round(c, 2)  # the floor's process CPU time over the row's
            lines.append(
                f"{a}: {med[a]:.3f} s, {nbytes / med[a] / 1e9:.2f} GB/s = {m:.2f}x the floor's "
                f"throughput ({b} {med[b]:.3f} s; per repeat {' '.join(f'{p:.2f}' for p in per)}; "
                f"CPU {c:.2f}x)"
            )
    for a, b in [
        ("save_modelshard", "save_orbax"),
        ("save_modelshard", "save_orbax_raw"),
        ("save_orbax", "save_orbax_raw"),
        ("restore_modelshard", "restore_orbax"),
        ("restore_modelshard", "restore_orbax_raw"),
        ("restore_modelshard_noverify", "restore_orbax"),
        ("restore_modelshard_noverify", "restore_orbax_raw"),
        ("relayout_modelshard", same_codec),
        ("relayout_modelshard", "relayout_orbax"),
        ("relayout_modelshard_of_orbax", "relayout_orbax"),
    ]:
        if a in med and b in med:
            m, per, c = ratio(a, b)
            out[f"{a}_vs_{b}"] = round(m, 2)
            out[f"{a}_vs_{b}_per_repeat"] = [round(p, 2) for p in per]
            out[f"{a}_vs_{b}_cpu"] = round(c, 2)
            lines.append(
                f"{a}: {med[a]:.3f} s vs {b} {med[b]:.3f} s -> {m:.2f}x time "
                f"(per repeat {' '.join(f'{p:.2f}' for p in per)}; process CPU time {c:.2f}x)"
            )
    sizes = {
        d: sum(f.stat().st_size for f in (root / d).rglob("*") if f.is_file())
        for d in ("ms", "orbax", "orbax_raw", "np")
        if (root / d).exists()
    }
    out["bytes_on_disk"] = sizes
    lines.append(
        "on disk: " + ", ".join(f"{d} {n / nbytes:.3f}x the state" for d, n in sizes.items())
    )
    print("\n".join(lines))
    print(json.dumps(out))
    from results import write_results

    figures = {k: v for k, v in out.items() if k not in ("load", "library", "bytes_on_disk")}
    figures["compression"] = str(ms_codec or "none")
    figures["state_mib"] = round(nbytes / (1 << 20))
    figures["leaves"] = args.leaves
    figures["repeats"] = args.repeats
    figures |= {f"{k}_s": round(med[k], 2) for k in med}
    figures |= {f"{k}_cpu_s": round(statistics.median(v), 2) for k, v in cpu.items()}
    figures |= {f"{k}_repeats_s": [round(t, 2) for t in v] for k, v in times.items()}
    figures |= {f"{d}_bytes_vs_state": round(n / nbytes, 3) for d, n in sizes.items()}
    figures |= {f"{k}_throughput_gbs": round(nbytes / v / 1e9, 2) for k, v in med.items()}
    if args.only is None:  # a partial run would replace the file with fewer figures
        name = "ckpt_save_restore" + (f"_{args.compression}" if args.compression else "")
        name = args.results_name or name
        write_results(name, figures, argv=sys.argv, notes=args.notes)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
