"""Safetensors written by one process: a failed write leaves the last export whole, the
size spellings ``max_shard_size`` takes, and a tensor handed over in row blocks."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

import modelshard as ms
from modelshard._weights import parse_size, write_safetensors


def test_a_failed_sharded_save_leaves_the_last_checkpoint_whole(tmp_path):
    state = {f"w{i}": np.full((256,), i, np.float32) for i in range(3)}
    good = ms.save_safetensors(tmp_path, state, max_shard_size=1024)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    items = [(k, (256,), np.float32) for k in state]

    def compute(name: str) -> np.ndarray:
        if name == "w2":
            raise OSError("disk full")
        return state[name] + 1

    with pytest.raises(OSError, match="disk full"):
        write_safetensors(tmp_path, items, compute, max_shard_size=1024)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no .partial left
    assert (np.asarray(ms.load_safetensors(good)["w1"]) == 1).all()


def test_max_shard_size_spellings():
    assert parse_size(5_000) == 5_000
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5kb") == 1500
    assert parse_size(" 100 MiB ") == 100 << 20
    for bad in ("5XB", "GB", "-1", 0, "0MB", 2.5, True):
        with pytest.raises(ms.CheckpointError) as e:
            parse_size(bad)  # type: ignore[arg-type]
        assert str(e.value) == (
            f"max_shard_size={bad!r}: want a positive number of bytes, as an int or a string "
            "like '5GB', '500MB' (powers of 10) or '2GiB' (powers of 2)"
        )


def test_a_tensor_computed_in_row_blocks_must_fill_its_entry(tmp_path):
    """The writer takes a tensor as blocks of whole rows (a leaf sharded along its first
    axis, shard by shard); blocks that do not make up the entry are refused, nothing left."""
    rows = [np.full((1, 2), 1, np.float32), np.full((3, 2), 2, np.float32)]
    ok = write_safetensors(tmp_path / "ok.safetensors", [("a", (4, 2), np.float32)], lambda n: rows)
    assert load_file(str(ok))["a"].tolist() == [[1, 1], [2, 2], [2, 2], [2, 2]]
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(ms.CheckpointError) as e:
        write_safetensors(bad, [("a", (5, 2), np.float32)], lambda n: rows)
    assert (
        str(e.value) == "a: computed float32[1, 2] + float32[3, 2], the header says float32[5, 2]"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.safetensors"]
