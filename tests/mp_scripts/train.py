"""One training run on a global (data=2, model=4) mesh, alone or under ``modelshard launch``.

Usage: ``python train.py OUT [--save CKPT] [--restore CKPT --expect NPZ --restore-mesh 4,2]``.
Writes ``OUT/result_<process>.json`` (losses, checks) and, on process 0, ``OUT/state.npz``
(the trained state's full values, all-gathered).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T0 = time.perf_counter()

import modelshard as ms  # noqa: E402

ms.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model as m  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--save")
    ap.add_argument("--restore")
    ap.add_argument("--expect")
    ap.add_argument("--restore-mesh", default="4,2")
    args = ap.parse_args()
    t_init = time.perf_counter() - T0
    me = jax.process_index()
    result: dict = {
        "process": me,
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
    }

    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = m.init_state()
    plan = ms.plan(state, m.RULES, mesh)
    result["plan"] = str(plan)
    # A state committed to this process's first device: shard must still place it globally.
    state = ms.shard(jax.device_put(state, jax.local_devices()[0]), m.RULES, mesh)
    result["state_specs"] = {
        p: str(s)
        for p, s in zip(
            ms.adapters.split(state).paths,
            [x.sharding.spec for x in ms.adapters.split(state).arrays],
            strict=True,
        )
    }

    step = jax.jit(m.train_step)
    batch_sharding = NamedSharding(mesh, m.BATCH_SPEC)
    losses = []
    rows = m.local_rows(mesh, m.BATCH)
    result["rows"] = [rows.start, rows.stop]
    for i in range(m.STEPS):
        x, y = m.batch(i)
        gx, gy = (
            jax.make_array_from_process_local_data(batch_sharding, a[rows], a.shape) for a in (x, y)
        )
        if i == 0:
            host = ms.distributed.to_host({"x": gx, "y": gy})
            result["assembled"] = {
                "shape": list(gx.shape),
                "spec": str(gx.sharding.spec),
                "equal": bool(np.array_equal(host["x"], x) and np.array_equal(host["y"], y)),
            }
        state, loss = step(state, gx, gy)
        losses.append(float(ms.distributed.to_host(loss)))
    result["losses"] = losses
    values = m.flat_values(state)
    if me == 0:
        np.savez(os.path.join(args.out, "state.npz"), **values)
    if args.save:
        ckpt_api().save(args.save, state)
    if args.restore:
        result["restored"] = check_restore(args.restore, args.expect, args.restore_mesh)
    result["seconds"] = {"initialize": t_init, "total": time.perf_counter() - T0}
    with open(os.path.join(args.out, f"result_{me}.json"), "w") as f:
        json.dump(result, f)
    ms.distributed.barrier("done")


def ckpt_api():
    if hasattr(ms, "save"):
        return ms
    from modelshard import _checkpoint

    return _checkpoint


def check_restore(ckpt: str, expect: str, shape: str) -> dict:
    """Restore ``ckpt`` onto a (data, model) mesh of ``shape``; compare with ``expect``."""
    data, model = (int(v) for v in shape.split(","))
    mesh = ms.make_mesh({"data": data, "model": model})
    like = jax.eval_shape(m.init_state)
    restored = ckpt_api().restore(ckpt, like=like, specs=m.RULES, mesh=mesh)
    planned = ms.plan(like, m.RULES, mesh).flat_shardings(0)
    flat = ms.adapters.split(restored)
    want = np.load(expect)
    exact, placed = [], []
    for path, x, s in zip(flat.paths, flat.arrays, planned, strict=True):
        placed.append(x.sharding == s)
        # Compare this process's shards only: no communication, bit for bit.
        exact.append(
            all(
                np.array_equal(np.asarray(sh.data), want[path][sh.index])
                for sh in x.addressable_shards
            )
        )
    return {
        "paths": flat.paths,
        "bit_exact": exact,
        "planned_shardings": placed,
        "mesh": [data, model],
    }


if __name__ == "__main__":
    main()
