"""``reshard`` writes what ``save`` writes: raw chunks by default, zstd on request."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from conftest import stored_codec
from modelshard.cli import main


def test_reshard_stores_raw_chunks_unless_compression_zstd(tmp_path):
    """A zstd source resharded by default comes out raw, as ``save`` writes; with
    ``compression="zstd"`` (Python) or ``--compression zstd`` (CLI) it comes out zstd.
    Each reads back bit-exact, in modelshard and in plain Orbax."""
    values = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    state = ms.shard(
        {"w": jnp.asarray(values), "b": jnp.ones(8)}, ms.fsdp("data"), ms.make_mesh({"data": 8})
    )
    src = ms.save(tmp_path / "src", state, compression="zstd")
    mesh = ms.make_mesh({"data": 2, "model": 4})
    rules = ms.Rules([(r"w$", P(None, "model")), (r".*", P())])
    raw = ms.reshard(src, tmp_path / "raw", specs=rules, mesh=mesh)
    packed = ms.reshard(src, tmp_path / "zstd", specs=rules, mesh=mesh, compression="zstd")
    argv = ["reshard", str(raw), str(tmp_path / "cli"), "--mesh", "data=2,model=4", "--compression"]
    assert main([*argv, "zstd"]) == 0
    assert stored_codec(src, "w") == {"id": "zstd", "level": 1}
    assert stored_codec(raw, "w") is None
    assert stored_codec(packed, "w") == {"id": "zstd", "level": 1}
    assert stored_codec(tmp_path / "cli", "w") == {"id": "zstd", "level": 1}
    for path in (raw, packed, tmp_path / "cli"):
        back = ms.restore(path)
        np.testing.assert_array_equal(np.asarray(back["w"]), values)
        plain = ocp.StandardCheckpointer().restore(str(path))
        np.testing.assert_array_equal(plain["w"], values)
        np.testing.assert_array_equal(plain["b"], np.ones(8, np.float32))


@pytest.mark.parametrize("bad", ["gzip", True])
def test_reshard_refuses_an_unknown_compression_before_writing(tmp_path, bad):
    src = ms.save(tmp_path / "src", {"w": jnp.ones(8)})
    with pytest.raises(ms.CheckpointError) as e:
        ms.reshard(src, tmp_path / "dst", mesh=ms.make_mesh({"data": 8}), compression=bad)
    assert str(e.value).splitlines() == [
        f"compression={bad!r} is not one of None (each chunk's raw bytes, the default) or "
        "'zstd' (Orbax's default codec: smaller files, several times the CPU)."
    ]
    assert not (tmp_path / "dst").exists()
