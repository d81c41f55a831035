"""The streaming writer's store is on the disk before its checkpoint is published.

``write_stream`` has TensorStore write its OCDBT store without a sync per commit (a slab's
write is a commit) and syncs the whole store once, itself, when every slab is written
(``_base.files.sync_tree``). Seen from the system calls this process makes: every file and
directory of the store is synced by ``os.fsync`` before the rename that publishes the
checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._base import sync_tree
from modelshard._checkpoint.stream import StreamLeaf, write_stream

STORE = "ocdbt.process_0"


@pytest.fixture
def events(monkeypatch):
    """``("fsync", path)`` and ``("rename", destination)`` in the order this process makes
    them (the real calls are made)."""
    seen: list[tuple[str, str]] = []
    fsync, rename = os.fsync, os.rename

    def spy_fsync(fd: int) -> None:
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.append(("rename", os.fspath(dst)))
        rename(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "rename", spy_rename)
    return seen


def _in_store(path: str) -> str | None:
    """``path`` relative to the store directory of whichever checkpoint holds it."""
    parts = Path(path).parts
    if STORE not in parts:
        return None
    return str(Path(*parts[parts.index(STORE) :]))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_write_stream_syncs_its_whole_store_before_publishing(tmp_path, events):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 32)).astype(np.float32)
    b = rng.normal(size=(16, 8)).astype(np.float32)
    leaves = [
        StreamLeaf("a", a.shape, a.dtype, lambda box: a[box], spec=P("data")),
        StreamLeaf("b", b.shape, b.dtype, lambda box: b[box]),
    ]
    mesh = ms.make_mesh({"data": 2})
    write_stream(tmp_path / "ck", leaves, mesh=mesh, slab_bytes=1024)  # 8 slabs of ``a``

    store = tmp_path / "ck" / STORE
    wanted = {_in_store(str(p)) for p in [store, *store.rglob("*")]}
    assert len([p for p in store.rglob("*") if p.is_file()]) > 1  # data and manifest
    published = events.index(("rename", str(tmp_path / "ck")))
    synced_before = {_in_store(p) for kind, p in events[:published] if kind == "fsync"}
    assert wanted <= synced_before, f"not synced before publishing: {wanted - synced_before}"
    out = ms.restore(tmp_path / "ck")  # checksums verified
    np.testing.assert_array_equal(np.asarray(out["a"]), a)
    np.testing.assert_array_equal(np.asarray(out["b"]), b)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_sync_tree_syncs_each_file_before_its_directory(tmp_path, events):
    (tmp_path / "t" / "d").mkdir(parents=True)
    (tmp_path / "t" / "manifest").write_bytes(b"m")
    (tmp_path / "t" / "d" / "x").write_bytes(b"x")
    sync_tree(tmp_path / "t")
    order = [Path(p).relative_to(tmp_path) for kind, p in events if kind == "fsync"]
    assert sorted(map(str, order)) == ["t", "t/d", "t/d/x", "t/manifest"]
    for path in order:
        assert order.index(path) > max(
            (order.index(q) for q in order if q.parent == path), default=-1
        ), f"{path} synced before what it holds"
