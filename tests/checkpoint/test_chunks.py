"""Stored chunks line up with halves and quarters of each dimension, so that a restore onto
another split reads each stored chunk once and no chunk it does not need."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._checkpoint.chunks import MIN_CHUNK_BYTES, aligned_chunks


@pytest.fixture
def mesh_2x4():
    return ms.make_mesh({"data": 2, "model": 4})


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _chunk_shapes(path) -> dict[str, list[int]]:
    meta = json.loads((path / "array_metadatas" / "process_0").read_text())
    return {
        m["array_metadata"]["param_name"]: m["array_metadata"]["chunk_shape"]
        for m in meta["array_metadatas"]
    }


@pytest.mark.parametrize(
    ("shape", "write", "itemsize", "chunk"),
    [
        # a 4 MiB column shard of four: quarters of both dimensions, 256 KiB each
        ((1024, 1024), (1024, 256), 4, (256, 256)),
        # written whole: quarters of both dimensions
        ((1024, 1024), (1024, 1024), 4, (256, 256)),
        # bfloat16: the rows' quarter would leave 128 KiB, so only halves there
        ((1024, 1024), (1024, 256), 2, (512, 256)),
        # small arrays stay one chunk per shard
        ((128, 128), (128, 32), 4, (128, 32)),
        ((8,), (8,), 4, (8,)),
        ((), (), 4, ()),
        # an odd dimension is never cut (a quarter shard already lines up); 6 only in halves
        ((3, 1 << 20), (3, 1 << 18), 4, (3, 1 << 18)),
        ((6, 1 << 18), (6, 1 << 18), 4, (3, 1 << 16)),
        # zero-size dimensions are stored as 1 (TensorStore's zarr needs it)
        ((0, 8), (0, 8), 4, (1, 8)),
    ],
)
def test_aligned_chunks_cuts_halves_then_quarters_above_the_floor(shape, write, itemsize, chunk):
    assert aligned_chunks(shape, write, itemsize) == chunk
    for d, (c, w) in enumerate(zip(chunk, write, strict=True)):
        assert max(1, w) % c == 0, f"dimension {d}: {c} does not tile the write {w}"
    if math.prod(chunk) != math.prod(max(1, w) for w in write):
        assert math.prod(chunk) * itemsize >= MIN_CHUNK_BYTES


def test_save_stores_aligned_chunks_that_plain_orbax_reads(tmp_path, mesh_2x4):
    cols = NamedSharding(mesh_2x4, P(None, "model"))
    w = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    state = {"w": jax.device_put(w, cols), "b": np.arange(8, dtype=np.float32)}
    path = ms.save(tmp_path / "ck", state)
    assert _chunk_shapes(path) == {"w": [256, 256], "b": [8]}
    with ocp.StandardCheckpointer() as ckptr:
        plain = ckptr.restore(path)
    np.testing.assert_array_equal(np.asarray(plain["w"]), w)
    rows = ms.restore(path, mesh=ms.make_mesh({"fsdp": 8}), specs=P("fsdp"))
    np.testing.assert_array_equal(np.asarray(rows["w"]), w)
    assert rows["w"].sharding.spec == P("fsdp")


def test_plain_orbax_saves_in_the_same_process_keep_their_chunks(tmp_path, mesh_2x4):
    cols = NamedSharding(mesh_2x4, P(None, "model"))
    w = jax.device_put(np.ones((1024, 1024), np.float32), cols)
    ms.save(tmp_path / "ours", {"w": w})
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "plain", {"w": w})
    # Orbax's own choice: each column shard, halved by its replica-parallel write
    assert _chunk_shapes(tmp_path / "plain") == {"w": [512, 256]}


def test_a_restore_reads_a_chunk_two_devices_share_about_once(tmp_path, mesh_2x4):
    # 256-row chunks restored onto 128-row shards: two devices need each chunk. No chunk
    # cache is kept: the array's reads run together (it is reserved whole), and TensorStore
    # reads a chunk once for the reads in flight that want it. On a loaded machine one read
    # may end before the other starts, so the bound sits well under twice, not at once.
    cols = NamedSharding(mesh_2x4, P(None, "model"))
    state = {f"w{i}": jax.device_put(np.full((1024, 1024), i, np.float32), cols) for i in range(4)}
    ck = ms.save(tmp_path / "ck", state)
    mesh = ms.make_mesh({"fsdp": 8})
    ms.restore(ck, mesh=mesh, specs=P("fsdp"))  # imports and compiles out of the count
    before = _rchar()
    out = ms.restore(ck, mesh=mesh, specs=P("fsdp"))
    read = _rchar() - before
    stored = 4 * 1024 * 1024 * 4
    assert stored <= read <= 1.5 * stored, f"read {read / stored:.3f}x the stored bytes"
    assert all(np.all(np.asarray(out[f"w{i}"]) == i) for i in range(4))
