"""CheckpointManager: steps, rotation, restore onto a mesh, and saves killed part-way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from conftest import MAKERS


def test_steps_rotation_and_restore_onto_a_mesh(tmp_path, mesh24):
    state = MAKERS["optax"]()
    with ms.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as mngr:
        saved = [mngr.save(step, state) for step in range(5)]
        mngr.wait_until_finished()
        assert saved == [True, False, True, False, True]
        assert mngr.all_steps() == [2, 4]
        assert mngr.latest_step() == 4
        out = mngr.restore(like=state, specs=ms.fsdp("model", min_size=0), mesh=mesh24)
    assert type(out) is type(state)
    leaves = ms.adapters.split(out).arrays
    for a, b in zip(ms.adapters.split(state).arrays, leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    assert leaves[1].sharding.spec == P("model")
    assert repr(mngr) == f"CheckpointManager({str(tmp_path)!r}, steps=[2, 4])"


def test_sync_manager_nnx_and_typed_keys(tmp_path):
    model = MAKERS["nnx"]()
    with ms.CheckpointManager(tmp_path, async_save=False) as mngr:
        assert mngr.save(3, model, metadata={"loss": 1.5})
        out = mngr.restore(3, like=model)
        record = ms.restore(mngr.step_directory(3))
    np.testing.assert_array_equal(
        jax.random.key_data(out.drop.rngs.key[...]), jax.random.key_data(model.drop.rngs.key[...])
    )
    assert isinstance(record, dict)


def test_manager_errors(tmp_path):
    with ms.CheckpointManager(tmp_path, async_save=False) as mngr:
        with pytest.raises(ms.CheckpointError) as e:
            mngr.restore()
        assert str(e.value) == f"no checkpoint in {tmp_path}: no step was saved yet."
        mngr.save(1, {"w": jnp.ones(2)})
        with pytest.raises(ms.CheckpointError) as e:
            mngr.restore(5)
        assert str(e.value) == f"no step 5 in {tmp_path}; steps there: 1."
        with pytest.raises(ms.CheckpointError) as e:
            mngr.save(1, {"w": jnp.ones(2)})
        assert str(e.value) == f"step 1 already exists in {tmp_path}; steps are never overwritten."
    with pytest.raises(ms.CheckpointError) as e:
        ms.CheckpointManager(tmp_path, max_to_keep=0)
    assert str(e.value) == "max_to_keep must be a positive int or None, got 0."
    with pytest.raises(ms.CheckpointError) as e:
        ms.CheckpointManager(tmp_path, save_interval_steps=0)
    assert str(e.value) == "save_interval_steps must be a positive int, got 0."


# The child saves v1 with both APIs, then starts v2 with both and stalls each v2 save after
# its data is written but before it is committed; the parent SIGKILLs it there.
CHILD = textwrap.dedent(
    """
    import os, sys, threading, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    import orbax.checkpoint as ocp
    import modelshard as ms

    root = sys.argv[1]
    v1 = {"w": jnp.arange(4096.0), "k": jax.random.key(1)}
    v2 = {"w": jnp.arange(4096.0) + 1, "k": jax.random.key(2)}
    ms.save(f"{root}/ckpt", v1)
    mngr = ms.CheckpointManager(f"{root}/mgr")
    mngr.save(1, v1)
    mngr.wait_until_finished()
    lock, stalled = threading.Lock(), []

    def stall(self, directory):
        with lock:
            stalled.append(directory)
            print(f"STALLED {len(stalled)}", flush=True)
        time.sleep(300)

    ocp.StandardCheckpointHandler.finalize = stall
    mngr.save(2, v2)
    ms.save(f"{root}/ckpt", v2, overwrite=True)
    print("NOT STALLED", flush=True)
    """
)


def _run_until(cmd, marker, timeout_s):
    """Start ``cmd``, wait for ``marker`` on stdout, SIGKILL it; always bounded."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line.strip())
            if line.strip() == marker:
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    return seen, proc.returncode


def test_sigkill_part_way_through_saves_keeps_the_previous_checkpoint(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    start = time.monotonic()
    seen, rc = _run_until([sys.executable, str(script), str(tmp_path)], "STALLED 2", 240)
    assert seen[-1] == "STALLED 2", seen
    assert rc == -signal.SIGKILL
    assert time.monotonic() - start < 240
    # The partial step exists only as Orbax's temporary directory and is ignored.
    assert any(name.startswith("2.") for name in os.listdir(tmp_path / "mgr"))
    with ms.CheckpointManager(tmp_path / "mgr") as mngr:
        assert mngr.all_steps() == [1]
        assert mngr.latest_step() == 1
        out = mngr.restore()
        np.testing.assert_array_equal(out["w"], np.arange(4096.0))
        mngr.save(2, {"w": jnp.zeros(4096), "k": jax.random.key(5)})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
    # The plain save left the previous checkpoint in place; the staging data is ignored.
    out = ms.restore(tmp_path / "ckpt")
    np.testing.assert_array_equal(out["w"], np.arange(4096.0))
    np.testing.assert_array_equal(
        jax.random.key_data(out["k"]), jax.random.key_data(jax.random.key(1))
    )
    ms.save(tmp_path / "ckpt", {"w": jnp.ones(3)}, overwrite=True)
    assert ms.restore(tmp_path / "ckpt")["w"].shape == (3,)
