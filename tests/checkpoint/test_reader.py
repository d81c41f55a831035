"""Every stored array read one way (``_checkpoint/reader.py``): the spec Orbax would open,
Orbax never imported for a local checkpoint, each array handed over as its reads are in,
no more bytes in flight than the cap, each shard read once into the buffer its device
keeps, plain Orbax's layouts read alike; damage an error naming the leaf and the file.
Every dtype on disk and back bit for bit (with the record's ``stored_as``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DAMAGED_HINT, DTYPES, assert_bit_exact, row_layers, values
from modelshard._checkpoint import checksum as cs
from modelshard._checkpoint import ocdbt, reader
from modelshard._checkpoint.sources import locate

SCRIPTS = Path(__file__).parent / "ckpt_scripts"


KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


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


def test_64_bit_dtypes_round_trip_under_x64_in_a_subprocess(zygote):
    """float64, int64, uint64, complex128 need ``jax_enable_x64``, which is process-wide: a
    child forked from the zygote turns it on before it first uses JAX."""
    assert zygote.x64(timeout_s=120) == (
        "X64 OK ['complex128', 'float64', 'float64', 'int64', 'int64', 'uint64', 'uint64']"
    )


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


# ---- the one reader: specs, reads in flight, placement --------------------------------------


def _equal(out, state):
    for name, leaf in state.items():
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(leaf["w"]))


def _abstract(state):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def _orbax_reads(monkeypatch):
    """A list that grows by one for each shard Orbax's own read path reads, or restore."""
    from orbax.checkpoint._src.serialization import serialization

    calls = []
    real = serialization._read_shard

    async def spy(*args, **kwargs):
        calls.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(serialization, "_read_shard", spy)
    restore = ocp.Checkpointer.restore
    monkeypatch.setattr(
        ocp.Checkpointer, "restore", lambda *a, **k: calls.append(1) or restore(*a, **k)
    )
    return calls


def test_the_spec_is_the_one_orbax_reads_with(tmp_path, mesh8):
    from modelshard._internals import ArrayReadSpec

    path = ms.save(tmp_path / "c", row_layers(mesh8, n=1))
    source = locate(path)
    orbax = ArrayReadSpec(str(source.tree_dir), "layer0.w", False, use_ocdbt=True)
    assert ocdbt.read_spec(str(source.tree_dir), "layer0.w") == orbax.json
    assert reader.array_spec(source, "layer0.w") == orbax.json


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
    w_sharded = ms.shard(w, ms.fsdp("data"), mesh)
    ms.save({str(tmp_path / "c")!r}, {{"w": w_sharded, "b": np.ones(3, np.float32)}})
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
    state = row_layers(mesh8, n=8)
    ms.save(tmp_path / "c", state)
    shard = 64 * 8 * 4 // 8
    monkeypatch.setattr(reader, "RESTORE_CONCURRENT_BYTES", 3 * shard + 1)
    started, handed = [0], []
    start, add = reader.start_read, cs.Checksums.add

    def start_spy(view, **kw):
        started[0] += 1
        return start(view, **kw)

    def add_spy(self, key, x, host=None):
        handed.append((key, started[0]))
        return add(self, key, x, host)

    monkeypatch.setattr(reader, "start_read", start_spy)
    monkeypatch.setattr(cs.Checksums, "add", add_spy)
    _equal(ms.restore(tmp_path / "c", like=state), state)
    assert [k for k, _ in handed] == [f"layer{i}/w" for i in range(8)]  # in order
    assert handed[0][1] < 8 * 8  # the first handed over before the last read started
    assert started[0] == 8 * 8  # each shard read once


def test_each_array_is_handed_over_before_the_read_returns(tmp_path, mesh8):
    state = row_layers(mesh8)
    ms.save(tmp_path / "c", state)
    source = locate(tmp_path / "c")
    targets = {f"layer{i}/w": _abstract(state)[f"layer{i}"]["w"] for i in range(6)}
    seen = {}
    out = reader.read_checked(source, targets, lambda p, x, host: seen.setdefault(p, x))
    assert list(seen) == list(targets)
    for p, x in out.items():
        assert seen[p] is x
        np.testing.assert_array_equal(np.asarray(x), np.asarray(state[p.split("/")[0]]["w"]))


@pytest.mark.parametrize("saved_cols, wanted", [(8, P("data")), (32, P(None, "model"))])
def test_bytes_in_flight_stay_under_the_cap(tmp_path, saved_cols, wanted, monkeypatch):
    """The buffers being read never reach the cap, yet several arrays are read at once;
    each array (its reads under the cap) is reserved whole, its reads started together and
    placed together, on a relayout (column blocks of row-chunked data) as on the saved one."""
    mesh8 = ms.make_mesh({"data": 8})
    state = row_layers(mesh8, n=8, cols=saved_cols)
    ms.save(tmp_path / "c", state)
    target = NamedSharding(ms.make_mesh({"data": 2, "model": 4}), wanted)
    one = jax.ShapeDtypeStruct((64, saved_cols), jnp.float32, sharding=target)
    distinct = len(reader.shard_boxes(target, one.shape))
    array_bytes = (
        64 * saved_cols * 4 * distinct // len(set(target.devices_indices_map(one.shape).values()))
    )
    cap = 3 * array_bytes
    monkeypatch.setattr(reader, "RESTORE_CONCURRENT_BYTES", cap)
    live, peak, batches = [0], [0], []
    start, place = reader.start_read, reader.place_boxes

    def start_spy(view, **kw):
        live[0] += int(np.prod(view.shape)) * 4
        peak[0] = max(peak[0], live[0])
        return start(view, **kw)

    def place_spy(bufs, devices, sharding):
        live[0] -= sum(b.nbytes for b in bufs)
        batches.append(len(bufs))
        return place(bufs, devices, sharding)

    monkeypatch.setattr(reader, "start_read", start_spy)
    monkeypatch.setattr(reader, "place_boxes", place_spy)
    _equal(ms.restore(tmp_path / "c", like={k: {"w": one} for k in state}), state)
    assert batches == [distinct] * 8  # each array's shards read and placed together
    assert live[0] == 0 and 2 * array_bytes <= peak[0] < cap  # two arrays at once, no more


def test_a_read_larger_than_the_cap_runs_alone(tmp_path, mesh8, monkeypatch):
    state = row_layers(mesh8, n=3, cols=32)
    ms.save(tmp_path / "c", state)
    shard = 64 * 32 * 4 // 8
    monkeypatch.setattr(reader, "RESTORE_CONCURRENT_BYTES", shard // 2)
    live, peak = [0], [0]
    start, place = reader.start_read, reader.place_boxes

    def start_spy(view, **kw):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return start(view, **kw)

    def place_spy(bufs, devices, sharding):
        live[0] -= len(bufs)
        return place(bufs, devices, sharding)

    monkeypatch.setattr(reader, "start_read", start_spy)
    monkeypatch.setattr(reader, "place_boxes", place_spy)
    _equal(ms.restore(tmp_path / "c", like=state), state)
    assert peak[0] == 1 and live[0] == 0


def test_a_restore_reads_each_shard_into_the_buffer_its_device_keeps(tmp_path, mesh24, monkeypatch):
    """Every distinct shard is read once, into a host buffer aligned so that a CPU device
    adopts it instead of copying it again; a shard held by two devices (replicas over
    ``data``) is copied for the second one, so that no two device buffers share memory
    and a donated replica is overwritten alone."""
    cols = NamedSharding(mesh24, P(None, "model"))
    state = {
        f"layer{i}": {"w": jax.device_put(jnp.arange(64 * 32.0).reshape(64, 32) - i, cols)}
        for i in range(3)
    }
    ms.save(tmp_path / "c", state)
    started = []
    start = reader.start_read
    monkeypatch.setattr(reader, "start_read", lambda v, **kw: started.append(1) or start(v, **kw))
    out = ms.restore(tmp_path / "c", like=_abstract(state))
    assert len(started) == 3 * 4  # each leaf's four column blocks, once
    for name, leaf in state.items():
        x = out[name]["w"]
        assert x.sharding == cols
        np.testing.assert_array_equal(np.asarray(x), np.asarray(leaf["w"]))
        pointers = [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
        assert len(set(pointers)) == len(pointers) == 8  # replicas do not share buffers
        if jax.default_backend() == "cpu":
            assert all(p % reader.HOST_ALIGN == 0 for p in pointers)
    x = out["layer0"]["w"]
    twice = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    np.testing.assert_array_equal(np.asarray(twice), 2 * np.asarray(state["layer0"]["w"]))
    np.testing.assert_array_equal(np.asarray(out["layer1"]["w"]), np.asarray(state["layer1"]["w"]))


@pytest.mark.parametrize("use_ocdbt", [False, True])
def test_plain_orbax_checkpoints_are_read_by_the_same_reader(
    tmp_path, mesh8, monkeypatch, use_ocdbt
):
    """A checkpoint Orbax wrote, in OCDBT or outside it, is read through the spec Orbax's
    read path opens, by the same reader: Orbax's restore never runs."""
    from modelshard._internals import ArrayReadSpec

    state = row_layers(mesh8, n=3)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "c", args=ocp.args.PyTreeSave(state))
    source = locate(tmp_path / "c")
    want = ArrayReadSpec(str(source.tree_dir), "layer0.w", False, use_ocdbt=use_ocdbt).json
    assert reader.array_spec(source, "layer0.w") == want
    orbax_reads = _orbax_reads(monkeypatch)
    _equal(ms.restore(tmp_path / "c", like=_abstract(state)), state)
    assert orbax_reads == []


def test_damaged_tree_metadata_is_an_error_though_the_read_needs_none(tmp_path, mesh8):
    path = ms.save(tmp_path / "c", row_layers(mesh8, n=2))
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


def test_a_failing_checksum_is_raised_after_the_read_not_as_a_read_error(
    tmp_path, mesh8, monkeypatch
):
    state = row_layers(mesh8, n=2)
    ms.save(tmp_path / "c", state)

    def broken(*args):
        raise RuntimeError("checksum program failed")

    monkeypatch.setattr(cs, "box_sums", broken)
    with pytest.raises(RuntimeError, match=r"^checksum program failed$"):
        ms.restore(tmp_path / "c", like=state)


def test_array_reader_boxes_are_adopted_by_a_cpu_device_without_a_copy(tmp_path):
    mesh = ms.make_mesh({"data": 8})
    w = jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48)
    b = jnp.arange(40, dtype=jnp.bfloat16).reshape(8, 5)
    ms.save(tmp_path / "ck", ms.shard({"w": w, "b": b}, P("data"), mesh))
    source = locate(tmp_path / "ck")
    device = jax.local_devices()[0]
    cases = {
        "w": (w, [(slice(3, 17), slice(5, 41)), (slice(0, 64), slice(0, 48))]),
        "b": (b, [(slice(1, 7), slice(2, 5)), (slice(0, 8), slice(0, 5))]),
    }
    for path, (want, boxes) in cases.items():
        read = reader.ArrayReader(source, source.record.by_path()[path])
        for box in boxes:
            got = read(box)
            assert got.ctypes.data % reader.HOST_ALIGN == 0
            np.testing.assert_array_equal(got, np.asarray(want)[box])
            on_device = jax.device_put(got, device)
            assert on_device.unsafe_buffer_pointer() == got.ctypes.data


def test_object_storage_is_read_through_the_same_specs(bucket_root, mesh8, monkeypatch):
    """A checkpoint on ``gs://`` or ``s3://`` is read with ``ocdbt.read_spec`` over the
    bucket's kvstore, as a local one is: Orbax's spec builder is never asked."""
    from modelshard import _internals

    state = row_layers(mesh8, n=2)
    ms.save(f"{bucket_root}/c", state)

    def refused(*args, **kwargs):
        raise AssertionError("Orbax's ArrayReadSpec built a spec")

    monkeypatch.setattr(_internals, "ArrayReadSpec", refused)
    _equal(ms.restore(f"{bucket_root}/c", like=_abstract(state)), state)
    source = locate(f"{bucket_root}/c")
    spec = reader.array_spec(source, "layer0.w")
    assert spec["kvstore"]["base"]["driver"] in ("gcs", "s3")


def test_a_long_read_failure_is_cut_between_words():
    """TensorStore's text of one failure is shown up to 300 characters, cut between words."""
    text = reader.read_failure(ValueError("DATA_LOSS: chunk " + "damaged " * 60))
    assert text.startswith("ValueError: DATA_LOSS: chunk damaged damaged")
    assert text.endswith(" damaged …") and len(text) <= len("ValueError: ") + 300


def test_a_large_read_buffer_is_resident_before_it_is_filled():
    """A fresh read buffer of 64 MiB that a CPU device adopts is faulted in as it is made, not
    a page at a time by TensorStore's threads as they fill it (resident pages)."""
    import resource

    if not reader.populate(np.empty(4 << 20, np.uint8)):
        pytest.skip("this system cannot fault pages in ahead (MADV_POPULATE_WRITE)")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    before = resident()
    buf = reader.aligned_empty((64 << 20,), np.uint8, adopted=True)
    assert resident() - before >= 60 << 20
    before = resident()  # a staging buffer (an accelerator's restore) or a small one: not
    staging = reader.aligned_empty((64 << 20,), np.uint8)
    small = reader.aligned_empty((reader.POPULATED_BYTES // 2,), np.uint8, adopted=True)
    assert resident() - before < reader.POPULATED_BYTES // 2
    del buf, staging, small
