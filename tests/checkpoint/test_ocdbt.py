"""Orbax's layout of a checkpoint, built without Orbax: each spec, metadata file and merge
equal to Orbax's own, on a local disk, gs:// and s3://, and a reshard in a fresh process
that never imports Orbax."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._checkpoint import ocdbt, s3, shards
from modelshard._checkpoint.sources import locate
from modelshard._checkpoint.storage import MARKER
from modelshard._checkpoint.urls import kvstore, location

# where a checkpoint's arrays may live: each spec is compared for all three
LOCATIONS = ["/ck/state/", "gs://bkt/ck/state", "s3://bkt/ck/state"]


@pytest.fixture
def orbax_on_s3(monkeypatch):
    """Orbax's specs for s3:// (through ``s3.enable``) and ours, from one AWS setting."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "TENSORSTORE_GCS_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    s3.enable()


# every dtype a checkpoint stores (codec.STORED_AS maps the others onto these)
DTYPES = [
    "float32", "bfloat16", "float16", "float64", "int8", "uint8", "int16", "int32", "uint32",
    "int64", "bool", "int4", "int2", "float8_e5m2", "float8_e4m3fn", "complex64",
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("process", [0, 1])
def test_the_write_spec_is_orbaxs(dtype, compress, process, orbax_on_s3):
    from modelshard._internals import ArrayWriteSpec

    cases = [((1024, 2048), (512, 256)), ((), ()), ((7, 3, 5), (7, 1, 5))]
    for (shape, chunk), where in zip(cases, LOCATIONS, strict=True):
        orbax = ArrayWriteSpec(
            where,
            "layers.0.w",
            global_shape=shape,
            write_shape=chunk,
            dtype=jnp.dtype(dtype),
            use_ocdbt=True,
            process_id=process,
            use_compression=compress,
        )
        ours = ocdbt.write_spec(
            kvstore(location(where)),
            "layers.0.w",
            shape=shape,
            chunk=chunk,
            dtype=jnp.dtype(dtype),
            process=process,
            compress=compress,
        )
        assert ours == json.loads(json.dumps(orbax.json))


def test_the_read_spec_is_orbaxs(tmp_path, mesh8, orbax_on_s3):
    from modelshard._internals import ArrayReadSpec

    path = ms.save(tmp_path / "c", {"w": ms.shard(jnp.ones((64, 8)), ms.fsdp("data"), mesh8)})
    tree = str(locate(path).tree_dir)
    orbax = ArrayReadSpec(tree, "w", False, use_ocdbt=True)
    assert ocdbt.read_spec(tree, "w") == orbax.json
    for where in [tree, *LOCATIONS]:
        orbax = ArrayReadSpec(where, "a.b", False, use_ocdbt=True)
        assert ocdbt.read_spec(kvstore(location(where)), "a.b") == json.loads(
            json.dumps(orbax.json)
        )


def test_the_context_is_orbaxs():
    orbax = ocp.type_handlers.get_ts_context(use_ocdbt=True).spec.to_json()
    assert ocdbt.context().spec.to_json() == orbax
    assert ocdbt.context(1 << 20, sync=False).spec.to_json() == {
        **orbax,
        "cache_pool": {"total_bytes_limit": 1 << 20},
        "file_io_sync": False,
    }


@pytest.mark.parametrize(
    "spec", [P(), P("data"), P(None, "model"), P("data", "model"), P(("data", "model"))]
)
def test_the_sharding_entry_is_orbaxs(mesh24, spec):
    sharding = NamedSharding(mesh24, spec)
    orbax = ocp.metadata.NamedShardingMetadata.from_jax_sharding(sharding)
    assert ocdbt.sharding_json(sharding) == orbax.to_serialized_string()


def test_the_metadata_files_are_orbaxs(tmp_path, mesh24):
    """``_METADATA``, ``_sharding``, ``array_metadatas/process_0`` and
    ``_CHECKPOINT_METADATA`` of ``save`` equal the ones Orbax's own handler writes for the
    same arrays, stored in the same chunks (``save``'s)."""
    from modelshard._internals import STANDARD_HANDLER_NAME

    state = {
        "layers": {"0": {"w": ms.shard(jnp.ones((64, 8)), P("data", "model"), mesh24)}},
        "b": ms.shard(jnp.ones(4, jnp.bfloat16), P(), mesh24),
        "k": ms.shard(jnp.zeros((2, 8), jnp.int8), P(None, "model"), mesh24),
        "one": jnp.arange(3.0),  # a single device's
    }
    path = ms.save(tmp_path / "c", state)
    names = ["_METADATA", "_sharding", "array_metadatas/process_0", "_CHECKPOINT_METADATA"]
    ours = {f: json.loads((path / f).read_text()) for f in names}
    chunks = {
        a["array_metadata"]["param_name"]: a["array_metadata"]["write_shape"]
        for a in ours["array_metadatas/process_0"]["array_metadatas"]
    }
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "orbax", state, custom_metadata=MARKER)
    theirs = {f: json.loads((tmp_path / "orbax" / f).read_text()) for f in names}
    # Orbax stores each shard as one chunk; ``save`` cuts them finer (chunks.py)
    assert chunks == {"b": [4], "k": [2, 2], "layers.0.w": [32, 2], "one": [3]}
    for entry in theirs["_METADATA"]["tree_metadata"].values():
        name = ".".join(k["key"] for k in entry["key_metadata"])
        entry["value_metadata"]["write_shape"] = chunks[name]
    for entry in theirs["array_metadatas/process_0"]["array_metadatas"]:
        meta = entry["array_metadata"]
        meta["write_shape"] = meta["chunk_shape"] = chunks[meta["param_name"]]
    for f in ("_METADATA", "_sharding", "array_metadatas/process_0"):
        assert ours[f] == theirs[f], f
    times = ("init_timestamp_nsecs", "commit_timestamp_nsecs")
    assert {k: v for k, v in ours["_CHECKPOINT_METADATA"].items() if k not in times} == {
        k: v for k, v in theirs["_CHECKPOINT_METADATA"].items() if k not in times
    }
    assert STANDARD_HANDLER_NAME.endswith(".StandardCheckpointHandler")


def _entries(directory):
    """Every key of the OCDBT database at ``directory`` with its value."""
    store = ts.KvStore.open(
        {"driver": "ocdbt", "base": {"driver": "file", "path": str(directory) + "/"}}
    ).result()
    return {k: store.read(k).result().value for k in store.list().result()}


def test_the_merge_is_orbaxs(tmp_path, mesh8, monkeypatch):
    """The databases a reshard wrote, merged by ``ocdbt.merge`` and, in a copy, by Orbax's
    finalize: the two roots hold the same keys and values, and plain Orbax reads ours."""
    values = {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32), "b": np.ones(3)}
    src = ms.save(tmp_path / "src", ms.shard(values, ms.fsdp("data"), mesh8))
    copy = tmp_path / "orbax_merged"
    merge = ocdbt.merge

    def copy_then_merge(tree_dir, names):
        shutil.copytree(tree_dir["path"], copy)
        merge(tree_dir, names)

    monkeypatch.setattr(shards, "merge", copy_then_merge)
    rules = ms.Rules([("w$", P(None, "data")), (".*", P())])
    out = ms.reshard(src, tmp_path / "dst", specs=rules, mesh=mesh8)
    ocp.PyTreeCheckpointHandler(use_zarr3=False).finalize(epath.Path(copy))
    ours = _entries(out)
    assert ours == _entries(copy)
    assert {k.decode() for k in ours} >= {"w/.zarray", "b/.zarray"}
    plain = ocp.StandardCheckpointer().restore(str(out))
    np.testing.assert_array_equal(plain["w"], values["w"])


def test_a_merge_missing_an_array_names_it_and_commits_nothing(tmp_path, mesh8):
    src = ms.save(tmp_path / "src", {"w": ms.shard(jnp.ones((64, 8)), ms.fsdp("data"), mesh8)})
    staged = tmp_path / "staged"
    shutil.copytree(locate(src).tree_dir, staged)
    for f in staged.glob("manifest.ocdbt"):
        f.unlink()  # the root's database, as before a merge
    shutil.rmtree(staged / "d", ignore_errors=True)
    with pytest.raises(ValueError) as e:
        ocdbt.merge(str(staged), ["w", "v"])
    assert str(e.value) == (
        f"{staged}: 1 of 2 arrays are missing their zarr metadata or chunks after the merge: v"
    )
    assert not (staged / "manifest.ocdbt").exists()


def _last_line_of(script: str) -> str:
    """The last line ``script`` prints in a fresh CPU process (which must succeed)."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_fresh_process_reshards_without_importing_orbax(tmp_path, mesh8):
    src = ms.save(
        tmp_path / "src",
        ms.shard(
            {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}, ms.fsdp("data"), mesh8
        ),
    )
    script = f"""
import sys
from modelshard.cli import main
code = main(["reshard", {str(src)!r}, {str(tmp_path / "dst")!r}, "--mesh", "data=2,model=4"])
print(code, sorted(m for m in sys.modules if m.startswith("orbax")))
"""
    assert _last_line_of(script) == "0 []"
    plain = ocp.StandardCheckpointer().restore(str(tmp_path / "dst"))
    np.testing.assert_array_equal(plain["w"], np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    back = ms.restore(tmp_path / "dst")  # verified: the source's checksums carried over
    np.testing.assert_array_equal(np.asarray(back["w"]), plain["w"])


def test_a_fresh_process_saves_without_importing_orbax(tmp_path):
    """``save`` writes through ``shards``/``ocdbt``: Orbax is never imported, and plain
    Orbax reads what it wrote."""
    script = f"""
import sys
import jax, jax.numpy as jnp
import modelshard as ms
ms.save({str(tmp_path / "c")!r}, {{"w": jnp.arange(12.0).reshape(3, 4), "k": jax.random.key(0)}})
print(sorted(m for m in sys.modules if m.startswith("orbax")))
"""
    assert _last_line_of(script) == "[]"
    plain = ocp.StandardCheckpointer().restore(str(tmp_path / "c"))
    np.testing.assert_array_equal(plain["w"], np.arange(12.0).reshape(3, 4))


def test_a_reshard_to_object_storage_is_written_without_orbax(tmp_path, mesh8, bucket_root):
    """Specs, context, metadata files and merge on gs:// and s3:// are this module's too:
    with Orbax's own made to fail, the reshard still lands, and plain Orbax reads it."""
    from modelshard._internals import tensorstore_utils as tsu

    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    src = ms.save(tmp_path / "src", ms.shard({"w": w, "b": np.ones(3)}, ms.fsdp("data"), mesh8))

    def orbax_called(*args, **kwargs):
        raise AssertionError("Orbax was asked")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ocp.PyTreeCheckpointHandler, "finalize", orbax_called)
        mp.setattr(tsu, "get_ts_context", orbax_called)
        mp.setattr(tsu, "ArrayWriteSpec", orbax_called)
        url = f"{bucket_root}/out"
        ms.reshard(src, url, specs=ms.Rules([("w$", P(None, "data")), (".*", P())]), mesh=mesh8)
    plain = ocp.StandardCheckpointer().restore(f"{url}/state")
    np.testing.assert_array_equal(plain["w"], w)
    np.testing.assert_array_equal(np.asarray(ms.restore(url)["w"]), w)
