"""Restoring damaged checkpoints (``_checkpoint/read.py``): every file truncated, flipped or
deleted errors clearly or restores bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DAMAGED_HINT, assert_bit_exact, largest_data_file, truncate_file


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    if data:
        data[len(data) // 2] ^= 0x5A
    f.write_bytes(bytes(data))


DAMAGE = {"truncated": truncate_file, "flipped": _flip, "deleted": Path.unlink}


def test_every_file_damaged_every_way_errors_or_restores_bit_exact(tmp_path):
    """Each file of a checkpoint truncated, flipped or deleted: restore is bit-exact (the file
    was not needed) or a CheckpointError; nothing else escapes, no wrong value comes back."""

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
    truncate_file(largest_data_file(path))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 1 leaf of {path} (damaged or incomplete checkpoint):"
    assert lines[1].startswith("  big: ValueError: ")
    assert lines[2].startswith(f"    file: {path}")
    assert lines[3:] == [DAMAGED_HINT]
    assert "small" not in str(e.value)


def test_one_damaged_file_shared_by_many_leaves_is_one_entry(tmp_path):
    """OCDBT keeps several arrays' metadata in one file: deleting it fails every leaf with
    the same error, shown once with the leaves it names (the first eight, then a count), and
    without the TensorStore spec JSON TensorStore appends to it."""
    state = {f"w{i:02d}": jnp.full((4, 4), float(i)) for i in range(10)}
    path = ms.save(tmp_path / "c", state)
    (shared,) = sorted((path / "d").iterdir())
    shared.unlink()
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 10 leaves of {path} (damaged or incomplete checkpoint):"
    assert lines[1].startswith(
        "  w00, w01, w02, w03, w04, w05, w06, w07 and 2 more: ValueError: NOT_FOUND: "
    )
    assert lines[3] == DAMAGED_HINT
    assert "tensorstore_spec" not in str(e.value) and len(lines) == 4
    assert lines[2] == f"    file: {shared}"


def test_deleted_process_shard_directory(tmp_path):

    path = ms.save(tmp_path / "c", {"w": jnp.arange(4096.0), "v": jnp.ones(3)})
    shutil.rmtree(next(path.glob("ocdbt.process_*")))
    try:
        out = ms.restore(path)
    except ms.CheckpointError as e:
        assert "\n  w: " in str(e) or "\n  v: " in str(e)
    else:  # the root manifest may hold everything this small checkpoint needs
        np.testing.assert_array_equal(out["w"], np.arange(4096.0))


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_a_restore_without_a_mesh_rebuilds_the_saved_one_with_its_axis_types(tmp_path, axis_types):
    mesh = ms.make_mesh({"data": 2, "model": 4}, axis_types=axis_types)
    w = ms.shard(jnp.arange(64.0).reshape(8, 8), P("data", "model"), mesh)
    out = ms.restore(ms.save(tmp_path / "c", {"w": w}))
    assert out["w"].sharding.spec == P("data", "model")
    assert out["w"].sharding.mesh.axis_types == mesh.axis_types
