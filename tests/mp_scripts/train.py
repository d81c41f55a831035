"""One training run on a global (data=2, model=4) mesh, alone or under ``modelshard launch``.

Usage: ``python train.py OUT [--save DIR] [--restore DIR --expect NPZ --restore-mesh 4,2]``.
Writes ``OUT/result_<process>.json`` (losses, checks) and, on process 0, ``OUT/state.npz``
(the trained state's full values, all-gathered). ``--save`` writes ``DIR/ckpt`` with
``modelshard.save`` and ``DIR/mngr`` with a ``CheckpointManager``; ``--restore`` reads both
back onto another mesh and runs the CLI's read-only commands on ``DIR/ckpt``.
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
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model as m  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--save")
    ap.add_argument("--restore")
    ap.add_argument("--expect")
    ap.add_argument("--restore-mesh", default="4,2")
    ap.add_argument("--nnx", action="store_true", help="also train an NNX model in place")
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

    step = ms.shard_jit(m.train_step, mesh=mesh, in_specs=(m.RULES, m.BATCH_SPEC, m.BATCH_SPEC))
    # NumPy inputs (the same full values on every process) are placed by shard_jit.
    x, y = m.batch(0)
    result["numpy_loss"] = float(ms.distributed.to_host(step(m.init_state(), x, y)[1]))
    losses = []
    rows = m.local_rows(mesh, m.BATCH)
    result["rows"] = [rows.start, rows.stop]
    result["assembled"] = {}
    for i in range(m.STEPS):
        x, y = m.batch(i)
        if i % 2 == 0:  # this process's rows of the batch
            how = "process_local"
            batch = ms.assemble_process_local({"x": x[rows], "y": y[rows]}, m.BATCH_SPEC, mesh)
        else:  # one piece per device this process addresses, in mesh order
            how = "pieces"
            index = NamedSharding(mesh, m.BATCH_SPEC).devices_indices_map(x.shape)
            mine = [d for d in mesh.devices.flat if d.process_index == me]
            pieces = [{"x": x[index[d]], "y": y[index[d]]} for d in mine]
            batch = ms.assemble(pieces, m.BATCH_SPEC, mesh)
        host = ms.distributed.to_host(batch)
        result["assembled"][how] = {
            "shape": list(batch["x"].shape),
            "spec": str(batch["x"].sharding.spec),
            "equal": bool(np.array_equal(host["x"], x) and np.array_equal(host["y"], y)),
        }
        state, loss = step(state, batch["x"], batch["y"])
        losses.append(float(ms.distributed.to_host(loss)))
    result["losses"] = losses
    if args.nnx:
        result["nnx_losses"] = m.nnx_losses(mesh)
    values = m.flat_values(state)
    if me == 0:
        np.savez(os.path.join(args.out, "state.npz"), **values)
    if args.save:
        result["device_barriers"] = save_both(args.save, state)
    if jax.process_count() > 1:
        result["errors"] = errors()
    if args.restore:
        result["restored"] = check_restore(args.restore, args.expect, args.restore_mesh)
        result["cli"] = run_cli(os.path.join(args.restore, "ckpt"))
    result["seconds"] = {"initialize": t_init, "total": time.perf_counter() - T0}
    with open(os.path.join(args.out, f"result_{me}.json"), "w") as f:
        json.dump(result, f)
    ms.distributed.barrier("done")


def errors() -> dict:
    """What modelshard says when a value or a layout cannot be had on this process."""
    out = {}
    devices = sorted(jax.devices(), key=lambda d: (d.id % 2, d.id))  # interleave processes
    odd = ms.make_mesh({"data": 8}, devices=devices)
    try:
        ms.distributed.local_slice((16,), m.BATCH_SPEC, odd)
    except ms.DistributedError as e:
        out["local_slice"] = str(e)
    x = ms.shard({"w": np.ones((8, 4), np.float32)}, P(), ms.make_mesh({"data": 8}))
    try:
        ms.distributed.require_addressable(x["w"], "the test")
    except ms.DistributedError as e:
        out["require_addressable"] = str(e)
    try:
        ms.assemble_process_local({"batch": x["w"]}, m.BATCH_SPEC, ms.make_mesh({"data": 8}))
    except ms.AssembleError as e:
        out["assemble_process_local"] = str(e)
    return out


def save_both(directory: str, state: dict) -> list[str]:
    """``ms.save`` to ``directory/ckpt``; a ``CheckpointManager`` step to ``directory/mngr``.

    Returns the device barriers (``sync_global_devices``) the saves issued: Orbax's own
    barriers should all go through the coordination service instead."""
    from jax.experimental import multihost_utils

    barriers: list[str] = []
    device_sync = multihost_utils.sync_global_devices

    def counted(name: str) -> None:
        barriers.append(name)
        device_sync(name)

    multihost_utils.sync_global_devices = counted
    try:
        _save_both(directory, state)
    finally:
        multihost_utils.sync_global_devices = device_sync
    return barriers


def _save_both(directory: str, state: dict) -> None:
    ms.save(os.path.join(directory, "ckpt"), state)
    # Leaves only this process holds (NumPy, one device, a typed key) are saved too.
    local = {
        "np": np.arange(6.0, dtype=np.float32),
        "one": jax.numpy.ones(3),
        "key": jax.random.key(7),
    }
    ms.save(os.path.join(directory, "local"), local)
    with ms.CheckpointManager(os.path.join(directory, "mngr"), max_to_keep=1) as mngr:
        mngr.save(m.STEPS, state)
        mngr.wait_until_finished()


def compare(restored: dict, planned: list, want: np.lib.npyio.NpzFile) -> dict:
    flat = ms.adapters.split(restored)
    exact, placed = [], []
    for path, x, s in zip(flat.paths, flat.arrays, planned, strict=True):
        placed.append(x.sharding == s)
        # This process's shards only: no communication, bit for bit.
        exact.append(
            all(
                np.array_equal(np.asarray(sh.data), want[path][sh.index])
                for sh in x.addressable_shards
            )
        )
    return {"paths": flat.paths, "bit_exact": exact, "planned_shardings": placed}


def check_restore(directory: str, expect: str, shape: str) -> dict:
    """Restore what ``save_both`` wrote onto a (data, model) mesh of ``shape``."""
    data, model = (int(v) for v in shape.split(","))
    mesh = ms.make_mesh({"data": data, "model": model})
    like = jax.eval_shape(m.init_state)
    planned = ms.plan(like, m.RULES, mesh).flat_shardings(0)
    want = np.load(expect)
    restored = ms.restore(os.path.join(directory, "ckpt"), like=like, specs=m.RULES, mesh=mesh)
    with ms.CheckpointManager(os.path.join(directory, "mngr")) as mngr:
        step = mngr.latest_step()
        from_manager = mngr.restore(like=like, specs=m.RULES, mesh=mesh)
    return {
        "mesh": [data, model],
        "save": compare(restored, planned, want),
        "manager": {"step": step, **compare(from_manager, planned, want)},
    }


def run_cli(ckpt: str) -> dict:
    """The CLI's read-only commands, from inside a multi-process run."""
    import contextlib
    import io

    from modelshard._cli import main as cli

    out = {}
    for name, argv in {
        "inspect": ["inspect", ckpt, "--json"],
        "plan": ["plan", ckpt, "--mesh", "data=4,model=2", "--json"],
    }.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli(argv)
        out[name] = {"rc": rc, "json": json.loads(buf.getvalue()) if rc == 0 else None}
    return out


if __name__ == "__main__":
    main()
