"""``modelshard convert`` (``_cli/convert.py``): missing inputs, replacing outputs, JSON paths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from helpers import CONVERT_MAP
from modelshard.cli import main


def test_convert_input_files_missing_are_file_not_found(ckpt, tmp_path, capsys, monkeypatch):
    """convert's input paths (SRC, --mapping, --reference) that are not there: the
    FileNotFoundError itself with errno 2, like --rules, nothing written."""
    from safetensors.numpy import save_file

    monkeypatch.chdir(tmp_path)
    save_file({"w": np.ones(4, np.float32)}, "m.safetensors")
    for argv, missing in (
        (["convert", "nope.safetensors", "c"], "nope.safetensors"),
        (["convert", "m.safetensors", "c", "--mapping", "nomap.toml"], "nomap.toml"),
        (
            ["convert", str(ckpt), "o.safetensors", "--to", "safetensors", "--mapping", "m.toml"],
            "m.toml",
        ),
        (
            [
                "convert",
                str(ckpt),
                "o.safetensors",
                "--to",
                "safetensors",
                "--reference",
                "ref.safetensors",
            ],
            "ref.safetensors",
        ),
    ):
        assert main([*argv, "--json"]) == 1, argv
        assert json.loads(capsys.readouterr().out)["error"] == {
            "type": "FileNotFoundError",
            "message": f"{missing}: No such file or directory",
            "errno": 2,
        }
        assert main(argv) == 1
        assert capsys.readouterr().err == (
            f"modelshard convert: error: {missing}: No such file or directory\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    # and inspect's JSON gives the file's paths absolute, as every command does
    assert main(["inspect", "m.safetensors", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["path"], doc["files"]) == (
        str(tmp_path / "m.safetensors"),
        [str(tmp_path / "m.safetensors")],
    )


def test_convert_to_safetensors_refuses_to_replace_without_overwrite(
    ckpt, tmp_path, capsys, monkeypatch
):
    """convert --to safetensors replaces an existing file (or sharded layout) only with
    --overwrite, as reshard and the other direction do; its JSON says what it wrote, with
    absolute paths."""
    monkeypatch.chdir(tmp_path)
    argv = ["convert", str(ckpt), "out.safetensors", "--to", "safetensors"]
    assert main([*argv, "--json"]) == 0
    out = tmp_path / "out.safetensors"
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        written = len(list(f.keys()))  # the tensors in the file (not the RNG key leaf)
    assert written == 18
    assert json.loads(capsys.readouterr().out) == {
        "schema": 1,
        "command": "convert",
        "ok": True,
        "source": str(ckpt),
        "step": None,
        "destination": str(out),
        "leaves": written,
        "files": [str(out)],
        "bytes": out.stat().st_size,
    }
    before = out.read_bytes()
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        "modelshard convert: error: out.safetensors already exists; pass --overwrite to replace "
        "it\n"
    )
    assert main([*argv, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"] == {
        "type": "CheckpointError",
        "message": "out.safetensors already exists; pass --overwrite to replace it",
    }
    assert out.read_bytes() == before
    assert main([*argv, "--overwrite"]) == 0
    assert (
        capsys.readouterr().out
        == f"wrote out.safetensors: 18 tensors, {out.stat().st_size / 1024:.2f} KiB\n"
    )
    # the sharded layout: an index or shards of that name in DST are refused too
    sharded = ["convert", str(ckpt), "hf", "--to", "safetensors", "--max-shard-size", "4KB"]
    assert main([*sharded, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1 and doc["files"] == [str(f) for f in shards]
    assert doc["destination"] == str(tmp_path / "hf" / "model.safetensors.index.json")
    assert doc["bytes"] == sum(f.stat().st_size for f in shards) and doc["leaves"] == written
    assert main(sharded) == 1
    assert capsys.readouterr().err == (
        "modelshard convert: error: hf (model-00001-of-00003.safetensors) already exists; pass "
        "--overwrite to replace it\n"
    )
    assert main([*sharded, "--overwrite"]) == 0
    size = sum(f.stat().st_size for f in shards) / 1024
    assert capsys.readouterr().out == (
        f"wrote hf/model.safetensors.index.json: {written} tensors, {size:.2f} KiB in 3 files\n"
    )
    # a directory DST without --max-shard-size: save_pretrained's 5GB, so here one
    # model.safetensors; refused beside an earlier export's shards, as save_safetensors is
    assert main(["convert", str(ckpt), "one", "--to", "safetensors", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["destination"] == str(tmp_path / "one" / "model.safetensors")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    assert main(["convert", str(ckpt), "hf", "--to", "safetensors"]) == 1
    assert capsys.readouterr().err == (
        "modelshard convert: error: hf (model-00001-of-00003.safetensors) already exists; pass "
        "--overwrite to replace it\n"
    )
    assert main(["convert", str(ckpt), "hf", "--to", "safetensors", "--overwrite"]) == 0
    one = (tmp_path / "hf" / "model.safetensors").stat().st_size / 1024
    assert (
        capsys.readouterr().out == f"wrote hf/model.safetensors: {written} tensors, {one:.2f} KiB\n"
    )
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]


def test_convert_json_paths_are_absolute_and_dry_run_transforms_null(tmp_path, capsys, monkeypatch):
    from safetensors.numpy import save_file

    monkeypatch.chdir(tmp_path)
    save_file(
        {"norm.weight": np.ones(16, np.float32), "l.0.up.weight": np.ones((24, 16), np.float32)},
        "model.safetensors",
    )
    Path("map.toml").write_text(CONVERT_MAP)
    argv = ["convert", "model.safetensors", "ck", "--mapping", "map.toml", "--json"]
    assert main([*argv, "--dry-run"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == str(tmp_path / "model.safetensors")
    assert [(r["target"], r["transforms"]) for r in doc["rows"]] == [
        ("layers/0/up/kernel", "transpose(1, 0)"),
        ("norm/scale", None),
    ]
    # the table's footer in the command's words: no Python argument (like=) named
    assert main([*argv[:-1], "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "like" not in out
    assert "2 leaves mapped from 2 stored tensors, 0 kept, 0 stored tensors skipped" in " ".join(
        out.split()
    )
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["source"], doc["destination"]) == (
        str(tmp_path / "model.safetensors"),
        str(tmp_path / "ck"),
    )
    assert (doc["mesh"], doc["leaves"], doc["bytes"]) == ({"data": 1}, 2, 24 * 16 * 4 + 64)
