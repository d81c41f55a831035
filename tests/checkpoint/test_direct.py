"""A local modelshard checkpoint is restored straight from TensorStore, without Orbax: the
spec Orbax would open, each array handed over as its reads are in, no more bytes in flight
than the cap, the checkpoint's damage still an error naming the leaf."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DAMAGED_HINT
from modelshard._checkpoint import checksum as cs
from modelshard._checkpoint import direct, ocdbt, read
from modelshard._checkpoint.chunks import shares_chunks
from modelshard._checkpoint.sources import locate


def _state(mesh, n=6, cols=8):
    rows = NamedSharding(mesh, P("data"))
    return {
        f"layer{i}": {
            "w": jax.device_put(
                jnp.arange(64 * cols, dtype=jnp.float32).reshape(64, cols) + i, rows
            )
        }
        for i in range(n)
    }


def _equal(out, state):
    for name, leaf in state.items():
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(leaf["w"]))


def test_the_spec_is_the_one_orbax_reads_with(tmp_path, mesh8):
    from modelshard._internals import ArrayReadSpec

    path = ms.save(tmp_path / "c", _state(mesh8, n=1))
    source = locate(path)
    assert direct.readable(source)
    orbax = ArrayReadSpec(str(source.tree_dir), "layer0.w", False, use_ocdbt=True)
    assert ocdbt.read_spec(str(source.tree_dir), "layer0.w") == orbax.json


def test_a_fresh_process_restores_without_importing_orbax(tmp_path):
    script = f"""
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
import modelshard as ms
mesh = ms.make_mesh({{"data": 8}})
w = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
if sys.argv[1] == "save":
    ms.save({str(tmp_path / "c")!r}, {{"w": ms.shard(w, ms.fsdp("data"), mesh), "b": np.ones(3, np.float32)}})
else:
    out = ms.restore({str(tmp_path / "c")!r}, specs=ms.fsdp("data"), mesh=mesh)
    assert np.array_equal(np.asarray(out["w"]), w) and "data" in out["w"].sharding.spec
    print(sorted(m for m in sys.modules if m.startswith("orbax")))
"""
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    for step in ("save", "restore"):
        done = subprocess.run(
            [sys.executable, "-c", script, step],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"  # the checksums verified, Orbax never imported


def test_each_array_is_handed_over_while_later_ones_are_read(tmp_path, mesh8, monkeypatch):
    """With room for three shards in flight, the first array's checksum starts before the
    last array's reads are started; every array's checksum is started."""
    state = _state(mesh8, n=8)
    ms.save(tmp_path / "c", state)
    shard = 64 * 8 * 4 // 8
    monkeypatch.setattr(read, "RESTORE_CONCURRENT_BYTES", 3 * shard + 1)
    monkeypatch.setattr(cs, "HOST_MAX_ELEMENTS", 0)  # every leaf reduced on the devices
    started, handed = [0], []
    start, add = direct.start_read, cs.Checksums.add

    def start_spy(view):
        started[0] += 1
        return start(view)

    def add_spy(self, key, x):
        handed.append((key, started[0]))
        return add(self, key, x)

    monkeypatch.setattr(direct, "start_read", start_spy)
    monkeypatch.setattr(cs.Checksums, "add", add_spy)
    _equal(ms.restore(tmp_path / "c", like=state), state)
    assert [k for k, _ in handed] == [f"layer{i}/w" for i in range(8)]  # in order
    assert handed[0][1] < 8 * 8  # the first handed over before the last read started
    assert started[0] == 8 * 8  # each shard read once


@pytest.mark.parametrize("saved_cols, wanted", [(8, P("data")), (32, P(None, "model"))])
def test_bytes_in_flight_stay_under_the_cap(tmp_path, saved_cols, wanted, monkeypatch):
    """Reads reserve what ``read.read_sizes`` counts (whole stored chunks: on a relayout, a
    column block of row-chunked data counts every row chunk, and the cap is scaled by that,
    ``read.read_cap``). The buffers being read never reach the cap, yet several arrays are
    read at once; each array (its reads under the cap) is reserved whole, its reads started
    together and placed together."""
    mesh8 = ms.make_mesh({"data": 8})
    state = _state(mesh8, n=8, cols=saved_cols)
    ms.save(tmp_path / "c", state)
    target = NamedSharding(ms.make_mesh({"data": 2, "model": 4}), wanted)
    one = jax.ShapeDtypeStruct((64, saved_cols), jnp.float32, sharding=target)
    like = {k: {"w": one} for k in state}
    chunk = locate(tmp_path / "c").write_shapes()[("layer0", "w")]
    monkeypatch.setattr(read, "RESTORE_CONCURRENT_BYTES", 3 * sum(read.read_sizes(one, chunk)))
    cap = read.read_cap([(one, chunk)])
    distinct = len(read.read_sizes(one, chunk))
    live, peak, batches = [0], [0], []
    start, place = direct.start_read, direct.place_boxes

    def start_spy(view):
        live[0] += int(np.prod(view.shape)) * 4
        peak[0] = max(peak[0], live[0])
        return start(view)

    def place_spy(bufs, devices, sharding):
        live[0] -= sum(b.nbytes for b in bufs)
        batches.append(len(bufs))
        return place(bufs, devices, sharding)

    monkeypatch.setattr(direct, "start_read", start_spy)
    monkeypatch.setattr(direct, "place_boxes", place_spy)
    _equal(ms.restore(tmp_path / "c", like=like), state)
    assert batches == [distinct] * 8  # each array's shards read and placed together
    array_bytes = 64 * saved_cols * 4 // (8 // distinct) // (8 // distinct) * (8 // distinct)
    assert live[0] == 0 and peak[0] < cap
    assert peak[0] >= 2 * min(array_bytes, 64 * saved_cols * 4)  # more than one array at once


def test_damaged_tree_metadata_is_an_error_though_the_read_needs_none(tmp_path, mesh8):
    path = ms.save(tmp_path / "c", _state(mesh8, n=2))
    meta = json.loads((path / "_METADATA").read_text())
    del meta["tree_metadata"][next(iter(meta["tree_metadata"]))]
    (path / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 1 leaf of {path} (damaged or incomplete checkpoint):"
    assert lines[1] == (
        f"  layer0/w: ValueError: {path / '_METADATA'} does not list the stored array layer0.w"
    )
    assert lines[2:] == [DAMAGED_HINT]


def test_a_stored_array_unlike_its_record_names_the_leaf(tmp_path, mesh8):
    path = ms.save(tmp_path / "c", {"w": jnp.ones((64, 8)), "v": jnp.ones((4, 8))})
    record = json.loads((path / "modelshard.json").read_text())
    (leaf,) = [x for x in record["leaves"] if x["path"] == "v"]
    leaf["shape"] = leaf["stored_shape"] = [5, 8]
    (path / "modelshard.json").write_text(json.dumps(record))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path, verify=False)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 1 leaf of {path} (damaged or incomplete checkpoint):"
    assert lines[1] == (
        "  v: ValueError: stored array v is float32[4, 8], the record says float32[5, 8]"
    )
    assert lines[2:] == [DAMAGED_HINT]


@pytest.mark.parametrize(
    "boxes, shape, chunk, shared",
    [
        ([((0, 128), (0, 64)), ((128, 256), (0, 64))], (256, 64), (128, 64), False),  # aligned
        ([((0, 128), (0, 64)), ((128, 256), (0, 64))], (256, 64), (256, 64), True),  # 2 a chunk
        ([((0, 256), (0, 32)), ((0, 256), (32, 64))], (256, 64), (64, 64), True),  # cols split
        ([((0, 100), (0, 64)), ((100, 200), (0, 64))], (200, 64), (100, 64), False),
        ([((0, 150), (0, 64)), ((150, 200), (0, 64))], (200, 64), (100, 64), True),
        ([((0, 200), (0, 64))], (200, 64), (128, 64), False),  # one box: the whole array
        ([((0, 128), (0, 64))], (256, 64), None, True),  # chunking unknown: cached
    ],
)
def test_chunks_are_cached_only_where_two_shards_share_one(boxes, shape, chunk, shared):
    assert shares_chunks(boxes, shape, chunk) == shared
