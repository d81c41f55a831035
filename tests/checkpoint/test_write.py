"""Saving under crashes and concurrency (``_checkpoint/write.py``): a saver SIGKILLed at random
moments, racing readers, concurrent and multi-process writers, an interrupted overwrite, leaf
names that are data; an empty state refused."""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import math
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from helpers import Zygote, assert_bit_exact

SCRIPTS = Path(__file__).parent / "ckpt_scripts"


def test_zero_size_only_state_is_refused_clearly(tmp_path):
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", {"a": jnp.zeros((0, 3)), "b": jnp.zeros(0, jnp.int8)})
    assert str(e.value) == "nothing to save: every array leaf of the dict is zero-size."
    assert not (tmp_path / "c").exists()


def _load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"ckpt_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sigkill_rounds(
    zygote: Zygote, tmp_path: Path, kills: int, seed: int, timeout_s: float
) -> dict[str, Any]:
    """Start a saver, SIGKILL it at a random moment, check the directory, restart; repeat.

    After every kill: the steps listed are complete and restore bit-exact, the latest is
    at least the last step the saver saw committed, the next saver resumes right after it,
    and the plain ``save(overwrite=True)`` checkpoint restores bit-exact to some step at
    least as new as the last one that returned.
    """
    loop = _load_script("save_loop")
    rng = random.Random(seed)
    stats = {"kills": 0, "steps_seen": 0, "restores": 0, "killed_before_first_commit": 0}
    committed = plain = 0
    resume_at = 1
    zygote.deadline = time.monotonic() + timeout_s
    try:
        for i in range(kills):
            assert zygote.start(tmp_path) == resume_at, (seed, i)
            # mostly early (start-up, the first saves), every fourth deep in the save loop
            time.sleep(rng.uniform(1.5, 3.5) if i % 4 == 3 else rng.uniform(0.0, 1.5))
            printed = zygote.kill_saver()
            stats["kills"] += 1
            done = [int(x.split()[2]) for x in printed if x.split()[1] == "COMMITTED"]
            plain_done = [int(x.split()[2]) for x in printed if x.split()[1] == "PLAIN"]
            stats["killed_before_first_commit"] += not done
            committed = max([committed, *done])
            plain = max([plain, *plain_done])
            with ms.CheckpointManager(tmp_path / "mngr") as mngr:
                steps = mngr.all_steps()
                assert (mngr.latest_step() or 0) >= committed, (seed, i, steps, committed)
                assert len(steps) <= 3 + 1, steps  # max_to_keep, plus one not yet rotated
                for step in steps:
                    assert_bit_exact(loop.state(step), mngr.restore(step), (seed, i, step))
                    stats["restores"] += 1
            stats["steps_seen"] = max(steps or [0])
            resume_at = max(steps or [0]) + 1
            if plain:
                out = ms.restore(tmp_path / "plain")
                step = int(out["step"])
                assert step >= plain, (seed, i, step, plain)
                assert_bit_exact(loop.state(step), out, (seed, i, step))
                stats["restores"] += 1
    finally:
        if zygote.saver is not None:
            zygote.kill_saver()
    return stats


def test_sigkill_at_random_moments_never_lists_a_partial_step(zygote, tmp_path):
    start = time.monotonic()
    # A bound on a hang, not a timing: 20 rounds take about a minute on an idle machine,
    # and `make test` runs the floor tests and pyright beside the suite.
    stats = sigkill_rounds(zygote, tmp_path, kills=20, seed=20261130, timeout_s=300)
    print("sigkill stats:", stats, f"{time.monotonic() - start:.1f}s")
    assert stats["kills"] == 20
    assert stats["steps_seen"] > 8  # the kills landed while saves were going on
    assert time.monotonic() - start < 300


@pytest.mark.slow
def test_sigkill_many_more_times(zygote, tmp_path):
    start = time.monotonic()
    stats = sigkill_rounds(zygote, tmp_path, kills=100, seed=7, timeout_s=900)
    print("sigkill stats:", stats, f"{time.monotonic() - start:.1f}s")
    assert stats["kills"] == 100


def test_restores_racing_saves_are_bit_exact_or_clear_errors(tmp_path):
    """A reader restores the latest step over and over while a writer saves and rotates."""
    steps, seen, errors, writer_errors = 12, [], [], []

    def state(step: int) -> dict[str, Any]:
        return {
            "w": np.full((64, 64), step, np.float32),
            "i": np.arange(1000, dtype=np.int32) * step,
        }

    def write() -> None:
        try:
            with ms.CheckpointManager(tmp_path, max_to_keep=2) as mngr:
                for step in range(1, steps + 1):
                    mngr.save(step, state(step))
        except Exception as e:  # the writer must never fail because someone reads
            writer_errors.append(f"{type(e).__name__}: {e}")

    writer = threading.Thread(target=write)
    writer.start()
    reader = ms.CheckpointManager(tmp_path)
    deadline = time.monotonic() + 120
    try:
        while (writer.is_alive() or not seen) and time.monotonic() < deadline:
            latest = reader.latest_step()
            if latest is None:
                time.sleep(0.01)
                continue
            try:
                out = reader.restore(latest)
            except ms.CheckpointError as e:  # rotated away while being read
                errors.append(str(e))
                continue
            assert_bit_exact(state(latest), {k: np.asarray(v) for k, v in out.items()}, latest)
            seen.append(latest)
    finally:
        writer.join(timeout=120)
        reader.close()
    assert writer_errors == []
    assert not writer.is_alive()
    with ms.CheckpointManager(tmp_path) as after:
        assert after.latest_step() == steps
        out = after.restore()
        assert_bit_exact(state(steps), {k: np.asarray(v) for k, v in out.items()})
    assert len(seen) >= 2, seen


@pytest.mark.slow
def test_two_writer_processes_never_both_claim_a_step(tmp_path):
    writers = {
        name: subprocess.Popen(
            [sys.executable, str(SCRIPTS / "two_writers.py"), str(tmp_path), name, str(off), "8"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        for name, off in [("A", 0), ("B", 1000)]
    }
    time.sleep(1.0)
    (tmp_path / "go").touch()
    lines = []
    for proc in writers.values():
        try:
            lines += proc.communicate(timeout=240)[0].splitlines()
        finally:
            proc.kill()
    saved = {(int(x.split()[2]), x.split()[0]) for x in lines if x.split()[1] == "SAVED"}
    refused = [x for x in lines if x.split()[1] == "REFUSED"]
    # refused while the other one writes, or (if it finished first) because the step exists
    assert all(
        "CheckpointError: another CheckpointManager is saving" in x or "already exists" in x
        for x in refused
    ), refused
    assert len(saved) + len(refused) == 16, lines
    owner = dict(saved)
    assert len(owner) == len(saved), f"a step claimed twice: {sorted(saved)}"
    with ms.CheckpointManager(tmp_path / "mngr") as mngr:
        assert mngr.all_steps() == sorted(owner)
        for step, name in owner.items():
            offset = 0 if name == "A" else 1000
            out = mngr.restore(step)
            np.testing.assert_array_equal(out["w"], np.full((64, 64), offset + step, np.float32))


@pytest.mark.parametrize("name", ["..", ".", "", "/etc", "a\\x00b", "ü 🎉", "x" * 300])
def test_leaf_names_are_data_not_paths(tmp_path, name):
    """Whatever a leaf is called, nothing is written outside the checkpoint directory."""
    before = set((tmp_path).iterdir())
    state = {"outer": {name: jnp.arange(3.0)}, "w": jnp.ones(2)}
    path = ms.save(tmp_path / "c", state)
    assert set(tmp_path.iterdir()) - before == {path}
    out = ms.restore(path, like=state)
    np.testing.assert_array_equal(out["outer"][name], np.arange(3.0))


def test_concurrent_saves_of_one_path_take_turns(tmp_path):
    def state(i: int) -> dict[str, Any]:
        return {"w": np.full((128, 128), i, np.float32), "v": np.arange(3000, dtype=np.int32) + i}

    errors: list[str] = []

    def saves(offset: int) -> None:
        for i in range(offset, offset + 4):
            try:
                ms.save(tmp_path / "c", state(i), overwrite=True)
            except Exception as e:  # any failure here is the finding
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=saves, args=(off,)) for off in (0, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    out = ms.restore(tmp_path / "c")
    last = int(out["v"][0])
    assert last in (3, 1003)
    assert_bit_exact(state(last), {k: np.asarray(v) for k, v in out.items()})
    assert os.listdir(tmp_path) == ["c"]


def test_overwrite_never_leaves_the_path_without_a_checkpoint(tmp_path, monkeypatch):
    """A crash at any rename of an overwrite: here every rename of the checkpoint's own
    directory is followed by a simulated crash. The path still holds a whole checkpoint."""
    import modelshard._checkpoint.write as ckpt

    path = ms.save(tmp_path / "c", {"w": jnp.zeros(4)})

    class Crash(Exception):
        pass

    class CrashingOs:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        def rename(self, src: Any, dst: Any) -> None:
            os.rename(src, dst)
            if Path(src) == path or Path(dst) == path:
                raise Crash(f"crashed after renaming {src} -> {dst}")

    monkeypatch.setattr(ckpt, "os", CrashingOs())
    with contextlib.suppress(Crash):
        ms.save(path, {"w": jnp.ones(4)}, overwrite=True)
    monkeypatch.undo()
    assert float(ms.restore(path)["w"][0]) in (0.0, 1.0)
    assert ckpt._exchange(tmp_path / "c", tmp_path / "c")  # this system can swap


@pytest.mark.parametrize("name", ["ck[red]pt", "run*1", "a?b", "x[0-9]"])
@pytest.mark.parametrize("how", ["save", "manager"])
def test_a_path_that_reads_as_a_glob_pattern_still_restores(tmp_path, name, how):
    """Orbax finds the per-process OCDBT databases to merge with a glob under the
    checkpoint's path, so ``[``, ``]``, ``*`` and ``?`` there matched nothing: the save was
    published without the manifest that indexes its arrays, and never restored."""
    import jax
    import orbax.checkpoint as ocp

    state = {"w": jnp.arange(4096.0).reshape(64, 64), "k": jax.random.key(3)}
    if how == "save":
        path = ms.save(tmp_path / name / "ck", state)
    else:
        with ms.CheckpointManager(tmp_path / name) as mngr:
            mngr.save(1, state)
        path = tmp_path / name / "1"
    out = ms.restore(path)  # checksums verified
    assert_bit_exact(state, out)
    tree = path if how == "save" else path / "state"
    assert (tree / "manifest.ocdbt").is_file()
    if how == "save":
        plain = ocp.StandardCheckpointer().restore(str(path))
        np.testing.assert_array_equal(plain["w"], np.asarray(state["w"]))


def test_python_values_are_written_into_the_record_with_their_types(tmp_path):
    """Plain Python leaves were dropped by save (only arrays reached the disk); each is now
    in the record, typed, exactly (a big int, -inf, a NaN, bytes)."""
    import json

    state = {
        "w": jnp.ones(2),
        "epoch": 3,
        "name": "run1",
        "lr": 0.1,
        "flag": True,
        "big": 2**70,
        "low": -math.inf,
        "raw": b"\x00\x01",
        "act": jax.nn.relu,  # code: not state, not saved, not refused
    }
    path = ms.save(tmp_path / "c", state)
    record = json.loads((path / "modelshard.json").read_text())
    assert [leaf["path"] for leaf in record["leaves"]] == ["w"]
    assert record["values"] == [
        {"path": "big", "key": ["big"], "type": "int", "value": "0x400000000000000000"},
        {"path": "epoch", "key": ["epoch"], "type": "int", "value": 3},
        {"path": "flag", "key": ["flag"], "type": "bool", "value": True},
        {"path": "low", "key": ["low"], "type": "float", "value": "-inf"},
        {"path": "lr", "key": ["lr"], "type": "float", "value": 0.1},
        {"path": "name", "key": ["name"], "type": "str", "value": "run1"},
        {"path": "raw", "key": ["raw"], "type": "bytes", "value": "AAE="},
    ]


class _Config:
    pass


class _Mode(enum.IntEnum):
    TRAIN = 1


def test_leaves_that_cannot_be_saved_faithfully_are_refused_by_name(tmp_path):
    """Objects among the leaves (neither arrays, Python values nor code) were dropped
    silently; save now refuses them all at once, naming each, and writes nothing."""
    state = {
        "w": jnp.ones(2),
        "cfg": _Config(),
        "opt": {"mode": _Mode.TRAIN, "dtype": np.dtype("float32")},
        "epoch": 3,
    }
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", state)
    assert str(e.value).splitlines() == [
        "cannot save 3 leaves (nothing was written): a checkpoint holds arrays and the values "
        "bool, int, float, complex, str, bytes and None, and these are neither:",
        f"  cfg: a {__name__}._Config",
        "  opt/dtype: a numpy.dtypes.Float32DType",
        f"  opt/mode: a {__name__}._Mode, a subclass of int (convert it: int(x))",
        "hint: make each an array or one of those values; or, if it is part of the model's "
        "definition, a static field (eqx.field(static=True), flax.struct.field(pytree_node="
        "False), an NNX attribute that is not a Variable), which is not saved and comes from "
        "like= on restore.",
    ]
    assert not (tmp_path / "c").exists()


def test_values_too_large_for_the_record_are_refused(tmp_path, monkeypatch):
    values = importlib.import_module("modelshard._checkpoint.values")
    monkeypatch.setattr(values, "MAX_VALUES_BYTES", 1000)
    state = {"w": jnp.ones(2), "text": "x" * 2000, "n": 1}
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", state)
    assert str(e.value) == (
        "cannot save: the state's Python values take 2119 bytes of JSON in the record, more "
        "than 1000; the largest: text (str), n (int). Store large data as arrays "
        "(np.frombuffer for bytes)."
    )
    assert not (tmp_path / "c").exists()


def test_numpy_leaves_that_are_not_numbers_are_refused_by_name(tmp_path):
    """NumPy strings, bytes, dates and object arrays escaped as JAX's TypeError."""
    state = {
        "w": jnp.ones(2),
        "tag": np.str_("run1"),
        "raw": np.bytes_(b"x"),
        "when": np.datetime64("2020-01-01"),
        "objs": np.array([None, 1]),
    }
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", state)
    assert str(e.value).splitlines() == [
        "cannot save 4 leaves (nothing was written):",
        "  objs: it is a NumPy array of dtype object, not numbers, which a checkpoint's arrays "
        "cannot hold",
        "  raw: it is a NumPy scalar of dtype |S1, not numbers, which a checkpoint's arrays "
        "cannot hold; as a Python value it is saved: bytes(x)",
        "  tag: it is a NumPy scalar of dtype <U4, not numbers, which a checkpoint's arrays "
        "cannot hold; as a Python value it is saved: str(x)",
        "  when: it is a NumPy scalar of dtype datetime64[D], not numbers, which a "
        "checkpoint's arrays cannot hold",
    ]
    assert not (tmp_path / "c").exists()


def test_dtypes_no_checkpoint_stores_are_refused_before_a_byte_is_written(tmp_path):
    """float6 and int1 arrays JAX holds have no TensorStore type and no integer of their
    width: every such leaf named at once, nothing written (not TensorStore's bare
    ValueError halfway through the save); a manager step refuses them alike."""
    import ml_dtypes

    state = {
        "a": jnp.zeros(4, ml_dtypes.float6_e2m3fn),
        "b": jnp.zeros(3, ml_dtypes.int1),
        "c": jnp.zeros(2, ml_dtypes.uint2),  # stored as its bits: fine
    }
    why = (
        "(TensorStore has no such type, and no integer of its width holds its bits); cast it "
        "to a wider dtype that holds its values exactly first (bfloat16 for a 6-bit float, int8 "
        "for int1)"
    )
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", state)
    assert str(e.value).splitlines() == [
        "cannot save 2 leaves (nothing was written):",
        f"  a: no checkpoint stores float6_e2m3fn {why}",
        f"  b: no checkpoint stores int1 {why}",
    ]
    assert os.listdir(tmp_path) == []
    with ms.CheckpointManager(tmp_path / "run", handle_signals=False) as mngr:
        with pytest.raises(ms.CheckpointError, match="cannot save 2 leaves"):
            mngr.save(0, state)
        assert mngr.all_steps() == []
    # cast on the host: XLA's CPU backend cannot convert float6 (it fails to lower)
    state["a"] = jnp.asarray(np.asarray(state["a"]).astype(jnp.bfloat16))
    state["b"] = jnp.asarray(np.asarray(state["b"]).astype(jnp.int8))
    ms.save(tmp_path / "c", state)
    assert_bit_exact(ms.restore(tmp_path / "c"), state)
