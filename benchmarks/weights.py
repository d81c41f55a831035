"""Weights benchmark: ``load_safetensors`` vs ``safetensors.numpy.load_file`` + ``device_put``.

Run from the repository root::

    .venv/bin/python benchmarks/weights.py                      # 1 GiB, 64 tensors, 3 repeats
    .venv/bin/python benchmarks/weights.py --gib 0.25 --repeats 1   # quick look
    .venv/bin/python benchmarks/weights.py --ops                # Gemma layout through ops
    .venv/bin/python benchmarks/weights.py --export                 # reference-free sharded export

``--export`` runs ``export_main`` instead (its docstring says what it measures).

The checkpoint is ``--tensors`` float32 matrices of random normals in one safetensors file
(written once, then read from a warm page cache). Every measurement runs in a fresh
process (so peak RSS is that load's own), with 8 simulated CPU devices and the same FSDP
shardings (``fsdp('data')`` over (8,), planned once by ``modelshard.plan``):

- ``naive``: ``safetensors.numpy.load_file`` (the whole file in host memory) then one
  ``jax.device_put`` of the tree onto the shardings: the usual way, holding the file and
  the device copies at once;
- ``load``: ``modelshard.load_safetensors(path, specs=fsdp('data'), mesh=...)``, each device
  reading its rows of each tensor;
- ``safe_open``: the ``safetensors`` package's own slice reads (``safe_open`` +
  ``get_slice(name)[index]`` per device through ``jax.make_array_from_callback``): what
  ``load`` would be without its own reader;
- ``transposed``: the same bytes stored ``[in, out]`` and loaded through a mapping with
  ``transpose = [1, 0]``: a device's rows are then columns of the stored tensor, copied
  transposed out of the tensor's memory map by JAX's host-to-device copy;
- ``convert``: ``modelshard convert plain.safetensors ck --mesh data=8 --rules fsdp.toml``
  (``modelshard.cli.main`` in the child): streamed, one slab of rows at a time;
- ``export``: ``modelshard convert ck back.safetensors --to safetensors``: one
  checkpoint leaf on the host at a time. For these two the child first runs both
  commands on a one-tensor file (imports, compiled checksum programs, TensorStore's
  pools: fixed costs, not what streaming bounds), resets its peak RSS
  (``/proc/self/clear_refs``) and takes the RSS then as the baseline.

Reported: the median time of each (``--repeats`` runs, the methods interleaved in each
repeat so background load hits them alike) and the median over repeats of each run's
ratio to the same repeat's reference (``naive``; ``load`` for ``transposed`` and
``safe_open``): paired ratios, robust to the machine's load changing between repeats;
peak RSS above the baseline process's (imports and devices only), over the state bytes,
and for ``convert``/``export`` over the target (one chunk of the streaming writer,
``reshard.DEFAULT_CHUNK_BYTES``, plus the largest tensor). On a
shared, noisy machine take the medians, not any one run. ``--only`` runs some methods.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

from results import write_results

# every child: 8 CPU devices, modelshard, and status("VmHWM:") (peak RSS) / ("VmRSS:")
PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import modelshard as ms

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    """
)

CHILD = PRELUDE + textwrap.dedent(
    """
    import numpy as np
    import safetensors.numpy

    mode, path = sys.argv[1], sys.argv[2]
    mesh = ms.make_mesh({"data": 8})
    jax.numpy.ones(8).block_until_ready()
    specs = ms.fsdp("data")
    base = status("VmHWM:")
    if mode in ("convert", "export"):
        # the command's fixed costs are not what streaming bounds: imports, compiled
        # checksum programs, TensorStore's pools. One warm-up of each command on a
        # one-tensor file first; then the peak is reset and the baseline is the RSS now.
        import shutil
        from modelshard.cli import main
        tiny, tmp = sys.argv[-1], path + ".warm"
        assert main(["convert", tiny, tmp, "--mesh", "data=8", "--rules", sys.argv[4],
                     "--json"]) == 0
        assert main(["convert", tmp, tmp + ".safetensors", "--to", "safetensors",
                     "--json"]) == 0
        shutil.rmtree(tmp)
        os.unlink(tmp + ".safetensors")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = status("VmRSS:")
    t = time.perf_counter()
    if mode == "convert":  # safetensors -> checkpoint, streamed
        rc = main(["convert", path, sys.argv[3], "--mesh", "data=8", "--rules", sys.argv[4],
                   "--json"])
        assert rc == 0, rc
        out = None
    elif mode == "export":  # checkpoint -> safetensors, one leaf at a time
        rc = main(["convert", path, sys.argv[3], "--to", "safetensors", "--json"])
        assert rc == 0, rc
        out = None
    elif mode == "safe_open":  # the safetensors package's slice reads, per device
        from safetensors import safe_open
        with safe_open(path, framework="numpy") as f:
            names = list(f.keys())
            shapes = {n: f.get_slice(n).get_shape() for n in names}
            like = {n: jax.ShapeDtypeStruct(tuple(shapes[n]), np.float32) for n in names}
            shardings = ms.plan(like, specs, mesh).shardings
            out = {}
            for n in names:
                sl = f.get_slice(n)
                out[n] = jax.make_array_from_callback(
                    tuple(shapes[n]), shardings[n], lambda idx, sl=sl: sl[idx]
                )
    elif mode == "naive":
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
        del out
    print(json.dumps({"seconds": seconds, "baseline": base, "peak": status("VmHWM:")}))
    """
)


def _write(path: Path, tensors: int, rows: int, cols: int, transposed: bool) -> None:
    import numpy as np

    from modelshard._weights import write_safetensors

    rng = np.random.default_rng(0)
    shape = (cols, rows) if transposed else (rows, cols)
    entries = [(f"layers.{i}.weight", shape, np.float32) for i in range(tensors)]
    write_safetensors(path, entries, lambda name: rng.standard_normal(shape, dtype=np.float32))


def _child(script: str, mode: str, *args: object) -> dict:
    """Run one child script in a fresh process; its last stdout line, parsed."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", script, mode, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired:  # subprocess.run kills the child first
        raise SystemExit(f"{mode} took over 900 s") from None
    if out.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(mode: str, *args: Path) -> dict[str, float]:
    return _child(CHILD, mode, *args)


def _per_run(runs: dict[str, list[dict]], what: str, value: Callable[[dict], str]) -> str:
    """``per run (what): mode v, v, ...; mode ...``: every run's own figure."""
    return f"per run ({what}): " + "; ".join(
        f"{m} " + ", ".join(value(r) for r in rs) for m, rs in runs.items()
    )


# ---- reference-free sharded export (--export) ---------------------------------------------

EXPORT_CHILD = PRELUDE + textwrap.dedent(
    """
    import numpy as np
    import safetensors.numpy

    mode, out, tensors, rows, cols, shard = sys.argv[1:7]
    tensors, rows, cols = int(tensors), int(rows), int(cols)
    mesh = ms.make_mesh({"data": 8})
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    make = jax.jit(lambda k: jax.random.normal(k, (rows, cols)), out_shardings=sharding)
    state = {"layers": [{"w": make(jax.random.key(i))} for i in range(tensors)]}
    jax.block_until_ready(state)
    flat = {f"layers.{i}.w": x["w"] for i, x in enumerate(state["layers"])}
    host = None
    if mode in ("save_file", "save_file_fsync"):  # tensors already on the host: only the write
        host = {n: np.asarray(x) for n, x in flat.items()}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak := now: the state (and host copies) are the baseline
    base = status("VmRSS:")
    t = time.perf_counter()
    if mode == "gather_save_file":  # the usual way: every leaf to the host, one save_file
        host = {n: np.asarray(x) for n, x in flat.items()}
        safetensors.numpy.save_file(host, out + "/model.safetensors", metadata={"format": "pt"})
    elif mode in ("save_file", "save_file_fsync"):
        safetensors.numpy.save_file(host, out + "/model.safetensors", metadata={"format": "pt"})
        if mode == "save_file_fsync":  # as durable as modelshard's files: on disk when done
            fd = os.open(out + "/model.safetensors", os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    elif mode == "sharded":  # modelshard, no reference, HF's sharded layout
        ms.save_safetensors(out, state, max_shard_size=int(shard), progress=False)
    elif mode == "one_file":
        ms.save_safetensors(out + "/model.safetensors", state, progress=False)
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "baseline": base, "peak": status("VmHWM:")}))
    """
)
EXPORT_MODES = ("gather_save_file", "save_file", "save_file_fsync", "sharded", "one_file")


def _run_export(mode: str, out: Path, tensors: int, rows: int, cols: int, shard: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        res = _child(EXPORT_CHILD, mode, out, tensors, rows, cols, shard)
    finally:
        written = sum(f.stat().st_size for f in out.iterdir()) if out.exists() else 0
        shutil.rmtree(out, ignore_errors=True)
    return {**res, "written": written}


def export_main(args: argparse.Namespace) -> int:
    """``save_safetensors(dir, state, max_shard_size=...)`` (no reference) of an FSDP state
    on 8 CPU devices, against ``safetensors.numpy.save_file`` of the same tensors.

    Each run is a fresh process that builds the state on the devices, resets its peak RSS
    (the state, on CPU devices in host memory, is the baseline) and times one write:
    ``gather_save_file`` (every leaf to the host, then ``save_file``: what one writes
    without modelshard), ``save_file`` (the host copies made before the clock starts:
    ``save_file`` alone), ``save_file_fsync`` (the same, then ``fsync``: as durable as
    modelshard's files), ``sharded`` (modelshard, HF's sharded layout, ``--shard-mb``
    shards) and ``one_file`` (modelshard, one file). modelshard fsyncs every file it
    writes; ``save_file`` does not.
    """
    cols = 1024
    rows = max(8, int(args.gib * (1 << 30) / args.tensors / 4 / cols) // 8 * 8)
    nbytes = args.tensors * rows * cols * 4
    shard = int(args.shard_mb * (1 << 20))
    root = Path(args.dir or tempfile.mkdtemp(prefix="modelshard-export-bench-"))
    runs: dict[str, list[dict]] = {m: [] for m in EXPORT_MODES}
    try:
        for _ in range(args.repeats):
            for mode in EXPORT_MODES:
                runs[mode].append(_run_export(mode, root / mode, args.tensors, rows, cols, shard))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mib = 1 << 20

    def paired(m: str, ref: str) -> float:
        return statistics.median(
            a["seconds"] / b["seconds"] for a, b in zip(runs[m], runs[ref], strict=True)
        )

    print(
        f"{args.tensors} float32 tensors [{rows}, {cols}], {nbytes / (1 << 30):.2f} GiB, FSDP "
        f"over 8 CPU devices, shards of {args.shard_mb:g} MiB; medians of {args.repeats}\n"
    )
    print(
        "| method | seconds | / gather + save_file (paired) | / save_file alone (paired) "
        "| / save_file + fsync (paired) | peak RSS above the state | target |"
    )
    print("|---|---|---|---|---|---|---|")
    for m, rs in runs.items():
        sec = statistics.median(r["seconds"] for r in rs)
        peak = max(0, statistics.median(r["peak"] - r["baseline"] for r in rs))
        a, b, c = (
            paired(m, "gather_save_file"),
            paired(m, "save_file"),
            paired(m, "save_file_fsync"),
        )
        target = ""
        if m == "sharded":
            target = (
                f"time <= 1.1x save_file: {a:.2f}x / {b:.2f}x / {c:.2f}x; RSS <= one shard "
                f"({args.shard_mb:g} MiB): {'met' if peak <= shard else 'MISSED'}"
            )
        print(
            f"| {m} | {sec:.2f} | {a:.2f} | {b:.2f} | {c:.2f} | {peak / mib:.0f} MiB | {target} |"
        )
    print("\n" + _per_run(runs, "seconds", lambda r: f"{r['seconds']:.2f}"))
    print(
        _per_run(
            runs,
            "peak MiB above the state",
            lambda r: f"{max(0, r['peak'] - r['baseline']) / mib:.0f}",
        )
    )
    figures: dict[str, float | list[float]] = {
        "gib": round(nbytes / (1 << 30), 2),
        "shard_mib": args.shard_mb,
        "repeats": args.repeats,
    }
    for m, rs in runs.items():
        figures[f"{m}_seconds"] = [round(r["seconds"], 2) for r in rs]
        figures[f"{m}_peak_mib"] = round(
            max(0, statistics.median(r["peak"] - r["baseline"] for r in rs)) / mib
        )
        for ref in ("gather_save_file", "save_file", "save_file_fsync"):
            figures[f"{m}_vs_{ref}"] = round(paired(m, ref), 2)
    write_results("weights_export", figures, argv=sys.argv, notes=_size_note(args))
    return 0


# ---- the Gemma layout through ops (--ops) --------------------------------------------------

OPS_CHILD = PRELUDE + textwrap.dedent(
    """
    mode, path, mapping = sys.argv[1:4]
    mesh = ms.make_mesh({"data": 8})
    jax.numpy.ones(8).block_until_ready()
    base = status("VmHWM:")
    t = time.perf_counter()
    if mode == "plain":  # every stored tensor as it is, FSDP
        out = ms.load_safetensors(path, specs=ms.fsdp("data"), mesh=mesh, progress=False)
    else:  # Google's Gemma layout: rearranges, stacks (examples/mappings/hf_gemma3.toml)
        out = ms.load_safetensors(
            path, mapping=mapping, specs=ms.fsdp("data"), mesh=mesh, progress=False
        )
    jax.block_until_ready(out)
    seconds = time.perf_counter() - t
    leaves = jax.tree.leaves(out)
    assert all(any(s == "data" for s in x.sharding.spec) for x in leaves if x.size >= 4096)
    state = sum(x.nbytes for x in leaves)
    print(json.dumps({"seconds": seconds, "baseline": base, "peak": status("VmHWM:"),
                      "state": state}))
    """
)
OPS_MODES = ("plain", "ops")


def _write_gemma(root: Path, layers: int, e: int, h: int, k: int, d: int, f: int) -> int:
    """A Hugging Face Gemma 3 checkpoint of float32 random normals and its config.json;
    returns the largest tensor's bytes."""
    import numpy as np

    from modelshard._weights import write_safetensors

    shapes = {"model.embed_tokens.weight": (8192, e), "model.norm.weight": (e,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h * d, e),
            p + "self_attn.k_proj.weight": (k * d, e),
            p + "self_attn.v_proj.weight": (k * d, e),
            p + "self_attn.o_proj.weight": (e, h * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, e),
            p + "mlp.up_proj.weight": (f, e),
            p + "mlp.down_proj.weight": (e, f),
        }
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[p + f"{norm}_layernorm.weight"] = (e,)
    rng = np.random.default_rng(0)
    write_safetensors(
        root / "model.safetensors",
        [(n, s, np.float32) for n, s in shapes.items()],
        lambda n: rng.standard_normal(shapes[n], dtype=np.float32),
    )
    config = {"num_attention_heads": h, "num_key_value_heads": k, "head_dim": d}
    (root / "config.json").write_text(json.dumps(config))
    return max(int(np.prod(s)) * 4 for s in shapes.values())


def ops_main(args: argparse.Namespace) -> int:
    """An ``ops`` load of Hugging Face Gemma 3 into the layout of Google's JAX Gemma code
    (``examples/mappings/hf_gemma3.toml``: q and o by ``Rearrange``, k/v and gate/up
    stacked after a rearrange) against the plain load of the same file (every tensor as
    it is), both FSDP (``fsdp('data')``) over 8 CPU devices, each run a fresh process.

    Targets: time <= 1.3x the plain load (paired: the same repeat's ratio); peak RSS above
    the baseline process <= the placed state + the largest stored tensor.
    """
    e, h, k, d, f = 1024, 8, 2, 128, 4096
    per_layer = (2 * h * d * e + 2 * k * d * e + 3 * f * e) * 4
    layers = max(1, round(args.gib * (1 << 30) / per_layer))
    root = Path(args.dir or tempfile.mkdtemp(prefix="modelshard-ops-bench-"))
    mapping = Path(__file__).resolve().parent.parent / "examples/mappings/hf_gemma3.toml"
    runs: dict[str, list[dict]] = {m: [] for m in OPS_MODES}
    try:
        largest = _write_gemma(root, layers, e, h, k, d, f)
        path = root / "model.safetensors"
        nbytes = path.stat().st_size
        for _ in range(args.repeats):
            for mode in OPS_MODES:
                runs[mode].append(_child(OPS_CHILD, mode, path, mapping))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mib = 1 << 20
    ratio = statistics.median(
        a["seconds"] / b["seconds"] for a, b in zip(runs["ops"], runs["plain"], strict=True)
    )
    print(
        f"Gemma 3 layout, {layers} layers (embed {e}, {h} heads, {k} kv heads, head_dim {d}, "
        f"ffw {f}), float32, {nbytes / (1 << 30):.2f} GiB, FSDP over 8 CPU devices; "
        f"medians of {args.repeats}\n"
    )
    print("| method | seconds | / plain (paired) | peak RSS above baseline | target |")
    print("|---|---|---|---|---|")
    for m, rs in runs.items():
        sec = statistics.median(r["seconds"] for r in rs)
        peak = statistics.median(r["peak"] - r["baseline"] for r in rs)
        budget = rs[0]["state"] + largest
        r = statistics.median(
            a["seconds"] / b["seconds"] for a, b in zip(rs, runs["plain"], strict=True)
        )
        target = f"RSS <= state + largest tensor ({budget / mib:.0f} MiB): " + (
            "met" if peak <= budget else "MISSED"
        )
        if m == "ops":
            target = (
                f"time <= 1.3x plain: {ratio:.2f}x, {'met' if ratio <= 1.3 else 'MISSED'}; "
                + target
            )
        print(f"| {m} | {sec:.2f} | {r:.2f} | {peak / mib:.0f} MiB | {target} |")
    print("\n" + _per_run(runs, "seconds", lambda r: f"{r['seconds']:.2f}"))
    print(
        _per_run(
            runs, "peak MiB above baseline", lambda r: f"{(r['peak'] - r['baseline']) / mib:.0f}"
        )
    )
    figures = {"gib": round(nbytes / (1 << 30), 2), "layers": layers, "repeats": args.repeats}
    figures["ops_vs_plain"] = round(ratio, 2)
    for m, rs in runs.items():
        figures[f"{m}_seconds"] = [round(r["seconds"], 2) for r in rs]
        peak = statistics.median(r["peak"] - r["baseline"] for r in rs)
        figures[f"{m}_peak_mib"] = round(peak / mib)
        figures[f"{m}_peak_vs_budget"] = round(peak / (rs[0]["state"] + largest), 2)
    write_results("weights_ops", figures, argv=sys.argv, notes=_size_note(args))
    return 0


MODES = ("naive", "load", "safe_open", "transposed", "convert", "export")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size (default 1)")
    ap.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method (default 3)")
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp dir)")
    ap.add_argument("--only", nargs="*", choices=MODES, default=None, help="run these methods")
    ap.add_argument(
        "--export",
        action="store_true",
        help="benchmark reference-free sharded export instead (export_main)",
    )
    ap.add_argument("--shard-mb", type=float, default=256, help="with --export: shard size")
    ap.add_argument(
        "--ops",
        action="store_true",
        help="benchmark an ops load of the Gemma layout against the plain load (ops_main)",
    )
    args = ap.parse_args(argv)
    if args.export:
        return export_main(args)
    if args.ops:
        return ops_main(args)
    cols = 1024
    rows = max(8, int(args.gib * (1 << 30) / args.tensors / 4 / cols) // 8 * 8)
    nbytes = args.tensors * rows * cols * 4
    largest = rows * cols * 4
    root = Path(args.dir or tempfile.mkdtemp(prefix="modelshard-weights-bench-"))
    plain, trans = root / "plain.safetensors", root / "transposed.safetensors"
    rules, ck, back = root / "fsdp.toml", root / "ck", root / "back.safetensors"
    tiny = root / "tiny.safetensors"
    rules.write_text('[[rules]]\npattern = ".*"\nspec = ["data"]\n')
    modes = [m for m in MODES if args.only is None or m in args.only]
    if "export" in modes and "convert" not in modes:
        modes.insert(modes.index("export"), "convert")  # export reads what convert wrote
    try:
        _write(plain, args.tensors, rows, cols, transposed=False)
        _write(trans, args.tensors, rows, cols, transposed=True)
        _write(tiny, 1, 8, cols, transposed=False)
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        base = _run("baseline", plain)
        for _ in range(args.repeats):
            for mode in modes:
                if mode == "convert":
                    shutil.rmtree(ck, ignore_errors=True)
                    runs[mode].append(_run(mode, plain, ck, rules, tiny))
                elif mode == "export":
                    back.unlink(missing_ok=True)
                    runs[mode].append(_run(mode, ck, back, rules, tiny))
                else:
                    runs[mode].append(_run(mode, trans if mode == "transposed" else plain))
    finally:
        for f in (plain, trans, back, rules, tiny):
            f.unlink(missing_ok=True)
        shutil.rmtree(ck, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    from modelshard._checkpoint.resharding import DEFAULT_CHUNK_BYTES

    med = {m: statistics.median(r["seconds"] for r in rs) for m, rs in runs.items()}
    peak = {m: statistics.median(r["peak"] - r["baseline"] for r in rs) for m, rs in runs.items()}

    def paired(m: str, ref: str) -> float:  # median over repeats of the same-repeat ratio
        return statistics.median(
            a["seconds"] / b["seconds"] for a, b in zip(runs[m], runs[ref], strict=True)
        )

    gib, mib = nbytes / (1 << 30), 1 << 20
    print(
        f"{args.tensors} float32 tensors [{rows}, {cols}], {gib:.2f} GiB, FSDP over 8 CPU "
        f"devices; medians of {args.repeats} (baseline process peak "
        f"{base['peak'] / mib:.0f} MiB)\n"
    )
    print(
        "| method | seconds | time / naive (paired) | peak RSS above baseline | / state bytes "
        "| target |"
    )
    print("|---|---|---|---|---|---|")
    # one chunk (the streaming writer's host budget: the slab being read, the one being
    # written, TensorStore's decode and encode buffers) + the largest tensor (one host)
    budget = DEFAULT_CHUNK_BYTES + largest
    for m in runs:
        t_ratio = paired(m, "naive") if "naive" in runs else float("nan")
        r_ratio = peak[m] / nbytes
        if m == "naive":
            target = "(baseline)"
        elif m == "load":
            target = (
                f"time <= 1.0x naive: {'met' if t_ratio <= 1.0 else 'MISSED'}; RSS <= 1.1x: "
                f"{'met' if r_ratio <= 1.1 else 'MISSED'}"
            )
        elif m == "safe_open":
            tl = paired(m, "load") if "load" in runs else float("nan")
            target = f"(safe_open + get_slice per device: {tl:.2f}x load's time)"
        elif m == "transposed":
            tl = paired(m, "load") if "load" in runs else float("nan")
            target = f"time <= 1.3x plain load: {tl:.2f}x, {'met' if tl <= 1.3 else 'MISSED'}"
        else:
            ok = peak[m] <= budget
            target = (
                f"RSS <= one chunk + largest tensor ({budget / mib:.0f} MiB): "
                f"{peak[m] / budget:.2f}x, {'met' if ok else 'MISSED'}"
            )
        print(
            f"| {m} | {med[m]:.2f} | {t_ratio:.2f} | {peak[m] / mib:.0f} MiB | {r_ratio:.2f} "
            f"| {target} |"
        )
    print(
        "\n"
        + _per_run(
            runs, "peak MiB above baseline", lambda r: f"{(r['peak'] - r['baseline']) / mib:.0f}"
        )
    )
    print(_per_run(runs, "seconds", lambda r: f"{r['seconds']:.2f}"))
    figures: dict[str, float | list[float]] = {"gib": round(gib, 2), "repeats": args.repeats}
    for m in runs:
        figures[f"{m}_seconds"] = [round(r["seconds"], 2) for r in runs[m]]
        figures[f"{m}_peak_mib"] = round(peak[m] / mib)
        figures[f"{m}_peak_vs_state"] = round(peak[m] / nbytes, 2)
        if "naive" in runs:
            figures[f"{m}_vs_naive"] = round(paired(m, "naive"), 2)
        if "load" in runs and m in ("safe_open", "transposed"):
            figures[f"{m}_vs_load"] = round(paired(m, "load"), 2)
        if m in ("convert", "export"):
            figures[f"{m}_peak_vs_budget"] = round(peak[m] / budget, 2)
    write_results("weights", figures, argv=sys.argv, notes=_size_note(args))
    return 0


def _size_note(args: argparse.Namespace) -> str:
    """Says so in the results when the run was smaller than the benchmark's defaults."""
    reduced = [f"{args.gib:g} GiB (default 1)"] if args.gib != 1.0 else []
    if args.export and args.shard_mb != 256:
        reduced.append(f"shards of {args.shard_mb:g} MiB (default 256)")
    return f"Reduced size: {', '.join(reduced)}." if reduced else ""


if __name__ == "__main__":
    sys.exit(main())
