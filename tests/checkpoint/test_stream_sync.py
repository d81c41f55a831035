"""The streaming writer's store is on the disk before its checkpoint is published.

``write_stream`` has TensorStore write its OCDBT store without a sync per commit (a slab's
write is a commit) and syncs the whole store once, itself, when every slab is written
(``_base.files.sync_tree``). Seen from the system calls this process makes: every file and
directory of the store is synced by ``os.fsync`` before the rename that publishes the
checkpoint.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._base import sync_tree
from modelshard._checkpoint import stream
from modelshard._checkpoint.slabs import StreamLeaf
from modelshard._checkpoint.stream import write_stream

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
def test_data_files_are_synced_while_later_leaves_are_written(tmp_path, datasynced):
    """``EarlySync``: once a leaf is written, the files written so far are synced on a
    thread of their own while the next leaves are; the final sync finds them clean."""
    synced = datasynced
    leaves, _ = _Reads(delay=0.02).leaves("w", 4, (64, 32))
    write_stream(tmp_path / "ck", leaves, mesh=ms.make_mesh({"data": 2}), slab_bytes=4096)
    data = {p for p in synced if f"{STORE}/d/" in p}
    assert data, synced  # data files synced early (before the whole store's sync)


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


class _Reads:
    """Readers of float32 leaves that sleep ``delay`` per read and record, as each read
    starts, the leaf's name and how many reads are running (itself included)."""

    def __init__(self, delay: float) -> None:
        self.delay, self.lock, self.running = delay, threading.Lock(), 0
        self.seen: list[tuple[str, int]] = []
        self.rng = np.random.default_rng(0)

    def leaves(self, prefix: str, n: int, shape: tuple[int, int], chunks=None):
        values = [self.rng.normal(size=shape).astype(np.float32) for _ in range(n)]
        leaves = [
            StreamLeaf(f"{prefix}{i}", shape, np.float32, self._reader(a, f"{prefix}{i}"),
                       spec=P("data"), chunks=chunks)
            for i, a in enumerate(values)
        ]  # fmt: skip
        return leaves, values

    def _reader(self, a: np.ndarray, name: str):
        def read(box):
            with self.lock:
                self.running += 1
                self.seen.append((name, self.running))
            time.sleep(self.delay)
            with self.lock:
                self.running -= 1
            return a[box]

        return read


def test_slabs_are_read_ahead_on_two_threads_and_a_big_one_alone(tmp_path):
    """``READS_AHEAD`` reads run at once, never more; a slab larger than ``slab_bytes`` (one
    whole source block, "big") is read while no other read runs, once the slabs read ahead
    before it are in."""
    reads = _Reads(delay=0.05)
    small, a = reads.leaves("small", 2, (64, 8))  # whole rows: 2 slabs of 32 rows each
    big, b = reads.leaves("big", 2, (64, 32), chunks=(16, 32))  # 4 blocks of 2 KiB each
    mesh = ms.make_mesh({"data": 2})
    write_stream(tmp_path / "ck", [*small, *big], mesh=mesh, slab_bytes=1024, whole_bytes=4096)
    assert stream.READS_AHEAD == 2
    assert [name for name, _ in reads.seen] == ["small0"] * 2 + ["small1"] * 2 + ["big0"] * 4 + [
        "big1"
    ] * 4
    assert max(n for _, n in reads.seen) == 2  # read ahead, on two threads at most
    assert [n for name, n in reads.seen[5:]] == [1] * 7  # each big slab after the first: alone
    out = ms.restore(tmp_path / "ck")
    for name, values in (("small", a), ("big", b)):
        for i, v in enumerate(values):
            np.testing.assert_array_equal(np.asarray(out[f"{name}{i}"]), v)


def test_slabs_of_any_shape_compile_no_checksum_program_twice(tmp_path, count_compiles):
    """Slabs are summed on the host by programs of fixed sizes, whatever their shape: a
    stream of a slab shape never seen before compiles nothing once those sizes are."""
    reads = _Reads(delay=0.0)
    # whole rows in slabs of 1 MiB: 992 rows then 8
    leaves, values = reads.leaves("w", 5, (1000, 264))
    with count_compiles() as first:
        write_stream(tmp_path / "ck", leaves, mesh=ms.make_mesh({"data": 2}), slab_bytes=1 << 20)
    assert first["jit(_sums_of)"] <= 3  # one per size at most (none if compiled before)
    others, _ = _Reads(delay=0.0).leaves("v", 2, (1000, 270))
    with count_compiles() as second:
        write_stream(tmp_path / "ck2", others, mesh=ms.make_mesh({"data": 2}), slab_bytes=1 << 20)
    assert second["jit(_sums_of)"] == 0
    out = ms.restore(tmp_path / "ck")  # the record's checksums, slab sums added
    for i, v in enumerate(values):
        np.testing.assert_array_equal(np.asarray(out[f"w{i}"]), v)


def test_a_small_stream_compiles_no_checksum_program(tmp_path, count_compiles):
    leaves, values = _Reads(delay=0.0).leaves("s", 3, (56, 24))
    with count_compiles() as n:
        write_stream(tmp_path / "ck", leaves, mesh=ms.make_mesh({"data": 2}), slab_bytes=2048)
    assert n["jit(_sums_of)"] == 0
    out = ms.restore(tmp_path / "ck")
    for i, v in enumerate(values):
        np.testing.assert_array_equal(np.asarray(out[f"s{i}"]), v)
