"""CheckpointManager: steps, rotation, restore onto a mesh, and saves killed part-way."""

from __future__ import annotations

import os
import re
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
from helpers import MAKERS, stored_codec


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
    import modelshard as ms
    from modelshard._checkpoint import shards

    root = sys.argv[1]
    v1 = {"w": jnp.arange(4096.0), "k": jax.random.key(1)}
    v2 = {"w": jnp.arange(4096.0) + 1, "k": jax.random.key(2)}
    ms.save(f"{root}/ckpt", v1)
    mngr = ms.CheckpointManager(f"{root}/mgr")
    mngr.save(1, v1)
    mngr.wait_until_finished()
    lock, stalled = threading.Lock(), []

    def stall(directory, *args):
        with lock:
            stalled.append(directory)
            print(f"STALLED {len(stalled)}", flush=True)
        time.sleep(300)

    shards._finalize = stall  # the arrays of the manager's step and of ms.save
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


def _w(step):
    return {"w": jnp.arange(8.0) + step}


def test_keep_policy_union_and_never_the_only_step():
    from modelshard._checkpoint.policy import KeepPolicy

    steps = list(range(10))
    loss = {s: {"loss": abs(s - 4) + 0.5} for s in steps}  # best (lowest) at 4, then 3/5
    assert KeepPolicy().keep(steps, {}) == set(steps)
    assert KeepPolicy(max_to_keep=2).keep(steps, {}) == {8, 9}
    assert KeepPolicy(keep_period=4).keep(steps, {}) == {0, 4, 8, 9}
    best = KeepPolicy(keep_best=2, best_fn=lambda m: m["loss"], best_mode="min")
    assert best.keep(steps, loss) == {4, 5, 9}  # ties: the newer of 3 and 5
    both = KeepPolicy(
        max_to_keep=1,
        keep_period=5,
        keep_best=1,
        best_fn=lambda m: -m["loss"],
        keep_steps=frozenset({2}),
    )
    assert both.keep(steps, loss) == {0, 2, 4, 5, 9}
    # steps saved without metrics never rank; the newest is kept whatever the rules say
    assert best.keep([1, 2, 3], {1: {"loss": 9.0}}) == {1, 3}
    assert KeepPolicy(keep_best=1, best_fn=len).keep([7], {}) == {7}


def test_keep_policy_errors():
    from modelshard._checkpoint.policy import KeepPolicy

    cases = {
        "max_to_keep must be a positive int or None, got 0.": dict(max_to_keep=0),
        "keep_period must be a positive int or None, got True.": dict(keep_period=True),
        "best_mode must be 'max' or 'min', got 'low'.": dict(best_mode="low"),
        "keep_best and best_fn go together: keep_best=N keeps the N steps with the best "
        "best_fn(metrics); pass both or neither.": dict(keep_best=2),
        "keep_steps must be ints, got '3'.": dict(keep_steps=frozenset({"3"})),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ms.CheckpointError) as e:
            KeepPolicy(**kwargs)
        assert str(e.value) == message
    bad = KeepPolicy(keep_best=1, best_fn=lambda m: m["acc"])
    with pytest.raises(ms.CheckpointError) as e:
        bad.keep([1, 2], {1: {"loss": 1.0}, 2: {"loss": 2.0}})
    assert str(e.value).startswith(
        "best_fn failed on the metrics of step 1 ({'loss': 1.0}): KeyError: 'acc'."
    )


def test_manager_rotation_by_every_rule(tmp_path):
    kw = dict(max_to_keep=2, keep_period=4, keep_best=1, best_fn=lambda m: m["acc"])
    with ms.CheckpointManager(tmp_path, keep_steps=[1], **kw) as mngr:
        for step in range(10):
            acc = 1.0 if step == 6 else 0.1 * (step % 3)
            assert mngr.save(step, _w(step), metrics={"acc": acc})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 1, 4, 6, 8, 9]
        assert mngr.best_step() == 6
        assert mngr.metrics(6) == {"acc": 1.0}
        np.testing.assert_array_equal(mngr.restore(6)["w"], np.arange(8.0) + 6)
        # a bad metric is refused before anything is written
        with pytest.raises(ms.CheckpointError) as e:
            mngr.save(10, _w(10), metrics={"loss": 1.0})
        assert "best_fn failed on the metrics of step 10 ({'loss': 1.0}): KeyError" in str(e.value)
        with pytest.raises(ms.CheckpointError) as e:
            mngr.save(10, _w(10), metrics={"acc": np.float32(1)})
        assert str(e.value).startswith("metrics must be JSON (nothing was written): TypeError")
        assert mngr.all_steps() == [0, 1, 4, 6, 8, 9]
    # a fresh manager ranks by the metrics on disk
    with ms.CheckpointManager(tmp_path, **kw) as mngr:
        assert mngr.best_step() == 6
        mngr.save(10, _w(10), metrics={"acc": 0.0})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 4, 6, 8, 9, 10]


def test_save_interval_is_arithmetic_and_should_save_agrees(tmp_path):
    with ms.CheckpointManager(tmp_path, save_interval_steps=5, handle_signals=False) as mngr:
        asked = [s for s in range(1, 12) if mngr.should_save(s)]
        saved = [s for s in range(1, 12) if mngr.save(s, _w(s))]
        assert asked == saved == [5, 10]  # Orbax would also save the first step, 1
        assert not mngr.should_save(10)  # just saved
        assert mngr.save(3, _w(3), force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [3, 5, 10]


@pytest.mark.parametrize("keep", [1, 2])
def test_failed_async_save_keeps_the_steps_on_disk(tmp_path, monkeypatch, keep):
    from modelshard._checkpoint import shards

    with ms.CheckpointManager(tmp_path, max_to_keep=keep) as mngr:
        mngr.save(0, _w(0))
        mngr.save(1, _w(1))
        mngr.wait_until_finished()

        def full(directory, arrays, start_ns):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(shards, "_finalize", full)  # the step's arrays, finished
        mngr.save(2, _w(2))
        with pytest.raises(ms.CheckpointError) as e:
            mngr.wait_until_finished()
        kept = [1] if keep == 1 else [0, 1]
        assert str(e.value).startswith(f"step 2 was not saved to {tmp_path}: ")
        assert str(e.value).endswith(f"Steps on disk: {', '.join(map(str, kept))}.")
        assert mngr.all_steps() == kept
        np.testing.assert_array_equal(mngr.restore()["w"], np.arange(8.0) + 1)
        monkeypatch.undo()
        mngr.save(2, _w(2))  # the failed attempt's leftovers are replaced
        mngr.wait_until_finished()
        assert mngr.all_steps() == ([2] if keep == 1 else [1, 2])
    assert not [n for n in os.listdir(tmp_path) if "orbax-checkpoint-tmp" in n]


def test_cli_reads_a_manager_root_at_its_latest_complete_step(tmp_path, capsys):
    import json

    from modelshard.cli import main

    root = tmp_path / "run"
    with ms.CheckpointManager(root, handle_signals=False) as mngr:
        mngr.save(
            3,
            _w(3),
            items={"cfg": {"lr": 0.1}, "rng": jax.random.key(1)},
            metrics={"loss": 0.5},
            metadata={"note": "x"},
        )
        mngr.save(5, _w(5), items={"cfg": {"lr": 0.2}})
    (root / "9").mkdir()  # not a step
    capsys.readouterr()
    assert main(["inspect", str(root / "3"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step"] == 3 and data["metadata"] == {"note": "x"}
    assert data["metrics"] == {"loss": 0.5}
    assert data["items"]["cfg"] == {"lr": 0.1}
    assert data["items"]["rng"]["impl"] == "threefry2x32"
    assert main(["inspect", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["step"], data["path"], data["items"]) == (5, str(root / "5"), {"cfg": {"lr": 0.2}})
    assert main(["inspect", str(root)]) == 0
    err = capsys.readouterr().err
    assert (
        err.split()
        == (
            f"{root} is a CheckpointManager directory: using its latest complete step 5 "
            f"({root / '5'})"
        ).split()
    )
    assert main(["plan", str(root), "--mesh", "data=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 5
    dst = tmp_path / "resharded"
    argv = ["reshard", str(root), str(dst), "--mesh", "data=2", "--json"]
    assert main(argv) == 1  # step 5's items would be lost: refused unless --drop-items
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "CheckpointError"
    assert main([*argv, "--drop-items"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["step"], out["source"]) == (5, str(root / "5"))
    assert out["dropped"] == {"items": ["cfg"], "metrics": []}
    np.testing.assert_array_equal(ms.restore(dst)["w"], np.arange(8.0) + 5)


def test_restore_a_step_through_a_weight_map(tmp_path, mesh8):
    """A step saved by an older model code is read into the new layout by a WeightMap."""
    w = jnp.arange(32.0).reshape(8, 4)
    with ms.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(3, {"w": w})
        wm = ms.WeightMap([ms.MapRule("w", "dense/kernel")])
        out = mngr.restore(mapping=wm, specs=P("data"), mesh=mesh8)
    assert out["dense"]["kernel"].sharding.spec == P("data")
    np.testing.assert_array_equal(out["dense"]["kernel"], w)


def test_constructor_documents_every_argument():
    """``help(CheckpointManager)`` describes each constructor argument (under ``__init__``;
    the docs page merges it into the class)."""
    import inspect
    import pydoc

    doc = inspect.getdoc(ms.CheckpointManager.__init__) or ""
    documented = re.findall(
        r"^    (\w+): ", doc.split("Args:")[1].split("Raises:")[0], flags=re.MULTILINE
    )
    params = [p for p in inspect.signature(ms.CheckpointManager.__init__).parameters if p != "self"]
    assert documented == params
    shown = pydoc.render_doc(ms.CheckpointManager, renderer=pydoc.plaintext)
    assert "Initialize self." not in shown and "save_interval_steps: ``should_save``" in shown


# ---- how a step's arrays are stored ---------------------------------------------------------


def _data_bytes(step_dir):
    return sum(f.stat().st_size for f in (step_dir / "state").rglob("*") if f.parent.name == "d")


def test_steps_store_raw_chunks_unless_compression_zstd(tmp_path, mesh8):
    import orbax.checkpoint as ocp

    zeros = ms.shard({"w": jnp.zeros((512, 256)), "b": jnp.ones(8)}, ms.fsdp("data"), mesh8)
    with ms.CheckpointManager(tmp_path) as mngr:  # the default is save's: raw chunks
        mngr.save(0, zeros)
    with ms.CheckpointManager(tmp_path, compression="zstd", async_save=False) as mngr:
        mngr.save(1, zeros)
    raw, packed = tmp_path / "0", tmp_path / "1"
    assert stored_codec(raw, "w") is None
    assert stored_codec(packed, "w") == {"id": "zstd", "level": 1}
    assert _data_bytes(raw) >= 512 * 256 * 4 > 20 * _data_bytes(packed)
    with ms.CheckpointManager(tmp_path) as mngr:  # either restores, whatever the option
        assert mngr.all_steps() == [0, 1]
        for step in (0, 1):
            out = mngr.restore(step, like=zeros)
            assert out["w"].sharding == zeros["w"].sharding
            np.testing.assert_array_equal(out["w"], np.zeros((512, 256), np.float32))
            np.testing.assert_array_equal(out["b"], np.ones(8, np.float32))
    for step_dir in (raw, packed):
        np.testing.assert_array_equal(ms.restore(step_dir)["b"], np.ones(8, np.float32))
        plain = ocp.StandardCheckpointer().restore(str(step_dir / "state"))  # plain Orbax
        np.testing.assert_array_equal(plain["w"], np.zeros((512, 256), np.float32))
        np.testing.assert_array_equal(plain["b"], np.ones(8, np.float32))


def test_a_step_written_by_orbax_standard_handler_still_restores(tmp_path):
    """Steps saved before ``compression=`` (the state item through Orbax's
    StandardCheckpointHandler: zstd) restore and list beside the new raw ones."""
    import orbax.checkpoint as ocp

    from modelshard._checkpoint.storage import nest
    from modelshard._checkpoint.write import prepare

    old = {"w": jnp.arange(64.0).reshape(8, 8), "k": jax.random.key(3)}
    arrays, record = prepare(old)
    record.resolve()
    tree = nest(arrays, "save")
    handler = ocp.CompositeCheckpointHandler(
        state=ocp.StandardCheckpointHandler(),
        modelshard=ocp.JsonCheckpointHandler(filename="modelshard.json"),
        items=ocp.JsonCheckpointHandler(filename="items.json"),
    )
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(tree),
        modelshard=ocp.args.JsonSave(record.to_json()),
        items=ocp.args.JsonSave({}),
    )
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(
            tmp_path / "0", args=args, custom_metadata={"modelshard": "modelshard.checkpoint/1"}
        )
    assert stored_codec(tmp_path / "0", "w") == {"id": "zstd", "level": 1}
    with ms.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, {"w": old["w"] + 1, "k": jax.random.key(4)})
        assert mngr.all_steps() == [0, 1]
        first, second = mngr.restore(0, like=old), mngr.restore(1, like=old)
    assert stored_codec(tmp_path / "1", "w") is None
    np.testing.assert_array_equal(first["w"], old["w"])
    np.testing.assert_array_equal(second["w"], old["w"] + 1)
    assert jnp.array_equal(jax.random.key_data(first["k"]), jax.random.key_data(old["k"]))


@pytest.mark.parametrize("bad", ["gzip", True])
def test_an_unknown_compression_is_refused_by_the_constructor(tmp_path, bad):
    with pytest.raises(ms.CheckpointError) as e:
        ms.CheckpointManager(tmp_path / "run", compression=bad)
    assert str(e.value).splitlines() == [
        f"compression={bad!r} is not one of None (each chunk's raw bytes, the default) or "
        "'zstd' (Orbax's default codec: smaller files, several times the CPU)."
    ]
    assert not (tmp_path / "run").exists()


def test_an_async_step_is_its_state_at_save_even_when_the_state_is_donated_next(tmp_path, mesh24):
    """``save`` returns before the step is written; the training step that follows donates
    the state (its buffers are reused), and the step still holds, and its checksums verify,
    the values it was saved with."""
    rng = np.random.default_rng(0)
    values = {
        "w": rng.integers(-1000, 1000, (512, 256)).astype(np.float32),  # + 1 is exact
        "b": rng.integers(0, 100, (256,), dtype=np.int32),
        "key": jax.random.key(3),
    }
    state = ms.shard(values, {"w": P("data", "model"), "b": P("model"), "key": P()}, mesh24)
    step = jax.jit(
        lambda s: jax.tree.map(lambda x: x if x.dtype == values["key"].dtype else x + 1, s),
        donate_argnums=0,
    )
    with ms.CheckpointManager(tmp_path) as mngr:
        for n in range(3):
            mngr.save(n, state)
            state = step(state)  # donates what was just saved
        mngr.wait_until_finished()
        for n in range(3):
            out = mngr.restore(n)  # verified against the checksums of the copy
            np.testing.assert_array_equal(np.asarray(out["w"]), values["w"] + n)
            np.testing.assert_array_equal(np.asarray(out["b"]), values["b"] + n)
