"""``reshard`` and the streaming writer under it (``_checkpoint/stream.py``).

Every result is read back twice, by ``ms.restore`` (checksums verified) and by raw Orbax,
and compared bit for bit with the source. Leaves larger than the chunk are copied in slabs
of rows (the reads are spied on); damage is reported per leaf and never published.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DAMAGED_HINT, array_bits, flip_byte, largest_data_file, launch_argv
from modelshard._checkpoint import locate
from modelshard._checkpoint.resharding import reshard
from modelshard._checkpoint.slabs import StreamLeaf
from modelshard._checkpoint.stream import write_stream

reshard_module = importlib.import_module("modelshard._checkpoint.resharding")


def _same_bits(want: dict[str, Any], got: dict[str, Any]) -> None:
    assert sorted(want) == sorted(got)
    bad = [k for k in want if array_bits(want[k]) != array_bits(got[k])]
    assert not bad, f"not bit-exact: {bad}"


def _raw_orbax(path: Path, mesh: Any) -> dict[str, Any]:
    """Raw Orbax's restore of a checkpoint's stored arrays onto ``mesh`` (each with the
    sharding its record gives), without modelshard; by canonical path."""
    leaves = [leaf for leaf in locate(path).record.leaves if np.prod(leaf.stored_shape)]
    target: dict[str, Any] = {}
    for leaf in leaves:
        node = target
        for k in leaf.key[:-1]:
            node = node.setdefault(k, {})
        node[leaf.key[-1]] = jax.ShapeDtypeStruct(
            leaf.stored_shape,
            jnp.dtype(leaf.stored_dtype),
            sharding=leaf.stored_sharding(NamedSharding(mesh, leaf.spec or P())),
        )
    with ocp.StandardCheckpointer() as ckptr:
        out = ckptr.restore(str(path), target)
    flat = {}
    for leaf in leaves:
        node = out
        for k in leaf.key:
            node = node[k]
        flat[leaf.path] = node
    return flat


def _spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[slice, ...]]]:
    reads: list[tuple[str, tuple[slice, ...]]] = []
    real = reshard_module.ArrayReader.__call__

    def spy(self: Any, box: tuple[slice, ...]) -> Any:
        reads.append((self.rec.path, box))
        return real(self, box)

    monkeypatch.setattr(reshard_module.ArrayReader, "__call__", spy)
    return reads


def _starts(box: tuple[slice, ...]) -> list[int | None]:
    return [b.start for b in box]


# ---- slabs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("saved", "blocks", "chunk"),
    [
        # stored in 8 row blocks of one chunk each: read block by block
        (P("data"), [(slice(a, a + 64), slice(0, 64)) for a in range(0, 512, 64)], [64, 16]),
        # in 8 column blocks: read block by block, along the second dimension
        (P(None, "data"), [(slice(0, 512), slice(a, a + 8)) for a in range(0, 64, 8)], [512, 8]),
        # one block of 8 chunks (saved from one device): cut into quarter chunks (16 rows)
        (None, [(slice(a, a + 16), slice(0, 64)) for a in range(0, 512, 16)], [16, 16]),
    ],
)
def test_a_leaf_8x_larger_than_the_chunk_is_read_and_written_in_slabs(
    tmp_path, monkeypatch, saved, blocks, chunk
):
    mesh8 = ms.make_mesh({"data": 8})
    big = np.random.default_rng(0).normal(size=(512, 64)).astype(np.float32)  # 128 KiB
    x = jnp.asarray(big) if saved is None else ms.shard(jnp.asarray(big), saved, mesh8)
    state = {"big": x, "b": jnp.arange(8.0)}
    src = ms.save(tmp_path / "src", state)
    reads = _spy_reads(monkeypatch)
    mesh = ms.make_mesh({"data": 2, "model": 4})
    specs = ms.Rules([("big", P(None, "model")), ("b", P())])
    reshard(src, tmp_path / "dst", specs=specs, mesh=mesh, chunk_bytes=16 << 10)
    # each block read once (two reader threads: the order two reads start in may swap)
    assert sorted([box for p, box in reads if p == "big"], key=_starts) == blocks
    meta = json.loads((tmp_path / "dst" / "_METADATA").read_text())["tree_metadata"]
    assert meta["('big',)"]["value_metadata"]["write_shape"] == chunk  # tiles slabs and shards
    before = {leaf.path: leaf.checksum for leaf in locate(src).record.leaves}
    assert {leaf.path: leaf.checksum for leaf in locate(tmp_path / "dst").record.leaves} == before
    out = ms.restore(tmp_path / "dst")  # verified against the record
    assert out["big"].sharding.spec == P(None, "model")
    _same_bits({"big": big, "b": np.arange(8.0, dtype=np.float32)}, out)
    _same_bits(out, _raw_orbax(tmp_path / "dst", mesh))


def test_array_reader_reads_boxes_of_a_stored_array_without_devices(tmp_path):
    from modelshard._checkpoint.checksum import box_sums, format_sums
    from modelshard._checkpoint.reader import ArrayReader

    w = np.random.default_rng(6).normal(size=(32, 24)).astype(np.float32)
    src = ms.save(
        tmp_path / "src", {"w": ms.shard(jnp.asarray(w), P("data"), ms.make_mesh({"data": 8}))}
    )
    source = locate(src)
    rec = source.record.leaves[0]
    read = ArrayReader(source, rec)
    boxes = [
        (slice(0, 20), slice(0, 24)),
        (slice(20, 32), slice(0, 10)),
        (slice(20, 32), slice(10, 24)),
    ]
    parts = [read(box) for box in boxes]
    for box, part in zip(boxes, parts, strict=True):
        np.testing.assert_array_equal(part, w[box])
    each = [
        np.asarray(box_sums(jnp.asarray(p), [b.start for b in box], w.shape), np.uint64)
        for box, p in zip(boxes, parts, strict=True)
    ]
    sums = np.sum(each, axis=0)
    assert format_sums(int(sums[0]), int(sums[1])) == rec.checksum  # boxes add up to the leaf
    (src / "d").rename(src / "gone")  # after locate, which names a file lost before it
    with pytest.raises(ms.CheckpointError) as e:
        ArrayReader(source, rec)(boxes[0])
    assert str(e.value).startswith(
        f"cannot read 1 leaf of {src} (damaged or incomplete checkpoint):\n  w: "
    )


# ---- dtypes: casts, PRNG keys, bit-stored dtypes -------------------------------------


def _every_kind_state() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    f = rng.normal(size=(16, 8)).astype(np.float32)
    f[0, :6] = [np.nan, np.inf, -np.inf, -0.0, 1e-40, 3.4e38]  # specials, a denormal
    return {
        "f32": jnp.asarray(f),
        "bf16": jnp.asarray(rng.normal(size=(8, 4)), jnp.bfloat16),
        "f8": jnp.asarray(rng.normal(size=(8, 4)).astype(ml_dtypes.float8_e4m3)),
        "u4": jnp.asarray(rng.integers(0, 16, size=(8, 4)).astype(ml_dtypes.uint4)),
        "i32": jnp.asarray(rng.integers(-9, 9, size=(8,)), jnp.int32),
        "step": jnp.asarray(7),
        "key": jax.random.split(jax.random.key(3), 8),
        "empty": jnp.zeros((0, 4), jnp.float32),
    }


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16, jnp.float32])
def test_every_dtype_is_bit_exact_with_restore_and_raw_orbax(tmp_path, dtype):
    state = _every_kind_state()
    src = ms.save(tmp_path / "src", state)
    mesh = ms.make_mesh({"data": 2, "model": 4})
    specs = ms.Rules([("step|empty", P()), (".*", P("model"))])
    dst = reshard(src, tmp_path / "dst", specs=specs, mesh=mesh, dtype=dtype, chunk_bytes=64)
    out = ms.restore(dst)
    _same_bits(ms.restore(src, dtype=dtype), out)  # casts as restore(dtype=) casts
    assert out["key"].dtype == state["key"].dtype and out["step"].dtype == jnp.int32
    assert out["f8"].sharding.spec == P("model")
    raw = _raw_orbax(dst, mesh)
    _same_bits({k: v for k, v in raw.items()}, {k: _stored(out[k]) for k in raw})


def _stored(x: Any) -> Any:
    """A leaf as it is stored: key data, dtypes TensorStore cannot name as their bits."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    stored_as = {"float8_e4m3": jnp.uint8, "uint4": jnp.int4}
    to = stored_as.get(x.dtype.name)
    return x if to is None else jax.lax.bitcast_convert_type(x, to)


# ---- the public function and the command -------------------------------------------


def test_public_reshard_lays_a_checkpoint_out_for_a_new_mesh_and_casts(tmp_path):
    state = {"w": jnp.arange(64.0).reshape(16, 4), "step": jnp.asarray(3), "k": jax.random.key(0)}
    src = ms.save(tmp_path / "src", state)
    mesh = ms.make_mesh({"data": 2, "model": 4})
    rules = ms.Rules([("w", P("model", "data"))])
    dst = ms.reshard(src, tmp_path / "dst", specs=rules, mesh=mesh, dtype=jnp.bfloat16)
    assert dst == tmp_path / "dst"
    out = ms.restore(dst, mesh=mesh)  # the saved specs of dst are the new ones
    assert out["w"].sharding.spec == P("model", "data")
    assert out["w"].dtype == jnp.bfloat16 and out["step"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.arange(64.0).reshape(16, 4))
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(state["k"]))
    with pytest.raises(ms.CheckpointError, match="already exists; pass overwrite=True"):
        ms.reshard(src, dst, mesh=mesh)


def test_public_reshard_of_a_manager_root_takes_its_latest_complete_step(tmp_path):
    with ms.CheckpointManager(tmp_path / "run", max_to_keep=3) as mngr:
        for step in (9, 10, 11):  # as numbers the latest is 11; as text it would be 9
            mngr.save(step, {"w": jnp.full((16, 4), float(step))})
    mesh = ms.make_mesh({"data": 8})
    dst = ms.reshard(tmp_path / "run", tmp_path / "dst", specs=P("data"), mesh=mesh)
    out = ms.restore(dst, mesh=mesh)
    np.testing.assert_array_equal(out["w"], np.full((16, 4), 11.0))
    assert out["w"].sharding.spec == P("data")


def test_the_cli_reshard_command_calls_the_public_function(tmp_path, monkeypatch, capsys):
    import importlib

    from modelshard.cli import main

    module = importlib.import_module("modelshard._checkpoint")  # the CLI calls the façade's
    calls = []
    real = module.reshard

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "reshard", spy)
    src = ms.save(tmp_path / "src", {"w": jnp.arange(8.0)})
    assert main(["reshard", str(src), str(tmp_path / "dst"), "--mesh", "data=8"]) == 0
    assert calls == [(str(src), str(tmp_path / "dst"))]
    assert ms.reshard is real
    assert "wrote " + str(tmp_path / "dst") in capsys.readouterr().out


# ---- damage and safety ---------------------------------------------------------------


def _hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_changed_checksums_name_every_leaf_and_nothing_is_published(tmp_path):
    state = {"a": jnp.arange(64.0).reshape(8, 8), "b": jnp.ones(4), "c": jnp.zeros(3)}
    src = ms.save(tmp_path / "src", state)
    old = ms.save(tmp_path / "dst", {"old": jnp.ones(2)})
    rec_file = src / "modelshard.json"
    rec = json.loads(rec_file.read_text())
    for leaf in rec["leaves"]:
        if leaf["path"] in ("a", "c"):
            leaf["checksum"] = "00000000:00000000"
    rec_file.write_text(json.dumps(rec))
    mesh = ms.make_mesh({"data": 8})
    with pytest.raises(ms.CheckpointError) as e:
        reshard(src, old, mesh=mesh, specs=P(), overwrite=True, chunk_bytes=64)
    lines = str(e.value).splitlines()
    assert lines[0] == (
        f"checksum mismatch in {src}: the stored bytes of 2 leaves changed since they were saved:"
    )
    assert lines[1].startswith("  a float32[8, 8]: recorded 00000000:00000000, read ")
    assert lines[2].startswith("  c float32[3]: recorded 00000000:00000000, read ")
    assert lines[3] == (
        "hint: the checkpoint is damaged; restore an earlier one, or pass verify=False to copy "
        "it anyway (the copy keeps the recorded checksums: restoring it reports the damage)."
    )
    assert len(lines) == 4
    assert list(ms.restore(old)) == ["old"]  # the last good checkpoint is untouched
    assert _hidden(tmp_path) == []
    reshard(src, tmp_path / "unchecked", mesh=mesh, specs=P(), verify=False)
    np.testing.assert_array_equal(ms.restore(tmp_path / "unchecked", verify=False)["b"], np.ones(4))


def test_damaged_data_names_the_leaf(tmp_path):
    mesh8 = ms.make_mesh({"data": 8})
    big = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    src = ms.save(tmp_path / "src", {"big": ms.shard(jnp.asarray(big), P("data"), mesh8)})
    ms.save(tmp_path / "src2", {"small": jnp.arange(8.0)})
    files = sorted(glob.glob(str(src / "ocdbt.process_*" / "d" / "*")), key=os.path.getsize)
    data = bytearray(Path(files[-1]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(files[-1]).write_bytes(bytes(data))
    with pytest.raises(ms.CheckpointError) as e:
        reshard(src, tmp_path / "dst", mesh=mesh8, chunk_bytes=4096)
    msg = str(e.value)
    assert msg.startswith((f"cannot read 1 leaf of {src}", f"checksum mismatch in {src}"))
    assert "\n  big" in msg
    assert not (tmp_path / "dst").exists() and _hidden(tmp_path) == []


def test_every_leaf_that_cannot_be_read_is_named_and_nothing_is_published(tmp_path, monkeypatch):
    """A reshard goes on past a leaf it cannot read, so that its error names every such
    leaf, grouped by failure as a restore's is (no TensorStore spec), with what to do."""
    state = {f"w{i:02d}": jnp.full((4, 4), float(i)) for i in range(10)}
    src = ms.save(tmp_path / "src", state)
    (shared,) = sorted((src / "d").iterdir())  # OCDBT keeps every small array in one file
    real = reshard_module.locate

    def locate_then_lose(directory):  # lost once locate looked (it names a file lost before)
        source = real(directory)
        shared.unlink()
        return source

    monkeypatch.setattr(reshard_module, "locate", locate_then_lose)
    with pytest.raises(ms.CheckpointError) as e:
        reshard(src, tmp_path / "dst", mesh=ms.make_mesh({"data": 8}))
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 10 leaves of {src} (damaged or incomplete checkpoint):"
    assert lines[1].startswith(
        "  w00, w01, w02, w03, w04, w05, w06, w07 and 2 more: ValueError: NOT_FOUND: "
    )
    assert lines[2] == f"    file: {shared}"
    assert lines[3:] == [DAMAGED_HINT]
    assert "tensorstore_spec" not in str(e.value)
    assert not (tmp_path / "dst").exists() and _hidden(tmp_path) == []


def test_an_unverified_reshard_carries_the_source_checksums(tmp_path):
    """``verify=False`` copies damage unchecked, but each leaf no cast changes keeps the
    source's checksum: a restore of the copy still finds the damage. A cast leaf gets the
    checksum of what was read, damaged or not."""
    mesh8 = ms.make_mesh({"data": 8})
    big = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    state = {"big": ms.shard(jnp.asarray(big), P("data"), mesh8), "small": jnp.arange(8.0)}
    src = ms.save(tmp_path / "src", state)
    before = {leaf.path: leaf.checksum for leaf in locate(src).record.leaves}
    clean = reshard(src, tmp_path / "clean", mesh=mesh8, verify=False)
    assert {leaf.path: leaf.checksum for leaf in locate(clean).record.leaves} == before
    _same_bits({"big": big, "small": np.arange(8.0, dtype=np.float32)}, ms.restore(clean))
    flip_byte(largest_data_file(src))
    copy = reshard(src, tmp_path / "copy", mesh=mesh8, verify=False, chunk_bytes=4096)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(copy)
    assert str(e.value).startswith(f"checksum mismatch in {copy}")
    assert f"\n  big float32[256, 64]: recorded {before['big']}" in str(e.value)
    cast = reshard(src, tmp_path / "cast", mesh=mesh8, verify=False, dtype=jnp.bfloat16)
    assert ms.restore(cast)["big"].dtype == jnp.bfloat16  # verified: what was read, cast


def test_the_destination_rules_are_kept(tmp_path):
    src = ms.save(tmp_path / "src", {"w": jnp.arange(8.0)})
    mesh = ms.make_mesh({"data": 8})
    with pytest.raises(ms.CheckpointError, match="the destination is inside the source"):
        reshard(src, src / "inner", mesh=mesh)
    with pytest.raises(ms.CheckpointError) as e:
        reshard(src, src, mesh=mesh, overwrite=True)
    assert str(e.value).splitlines() == [
        f"cannot reshard {src} into itself: the destination is the source checkpoint; write "
        "to another path (and remove the source once the new one restores, if it should take "
        "its place)."
    ]
    np.testing.assert_array_equal(ms.restore(src)["w"], np.arange(8.0))  # as it was
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("keep")
    with pytest.raises(ms.CheckpointError, match="not a modelshard checkpoint"):
        reshard(src, tmp_path / "notes", mesh=mesh, overwrite=True)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "keep"


# ---- the streaming writer ------------------------------------------------------------


def test_write_stream_writes_a_checkpoint_from_row_readers(tmp_path):
    rng = np.random.default_rng(2)
    w = rng.normal(size=(64, 16)).astype(np.float32)
    e = rng.normal(size=(32, 8)).astype(ml_dtypes.bfloat16)
    key_data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 4)))
    calls: list[tuple[str, tuple[slice, ...]]] = []

    def reader(name: str, a: np.ndarray) -> Any:
        def read(box: tuple[slice, ...]) -> np.ndarray:
            calls.append((name, box))
            return a[box]

        return read

    mesh = ms.make_mesh({"data": 2, "model": 4})
    progress: list[tuple[int, int]] = []
    leaves = [
        StreamLeaf("layers/0/w", w.shape, w.dtype, reader("w", w), spec=P("data", "model")),
        StreamLeaf("embed", e.shape, "bfloat16", reader("e", e), spec=P("model")),
        StreamLeaf(
            "rng", key_data.shape, np.uint32, reader("k", key_data), key_impl="threefry2x32"
        ),
        StreamLeaf("scale", (), np.float32, lambda box: np.float32(2.5)),
    ]
    record = write_stream(
        tmp_path / "ck",
        leaves,
        mesh=mesh,
        metadata={"from": "test"},
        slab_bytes=1024,
        progress=lambda done, total: progress.append((done, total)),
    )
    assert [box for name, box in calls if name == "w"] == [
        (slice(a, a + 16), slice(0, 16)) for a in range(0, 64, 16)
    ]
    assert progress[-1] == (w.nbytes + e.nbytes + key_data.nbytes + 4,) * 2
    out = ms.restore(tmp_path / "ck")  # checksums verified
    assert out["layers"]["0"]["w"].sharding.spec == P("data", "model")
    _same_bits(
        {"w": w, "embed": e, "scale": np.float32(2.5)},
        {"w": out["layers"]["0"]["w"], "embed": out["embed"], "scale": out["scale"]},
    )
    np.testing.assert_array_equal(jax.random.key_data(out["rng"]), key_data)
    assert locate(tmp_path / "ck").record.metadata == {"from": "test"}
    assert [leaf.dtype for leaf in record.leaves] == ["float32", "bfloat16", "key<fry>", "float32"]
    raw = _raw_orbax(tmp_path / "ck", mesh)
    np.testing.assert_array_equal(raw["layers/0/w"], w)


def test_write_stream_names_a_reader_that_returns_the_wrong_rows(tmp_path):
    mesh = ms.make_mesh({"data": 8})
    leaf = StreamLeaf("w", (8, 4), np.float32, lambda box: np.zeros((3, 4), np.float32))
    with pytest.raises(ms.CheckpointError) as e:
        write_stream(tmp_path / "ck", [leaf], mesh=mesh)
    assert str(e.value) == (
        "leaf 'w': the box [0:8, 0:4] was read as float32[3, 4], not float32[8, 4]."
    )
    assert not (tmp_path / "ck").exists() and _hidden(tmp_path) == []


def test_write_stream_refuses_leaves_that_share_a_stored_name(tmp_path):
    mesh = ms.make_mesh({"data": 8})
    read = lambda box: np.zeros((4,), np.float32)  # noqa: E731
    leaves = [StreamLeaf("a.b", (4,), np.float32, read), StreamLeaf("a/b", (4,), np.float32, read)]
    with pytest.raises(ms.CheckpointError, match=r"are all stored as 'a\.b'"):
        write_stream(tmp_path / "ck", leaves, mesh=mesh)


# ---- several processes ---------------------------------------------------------------

SCRIPT = Path(__file__).parents[1] / "mp_scripts" / "reshard.py"


def _arrays_in(store: Path) -> set[str]:
    """The arrays one process's OCDBT store holds (their ``.zarray`` keys)."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{store}/"}).result()
    return {k.decode().rsplit("/", 1)[0] for k in kv.list().result() if k.endswith(b".zarray")}


RULES_TOML = """
[[rules]]
pattern = "^key$"
spec = []

[[rules]]
pattern = ".*"
spec = ["data", "model"]
"""


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux")
@pytest.mark.parametrize("how", ["function", "command"])
def test_under_launch_each_process_writes_its_share_with_the_same_result(tmp_path, how):
    rng = np.random.default_rng(4)
    state = {f"l{i}": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32) for i in range(6)}
    state["key"] = jax.random.split(jax.random.key(1), 4)
    src = ms.save(tmp_path / "src", state)
    mesh = ms.make_mesh({"data": 2, "model": 4})
    specs = ms.Rules([("^key$", P()), (".*", P("data", "model"))])  # as the script's, the file's
    alone = reshard(src, tmp_path / "alone", specs=specs, mesh=mesh)
    if how == "function":
        cmd = launch_argv(sys.executable, str(SCRIPT), str(src), str(tmp_path / "two"))
    else:
        (tmp_path / "rules.toml").write_text(RULES_TOML)
        exe = str(Path(sys.executable).parent / "modelshard")
        cmd = launch_argv(
            exe, "reshard", str(src), str(tmp_path / "two"), "--mesh", "data=2,model=4",
            "--rules", str(tmp_path / "rules.toml"), "--json",
        )  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    if how == "command":  # one report, from process 0
        assert run.stdout.count('"destination"') == 1, run.stdout
    two = tmp_path / "two"
    assert sorted(p.name for p in two.glob("ocdbt.process_*")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    arrays = [_arrays_in(two / f"ocdbt.process_{i}") for i in range(2)]
    assert arrays[0] and arrays[1] and not arrays[0] & arrays[1]  # each wrote a share
    assert arrays[0] | arrays[1] == {leaf.path for leaf in locate(src).record.leaves}
    same = {leaf.path: leaf.checksum for leaf in locate(two).record.leaves}
    assert same == {leaf.path: leaf.checksum for leaf in locate(alone).record.leaves}
    _same_bits(ms.restore(alone), ms.restore(two))
    _same_bits(_raw_orbax(alone, mesh), _raw_orbax(two, mesh))


# ---- object storage ------------------------------------------------------------------


def test_reshard_to_and_from_object_storage_commits_last(tmp_path, bucket_root):
    rng = np.random.default_rng(5)
    state = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), "k": jax.random.key(2)}
    src = ms.save(tmp_path / "src", state)
    mesh = ms.make_mesh({"data": 2, "model": 4})
    url = f"{bucket_root}/resharded"
    specs = ms.Rules([("w", P("model", "data")), ("k", P())])
    reshard(src, url, specs=specs, mesh=mesh, chunk_bytes=4096)
    assert locate(url).record.leaves[0].checksum == locate(src).record.leaves[0].checksum
    out = ms.restore(url)  # locate checks the commit file; checksums verified
    assert out["w"].sharding.spec == P("model", "data")
    _same_bits(ms.restore(src), out)
    with pytest.raises(ms.CheckpointError, match="already exists; pass overwrite=True"):
        reshard(src, url, specs=specs, mesh=mesh)
    again = reshard(src, url, specs=specs, mesh=mesh, overwrite=True)
    assert str(again) == url  # the URL itself, not a local path made of it
    back = reshard(url, tmp_path / "back", mesh=mesh)  # and from object storage
    _same_bits(ms.restore(src), ms.restore(back))
    rec_file = src / "modelshard.json"  # a damaged source: the write stops before its commit
    rec = json.loads(rec_file.read_text())
    rec["leaves"][0]["checksum"] = "00000000:00000000"
    rec_file.write_text(json.dumps(rec))
    with pytest.raises(ms.CheckpointError, match="checksum mismatch"):
        reshard(src, url, specs=specs, mesh=mesh, overwrite=True)
    with pytest.raises(ms.CheckpointError, match=r"no complete checkpoint|does not exist"):
        ms.restore(url)
