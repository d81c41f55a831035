"""Weights benchmark: ``load_safetensors`` vs ``safetensors.numpy.load_file`` + ``device_put``.

Run from the repository root::

    .venv/bin/python benchmarks/weights.py                      # 1 GiB, 64 tensors, 3 repeats
    .venv/bin/python benchmarks/weights.py --gib 0.25 --repeats 1   # quick look

The checkpoint is ``--tensors`` float32 matrices of random normals in one safetensors file
(written once, then read from a warm page cache). Every measurement runs in a fresh
process (so peak RSS is that load's own), with 8 simulated CPU devices and the same FSDP
shardings (``fsdp('data')`` over (8,), planned once by ``modelshard.plan``):

- ``naive``: ``safetensors.numpy.load_file`` (the whole file in host memory) then one
  ``jax.device_put`` of the tree onto the shardings: the usual way, holding the file and
  the device copies at once;
- ``load``: ``modelshard.load_safetensors(path, specs=fsdp('data'), mesh=...)``, each device
  reading its rows of each tensor;
- ``transposed``: the same bytes stored ``[in, out]`` and loaded through a mapping with
  ``transpose = [1, 0]``: a device's rows are then columns of the stored tensor, so each
  tensor is read whole once and sliced.

Reported: the median load time of each (``--repeats`` runs, the methods interleaved in each
repeat so background load hits them alike) and the ratio to ``naive``; peak RSS above the
baseline process's (imports and devices only) over the state bytes. On a shared, noisy
machine take the medians, not any one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import safetensors.numpy
    import modelshard as ms

    def vm_hwm():  # this process's peak RSS
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    mode, path = sys.argv[1], sys.argv[2]
    mesh = ms.make_mesh({"data": 8})
    jax.numpy.ones(8).block_until_ready()
    specs = ms.fsdp("data")
    base = vm_hwm()
    t = time.perf_counter()
    if mode == "naive":
        tree = safetensors.numpy.load_file(path)
        shardings = ms.plan(tree, specs, mesh).shardings
        out = jax.device_put(tree, shardings)
        del tree
    elif mode == "load":
        out = ms.load_safetensors(path, specs=specs, mesh=mesh)
    elif mode == "transposed":
        wm = ms.WeightMap([ms.MapRule(r"(.+)", "{1}", transpose=(1, 0))])
        out = ms.load_safetensors(path, mapping=wm, specs=specs, mesh=mesh)
    else:
        out = None
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t
    if out is not None:
        assert all(x.sharding.spec[0] == "data" for x in jax.tree.leaves(out)), "not FSDP"
    print(json.dumps({"seconds": seconds, "baseline": base, "peak": vm_hwm()}))
    """
)


def _write(path: Path, tensors: int, rows: int, cols: int, transposed: bool) -> None:
    import numpy as np

    from modelshard._weights import write_safetensors

    rng = np.random.default_rng(0)
    shape = (cols, rows) if transposed else (rows, cols)
    entries = [(f"layers.{i}.weight", shape, np.float32) for i in range(tensors)]
    write_safetensors(path, entries, lambda name: rng.standard_normal(shape, dtype=np.float32))


def _run(mode: str, path: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size (default 1)")
    ap.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method (default 3)")
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp dir)")
    args = ap.parse_args(argv)
    cols = 1024
    rows = max(8, int(args.gib * (1 << 30) / args.tensors / 4 / cols) // 8 * 8)
    nbytes = args.tensors * rows * cols * 4
    root = Path(args.dir or tempfile.mkdtemp(prefix="modelshard-weights-bench-"))
    plain, trans = root / "plain.safetensors", root / "transposed.safetensors"
    try:
        _write(plain, args.tensors, rows, cols, transposed=False)
        _write(trans, args.tensors, rows, cols, transposed=True)
        runs: dict[str, list[dict[str, float]]] = {"naive": [], "load": [], "transposed": []}
        base = _run("baseline", plain)
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(_run(mode, trans if mode == "transposed" else plain))
    finally:
        for f in (plain, trans):
            f.unlink(missing_ok=True)
        if args.dir is None:
            root.rmdir()

    med = {m: statistics.median(r["seconds"] for r in rs) for m, rs in runs.items()}
    peak = {m: statistics.median(r["peak"] - r["baseline"] for r in rs) for m, rs in runs.items()}
    gib = nbytes / (1 << 30)
    print(
        f"{args.tensors} float32 tensors [{rows}, {cols}], {gib:.2f} GiB, FSDP over 8 CPU "
        f"devices; medians of {args.repeats} (baseline process peak "
        f"{base['peak'] / (1 << 20):.0f} MiB)\n"
    )
    print("| method | seconds | time / naive | peak RSS above baseline / state bytes | target |")
    print("|---|---|---|---|---|")
    targets = {
        "naive": ("", ""),
        "load": (1.0, 1.1),
        "transposed": (None, 1.1),
    }
    for m in runs:
        t_ratio = med[m] / med["naive"]
        r_ratio = peak[m] / nbytes
        tt, rt = targets[m]
        if m == "naive":
            target = "(baseline)"
        elif m == "load":
            target = (
                f"time <= {tt}x: {'met' if t_ratio <= tt else 'MISSED'}; RSS <= {rt}x: "
                f"{'met' if r_ratio <= rt else 'MISSED'}"
            )
        else:
            tl = med[m] / med["load"]
            target = f"time <= 1.3x plain load: {tl:.2f}x, {'met' if tl <= 1.3 else 'MISSED'}"
        print(f"| {m} | {med[m]:.2f} | {t_ratio:.2f} | {r_ratio:.2f} | {target} |")
    print(
        "\nper run (seconds): "
        + "; ".join(
            f"{m} " + ", ".join(f"{r['seconds']:.2f}" for r in rs) for m, rs in runs.items()
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
