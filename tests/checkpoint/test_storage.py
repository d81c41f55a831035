"""save, restore, CheckpointManager and inspect on object storage: every test runs on
gs:// and on s3://, against servers on localhost started once per session (conftest's
``bucket_root``: a GCS emulator and moto). Renames there are not atomic, so a checkpoint
is complete once Orbax's commit file is there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from helpers import stored_codec

CHILD = Path(__file__).parent / "manager_scripts" / "exit_child.py"


def _names(url):
    from etils import epath

    return sorted(p.name for p in epath.Path(url).iterdir())


def test_save_rotate_items_and_commit_files(bucket_root):
    with ms.CheckpointManager(bucket_root, max_to_keep=2, handle_signals=False) as mngr:
        for step in range(3):
            mngr.save(step, {"w": jnp.arange(8.0) + step}, items={"data": {"pos": step}})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        assert mngr.items()["data"] == {"pos": 2}
        np.testing.assert_array_equal(np.asarray(mngr.restore()["w"]), np.arange(8.0) + 2)
    assert _names(bucket_root) == ["1", "2"]  # written in place: no temporary folders
    assert _names(f"{bucket_root}/2") == [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "data",  # the JSON item again, where Orbax's own manager reads it
        "items",
        "modelshard",
        "state",
    ]
    # a fresh manager lists the same steps from the bucket
    assert ms.CheckpointManager(bucket_root, handle_signals=False).all_steps() == [1, 2]


def test_inspect_of_a_manager_root(bucket_root, capsys):
    from modelshard.cli import main

    with ms.CheckpointManager(bucket_root, handle_signals=False) as mngr:
        mngr.save(4, {"w": jnp.arange(8.0)}, items={"data": {"pos": 4}}, metrics={"loss": 1.0})
    capsys.readouterr()
    assert main(["inspect", bucket_root, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["step"], data["path"]) == (4, f"{bucket_root}/4")
    assert data["items"] == {"data": {"pos": 4}} and data["metrics"] == {"loss": 1.0}
    assert [leaf["path"] for leaf in data["leaves"]] == ["w"]
    assert main(["inspect", bucket_root]) == 0
    out = capsys.readouterr()
    assert out.err.splitlines()[0] == (
        f"{bucket_root} is a CheckpointManager directory: using its latest complete step "
        f"4 ({bucket_root}/4)"
    )
    assert "float32" in out.out


def test_step_without_commit_file_is_not_a_step(bucket_root):
    from etils import epath

    with ms.CheckpointManager(bucket_root, handle_signals=False, async_save=False) as mngr:
        mngr.save(0, {"w": jnp.zeros(4)})
        mngr.save(1, {"w": jnp.ones(4)})
        (epath.Path(bucket_root) / "1" / "commit_success.txt").unlink()
        assert mngr.all_steps() == [0]
        assert mngr.save(1, {"w": jnp.full(4, 2.0)})  # the uncommitted step is replaced
        assert mngr.all_steps() == [0, 1]
        np.testing.assert_array_equal(np.asarray(mngr.restore(1)["w"]), np.full(4, 2.0))


def test_killed_save_leaves_the_previous_step(bucket_root, tmp_path):
    # the child inherits the session's environment that points at the local server
    err = tmp_path / "child.err"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), bucket_root, "stall"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    timer = threading.Timer(120, proc.kill)
    timer.start()
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "READY":
                time.sleep(0.5)
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lines[-1:] == ["READY"], err.read_text()[-3000:]
    assert proc.returncode == -signal.SIGKILL
    if "2" in _names(bucket_root):  # step 2 was being written in place (Orbax may
        assert "commit_success.txt" not in _names(f"{bucket_root}/2")  # not have begun)
    with ms.CheckpointManager(bucket_root, handle_signals=False) as mngr:
        assert mngr.all_steps() == [0, 1]
        assert mngr.items(1) == {}
        w = np.asarray(mngr.restore()["w"])
    np.testing.assert_array_equal(w, np.arange(1 << 16, dtype=np.float32) + 1)


def test_a_missing_bucket_is_refused_not_created(bucket_root):
    from etils import epath

    scheme = bucket_root.split("://")[0]
    if scheme == "s3":
        server = f"the S3 server {os.environ['AWS_ENDPOINT_URL']} (from AWS_ENDPOINT_URL_S3 / "
        server += "AWS_ENDPOINT_URL)"
    else:
        server = (
            f"the GCS server {os.environ['STORAGE_EMULATOR_HOST']} (from STORAGE_EMULATOR_HOST)"
        )
    bucket = f"{scheme}://no-such-bucket-{bucket_root[-8:]}"
    for url, call in (
        (f"{bucket}/run", lambda url: ms.CheckpointManager(url, handle_signals=False)),
        (f"{bucket}/ck", lambda url: ms.save(url, {"w": jnp.ones(2)})),
    ):
        with pytest.raises(ms.CheckpointError) as e:
            call(url)
        assert str(e.value) == (
            f"bucket {bucket} does not exist on {server}: create it first (modelshard does "
            f"not create buckets; the storage client would, on the first write to {url})."
        )
    assert not epath.Path(bucket).exists()


def test_unsupported_urls_are_refused_by_scheme(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ms.CheckpointError) as e:
        ms.CheckpointManager("ftp://host/run")
    assert str(e.value) == (
        "unsupported URL scheme 'ftp' in 'ftp://host/run': checkpoints go to a local path "
        "or to gs://, s3://."
    )
    with pytest.raises(ms.CheckpointError) as e:
        ms.save("ftp://host/ck", {"w": jnp.ones(2)})
    assert str(e.value).startswith("unsupported URL scheme 'ftp' in 'ftp://host/ck'")
    assert os.listdir(tmp_path) == []  # no local ./ftp: folder


def test_restore_onto_another_mesh_is_bit_exact(bucket_root):
    from jax.sharding import PartitionSpec as P

    mesh24 = ms.make_mesh({"data": 2, "model": 4})  # the axis types are tested elsewhere

    key = jax.random.key(3)
    state = {"w": jax.random.normal(key, (8, 4)), "k": key}
    with ms.CheckpointManager(bucket_root, handle_signals=False) as mngr:
        mngr.save(0, state, items={"rng": key}, metadata={"run": "a"})
        out = mngr.restore(specs={"w": P("data", "model"), "k": P()}, mesh=mesh24)
        got = mngr.items()
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(state["w"]))
    assert out["w"].sharding.spec == P("data", "model")
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(key))
    step = f"{bucket_root}/0"
    assert ms.read_metadata(step) == {"run": "a"}
    rng = ms.read_items(step)["rng"]
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(key))
    assert ms.restore(step)["w"].shape == (8, 4)
    # raw chunks by default, zstd when asked; a manager restores either
    with ms.CheckpointManager(bucket_root, handle_signals=False, compression="zstd") as mngr:
        mngr.save(1, state)
        again = mngr.restore(1, specs={"w": P("data", "model"), "k": P()}, mesh=mesh24)
    assert (stored_codec(step, "w"), stored_codec(f"{bucket_root}/1", "w")) == (
        None,
        {"id": "zstd", "level": 1},
    )
    np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(state["w"]))
