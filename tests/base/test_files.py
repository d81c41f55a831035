"""Files made durable: ``EarlySync`` gives a writer's final ``sync_tree`` a head start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelshard._base import EarlySync


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_each_pass_syncs_what_changed_since_the_last(tmp_path, datasynced):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"a")
    (tmp_path / "m").write_bytes(b"m")
    with EarlySync(tmp_path) as early:
        early.kick()
    assert sorted(datasynced) == [str(tmp_path / "d" / "a"), str(tmp_path / "m")]
    datasynced.clear()
    (tmp_path / "d" / "b").write_bytes(b"b")  # new
    (tmp_path / "m").write_bytes(b"mm")  # grown
    with EarlySync(tmp_path) as again:
        again._synced = dict.fromkeys([str(tmp_path / "d" / "a")], 1)
        again._synced[str(tmp_path / "m")] = 1
        again.kick()
    assert sorted(datasynced) == [str(tmp_path / "d" / "b"), str(tmp_path / "m")]


def test_without_a_root_nothing_is_synced(datasynced):
    with EarlySync(None) as early:
        early.kick()
    assert datasynced == []


def test_a_file_gone_meanwhile_is_left_to_sync_tree(tmp_path, monkeypatch):
    (tmp_path / "x").write_bytes(b"x")
    real = os.open

    def gone(path, *a, **k):
        if str(path).endswith("x"):
            raise FileNotFoundError(path)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", gone)
    with EarlySync(tmp_path) as early:
        early.kick()  # no error: the final sync_tree meets it
    assert early._synced == {}
