"""Checkpoint benchmark: modelshard save/restore vs raw Orbax vs np.save+fsync, and peak RSS.

Run from the repository root::

    .venv/bin/python benchmarks/checkpoint.py            # ~1 GiB state, 3 repeats
    .venv/bin/python benchmarks/checkpoint.py --gib 0.25 --repeats 1   # quick look

What it measures (medians over ``--repeats``; the methods are interleaved within each
repeat so that background load and disk write-back hit them alike):

- save throughput of ``modelshard.save`` (record and checksums included), of Orbax's
  ``StandardCheckpointHandler`` on the same nested dict, and of ``np.save`` + ``fsync`` of
  the same bytes (one file per leaf);
- restore throughput of ``modelshard.restore`` (into the planned sharding, with and without
  checksum verification), of Orbax restoring the same sharded targets, and of ``np.load`` +
  ``device_put`` onto the same shardings. Reads are from a warm page cache;
- peak RSS, each in a fresh subprocess (``VmHWM``, or ``RUSAGE_CHILDREN`` of a small
  wrapper for the command): a baseline process (imports and 8 CPU devices only),
  ``modelshard.restore`` resharding from fsdp over (8,) onto (2, 4) rules, and the
  ``modelshard reshard`` command doing the same offline, and the command on a checkpoint of
  one leaf 8x the chunk (``--big-factor``), which it must copy in slabs. Ratios are peak RSS
  over the state (or checkpoint) bytes, with and without the baseline; the reshard target is
  peak RSS above the baseline <= the chunk + 64 MiB;
- restore onto (2, 4) timed in fresh processes (the peak-RSS process): modelshard's against
  Orbax's ``StandardCheckpointer`` restoring its own checkpoint onto the same targets, the
  order alternating, ratios per repeat (issue 46's bar);
- reshard time: ``modelshard.reshard`` in this process against ``restore`` onto the same
  new layout + ``save`` of the result, and against Orbax's restore onto it + Orbax's save
  (ratios per repeat), interleaved, medians over ``--repeats``; then the
  ``modelshard reshard`` command against restore + save again, each of those runs started
  ``SETTLE_S`` after its old output was removed (see there), in wall time and in CPU time
  (all threads; the load on a shared machine moves it less); and the command against
  Orbax's restore onto (2, 4) + save in a fresh process of its own (issue 46's bar: both
  start-ups included, both settled, per repeat).

The state is ``--leaves`` float32 matrices of random normals sharded by ``fsdp('data')`` over
8 simulated CPU devices.
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
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import modelshard as ms  # noqa: E402

RULES_TOML = """
[[rules]]
pattern = "w$"
spec = ["data", "model"]
"""

CHILD_RESTORE = textwrap.dedent(
    """
    import os, sys, json, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import orbax.checkpoint
    from jax.sharding import PartitionSpec as P
    import modelshard as ms
    mesh = ms.make_mesh({"data": 2, "model": 4})
    jnp.ones(8).block_until_ready()

    def vm_hwm():  # peak RSS of this process image (ru_maxrss would include the parent's)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    base = vm_hwm()
    t = time.perf_counter()
    if sys.argv[1] == "orbax":  # Orbax's own checkpoint onto the same (2, 4) layout
        sharding = jax.sharding.NamedSharding(mesh, P("data", "model"))
        target = {k: {"w": jax.ShapeDtypeStruct(tuple(s), jnp.float32, sharding=sharding)}
                  for k, s in json.loads(sys.argv[3]).items()}
        out = orbax.checkpoint.StandardCheckpointer().restore(sys.argv[2], target)
        jax.block_until_ready(out)
    elif sys.argv[1] != "baseline":
        out = ms.restore(sys.argv[1], specs=ms.Rules([("w$", P("data", "model"))]), mesh=mesh)
        jax.block_until_ready(out)
    print(json.dumps({"baseline": base, "peak": vm_hwm(), "s": time.perf_counter() - t}))
    """
)

# Orbax's own reshard, in a fresh process as the command is: its checkpoint restored onto
# (2, 4) (StandardCheckpointer), then saved (issue 46's baseline for the command).
CHILD_ORBAX_RESHARD = textwrap.dedent(
    """
    import os, sys, json
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {k: {"w": jax.ShapeDtypeStruct(tuple(s), jnp.float32, sharding=sharding)}
              for k, s in json.loads(sys.argv[3]).items()}
    ckpt = ocp.StandardCheckpointer()
    out = ckpt.restore(sys.argv[1], target)
    ckpt.save(sys.argv[2], out)
    ckpt.wait_until_finished()
    """
)

# ru_maxrss of a grandchild forked from this small wrapper is that process's own peak.
CHILD_CLI = textwrap.dedent(
    """
    import resource, subprocess, sys, json
    rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"rc": rc, "peak": usage.ru_maxrss * 1024,
                      "cpu": usage.ru_utime + usage.ru_stime}))
    """
)


def _rss_row(what, peak, base, nbytes, chunk_bytes):
    """A peak-RSS table row of a reshard: the target is the chunk + 64 MiB above baseline."""
    mb = 1 << 20
    above = peak - base
    met = "met" if above <= chunk_bytes + 64 * mb else "MISSED"
    return (
        f"| {what} | {peak / mb:.0f} | {peak / nbytes:.2f} (of the data) | "
        f"{above / mb:.0f} MiB | <= chunk + 64 = {(chunk_bytes + 64 * mb) / mb:.0f} MiB: {met} |"
    )


# This machine's hypervisor takes back memory the guest kernel has left free for about 2 s
# (virtio-balloon free page reporting, /sys/module/page_reporting), and a write that fills
# new page cache from such memory costs many times the CPU time of one into pages freed
# moments before (256 MiB written: 2.2 s of system time against 0.08 s). Restore + save in
# this process removes its old output just before writing, into just-freed pages, while
# the command's start-up alone outlasts the 2 s: unsettled, their ratio says more about
# when the old output was removed than about either. So each run of that comparison starts
# SETTLE_S after its old output was removed (its source read just before): every write
# pays alike.
SETTLE_S = 3.0


def _timed(fn, setup=None):
    if setup is not None:
        setup()
    t = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t
    _release()
    return seconds


def _release() -> None:
    """Untimed, after each operation: what it freed handed back to the system. One process
    runs every method at 3 GiB, and glibc keeps each one's freed buffers for the next (this
    process grew past 20 GiB and was OOM-killed on a 24 GiB machine); a user's process
    runs one."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _make_state(gib, leaves, mesh):
    rows = 2048
    cols = max(8, int(gib * (1 << 30) / 4 / leaves / rows) // 8 * 8)
    keys = jax.random.split(jax.random.key(0), leaves)
    state = {
        f"layer{i:03d}": {"w": jax.random.normal(k, (rows, cols), jnp.float32)}
        for i, k in enumerate(keys)
    }
    return ms.shard(state, ms.fsdp("data"), mesh)


def _setup(args, prefix):
    """``(scratch dir, mesh, state, its bytes, its abstract twin)`` for ``--dir``,
    ``--gib`` and ``--leaves``: the state sharded over 8 devices and ready."""
    root = Path(args.dir or tempfile.mkdtemp(prefix=prefix)).absolute()
    root.mkdir(parents=True, exist_ok=True)
    mesh = ms.make_mesh({"data": 8})
    state = _make_state(args.gib, args.leaves, mesh)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    return root, mesh, state, nbytes, abstract


def warm(directory) -> None:
    """Read every file under ``directory``, untimed, so that the restore timed next reads
    from the page cache, as a "warm cache" row says. This machine's kernel pages out file
    data nobody touched for a while (a DAMON ``pageout`` scheme), so a file written a minute
    earlier may come from disk again: unwarmed, whichever method ran longest after its
    files were last read paid the disk (the floor's ``np.load`` most often, 12 s for
    384 MiB in one run)."""
    for f in sorted(Path(directory).rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def _np_save(directory, state):
    directory.mkdir(parents=True)
    for name, leaf in state.items():
        with open(directory / f"{name}.npy", "wb") as f:
            np.save(f, np.asarray(leaf["w"]))
            f.flush()
            os.fsync(f.fileno())


def _np_load(directory, shardings):
    host = {name: {"w": np.load(directory / f"{name}.npy")} for name in shardings}
    return jax.block_until_ready(jax.device_put(host, shardings))


def _run_json(cmd, timeout=900):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _figures(results, reshard_ratios, args, chunk_bytes) -> dict:
    """What ``docs/benchmarks/checkpoint.md`` shows, in the units it shows them."""
    mib = 1 << 20
    nbytes, disk, big = (
        results["state_bytes"],
        results["checkpoint_bytes_on_disk"],
        results["big_leaf_bytes"],
    )
    base = results["rss_baseline"]
    out: dict = {
        "gib": args.gib,
        "leaves": args.leaves,
        "repeats": args.repeats,
        "chunk_mib": args.chunk_mb,
        "state_mib": round(nbytes / mib),
        "leaf_mib": round(nbytes / args.leaves / mib, 1),
        "checkpoint_vs_state": round(disk / nbytes, 3),
        "big_leaf_mib": round(big / mib),
    }
    for k in ("save_modelshard", "save_orbax", "save_np"):
        out[f"{k}_s"] = round(results[f"{k}_s"], 2)
        out[f"{k}_gbs"] = round(nbytes / results[f"{k}_s"] / 1e9, 2)
        out[f"{k}_vs_orbax"] = round(results[f"{k}_s"] / results["save_orbax_s"], 2)
    for k in ("restore_modelshard", "restore_modelshard_noverify", "restore_orbax", "restore_np"):
        out[f"{k}_s"] = round(results[f"{k}_s"], 2)
        out[f"{k}_gbs"] = round(nbytes / results[f"{k}_s"] / 1e9, 2)
        out[f"{k}_vs_orbax"] = round(results[f"{k}_s"] / results["restore_orbax_s"], 2)
    out["save_vs_floor"] = round(results["save_np_s"] / results["save_modelshard_s"], 2)
    out["restore_vs_floor"] = round(results["restore_np_s"] / results["restore_modelshard_s"], 2)
    for k, size in (
        ("baseline", nbytes),
        ("restore_reshard", nbytes),
        ("reshard_cli", disk),
        ("reshard_big_cli", big),
    ):
        peak = results[f"rss_{k}"]
        out[f"rss_{k}_mib"] = round(peak / mib)
        out[f"rss_{k}_vs_bytes"] = round(peak / size, 2)
        if k != "baseline":
            out[f"rss_{k}_above_baseline_mib"] = round((peak - base) / mib)
            out[f"rss_{k}_above_baseline_vs_bytes"] = round((peak - base) / size, 2)
    out["reshard_peak_target_mib"] = round((chunk_bytes + 64 * mib) / mib)
    for k in ("reshard_restore_save_s", "reshard_s", "reshard_cli_s", "reshard_big_cli_s"):
        out[k] = round(results[k], 1)
    out["cli_startup_s"] = round(results["cli_startup_s"], 1)
    out["reshard_cli_less_startup_s"] = round(
        results["reshard_cli_s"] - results["cli_startup_s"], 1
    )
    out["reshard_vs_restore_save"] = round(
        results["reshard_s"] / results["reshard_restore_save_s"], 2
    )
    out["reshard_ratios"] = [round(r, 2) for r in reshard_ratios]
    out["reshard_orbax_restore_save_s"] = round(results["reshard_orbax_restore_save_s"], 1)
    vs_orbax = results["reshard_vs_orbax_ratios"]
    out["reshard_vs_orbax_restore_save"] = round(statistics.median(vs_orbax), 2)
    out["reshard_vs_orbax_restore_save_ratios"] = [round(r, 2) for r in vs_orbax]
    out["fresh_restore24_ms_s"] = round(results["fresh_restore24_ms_s"], 2)
    out["fresh_restore24_orbax_s"] = round(results["fresh_restore24_orbax_s"], 2)
    out["fresh_restore24_vs_orbax"] = round(statistics.median(results["fresh_restore24_ratios"]), 2)
    out["fresh_restore24_vs_orbax_ratios"] = [
        round(r, 2) for r in results["fresh_restore24_ratios"]
    ]
    out["rss_fresh_restore24_orbax_mib"] = round(results["rss_fresh_restore24_orbax"] / mib)
    out["reshard_cli_vs_restore_save"] = round(results["reshard_cli_vs_restore_save"], 2)
    out["reshard_cli_ratios"] = [round(r, 2) for r in results["reshard_cli_ratios"]]
    out["reshard_cli_restore_save_s"] = round(results["reshard_cli_restore_save_s"], 1)
    out["cli_fixed_s"] = round(results["cli_fixed_s"], 1)
    out["reshard_cli_less_fixed_s"] = round(results["reshard_cli_s"] - results["cli_fixed_s"], 1)
    out["reshard_cli_less_fixed_vs_restore_save"] = round(
        results["reshard_cli_less_fixed_vs_restore_save"], 2
    )
    out["reshard_cli_less_fixed_ratios"] = [
        round(r, 2) for r in results["reshard_cli_less_fixed_ratios"]
    ]
    out["reshard_cli_less_fixed_cpu_vs_restore_save"] = round(
        results["reshard_cli_less_fixed_cpu_vs_restore_save"], 2
    )
    out["reshard_cli_less_fixed_cpu_ratios"] = [
        round(r, 2) for r in results["reshard_cli_less_fixed_cpu_ratios"]
    ]
    out["reshard_cli_orbax_fresh_s"] = round(results["reshard_cli_orbax_fresh_s"], 1)
    vs_fresh = results["reshard_cli_vs_orbax_fresh_ratios"]
    out["reshard_cli_vs_orbax_fresh"] = round(statistics.median(vs_fresh), 2)
    out["reshard_cli_vs_orbax_fresh_ratios"] = [round(r, 2) for r in vs_fresh]
    out["rss_reshard_orbax_fresh_mib"] = round(results["rss_reshard_orbax_fresh"] / mib)
    out["reshard_checksums_match"] = "yes" if results["reshard_checksums_match"] else "no"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--leaves", type=int, default=64, help="number of leaves (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per timing (default 3)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument(
        "--chunk-mb",
        type=float,
        default=16.0,
        help="--chunk-mb for modelshard reshard (default 16)",
    )
    parser.add_argument(
        "--big-factor",
        type=float,
        default=8.0,
        help="size of the single-leaf reshard case, in chunks (default 8)",
    )
    parser.add_argument("--notes", default="", help="recorded in the results file")
    args = parser.parse_args(argv)

    root, mesh, state, nbytes, abstract = _setup(args, "ms-bench-")
    gb = nbytes / 1e9
    tree_shardings = jax.tree.map(lambda x: x.sharding, state)
    results: dict[str, Any] = {"state_bytes": nbytes}

    def fresh(name):
        return lambda: shutil.rmtree(root / name, ignore_errors=True)

    # ---- save, then restore (warm page cache); methods interleaved within each repeat ----
    handler = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    pytree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    specs = ms.fsdp("data")
    saves = {
        "save_modelshard_s": ("ms", lambda: ms.save(root / "ms", state)),
        "save_orbax_s": (
            "orbax",
            lambda: handler.save(root / "orbax", args=ocp.args.StandardSave(state)),
        ),
        "save_np_s": ("np", lambda: _np_save(root / "np", state)),
    }
    restores = {
        "restore_modelshard_s": lambda: ms.restore(
            root / "ms", like=abstract, specs=specs, mesh=mesh
        ),
        "restore_modelshard_noverify_s": lambda: ms.restore(
            root / "ms", like=abstract, specs=specs, mesh=mesh, verify=False
        ),
        "restore_orbax_s": lambda: pytree.restore(
            root / "orbax",
            args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args),
        ),
        "restore_np_s": lambda: _np_load(root / "np", tree_shardings),
    }
    mesh24 = ms.make_mesh({"data": 2, "model": 4})
    rules24 = ms.Rules([("w$", P("data", "model"))])
    chunk_bytes = int(args.chunk_mb * (1 << 20))

    def restore_then_save():
        out = ms.restore(root / "ms", specs=rules24, mesh=mesh24)
        jax.block_until_ready(out)
        ms.save(root / "rs_baseline", out)

    abstract24 = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh24, P("data", "model"))
        ),
        abstract,
    )

    def orbax_restore_then_save():
        out = handler.restore(root / "orbax", args=ocp.args.StandardRestore(abstract24))
        jax.block_until_ready(out)
        handler.save(root / "rs_orbax", args=ocp.args.StandardSave(out))

    reshards = {
        "reshard_restore_save_s": ("rs_baseline", restore_then_save),
        "reshard_orbax_restore_save_s": ("rs_orbax", orbax_restore_then_save),
        "reshard_s": (
            "rs_new",
            lambda: ms.reshard(
                root / "ms", root / "rs_new", specs=rules24, mesh=mesh24, chunk_bytes=chunk_bytes
            ),
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in [*saves, *restores, *reshards]}
    for _ in range(args.repeats):
        for key, (name, fn) in saves.items():
            times[key].append(_timed(fn, setup=fresh(name)))
        for key, fn in restores.items():
            times[key].append(_timed(lambda fn=fn: jax.block_until_ready(fn())))
        for key, (name, fn) in reshards.items():
            times[key].append(_timed(fn, setup=fresh(name)))
    reshard_ratios = [
        a / b for a, b in zip(times["reshard_s"], times["reshard_restore_save_s"], strict=True)
    ]
    results["reshard_vs_orbax_ratios"] = [
        a / b
        for a, b in zip(times["reshard_s"], times["reshard_orbax_restore_save_s"], strict=True)
    ]
    results.update({k: statistics.median(v) for k, v in times.items()})
    state = None  # free the source state before the fresh-process measurements
    ckpt_bytes = sum(f.stat().st_size for f in (root / "ms").rglob("*") if f.is_file())
    results["checkpoint_bytes_on_disk"] = ckpt_bytes

    # ---- peak RSS in fresh processes ------------------------------------------------
    child = root / "child_restore.py"
    child.write_text(CHILD_RESTORE)
    base = _run_json([sys.executable, str(child), "baseline"])
    rss = _run_json([sys.executable, str(child), str(root / "ms")])
    results["rss_baseline"] = base["peak"]
    results["rss_restore_reshard"] = rss["peak"]
    # restore onto (2, 4), each in a fresh process, modelshard's and Orbax's (its own
    # checkpoint, the same targets), order alternating, each reading a warm page cache
    shapes = {k: list(v["w"].shape) for k, v in abstract.items()}
    fresh_s: dict[str, list[float]] = {"ms": [], "orbax": []}
    fresh_peak: dict[str, list[int]] = {"ms": [], "orbax": []}
    for r in range(args.repeats):
        for kind in ("ms", "orbax") if r % 2 == 0 else ("orbax", "ms"):
            warm(root / kind)
            cmd = [sys.executable, str(child)]
            cmd += [str(root / "ms")] if kind == "ms" else ["orbax", str(root / "orbax")]
            out = _run_json([*cmd, json.dumps(shapes)])
            fresh_s[kind].append(out["s"])
            fresh_peak[kind].append(out["peak"])
    results["fresh_restore24_ms_s"] = statistics.median(fresh_s["ms"])
    results["fresh_restore24_orbax_s"] = statistics.median(fresh_s["orbax"])
    results["fresh_restore24_ratios"] = [
        a / b for a, b in zip(fresh_s["ms"], fresh_s["orbax"], strict=True)
    ]
    results["rss_fresh_restore24_orbax"] = max(fresh_peak["orbax"])
    rules = root / "rules.toml"
    rules.write_text(RULES_TOML)
    cli_child = root / "child_cli.py"
    cli_child.write_text(CHILD_CLI)
    exe = str(Path(sys.executable).parent / "modelshard")

    def settled(name):
        """Remove ``name``, read the source, then wait ``SETTLE_S``: the write timed next
        fills new page cache from memory the hypervisor has taken back (``SETTLE_S``)."""

        def setup():
            shutil.rmtree(root / name, ignore_errors=True)
            warm(root / "ms")
            time.sleep(SETTLE_S)

        return setup

    def reshard_cli(src: str, dst: str) -> tuple[dict, float]:
        """``modelshard reshard src dst`` onto (2, 4) in a fresh process: its result, seconds."""
        settled(dst)()
        t = time.perf_counter()
        cmd = [sys.executable, str(cli_child), exe, "reshard", str(root / src), str(root / dst)]
        cmd += ["--mesh", "data=2,model=4", "--rules", str(rules), "--chunk-mb", str(args.chunk_mb)]
        out = _run_json(cmd)
        if out["rc"] != 0:
            raise RuntimeError(f"modelshard reshard {src} failed")
        return out, time.perf_counter() - t

    # The command against restore + save in this process, paired repeat by repeat: each
    # repeat runs restore + save here, then two measures of the command's start-up, then the
    # command. Start-up is most of a command's time on a small state, so one unpaired pair
    # of processes under load can put the ratio anywhere (3.58x, then -0.21x, on the same
    # code): the ratios recorded are medians of per-repeat ratios. The start-ups:
    # `modelshard inspect` of the same checkpoint (interpreter, imports, 8 CPU devices, the
    # record read), and the command on a one-leaf checkpoint of 64 KiB, which also pays what
    # any reshard pays once per process whatever its size (importing Orbax, compiling the
    # transfer and checksum programs for a leaf, the writer's setup).
    tiny = {"layer000": {"w": jnp.ones((2048, 8), jnp.float32)}}
    ms.save(root / "tiny", ms.shard(tiny, ms.fsdp("data"), mesh), overwrite=True)
    cli_s, startup_s, fixed_s, rs_s, cli_ratios, fixed_ratios, cli_peaks = ([] for _ in range(7))
    fixed_cpu_ratios: list[float] = []
    orbax_fresh_s: list[float] = []
    orbax_fresh_peaks: list[int] = []
    orbax_child = root / "child_orbax_reshard.py"
    orbax_child.write_text(CHILD_ORBAX_RESHARD)
    shapes_json = json.dumps(shapes)
    for _ in range(args.repeats):
        settled("rs_baseline")()
        cpu = time.process_time()
        rs_s.append(_timed(restore_then_save))
        rs_cpu = time.process_time() - cpu
        t = time.perf_counter()
        if _run_json([sys.executable, str(cli_child), exe, "inspect", str(root / "ms")])["rc"]:
            raise RuntimeError("modelshard inspect failed")
        startup_s.append(time.perf_counter() - t)
        fixed, seconds = reshard_cli("tiny", "tiny_resharded")
        fixed_s.append(seconds)
        cli, seconds = reshard_cli("ms", "resharded")
        settled("orbax_resharded")()
        t = time.perf_counter()
        cmd = [sys.executable, str(cli_child), sys.executable, str(orbax_child)]
        got = _run_json([*cmd, str(root / "orbax"), str(root / "orbax_resharded"), shapes_json])
        if got["rc"] != 0:
            raise RuntimeError("Orbax restore + save in a fresh process failed")
        orbax_fresh_s.append(time.perf_counter() - t)
        orbax_fresh_peaks.append(got["peak"])
        fixed_cpu_ratios.append((cli["cpu"] - fixed["cpu"]) / rs_cpu)
        cli_s.append(seconds)
        cli_peaks.append(cli["peak"])
        cli_ratios.append((seconds - startup_s[-1]) / rs_s[-1])
        fixed_ratios.append((seconds - fixed_s[-1]) / rs_s[-1])
    results["reshard_cli_s"] = statistics.median(cli_s)
    results["cli_startup_s"] = statistics.median(startup_s)
    results["cli_fixed_s"] = statistics.median(fixed_s)
    results["reshard_cli_restore_save_s"] = statistics.median(rs_s)
    results["reshard_cli_vs_restore_save"] = statistics.median(cli_ratios)
    results["reshard_cli_ratios"] = cli_ratios
    results["reshard_cli_less_fixed_vs_restore_save"] = statistics.median(fixed_ratios)
    results["reshard_cli_less_fixed_ratios"] = fixed_ratios
    results["reshard_cli_less_fixed_cpu_vs_restore_save"] = statistics.median(fixed_cpu_ratios)
    results["reshard_cli_less_fixed_cpu_ratios"] = fixed_cpu_ratios
    results["rss_reshard_cli"] = max(cli_peaks)
    # the command against Orbax's restore + save, each a fresh process, start-up included
    results["reshard_cli_orbax_fresh_s"] = statistics.median(orbax_fresh_s)
    results["reshard_cli_vs_orbax_fresh_ratios"] = [
        a / b for a, b in zip(cli_s, orbax_fresh_s, strict=True)
    ]
    results["rss_reshard_orbax_fresh"] = max(orbax_fresh_peaks)
    cli = {"peak": max(cli_peaks)}
    # one leaf args.big_factor times the chunk: copied in slabs, the peak must stay near a chunk
    big_rows = 2048
    big_cols = max(8, int(args.big_factor * chunk_bytes / 4 / big_rows) // 8 * 8)
    big = ms.shard(
        {"big": {"w": jax.random.normal(jax.random.key(1), (big_rows, big_cols), jnp.float32)}},
        ms.fsdp("data"),
        mesh,
    )
    big_bytes = big_rows * big_cols * 4
    ms.save(root / "big", big, overwrite=True)
    del big
    cli_big, results["reshard_big_cli_s"] = reshard_cli("big", "big_resharded")
    results["rss_reshard_big_cli"] = cli_big["peak"]
    results["big_leaf_bytes"] = big_bytes
    # bit-exact: the new record carries the source's checksums (unchanged bits keep them),
    # and restoring the new checkpoint verifies its stored bits against them.
    sums = [
        [
            leaf["checksum"]
            for leaf in json.loads((root / d / "modelshard.json").read_text())["leaves"]
        ]
        for d in ("ms", "resharded", "big", "big_resharded")
    ]
    results["reshard_checksums_match"] = sums[0] == sums[1] and sums[2] == sums[3]

    # ---- report ---------------------------------------------------------------------
    def row(name, seconds, ref=None):
        ratio = "" if ref is None else f"{seconds / ref:.2f}x"
        return f"| {name} | {seconds:.2f} s | {gb / seconds:.2f} GB/s | {ratio} |"

    mb = 1 << 20
    lines = [
        f"state: {args.leaves} float32 leaves, {nbytes / (1 << 30):.2f} GiB "
        f"({nbytes / 1e9:.2f} GB), fsdp over 8 CPU devices; checkpoint on disk "
        f"{ckpt_bytes / (1 << 30):.2f} GiB; median of {args.repeats}",
        "",
        "| operation | time | throughput | time vs raw Orbax |",
        "|---|---|---|---|",
        row("save: modelshard.save", results["save_modelshard_s"], results["save_orbax_s"]),
        row("save: raw Orbax", results["save_orbax_s"], results["save_orbax_s"]),
        row("save: np.save + fsync", results["save_np_s"], results["save_orbax_s"]),
        row(
            "restore: modelshard.restore",
            results["restore_modelshard_s"],
            results["restore_orbax_s"],
        ),
        row(
            "restore: modelshard.restore(verify=False)",
            results["restore_modelshard_noverify_s"],
            results["restore_orbax_s"],
        ),
        row("restore: raw Orbax", results["restore_orbax_s"], results["restore_orbax_s"]),
        row("restore: np.load + device_put", results["restore_np_s"], results["restore_orbax_s"]),
        "",
        "| peak RSS (fresh process) | MiB | / bytes | above baseline | target |",
        "|---|---|---|---|---|",
        f"| baseline (imports, 8 CPU devices) | {base['peak'] / mb:.0f} | "
        f"{base['peak'] / nbytes:.2f} | - | - |",
        f"| restore with reshard (8,) -> (2,4) | {rss['peak'] / mb:.0f} | "
        f"{rss['peak'] / nbytes:.2f} | {(rss['peak'] - base['peak']) / nbytes:.2f} | "
        # the target is on what the restore holds above the baseline process (the docs' table)
        f"above baseline <= 1.3: "
        f"{'met' if rss['peak'] - base['peak'] <= 1.3 * nbytes else 'MISSED'} |",
        _rss_row(
            f"`modelshard reshard` (chunk {args.chunk_mb:g} MiB, {results['reshard_cli_s']:.1f} s)",
            cli["peak"],
            base["peak"],
            ckpt_bytes,
            chunk_bytes,
        ),
        _rss_row(
            f"`modelshard reshard`, one {big_bytes / mb:.0f} MiB leaf "
            f"({results['reshard_big_cli_s']:.1f} s)",
            cli_big["peak"],
            base["peak"],
            big_bytes,
            chunk_bytes,
        ),
        "",
        "| reshard time (in process) | median | vs restore + save |",
        "|---|---|---|",
        f"| restore onto (2, 4) + save | {results['reshard_restore_save_s']:.2f} s | 1.00x |",
        f"| `modelshard.reshard`, chunk {args.chunk_mb:g} MiB | {results['reshard_s']:.2f} s | "
        f"{results['reshard_s'] / results['reshard_restore_save_s']:.2f}x (per repeat: "
        + ", ".join(f"{r:.2f}x" for r in reshard_ratios)
        + ") |",
        f"| `modelshard reshard` command, start-up ({results['cli_startup_s']:.2f} s) "
        f"subtracted | {results['reshard_cli_s'] - results['cli_startup_s']:.2f} s | "
        f"{results['reshard_cli_vs_restore_save']:.2f}x (per repeat, against restore + save "
        "run beside it: " + ", ".join(f"{r:.2f}x" for r in cli_ratios) + ") |",
        f"| `modelshard reshard` command, a 64 KiB reshard ({results['cli_fixed_s']:.2f} s) "
        f"subtracted | {results['reshard_cli_s'] - results['cli_fixed_s']:.2f} s | "
        f"{results['reshard_cli_less_fixed_vs_restore_save']:.2f}x (per repeat: "
        + ", ".join(f"{r:.2f}x" for r in fixed_ratios)
        + ") |",
        f"| the same, CPU time (all threads) | - | "
        f"{results['reshard_cli_less_fixed_cpu_vs_restore_save']:.2f}x (per repeat: "
        + ", ".join(f"{r:.2f}x" for r in results["reshard_cli_less_fixed_cpu_ratios"])
        + ") |",
        "",
        f"Orbax restore onto (2, 4) + Orbax save: {results['reshard_orbax_restore_save_s']:.2f} s;"
        f" reshard / that, per repeat: "
        + ", ".join(f"{r:.2f}x" for r in results["reshard_vs_orbax_ratios"]),
        f"`modelshard reshard` against Orbax restore + save, each a fresh process: "
        f"{results['reshard_cli_s']:.2f} s, {results['rss_reshard_cli'] / mb:.0f} MiB peak "
        f"against {results['reshard_cli_orbax_fresh_s']:.2f} s, "
        f"{results['rss_reshard_orbax_fresh'] / mb:.0f} MiB; per repeat: "
        + ", ".join(f"{r:.2f}x" for r in results["reshard_cli_vs_orbax_fresh_ratios"]),
        f"restore onto (2, 4) in a fresh process: modelshard "
        f"{results['fresh_restore24_ms_s']:.2f} s, Orbax {results['fresh_restore24_orbax_s']:.2f}"
        " s; per repeat: " + ", ".join(f"{r:.2f}x" for r in results["fresh_restore24_ratios"]),
        "",
        f"resharded checkpoint carries the source's checksums: "
        f"{results['reshard_checksums_match']}",
    ]
    print("\n".join(lines))
    print(json.dumps({**results, "reshard_ratios": reshard_ratios}))
    from results import write_results

    figures = _figures(results, reshard_ratios, args, chunk_bytes)
    write_results("checkpoint", figures, argv=sys.argv, notes=args.notes)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
