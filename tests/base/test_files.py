"""Files made durable: ``EarlySync`` gives a writer's final ``sync_tree`` a head start."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from helpers import kill_while_writing
from modelshard._base import EarlySync, write_durable


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


def test_write_durable_killed_at_any_moment_leaves_the_old_file_or_the_new(tmp_path):
    p = tmp_path / "record.json"
    setup = f"""
from modelshard._base import write_durable
texts = ["a" * (1 << 16), "b" * (1 << 16)]
def write(i):
    write_durable({str(p)!r}, texts[i % 2])
write(0)
"""
    seen = kill_while_writing(p, setup)
    assert {s[:1] * (1 << 16) == s for s in seen} == {True}, [len(s) for s in seen]


def test_write_durable_syncs_the_file_and_its_directory(tmp_path, fsynced):
    write_durable(tmp_path / "a.json", "{}")
    write_durable(tmp_path / "a.json", b"[]")
    assert (tmp_path / "a.json").read_bytes() == b"[]"
    assert sorted(os.listdir(tmp_path)) == ["a.json"]  # no temporary left
    names = [re.sub("[0-9a-f]{12}", "*", os.path.relpath(f, tmp_path)) for f in fsynced]
    assert names == [".a.json.*.partial", "."] * 2  # the temporary, then the rename
