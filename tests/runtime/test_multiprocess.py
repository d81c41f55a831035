"""The public API on JAX's distributed runtime: real processes on localhost, gloo collectives.

Each test starts ``modelshard launch`` (bounded by ``--timeout`` and, around it, a SIGKILL
backstop) on a script in ``tests/mp_scripts``, then checks what the processes wrote against
a single-process reference computed here, on this process's 8 CPU devices.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import modelshard as ms
from helpers import launch_argv

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.xdist_group(
        "multiprocess-train"
    ),  # one worker: its module fixtures start processes once
    pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux"),
]

SCRIPTS = Path(__file__).parents[1] / "mp_scripts"
_spec = importlib.util.spec_from_file_location("mp_model", SCRIPTS / "_model.py")
assert _spec is not None and _spec.loader is not None
m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(m)

LAUNCH_TIMEOUT = 300  # seconds: a bound for a loaded 2-core machine, not an expectation


def launch(n: int, devices: int, script: str, *args: str) -> tuple[int, str, float]:
    """Run ``modelshard launch`` as a subprocess; return (exit code, output, seconds)."""
    cmd = launch_argv(
        sys.executable, str(SCRIPTS / script), *args, n=n, devices=devices, timeout=LAUNCH_TIMEOUT
    )
    t0 = time.monotonic()
    # The launcher bounds its processes; killing it (the backstop) kills them too.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT + 30)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def same(got: object, want: object) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=0)


def results(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"result_{i}.json").read_text()) for i in range(n)]


@pytest.fixture(scope="module")
def reference() -> dict:
    """The same training steps in this single process, on a (2, 4) mesh of 8 devices."""
    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = ms.shard(m.init_state(), m.RULES, mesh)
    step = ms.shard_jit(m.train_step, mesh=mesh, in_specs=(m.RULES, m.BATCH_SPEC, m.BATCH_SPEC))
    losses = []
    for i in range(m.STEPS):
        state, loss = step(state, *m.batch(i))
        losses.append(float(loss))
    return {"losses": losses, "values": m.flat_values(state), "nnx_losses": m.nnx_losses(mesh)}


@pytest.fixture(scope="module")
def two_by_four(tmp_path_factory) -> Path:
    """2 processes x 4 devices: train on a global (2, 4) mesh, save a checkpoint."""
    out = tmp_path_factory.mktemp("two_by_four")
    rc, output, seconds = launch(2, 4, "train.py", str(out), "--save", str(out / "saved"), "--nnx")
    assert rc == 0, output
    print(f"2x4 run: {seconds:.1f} s")
    return out


def test_two_processes_train_like_one(two_by_four, reference):
    res = results(two_by_four, 2)
    for r in res:
        assert (r["process_count"], r["devices"], r["local_devices"]) == (2, 8, 4)
        # The loss is the same, bit for bit, as one process with 8 devices.
        # The same loss as one process with 8 devices. (Bit-identical in every run so far;
        # the tolerance only allows gloo to sum in another order than one process does.)
        same(r["losses"], reference["losses"])
        same(r["numpy_loss"], reference["losses"][0])  # NumPy inputs placed by shard_jit
        same(r["nnx_losses"], reference["nnx_losses"])  # an NNX module updated in place
        assert r["state_specs"]["params/w1"] == "P(None, 'model')"
        assert r["state_specs"]["opt/0/mu/w2"] == "P('model', None)"
        assert "13 array leaves on mesh (data=2, model=4), 8 devices" in r["plan"]
    # The updated state agrees to float rounding (all-reduce order differs across processes).
    got = np.load(two_by_four / "state.npz")
    for path, want in reference["values"].items():
        np.testing.assert_allclose(got[path], want, rtol=1e-6, atol=1e-7, err_msg=path)


def test_process_local_batches_assemble_into_the_global_batch(two_by_four):
    res = results(two_by_four, 2)
    assert [r["rows"] for r in res] == [[0, 8], [8, 16]]
    want = {"shape": [m.BATCH, m.D_IN], "spec": "P('data',)", "equal": True}
    for r in res:
        # assemble_process_local (this process's rows) and assemble (its devices' pieces)
        assert r["assembled"] == {"process_local": want, "pieces": want}


def test_values_and_layouts_other_processes_hold_raise_clear_errors(two_by_four):
    r = results(two_by_four, 2)[1]
    assert r["errors"] == {
        "local_slice": "process 1's shards of a [16] array with spec P('data',) do not form one "
        "block along dimension 0 ([(4, 6), (6, 8), (12, 14), (14, 16)]); use "
        "NamedSharding(mesh, spec).addressable_devices_indices_map(shape).",
        "require_addressable": "the test needs the full value of a float32[8, 4] array that "
        "spans devices of other processes (process 1 of 2 holds 4 of its 8 devices); call "
        "modelshard.distributed.to_host(value) on every process to all-gather it, or work on "
        "value.addressable_shards.",
        "assemble_process_local": "assemble_process_local: leaf 'batch' float32[8, 4] is "
        "already a global array spanning devices of other processes; pass this process's part "
        "as a NumPy or local array (modelshard.distributed.local_slice says which), or use the "
        "global array as it is.",
    }


def test_a_two_process_checkpoint_restores_in_one_process_onto_8(two_by_four):
    mesh = ms.make_mesh({"data": 8})
    like = jax.eval_shape(m.init_state)
    specs = ms.fsdp("data", min_size=0)
    planned = ms.plan(like, specs, mesh).flat_shardings(0)
    want = np.load(two_by_four / "state.npz")
    saved = two_by_four / "saved"
    restored = ms.restore(saved / "ckpt", like=like, specs=specs, mesh=mesh)
    with ms.CheckpointManager(saved / "mngr") as mngr:
        assert mngr.all_steps() == [m.STEPS]
        from_manager = mngr.restore(like=like, specs=specs, mesh=mesh)
    for tree in (restored, from_manager):
        flat = ms.adapters.split(tree)
        assert sorted(flat.paths) == sorted(want.files)
        for path, x, s in zip(flat.paths, flat.arrays, planned, strict=True):
            assert x.sharding == s, path
            np.testing.assert_array_equal(np.asarray(x), want[path], err_msg=path)  # bit-exact


def test_saves_on_two_processes_issue_no_device_barrier(two_by_four):
    """``ms.save`` and the manager pass every process to Orbax as its active processes, so
    Orbax's barriers of a save are coordination-service barriers, not device all-gathers."""
    for r in results(two_by_four, 2):
        assert r["device_barriers"] == [], r["device_barriers"]


def test_process_local_leaves_saved_by_two_processes_restore(two_by_four):
    restored = ms.restore(two_by_four / "saved" / "local")
    np.testing.assert_array_equal(np.asarray(restored["np"]), np.arange(6.0, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(restored["one"]), np.ones(3, np.float32))
    assert jax.numpy.array_equal(
        jax.random.key_data(restored["key"]), jax.random.key_data(jax.random.key(7))
    )


def test_four_processes_train_like_one_and_restore_onto_4x2(two_by_four, reference, tmp_path):
    rc, output, seconds = launch(
        4,
        2,
        "train.py",
        str(tmp_path),
        "--restore",
        str(two_by_four / "saved"),
        "--expect",
        str(two_by_four / "state.npz"),
        "--restore-mesh",
        "4,2",
    )
    assert rc == 0, output
    print(f"4x2 run: {seconds:.1f} s")
    res = results(tmp_path, 4)
    # Processes 0 and 1 hold the devices of data row 0, so they feed the same rows.
    assert [r["rows"] for r in res] == [[0, 8], [0, 8], [8, 16], [8, 16]]
    for r in res:
        assert (r["process_count"], r["devices"], r["local_devices"]) == (4, 8, 2)
        same(r["losses"], reference["losses"])
        same(r["numpy_loss"], reference["losses"][0])
        assert all(a["equal"] and a["shape"] == [m.BATCH, m.D_IN] for a in r["assembled"].values())
        restored = r["restored"]
        assert restored["mesh"] == [4, 2]
        assert restored["manager"]["step"] == m.STEPS
        for how in ("save", "manager"):
            assert len(restored[how]["paths"]) == 13
            assert all(restored[how]["bit_exact"]), (how, restored[how])
            assert all(restored[how]["planned_shardings"]), (how, restored[how])
        cli = r["cli"]
        assert cli["inspect"]["rc"] == 0 and cli["plan"]["rc"] == 0, cli
        assert cli["plan"]["json"]["mesh"] == {"data": 4, "model": 2}
        assert len(cli["plan"]["json"]["leaves"]) == 13


def test_killing_one_process_stops_the_run_with_no_process_left(tmp_path):
    rc, output, seconds = launch(2, 1, "die.py", str(tmp_path))
    assert rc == 128 + 9, output
    assert "[modelshard launch] process 1 exited with code -9; stopping the others" in output
    assert seconds < 120, seconds
    pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(2)]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
