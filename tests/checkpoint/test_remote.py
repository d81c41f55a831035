"""``save`` on object storage (``_checkpoint/remote.py``): one Orbax save committed by its
commit file, written where it belongs (no rename there); an old checkpoint replaced only
with ``overwrite=True`` and only when modelshard wrote it, removed whole first. Every test
runs on gs:// and s3:// (conftest's ``bucket_root``: servers on localhost)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from helpers import stored_codec


def _names(url):
    from etils import epath

    return sorted(p.name for p in epath.Path(url).iterdir())


def _objects(url) -> dict[str, bytes]:
    """Every object under ``url`` (its bytes), by path below it, read without modelshard."""
    from etils import epath

    top = epath.Path(url)
    out: dict[str, bytes] = {}
    todo = [top]
    while todo:
        for p in todo.pop().iterdir():
            if p.is_dir():
                todo.append(p)
            else:
                out[str(p)[len(str(top)) + 1 :]] = p.read_bytes()
    return out


def test_plain_checkpoint_written_in_one_commit(bucket_root, capsys):
    from etils import epath
    from jax.sharding import PartitionSpec as P

    from modelshard.cli import main

    path = epath.Path(f"{bucket_root}/ck")
    key = jax.random.key(5)
    state = {"w": jnp.arange(16.0), "k": key}
    assert ms.save(str(path), state, metadata={"note": "remote"}) == path
    assert "commit_success.txt" in _names(str(path))
    out = ms.restore(str(path), specs={"w": P("data"), "k": P()}, mesh=ms.make_mesh({"data": 8}))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(16.0))
    assert out["w"].sharding.spec == P("data")
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(key))
    assert ms.read_metadata(str(path)) == {"note": "remote"}
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["path"], data["metadata"]) == (str(path), {"note": "remote"})
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(str(path), state)
    assert str(e.value).startswith(f"{path} already exists; pass overwrite=True")
    assert stored_codec(path, "w") is None  # raw chunks by default, as on a local disk
    ms.save(str(path), {"w": jnp.zeros(3), "k": key}, overwrite=True, compression="zstd")
    assert ms.restore(str(path))["w"].shape == (3,)
    assert stored_codec(path, "w") == {"id": "zstd", "level": 1}
    (path / "commit_success.txt").unlink()  # as a save killed part-way leaves it
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(str(path))
    assert str(e.value) == (
        f"no complete checkpoint at {path}: Orbax's commit file commit_success.txt is "
        "missing (on object storage it is written last, so the save there did not finish)."
    )
    foreign = epath.Path(f"{bucket_root}/notes")
    (foreign / "a.txt").write_text("mine")
    with pytest.raises(ms.CheckpointError, match="is not a checkpoint modelshard wrote"):
        ms.save(str(foreign), state, overwrite=True)
    assert (foreign / "a.txt").read_text() == "mine"


def test_overwrite_removes_every_object_of_the_old_checkpoint(bucket_root):
    """No object of the old checkpoint survives (its arrays' data files included): a
    checkpoint with fewer leaves holds only its own, and restores as written."""
    path = f"{bucket_root}/ck"
    ms.save(path, {"w": jnp.arange(64.0), "old": jnp.ones((32, 32))})
    before = _objects(path)
    ms.save(path, {"w": jnp.zeros(3)}, overwrite=True)
    after = _objects(path)
    data = [n for n in before if "/d/" in n]  # the arrays' chunks (OCDBT data files)
    assert data and not set(data) & set(after)
    assert "commit_success.txt" in after
    assert [leaf["path"] for leaf in json.loads(after["modelshard/modelshard.json"])["leaves"]] == [
        "w"
    ]
    np.testing.assert_array_equal(np.asarray(ms.restore(path)["w"]), np.zeros(3))


def test_a_refused_save_leaves_what_is_there_untouched(bucket_root):
    """Without ``overwrite``, and with it over what modelshard did not write (here an
    Orbax checkpoint: its metadata, without modelshard's marker), nothing is removed."""
    from etils import epath

    path = f"{bucket_root}/ck"
    ms.save(path, {"w": jnp.arange(8.0)})
    orbax = epath.Path(f"{bucket_root}/orbax")
    (orbax / "_CHECKPOINT_METADATA").write_text(json.dumps({"custom_metadata": {}}))
    (orbax / "state" / "x").write_text("data")
    kept = {p: _objects(p) for p in (path, str(orbax))}
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(path, {"w": jnp.zeros(8)})
    assert str(e.value) == (
        f"{path} already exists; pass overwrite=True to replace it (on object storage the "
        "old checkpoint is removed before the new one is written)."
    )
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(str(orbax), {"w": jnp.zeros(8)}, overwrite=True)
    assert str(e.value) == (
        f"{orbax} is not a checkpoint modelshard wrote; overwrite=True replaces only those. "
        "Choose another path or remove it yourself."
    )
    assert {p: _objects(p) for p in kept} == kept
    np.testing.assert_array_equal(np.asarray(ms.restore(path)["w"]), np.arange(8.0))


def test_plain_orbax_restores_an_object_storage_save(bucket_root):
    """Orbax's own ``StandardCheckpointer`` reads the arrays item of a save on object
    storage, as it reads a local one."""
    import orbax.checkpoint as ocp
    from etils import epath
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = ms.make_mesh({"data": 8})
    w = jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("data")))
    path = epath.Path(ms.save(f"{bucket_root}/ck", {"w": w}))
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding)}
    got = ocp.StandardCheckpointer().restore(path / "state", target)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(w))
