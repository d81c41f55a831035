"""Checkpoint safety, round two (issue 17): no leaf lost to a name, nothing deleted that is not
a checkpoint, no hang on hostile files, every refusal before a byte is written.

Each test is a regression test for one finding of docs/reliability.md ("Findings, round two").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard._checkpoint.resharding import reshard

# one worker runs this file (its module fixtures start processes once)
pytestmark = pytest.mark.xdist_group("safety")


def _hidden(parent: Path) -> list[str]:
    """Names in ``parent`` a save leaves behind when it fails: anything starting with '.'
    or holding Orbax's temporary suffix."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") or "tmp" in p.name)


def _in_time(fn: Any, timeout_s: float = 60) -> BaseException | None:
    """Run ``fn`` in a thread; the exception it raised, failing the test if it hangs."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:  # handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert out, f"hung for {timeout_s} s"
    return out[0]


# ---- 1. dotted names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state, clash",
    [
        ({"a.b": 1.0, "a": {"b": 2.0}}, "'a/b', 'a.b' are all stored as 'a.b'"),
        ({"a": {"b.c": 1.0}, "a.b": {"c": 2.0}}, "'a/b.c', 'a.b/c' are all stored as 'a.b.c'"),
        ({"x.": {"y": 1.0}, "x": {".y": 2.0}}, "'x/.y', 'x./y' are all stored as 'x..y'"),
    ],
)
def test_leaves_whose_dotted_names_collide_are_refused_before_writing(tmp_path, state, clash):
    state = jax.tree.map(lambda v: jnp.full((3,), v), state)
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", state)
    lines = str(e.value).splitlines()
    assert lines[0] == (
        "cannot save: 1 leaf name problem (Orbax stores each array under its path joined with '.'):"
    )
    assert lines[1] == "  " + clash
    assert not (tmp_path / "c").exists() and _hidden(tmp_path) == []


def test_manager_refuses_colliding_names_too(tmp_path):
    with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
        with pytest.raises(ms.CheckpointError, match=r"are all stored as 'a\.b'"):
            mngr.save(0, {"a.b": jnp.ones(2), "a": {"b": jnp.zeros(2)}})
        assert mngr.all_steps() == []


def test_a_record_whose_leaves_share_a_stored_name_is_refused(tmp_path):
    path = ms.save(tmp_path / "c", {"a": {"b": jnp.ones(2)}, "ab": jnp.zeros(2)})
    record = json.loads((path / "modelshard.json").read_text())
    leaf = next(x for x in record["leaves"] if x["path"] == "ab")
    leaf["path"], leaf["key"] = "a.b", ["a.b"]
    (path / "modelshard.json").write_text(json.dumps(record))
    with pytest.raises(ms.CheckpointError, match="do not name distinct stored arrays"):
        ms.restore(path)


def test_a_very_long_leaf_name_is_refused_before_writing(tmp_path):
    with pytest.raises(ms.CheckpointError, match="its storage name has 100000 characters"):
        ms.save(tmp_path / "c", {"a" * 100_000: jnp.ones(2)})
    assert not (tmp_path / "c").exists() and _hidden(tmp_path) == []


# ---- 2. overwrite replaces only a checkpoint ---------------------------------------------------


def _run_folder(root: Path) -> Path:
    (root / "logs").mkdir(parents=True)
    (root / "config.yaml").write_text("lr: 1e-3\n")
    (root / "logs" / "train.log").write_text("step 1\n")
    return root


def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    run = _run_folder(tmp_path / "run")
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(run, {"w": jnp.ones(2)}, overwrite=True)
    assert str(e.value).startswith(
        f"cannot overwrite {run}: it is a directory but not a modelshard checkpoint"
    )
    assert "nothing was deleted" in str(e.value)
    assert (run / "config.yaml").read_text() == "lr: 1e-3\n"
    assert (run / "logs" / "train.log").exists()
    assert _hidden(tmp_path) == []


def test_overwrite_refuses_a_file_and_replaces_checkpoints_and_empty_directories(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep")
    with pytest.raises(ms.CheckpointError, match="it is a file, not a checkpoint"):
        ms.save(f, {"w": jnp.ones(2)}, overwrite=True)
    assert f.read_text() == "keep"
    (tmp_path / "empty").mkdir()
    ms.save(tmp_path / "empty", {"w": jnp.ones(2)}, overwrite=True)
    ms.save(tmp_path / "empty", {"w": jnp.zeros(2)}, overwrite=True)
    assert float(ms.restore(tmp_path / "empty")["w"][0]) == 0.0


def test_reshard_overwrite_never_deletes_the_source_or_its_neighbours(tmp_path, mesh8):
    run = _run_folder(tmp_path / "exp")
    ck = ms.save(run / "ck", {"w": jnp.arange(8.0)})
    with pytest.raises(ms.CheckpointError, match="not a modelshard checkpoint"):
        reshard(ck, run, mesh=mesh8, overwrite=True)
    with pytest.raises(ms.CheckpointError, match="the destination is inside the source"):
        reshard(ck, ck / "inner", mesh=mesh8, overwrite=True)
    assert (run / "config.yaml").exists()
    np.testing.assert_array_equal(ms.restore(ck)["w"], np.arange(8.0))


# ---- 3. named pipes, directories and sizes ----------------------------------------------------


@pytest.mark.parametrize("name", ["modelshard.json", "_METADATA", "manifest.ocdbt"])
def test_a_named_pipe_in_a_checkpoint_is_refused_without_hanging(tmp_path, name):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(2)})
    (path / name).unlink()
    os.mkfifo(path / name)
    err = _in_time(lambda: ms.restore(path))
    assert isinstance(err, ms.CheckpointError)
    assert str(err) == (
        f"{path / name} is a named pipe, not a regular file; a checkpoint holds only files "
        "and directories, refusing to read it."
    )


def test_a_named_pipe_is_refused_by_inspect_without_hanging(tmp_path, capsys):
    from modelshard.cli import main

    path = ms.save(tmp_path / "c", {"w": jnp.ones(2)})
    (path / "modelshard.json").unlink()
    os.mkfifo(path / "modelshard.json")
    holder: list[int] = []
    assert _in_time(lambda: holder.append(main(["inspect", str(path)]))) is None
    assert holder == [1]
    assert "is a named pipe, not a regular file" in capsys.readouterr().err


def test_a_record_that_is_a_directory_is_a_checkpoint_error(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(2)})
    (path / "modelshard.json").unlink()
    (path / "modelshard.json").mkdir()
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == (
        f"{path / 'modelshard.json'} is a directory, not a regular file; a checkpoint's "
        "files are regular files, refusing to read it."
    )


def test_read_small_refuses_what_is_not_a_bounded_regular_file(tmp_path):
    from modelshard._checkpoint.storage import read_small

    (tmp_path / "f").write_bytes(b"x" * 10)
    assert read_small(tmp_path / "f") == b"x" * 10
    with pytest.raises(ms.CheckpointError, match="is 10 bytes, more than the 9"):
        read_small(tmp_path / "f", limit=9)
    os.mkfifo(tmp_path / "p")
    with pytest.raises(ms.CheckpointError, match="is a named pipe"):
        read_small(tmp_path / "p")
    with pytest.raises(FileNotFoundError):
        read_small(tmp_path / "missing")


# ---- 6. metadata and failed saves ---------------------------------------------------------------


def test_metadata_that_is_not_json_is_refused_before_any_data_is_written(tmp_path):
    meta = {"step": np.int64(3), "ok": [1, "a"], "nested": {"f": object(), 4: "int key"}}
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", {"w": jnp.ones(2)}, metadata=meta)
    lines = str(e.value).splitlines()
    assert lines[0] == (
        "cannot save: 3 metadata entries are not plain JSON (str, int, float, bool, None, "
        "lists and dicts with str keys):"
    )
    assert lines[1] == (
        "  metadata['step']: a numpy.int64, not JSON (convert it: int(x), float(x) or x.tolist())"
    )
    assert lines[2] == "  metadata['nested']['f']: a builtins.object, not JSON"
    assert lines[3] == "  metadata['nested'][4]: the key is a int, not a str"
    assert not (tmp_path / "c").exists() and _hidden(tmp_path) == []


def test_manager_refuses_non_json_metadata_without_a_partial_step(tmp_path):
    with (
        ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr,
        pytest.raises(ms.CheckpointError, match="metadata"),
    ):
        mngr.save(0, {"w": jnp.ones(2)}, metadata={"step": np.int64(3)})
    assert [p.name for p in (tmp_path / "m").iterdir() if p.name[0].isdigit()] == []


def test_a_save_that_fails_while_writing_leaves_no_hidden_copy(tmp_path, monkeypatch):
    import modelshard._checkpoint.write as write

    real = write.write_held

    def failing(directory: Path, held: Any, **options: Any) -> None:
        real(directory, held, **options)  # a whole copy, as when the record then fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(write, "write_held", failing)
    with pytest.raises(OSError, match="No space left"):
        ms.save(tmp_path / "c", {"w": jnp.ones(2)})
    assert _hidden(tmp_path) == [] and not (tmp_path / "c").exists()


def test_leftovers_of_a_killed_save_are_removed_by_the_next_one(tmp_path):
    (tmp_path / ".c.modelshard-tmp.orbax-checkpoint-tmp-99").mkdir()
    (tmp_path / "..c.modelshard-tmp.pieces").mkdir()  # reshard's chunks
    ms.save(tmp_path / "c", {"w": jnp.ones(2)})
    assert _hidden(tmp_path) == []


# ---- 7. deleted (donated) arrays ---------------------------------------------------------------


def test_saving_a_deleted_array_names_the_leaf(tmp_path):
    w, b = jnp.ones((4, 2)), jnp.zeros(2)
    w.delete()
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", {"layer": {"w": w, "b": b}})
    assert str(e.value).splitlines() == [
        "cannot save 1 leaf (nothing was written):",
        "  layer/w: the array was deleted (donated to a jitted step, or .delete() called); "
        "save the step's output instead",
    ]
    with (
        ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr,
        pytest.raises(ms.CheckpointError, match="layer/w: the array was deleted"),
    ):
        mngr.save(0, {"layer": {"w": w, "b": b}})
    assert not (tmp_path / "c").exists()


# ---- 8. 64-bit dtypes with x64 off --------------------------------------------------------------


@pytest.fixture(scope="module")
def x64_ckpt(tmp_path_factory) -> Path:
    """A checkpoint with int64 and float64 leaves, saved by a child process with x64 on."""
    path = tmp_path_factory.mktemp("x64") / "c"
    code = (
        "import sys, jax, jax.numpy as jnp, modelshard as ms\n"
        "ms.save(sys.argv[1], {'step': jnp.asarray(2**40 + 7), 'w': jnp.ones(3, jnp.float64),"
        " 'f': jnp.ones(2, jnp.float32)})\n"
    )
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], env=env)
    try:
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return path


@pytest.mark.parametrize("verify", [True, False])
def test_a_64_bit_checkpoint_restored_with_x64_off_is_refused_not_called_damaged(x64_ckpt, verify):
    assert not jax.config.jax_enable_x64
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(x64_ckpt, verify=verify)
    assert str(e.value).splitlines() == [
        f"cannot restore 2 leaves of {x64_ckpt} in this process: their 64-bit dtypes need "
        "jax_enable_x64, which is off (the checkpoint is fine):",
        "  step: int64[]",
        "  w: float64[3]",
        "hint: jax.config.update('jax_enable_x64', True) before using JAX.",
    ]
    # the leaves this process can hold restore as they are
    out = ms.restore(x64_ckpt, like={"f": jax.ShapeDtypeStruct((2,), jnp.float32)}, partial=True)
    np.testing.assert_array_equal(out["f"], np.ones(2, np.float32))


def test_saving_a_numpy_int64_with_x64_off_is_refused(tmp_path):
    with pytest.raises(ms.CheckpointError, match="n: it is a NumPy int64 array, which JAX holds"):
        ms.save(tmp_path / "c", {"n": np.array([2**40]), "w": jnp.ones(2)})
    assert not (tmp_path / "c").exists()


# ---- 9. absurd sizes in a record ---------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, why",
    [
        ("Infinity", "has inf, not an integer"),
        ("1e30", "has 1e+30, not an integer"),
        ("2.5", "has 2.5, not an integer"),
        (str(10**30), f"has the dimension {10**30}, out of range"),
        ("true", "has True, not an integer"),
    ],
)
def test_absurd_sizes_in_a_record_are_refused(tmp_path, shape, why):
    from modelshard._checkpoint import locate

    path = ms.save(tmp_path / "c", {"w": jnp.ones(3)})
    text = (path / "modelshard.json").read_text()
    text = text.replace('"shape": [\n    3\n   ]', f'"shape": [{shape}]', 1)
    assert shape in text
    (path / "modelshard.json").write_text(text)
    for fn in (ms.restore, locate):
        with pytest.raises(ms.CheckpointError) as e:
            fn(path)
        assert str(e.value).startswith(
            f"{path / 'modelshard.json'}: leaf 'w' of the record is invalid: shape ["
        )
        assert why in str(e.value)


def test_a_huge_product_of_dimensions_is_refused(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones((3, 3))})
    record = json.loads((path / "modelshard.json").read_text())
    record["leaves"][0]["shape"] = record["leaves"][0]["stored_shape"] = [2**40, 2**40]
    (path / "modelshard.json").write_text(json.dumps(record))
    with pytest.raises(ms.CheckpointError, match="has more than 72057594037927936 elements"):
        ms.restore(path)


# ---- 12. smaller ---------------------------------------------------------------------------------


def test_restore_refuses_an_integer_cast(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(3)})
    with pytest.raises(ms.CheckpointError, match=r"^dtype=int8 is not a floating-point dtype"):
        ms.restore(path, dtype=jnp.int8)
    with pytest.raises(ms.CheckpointError, match=r"^dtype=float64 needs jax_enable_x64"):
        ms.restore(path, dtype=jnp.float64)


def test_a_cast_mismatch_names_the_checkpoint_dtype_and_the_cast(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(3)})
    like = {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path, like=like, dtype=jnp.bfloat16)
    assert "checkpoint float32[3] (restored as bfloat16 by dtype=) -> target float32[3]" in str(
        e.value
    )


def test_cli_reshard_refuses_a_mesh_too_large_to_simulate(tmp_path, capsys):
    from modelshard.cli import main

    src = ms.save(tmp_path / "src", {"w": jnp.ones(8)})
    code = _in_time(
        lambda: main(["reshard", str(src), str(tmp_path / "d"), "--mesh", "data=100000"])
    )
    assert code is None or isinstance(code, SystemExit)
    err = capsys.readouterr().err
    assert "the target mesh has 100000 devices; reshard on this host simulates at most 4096" in err
    assert not (tmp_path / "d").exists()


def test_a_mesh_whose_axis_names_are_not_strings_is_refused_not_recorded_replicated(tmp_path):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), (0, "model"))
    x = jax.device_put(jnp.arange(16.0).reshape(2, 8), NamedSharding(mesh, P(0, "model")))
    with pytest.raises(ms.CheckpointError, match=r"mesh with axis names \(0, 'model'\)"):
        ms.save(tmp_path / "c", {"w": x})
    assert not (tmp_path / "c").exists()
