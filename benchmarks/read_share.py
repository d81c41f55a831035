"""Bytes each process reads on a restore, as a multiple of its share, beside plain Orbax.

Run from the repository root::

    .venv/bin/python benchmarks/read_share.py            # needs root (it drops the page cache)

Two processes x 4 CPU devices (``modelshard launch -n 2 --devices-per-process 4``) save 32
float32 leaves of 4 MiB (1024 x 1024) from a ``data=2, model=4`` mesh, split by ``model``:
once with ``ms.save`` and once with plain Orbax (``StandardCheckpointer``) on its own
checkpoint of the same state. Then, for each target, two fresh processes restore it:

- ``rows``: ``fsdp=8``, each leaf's rows split (each process holds half of every leaf);
- ``saved``: the saved mesh and split (each process holds every leaf whole);
- ``cols``: ``fsdp=8``, columns split (half of every leaf);
- ``replicated``: ``fsdp=8``, every leaf replicated (every leaf whole).

Before each restore the page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``); the
bytes a process reads are the growth of ``rchar`` in ``/proc/self/io`` around the restore
call alone, divided by the bytes of the process's share (the union of its devices' blocks).
Every restored block is compared with the saved values (bit-exact). Reported: the ratio per
process and target for both libraries (target <= 1.05x for modelshard), the restore time, and
the time of each library's first save in the process (the slower process's; no page cache
dropped there), and warm saves repeated alternately: ``ms.save`` as it stores chunks, with
each shard one chunk (the layout before ``chunks.py``: ``MIN_CHUNK_BYTES`` out of reach),
and plain Orbax, as ratios per repeat. Figures go to ``docs/benchmarks/results/read_share.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LEAVES, ROWS, COLS = 32, 1024, 1024
TARGETS = ("rows", "saved", "cols", "replicated")
WARM = ("aligned", "whole", "orbax")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _values(i: int):
    import numpy as np

    return np.random.default_rng(i).standard_normal((ROWS, COLS), dtype=np.float32)


def _target(name: str):
    from jax.sharding import PartitionSpec as P

    import modelshard as ms

    if name == "saved":
        return ms.make_mesh({"data": 2, "model": 4}), P(None, "model")
    spec = {"rows": P("fsdp", None), "cols": P(None, "fsdp"), "replicated": P()}[name]
    return ms.make_mesh({"fsdp": 8}), spec


def child(args: argparse.Namespace) -> None:
    import modelshard as ms

    ms.distributed.initialize()
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding

    root = Path(args.dir)
    names = [f"w{i:02d}" for i in range(LEAVES)]
    if args.mode == "save":
        mesh, spec = _target("saved")
        sharding = NamedSharding(mesh, spec)
        state = {
            n: jax.make_array_from_callback((ROWS, COLS), sharding, lambda ix, i=i: _values(i)[ix])
            for i, n in enumerate(names)
        }
        jax.block_until_ready(state)
        t = time.perf_counter()
        ms.save(root / "ms", state)
        ours = time.perf_counter() - t
        t = time.perf_counter()
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(root / "orbax", state)
        plain = time.perf_counter() - t
        # warm repeats, alternating: ms.save as it stores chunks, ms.save with each shard
        # one chunk (the layout before chunks.py), and plain Orbax
        from modelshard._checkpoint import chunks

        floor, warm = chunks.MIN_CHUNK_BYTES, {"aligned": [], "whole": [], "orbax": []}
        for i in range(args.repeats):
            for kind in warm:
                t = time.perf_counter()
                if kind == "orbax":
                    with ocp.StandardCheckpointer() as ckptr:
                        ckptr.save(root / f"orbax{i}", state)
                else:
                    chunks.MIN_CHUNK_BYTES = floor if kind == "aligned" else 1 << 62
                    ms.save(root / f"{kind}{i}", state)
                warm[kind].append(time.perf_counter() - t)
        chunks.MIN_CHUNK_BYTES = floor
        print(
            "RESULT " + json.dumps({"process": jax.process_index(), "first": [ours, plain], **warm})
        )
        return
    mesh, spec = _target(args.target)
    sharding = NamedSharding(mesh, spec)
    like = {n: jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=sharding) for n in names}
    # the share: the distinct blocks this process's devices hold
    blocks = {
        tuple((s.start or 0, s.stop or n) for s, n in zip(ix, (ROWS, COLS), strict=True))
        for ix in sharding.addressable_devices_indices_map((ROWS, COLS)).values()
    }
    share = LEAVES * 4 * sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in blocks)
    ms.distributed.barrier("read_share:ready")
    _drop_caches()
    ms.distributed.barrier("read_share:dropped")
    before, t = _rchar(), time.perf_counter()
    if args.lib == "ms":
        out = ms.restore(root / "ms", like=like, mesh=mesh, specs=spec)
    else:
        with ocp.StandardCheckpointer() as ckptr:
            out = ckptr.restore(root / "orbax", like)
    jax.block_until_ready(out)
    seconds, read = time.perf_counter() - t, _rchar() - before
    exact = all(
        np.array_equal(np.asarray(s.data), _values(i)[s.index])
        for i, n in enumerate(names)
        for s in out[n].addressable_shards
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "process": jax.process_index(),
                "read": read,
                "share": share,
                "seconds": seconds,
                "exact": exact,
            }
        ),
        flush=True,
    )


def _launch(*extra: str, timeout: int = 600) -> list[dict]:
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
        str(timeout - 30),
        "--",
        sys.executable,
        __file__,
        "--child",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        print(out.stdout[-4000:], out.stderr[-4000:], sep="\n")
        raise SystemExit(f"{' '.join(extra)}: exit {out.returncode}")
    return sorted(
        (
            json.loads(line.split("RESULT ", 1)[1])
            for line in out.stdout.splitlines()
            if "RESULT {" in line
        ),
        key=lambda r: r["process"],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets")
    ap.add_argument("--libs", default="ms,orbax", help="ms, orbax or both (default)")
    ap.add_argument("--repeats", type=int, default=3, help="warm saves of each kind (3)")
    ap.add_argument("--no-write", action="store_true", help="print only, write no results file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="restore", help=argparse.SUPPRESS)
    ap.add_argument("--target", default="rows", help=argparse.SUPPRESS)
    ap.add_argument("--lib", default="ms", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    load = os.getloadavg()[0]
    figures: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="ms-read-share-", dir="/tmp") as tmp:
        saves = _launch("--mode", "save", "--dir", tmp, "--repeats", str(args.repeats))
        ours, plain = (max(r["first"][i] for r in saves) for i in (0, 1))
        print(f"save: ms.save {ours:.2f} s, Orbax {plain:.2f} s ({ours / plain:.2f}x)", flush=True)
        figures["ms_save_s"], figures["orbax_save_s"] = round(ours, 3), round(plain, 3)
        warm = {k: [max(r[k][i] for r in saves) for i in range(args.repeats)] for k in WARM}
        for kind in ("aligned", "whole"):
            figures[f"warm_save_{kind}_vs_orbax"] = [
                round(a / b, 3) for a, b in zip(warm[kind], warm["orbax"], strict=True)
            ]
        figures["warm_save_aligned_vs_whole"] = [
            round(a / b, 3) for a, b in zip(warm["aligned"], warm["whole"], strict=True)
        ]
        print(
            "warm saves (s): " + ", ".join(f"{k} {[round(v, 2) for v in warm[k]]}" for k in WARM),
            flush=True,
        )
        for tag in ("aligned", "whole", "orbax"):
            for i in range(args.repeats):
                shutil.rmtree(Path(tmp) / f"{tag}{i}", ignore_errors=True)
        for target in args.targets.split(","):
            for lib in args.libs.split(","):
                runs = _launch("--target", target, "--lib", lib, "--dir", tmp)
                if len(runs) != 2 or not all(r["exact"] for r in runs):
                    print(runs)
                    raise SystemExit(f"{target}/{lib}: not bit-exact or a process missing")
                ratios = [round(r["read"] / r["share"], 3) for r in runs]
                secs = max(r["seconds"] for r in runs)
                print(
                    f"{target:>10} {lib:>5}: read/share {ratios[0]:.3f}x, {ratios[1]:.3f}x"
                    f" (share {runs[0]['share'] >> 20} MiB), restore {secs:.2f} s",
                    flush=True,
                )
                figures[f"{lib}_{target}_read_vs_share"] = ratios
                figures[f"{lib}_{target}_restore_s"] = round(secs, 3)
    figures["load_at_start"] = round(load, 2)
    if not args.no_write:
        sys.path.insert(0, str(HERE))
        from results import write_results

        write_results("read_share", figures, argv=sys.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
