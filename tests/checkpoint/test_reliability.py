"""Checkpoint reliability: bit-exact round trips of every dtype, SIGKILLed saves, damaged and
hostile checkpoints, and two writers on one directory.

Every case ends either bit-exact or in a ``CheckpointError``; nothing else may escape and no
wrong value may come back. The numbers these tests measure are in ``docs/reliability.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DTYPES, values

SCRIPTS = Path(__file__).parent / "ckpt_scripts"
KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


@pytest.fixture(autouse=True)
def _slow_only_on_request(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("slow") and "slow" not in (
        request.config.getoption("markexpr") or ""
    ):
        pytest.skip("runs with `pytest -m slow`")


def _bits(x: Any) -> tuple[str, tuple[int, ...], bytes]:
    """dtype, shape and raw bytes: what "bit-exact" compares (typed keys by their data)."""
    dtype = str(x.dtype)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        dtype = f"{dtype}:{jax.random.key_impl(x)}"
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return dtype, a.shape, np.ascontiguousarray(a).tobytes()


def assert_bit_exact(want: Any, got: Any, where: Any = "") -> None:
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want], where
    bad = [
        jax.tree_util.keystr(p)
        for (p, a), (_, b) in zip(flat_want, flat_got, strict=True)
        if _bits(a) != _bits(b)
    ]
    assert not bad, f"{where}: not bit-exact: {bad}"


# ---- every dtype -------------------------------------------------------------------------


def every_dtype_state(mesh: Any) -> dict[str, Any]:
    """Each dtype sharded (8, 3), as a scalar and zero-size; typed keys; odd NumPy inputs."""
    rows = NamedSharding(mesh, P("data"))
    tree: dict[str, Any] = {}
    for dt in DTYPES:
        tree[f"{dt}/sharded"] = jax.device_put(values(dt, (8, 3)), rows)
        tree[f"{dt}/scalar"] = jnp.asarray(values(dt, (), seed=1))
        tree[f"{dt}/empty"] = jax.device_put(values(dt, (0, 4)), rows)
    for dt in ["float32", "bfloat16", "int4", "int8", "bool", "complex64"]:
        tree[f"{dt}/numpy_strided"] = values(dt, (6, 10), seed=2)[::2, 1::3]
    for impl in KEY_IMPLS:
        keys = jax.random.split(jax.random.key(7, impl=impl), 8)
        tree[f"key_{impl}/sharded"] = jax.device_put(keys, rows)
        tree[f"key_{impl}/scalar"] = jax.random.key(3, impl=impl)
        tree[f"key_{impl}/empty"] = jax.random.split(jax.random.key(1, impl=impl), 0)
    f32 = np.arange(60, dtype=np.float32).reshape(6, 10)
    tree["numpy/transposed"] = f32.T
    tree["numpy/fortran"] = np.asfortranarray(f32)
    tree["numpy/negative_stride"] = f32[::-1, ::-2]
    tree["numpy/broadcast"] = np.broadcast_to(np.arange(3, dtype=np.int32), (4, 3))
    tree["numpy/scalar"] = np.float32(2.5)
    return {k.replace("/", "_"): v for k, v in tree.items()}


def test_every_dtype_round_trips_bit_exact(tmp_path):
    mesh8 = ms.make_mesh({"data": 8})
    mesh24 = ms.make_mesh({"data": 2, "model": 4}, axis_types="explicit")
    state = every_dtype_state(mesh8)
    path = ms.save(tmp_path / "c", state)
    assert_bit_exact(state, ms.restore(path))
    # onto another mesh, through the planning pipeline, every leaf sharded where it divides
    specs = ms.fsdp("model", min_size=0)
    out = ms.restore(path, like=state, specs=specs, mesh=mesh24)
    assert_bit_exact(state, out)
    for name, want in zip(
        sorted(state), ms.plan(out, specs, mesh24).flat_shardings(0), strict=True
    ):
        assert out[name].sharding.is_equivalent_to(want, out[name].ndim), name
    assert out["float8_e4m3fn_sharded"].sharding.spec == P("model")
    # and through CheckpointManager's two-item layout
    with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
        mngr.save(1, state)
        assert_bit_exact(state, mngr.restore(1))


def test_dtype_list_covers_what_jax_has():
    for name in ["float8_e4m3", "float8_e5m2", "float4_e2m1fn", "int4", "uint4", "bfloat16"]:
        assert hasattr(jnp, name) == (name in DTYPES), name


def test_dtypes_tensorstore_lacks_are_stored_as_bits(tmp_path):
    import json

    state = {dt: jnp.asarray(values(dt, (5,))) for dt in ["float8_e4m3", "uint4", "uint2"]}
    ms.save(tmp_path / "c", state)
    rec = json.loads((tmp_path / "c" / "modelshard.json").read_text())
    stored = {leaf["path"]: (leaf["dtype"], leaf["stored_dtype"]) for leaf in rec["leaves"]}
    assert stored == {
        "float8_e4m3": ("float8_e4m3", "uint8"),
        "uint4": ("uint4", "int4"),
        "uint2": ("uint2", "int2"),
    }
    assert_bit_exact(state, ms.restore(tmp_path / "c"))
    out = ms.restore(tmp_path / "c", dtype=jnp.float32)
    assert out["float8_e4m3"].dtype == jnp.float32
    np.testing.assert_array_equal(out["float8_e4m3"], state["float8_e4m3"].astype(jnp.float32))
    assert out["uint4"].dtype == jnp.uint4  # integers are never cast


def test_zero_size_only_state_is_refused_clearly(tmp_path):
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", {"a": jnp.zeros((0, 3)), "b": jnp.zeros(0, jnp.int8)})
    assert str(e.value) == "nothing to save: every array leaf of the dict is zero-size."
    assert not (tmp_path / "c").exists()


def test_64_bit_dtypes_round_trip_under_x64_in_a_subprocess(zygote):
    """float64, int64, uint64, complex128 need ``jax_enable_x64``, which is process-wide: a
    child forked from the zygote turns it on before it first uses JAX."""
    assert zygote.x64(timeout_s=120) == (
        "X64 OK ['complex128', 'float64', 'float64', 'int64', 'int64', 'uint64', 'uint64']"
    )


# ---- SIGKILL at random moments --------------------------------------------------------------


def _load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"ckpt_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Zygote:
    """``ckpt_scripts/save_loop.py``: imports once, forks a saver per :meth:`start`."""

    def __init__(self, timeout_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "save_loop.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.deadline = time.monotonic() + timeout_s
        self.tmp = Path(tempfile.mkdtemp(prefix="zygote"))
        self.saver: int | None = None
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("READY")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str) -> str:
        while True:
            left = self.deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {prefix!r}"
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if re.match(prefix, line):
                return line

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def x64(self, timeout_s: float) -> str:
        """Fork a child that round-trips 64-bit dtypes; return its ``X64 OK`` line."""
        self.deadline = time.monotonic() + timeout_s
        self.send(f"x64 {self.tmp}")
        pid = self.expect("FORKED ").split()[1]
        line = self.expect(f"X64 OK|{pid} FAILED")
        return line

    def start(self, root: Path) -> int:
        """Fork a saver on ``root``; return the step it resumes at once its backend is up."""
        self.send(f"fork {root}")
        self.saver = int(self.expect("FORKED ").split()[1])
        return int(self.expect(f"{self.saver} START ").split()[2])

    def kill_saver(self) -> list[str]:
        """SIGKILL the saver, wait until it is gone; return what it printed since START."""
        assert self.saver is not None
        os.kill(self.saver, signal.SIGKILL)
        while os.path.exists(f"/proc/{self.saver}") and _alive(self.saver):
            assert time.monotonic() < self.deadline, "the killed saver did not go away"
            time.sleep(0.01)
        self.saver = None
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return out

    def close(self) -> None:
        if self.saver is not None:
            os.kill(self.saver, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(timeout_s=120)
    try:
        yield z
    finally:
        z.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


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
    stats = sigkill_rounds(zygote, tmp_path, kills=20, seed=20261130, timeout_s=150)
    print("sigkill stats:", stats, f"{time.monotonic() - start:.1f}s")
    assert stats["kills"] == 20
    assert stats["steps_seen"] > 8  # the kills landed while saves were going on
    assert time.monotonic() - start < 150


@pytest.mark.slow
def test_sigkill_many_more_times(zygote, tmp_path):
    start = time.monotonic()
    stats = sigkill_rounds(zygote, tmp_path, kills=100, seed=7, timeout_s=900)
    print("sigkill stats:", stats, f"{time.monotonic() - start:.1f}s")
    assert stats["kills"] == 100


# ---- hostile records -----------------------------------------------------------------------


@pytest.fixture
def small_ckpt(tmp_path):
    """A saved checkpoint and its record as a dict: (path, record)."""
    import json

    state = {"w": jnp.arange(12.0).reshape(3, 4), "k": jax.random.key(1), "n": {"i": jnp.arange(5)}}
    path = ms.save(tmp_path / "c", state)
    return path, json.loads((path / "modelshard.json").read_text())


def _leaf(record: dict[str, Any], path: str) -> dict[str, Any]:
    return next(leaf for leaf in record["leaves"] if leaf["path"] == path)


EDITS = {
    "storage key walks up": (
        lambda r: _leaf(r, "w").update(key=["..", "..", "w"]),
        "leaf 'w' of the record is invalid: its storage key ['..', '..', 'w'] is not the one "
        "its path gives, ['w'].",
    ),
    "storage key names another leaf": (
        lambda r: _leaf(r, "w").update(key=["n", "i"]),
        "leaf 'w' of the record is invalid: its storage key ['n', 'i'] is not the one its "
        "path gives, ['w'].",
    ),
    "path walks up": (
        lambda r: _leaf(r, "w").update(path="../../etc/passwd"),
        "leaf '../../etc/passwd' of the record is invalid: its storage key ['w'] is not the "
        "one its path gives, ['..', '..', 'etc', 'passwd'].",
    ),
    "shape": (
        lambda r: _leaf(r, "w").update(shape=[4, 3]),
        "leaf 'w' of the record is invalid: a float32[4, 3] leaf is never stored as float32[3, 4].",
    ),
    "dtype": (
        lambda r: _leaf(r, "w").update(dtype="int32"),
        "leaf 'w' of the record is invalid: a int32[3, 4] leaf is never stored as float32[3, 4].",
    ),
    "object dtype": (
        lambda r: _leaf(r, "w").update(dtype="object", stored_dtype="object"),
        "leaf 'w' of the record is invalid: dtype 'object' is not a numeric dtype.",
    ),
    "dtype that is code": (
        lambda r: _leaf(r, "w").update(stored_dtype="os.system"),
        "leaf 'w' of the record is invalid: unknown dtype 'os.system' in the checkpoint record.",
    ),
    "negative shape": (
        lambda r: _leaf(r, "w").update(shape=[-3, 4], stored_shape=[-3, 4]),
        "leaf 'w' of the record is invalid: negative dimension in [-3, 4] (stored [-3, 4]).",
    ),
    "key impl": (
        lambda r: _leaf(r, "k").update(key_impl="evil"),
        "leaf 'k' of the record is invalid: it is not key data of PRNG impl 'evil': "
        'unrecognized PRNG implementation "evil".',
    ),
    "key data shape": (
        lambda r: _leaf(r, "k").update(stored_shape=[3]),
        "leaf 'k' of the record is invalid: it is not key data of PRNG impl 'threefry2x32': "
        "JAX encountered invalid PRNG key data",
    ),
    "spec axis": (
        lambda r: (r.update(mesh={"axes": {"data": 8}}), _leaf(r, "w").update(spec=["model"])),
        "leaf 'w' of the record is invalid: its spec P('model',) names 'model', not an axis "
        "of the recorded mesh.",
    ),
    "spec rank": (
        lambda r: (
            r.update(mesh={"axes": {"data": 8}}),
            _leaf(r, "n/i").update(spec=[None, "data"]),
        ),
        "leaf 'n/i' of the record is invalid: its spec P(None, 'data') is longer than its rank 1.",
    ),
    "mesh": (
        lambda r: r.update(mesh={"axes": {"data": -8}}),
        "the modelshard record is malformed (ValueError: mesh axes {'data': -8} are not names "
        "and positive sizes).",
    ),
    "leaves not a list of objects": (
        lambda r: r.update(leaves=["w"]),
        "the modelshard record is malformed (AttributeError: 'str' object has no attribute 'get').",
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_edited_record_is_refused_naming_leaf_and_file(small_ckpt, edit):
    import json

    path, record = small_ckpt
    change, message = EDITS[edit]
    change(record)
    (path / "modelshard.json").write_text(json.dumps(record))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value).startswith(f"{path / 'modelshard.json'}: {message}")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1]", "the record is a JSON list, not an object."),
        ('{"format": "modelshard.checkpoint/1", "kind": 1', "is not valid JSON"),
    ],
)
def test_record_that_is_not_an_object_is_refused(small_ckpt, text, message):
    path, _ = small_ckpt
    (path / "modelshard.json").write_text(text)
    with pytest.raises(ms.CheckpointError, match=message):
        ms.restore(path)


def test_deeply_nested_record_is_refused(small_ckpt):
    path, _ = small_ckpt
    (path / "modelshard.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value).startswith(
        f"{path / 'modelshard.json'} is not valid JSON: maximum recursion"
    )


@pytest.mark.parametrize("name", ["modelshard.json", "_METADATA"])
def test_oversized_metadata_is_refused_unread(small_ckpt, monkeypatch, name):
    # the package's attribute `locate` is the function, not this module
    ckpt = importlib.import_module("modelshard._checkpoint.sources")

    path, _ = small_ckpt
    with open(path / name, "a") as f:
        f.write(" " * 4096)  # still valid JSON, now the largest metadata file
    size = (path / name).stat().st_size
    monkeypatch.setattr(ckpt, "MAX_METADATA_BYTES", size - 1)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == (
        f"{path / name} is {size} bytes, more than the {size - 1} that checkpoint metadata "
        "may have; refusing to read it."
    )
    monkeypatch.setattr(ckpt, "MAX_METADATA_BYTES", size)
    assert ms.restore(path)["w"].shape == (3, 4)


def _largest_data_file(path: Path) -> Path:
    return max((f for f in path.rglob("*") if f.parent.name == "d"), key=lambda f: f.stat().st_size)


@pytest.mark.parametrize("what", ["data file", "directory", "record"])
def test_symlinks_leading_outside_are_not_followed(small_ckpt, tmp_path, what):
    import shutil

    path, _ = small_ckpt
    outside = tmp_path / "outside"
    outside.mkdir()
    if what == "data file":
        link = _largest_data_file(path)
    elif what == "directory":
        link = next(path.glob("ocdbt.process_*"))
    else:
        link = path / "modelshard.json"
    target = outside / link.name
    shutil.move(link, target)  # the same bytes, now reached through a link
    link.symlink_to(target)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == (
        f"{link} is a symbolic link to {target}, outside the checkpoint {path}; "
        "refusing to follow it."
    )


def test_symlinks_inside_the_checkpoint_are_fine(small_ckpt):
    path, _ = small_ckpt
    (path / "alias").symlink_to(path / "modelshard.json")
    assert ms.restore(path)["w"].shape == (3, 4)


@pytest.mark.parametrize("step", [-1, True, 1.5, "3", "../x", None])
def test_manager_refuses_steps_that_are_not_non_negative_ints(tmp_path, step):
    with ms.CheckpointManager(tmp_path, async_save=False) as mngr:
        with pytest.raises(ms.CheckpointError) as e:
            mngr.save(step, {"w": jnp.ones(2)})
        assert str(e.value) == f"step must be a non-negative int, got {step!r}."
        assert mngr.save(np.int64(2), {"w": jnp.ones(2)})
        assert mngr.all_steps() == [2]
    assert sorted(os.listdir(tmp_path)) == [".modelshard-lock", "2"]


def test_manager_does_not_follow_a_step_linked_outside(tmp_path):
    import shutil

    with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
        mngr.save(1, {"w": jnp.ones(2)})
        shutil.move(tmp_path / "m" / "1", tmp_path / "elsewhere")
        (tmp_path / "m" / "1").symlink_to(tmp_path / "elsewhere")
        with pytest.raises(ms.CheckpointError) as e:
            mngr.restore(1)
    assert str(e.value) == (
        f"{tmp_path / 'm' / '1'} is a symbolic link to {tmp_path / 'elsewhere'}; steps are "
        f"directories of {tmp_path / 'm'}, refusing to follow it."
    )


def test_rotation_leaves_nothing_half_deleted(tmp_path):
    with ms.CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as mngr:
        for step in range(4):
            mngr.save(step, {"w": jnp.full(3, step)})
        # a step a killed purge left half-deleted in the rotation area is never listed
        (tmp_path / ".modelshard-rotated" / "99" / "state").mkdir(parents=True)
        assert mngr.all_steps() == [3]
    assert sorted(os.listdir(tmp_path)) == [".modelshard-lock", ".modelshard-rotated", "3"]
    assert os.listdir(tmp_path / ".modelshard-rotated") == []  # purged on close


# ---- damaged files ---------------------------------------------------------------------------


def _truncate(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    if data:
        data[len(data) // 2] ^= 0x5A
    f.write_bytes(bytes(data))


DAMAGE = {"truncated": _truncate, "flipped": _flip, "deleted": Path.unlink}


def test_every_file_damaged_every_way_errors_or_restores_bit_exact(tmp_path):
    """Each file of a checkpoint truncated, flipped or deleted: restore is bit-exact (the file
    was not needed) or a CheckpointError; nothing else escapes, no wrong value comes back."""
    import shutil

    mesh = ms.make_mesh({"data": 8})
    rng = np.random.default_rng(0)
    state = {
        "big": jax.device_put(
            rng.standard_normal((256, 64)).astype(np.float32), NamedSharding(mesh, P("data"))
        ),
        "small": jnp.arange(8.0),
        "k": jax.random.key(5),
    }
    base = ms.save(tmp_path / "base", state)
    files = sorted(f.relative_to(base) for f in base.rglob("*") if f.is_file())
    outcomes: dict[str, list[str]] = {"bit-exact": [], "CheckpointError": []}
    for rel in files:
        for how, damage in DAMAGE.items():
            case = (
                tmp_path / f"{how}-{len(outcomes['bit-exact']) + len(outcomes['CheckpointError'])}"
            )
            shutil.copytree(base, case)
            damage(case / rel)
            try:
                out = ms.restore(case)
            except ms.CheckpointError:
                outcomes["CheckpointError"].append(f"{how} {rel}")
            else:
                assert_bit_exact(state, out, f"{how} {rel}")
                outcomes["bit-exact"].append(f"{how} {rel}")
            shutil.rmtree(case)
    print("damage outcomes:", {k: len(v) for k, v in outcomes.items()}, "files:", len(files))
    # every data file, the record and the Orbax metadata are checked
    for must_fail in ["modelshard.json", "_METADATA", "manifest.ocdbt"]:
        assert f"flipped {must_fail}" in outcomes["CheckpointError"], outcomes
    assert any(s.startswith("truncated d/") for s in outcomes["CheckpointError"]), outcomes


def test_truncated_data_names_the_leaf_and_the_file(tmp_path):
    mesh = ms.make_mesh({"data": 8})
    big = np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)
    path = ms.save(
        tmp_path / "c",
        {"big": jax.device_put(big, NamedSharding(mesh, P("data"))), "small": jnp.ones(3)},
    )
    _truncate(_largest_data_file(path))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 1 leaf of {path} (damaged or incomplete checkpoint):"
    assert lines[1].startswith("  big: ValueError: ")
    assert lines[2].startswith(f"    file: {path}")
    assert "small" not in str(e.value)


def test_broken_orbax_metadata_names_the_file(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(3)})
    _truncate(path / "_METADATA")
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 1 leaf of {path} (damaged or incomplete checkpoint):"
    assert lines[1].startswith("  w: JSONDecodeError: ")
    assert lines[2] == f"    file: {path / '_METADATA'}"


def test_deleted_process_shard_directory(tmp_path):
    import shutil

    path = ms.save(tmp_path / "c", {"w": jnp.arange(4096.0), "v": jnp.ones(3)})
    shutil.rmtree(next(path.glob("ocdbt.process_*")))
    try:
        out = ms.restore(path)
    except ms.CheckpointError as e:
        assert "\n  w: " in str(e) or "\n  v: " in str(e)
    else:  # the root manifest may hold everything this small checkpoint needs
        np.testing.assert_array_equal(out["w"], np.arange(4096.0))


@pytest.mark.parametrize("layout", ["save", "manager"])
def test_deleted_record_is_an_error_not_a_plain_orbax_checkpoint(tmp_path, layout):
    import shutil

    state = {"w": jnp.ones(3), "k": jax.random.key(0)}
    if layout == "save":
        path = ms.save(tmp_path / "c", state)
        record = path / "modelshard.json"
        record.unlink()
    else:
        with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
            mngr.save(1, state)
        path = tmp_path / "m" / "1"
        record = path / "modelshard" / "modelshard.json"
        shutil.rmtree(path / "modelshard")
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == (
        f"{record} is missing, but modelshard wrote {path}: without the record the leaves' "
        "paths, dtypes (typed PRNG keys) and checksums are unknown. Restore a complete copy "
        "of the checkpoint."
    )


# ---- two writers, a reader racing a writer ---------------------------------------------------


def _writer_message(directory: Path) -> str:
    return (
        f"another CheckpointManager is saving to {directory} (it holds "
        f"{directory / '.modelshard-lock'}); two writers would overwrite each other's steps. "
        "Save from one manager, or give each its own directory."
    )


def test_two_managers_on_one_directory_serialise_or_fail_clearly(tmp_path):
    first = ms.CheckpointManager(tmp_path, async_save=False)
    second = ms.CheckpointManager(tmp_path, async_save=False)
    assert first.save(1, {"w": jnp.full(3, 1.0)})
    with pytest.raises(ms.CheckpointError) as e:
        second.save(2, {"w": jnp.full(3, 2.0)})
    assert str(e.value) == _writer_message(tmp_path)
    assert second.restore(1)["w"][0] == 1.0  # reading needs no lock
    first.close()
    assert second.save(2, {"w": jnp.full(3, 2.0)})  # the first one is gone: serialised
    with pytest.raises(ms.CheckpointError, match="another CheckpointManager is saving"):
        first.save(3, {"w": jnp.full(3, 3.0)})  # even a closed manager cannot write now
    second.close()
    with ms.CheckpointManager(tmp_path) as third:
        assert third.all_steps() == [1, 2]
        assert third.restore(2)["w"][0] == 2.0


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


# ---- no code execution, names stay names -------------------------------------------------


UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "joblib",
}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _unsafe(path: Path) -> list[str]:
    """Imports of unpickling modules, calls of eval/exec/compile/__import__ (bare or via
    ``builtins``), ``allow_pickle=``, and ``import_module`` of a non-literal name outside
    ``import_optional`` (whose callers must pass literals)."""
    import ast

    tree = ast.parse(path.read_text())
    exempt = {
        id(n)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name == "import_optional"
        for n in ast.walk(fn)
    }
    bad = []
    where = path.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            bad += [
                f"{where}:{node.lineno}: import {m}"
                for m in mods
                if m.split(".")[0] in UNSAFE_MODULES
            ]
        if not isinstance(node, ast.Call):
            continue
        f, literal = node.func, all(isinstance(a, ast.Constant) for a in node.args)
        if isinstance(f, ast.Name) and f.id in UNSAFE_BUILTINS:
            bad.append(f"{where}:{node.lineno}: {f.id}()")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if f.value.id == "builtins" and f.attr in UNSAFE_BUILTINS:
                bad.append(f"{where}:{node.lineno}: builtins.{f.attr}()")
            if f.attr == "import_module" and not literal and id(node) not in exempt:
                bad.append(f"{where}:{node.lineno}: import_module of a computed name")
        if isinstance(f, ast.Name) and f.id == "import_optional" and not literal:
            bad.append(f"{where}:{node.lineno}: import_optional of a computed name")
        bad += [
            f"{where}:{node.lineno}: allow_pickle" for k in node.keywords if k.arg == "allow_pickle"
        ]
    return sorted(set(bad))


def test_no_pickle_eval_or_exec_anywhere_in_the_package(tmp_path):
    """Restoring reads JSON and array bytes only: nothing in modelshard can run code that a
    checkpoint carries."""
    files = sorted(Path(ms.__file__).parent.rglob("*.py"))
    assert len(files) > 10
    assert [bad for f in files for bad in _unsafe(f)] == []
    # the scan does find what it looks for
    (tmp_path / "evil.py").write_text(
        "import pickle\nimport builtins\ndef f(x):\n    eval(x)\n    builtins.exec(x)\n"
        "    importlib.import_module(x)\n    np.load(x, allow_pickle=True)\n"
    )
    assert _unsafe(tmp_path / "evil.py") == [
        "evil.py:1: import pickle",
        "evil.py:4: eval()",
        "evil.py:5: builtins.exec()",
        "evil.py:6: import_module of a computed name",
        "evil.py:7: allow_pickle",
    ]


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


def test_reshard_keeps_bitcast_and_zero_size_leaves_bit_exact(tmp_path):
    from modelshard._checkpoint.resharding import reshard

    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = {
        "f8": jnp.asarray(values("float8_e4m3", (8, 4))),
        "u4": jnp.asarray(values("uint4", (8, 4))),
        "empty": jnp.zeros((0, 8), jnp.bfloat16),
        "key": jax.random.split(jax.random.key(2), 8),
        "w": jnp.arange(32.0).reshape(8, 4),
    }
    ms.save(tmp_path / "src", state)
    reshard(tmp_path / "src", tmp_path / "dst", mesh=mesh, specs=P("model"), chunk_bytes=1)
    out = ms.restore(tmp_path / "dst")
    assert_bit_exact(state, out)
    assert out["f8"].sharding.spec == P("model")


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
