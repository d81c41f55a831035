"""``hf://org/name[@revision]`` safetensors paths, resolved offline against a Hugging Face
cache directory each test builds (the layout ``huggingface_hub`` writes: ``refs/<branch>``
holding a commit hash, ``snapshots/<hash>/`` of links into ``blobs/``)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import modelshard as ms

pytest.importorskip("huggingface_hub")

REV = "0123456789abcdef0123456789abcdef01234567"
REV2 = "fedcba9876543210fedcba9876543210fedcba98"
W = np.arange(32, dtype=np.float32).reshape(4, 8)
W2 = -np.arange(32, dtype=np.float32).reshape(4, 8)


def _snapshot(hub: Path, repo: str, rev: str, files: dict[str, bytes], ref: str | None) -> Path:
    """One snapshot in the cache as ``huggingface_hub`` lays it out."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(rev)
    return snap


def _bytes(tmp: Path, tensors: dict[str, np.ndarray]) -> bytes:
    p = tmp / f"t{len(list(tmp.iterdir()))}.safetensors"
    save_file(tensors, str(p))
    return p.read_bytes()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding ``org/tiny`` (main: one file; a second
    commit) and ``org/sharded`` (an index and two files)."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cache = home / "hub"
    config = json.dumps({"num_attention_heads": 2}).encode()
    _snapshot(
        cache,
        "org/tiny",
        REV,
        {"model.safetensors": _bytes(scratch, {"fc.weight": W}), "config.json": config},
        "main",
    )
    _snapshot(
        cache, "org/tiny", REV2, {"model.safetensors": _bytes(scratch, {"fc.weight": W2})}, "v2"
    )
    index = {
        "metadata": {"total_size": 256},
        "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"},
    }
    _snapshot(
        cache,
        "org/sharded",
        REV,
        {
            "model.safetensors.index.json": json.dumps(index).encode(),
            "m-1.safetensors": _bytes(scratch, {"a": W}),
            "m-2.safetensors": _bytes(scratch, {"b": W2}),
        },
        "main",
    )
    return cache


def test_load_a_cached_repo_offline(hub):
    out = ms.load_safetensors("hf://org/tiny")
    assert (np.asarray(out["fc"]["weight"]) == W).all()
    sharded = ms.load_safetensors("hf://org/sharded")  # links into blobs/ are the cache's own
    assert (np.asarray(sharded["b"]) == W2).all()


def test_revision_by_branch_and_by_commit(hub):
    assert (np.asarray(ms.load_safetensors("hf://org/tiny@v2")["fc"]["weight"]) == W2).all()
    by_commit = ms.load_safetensors(f"hf://org/tiny@{REV2}")
    assert (np.asarray(by_commit["fc"]["weight"]) == W2).all()
    assert (np.asarray(ms.load_safetensors(f"hf://org/tiny@{REV}")["fc"]["weight"]) == W).all()


def test_export_and_unmap_take_a_hub_reference(hub, tmp_path):
    wm = ms.WeightMap([ms.MapRule(r"(\w+)\.weight", "{1}/kernel", transpose=(1, 0))])
    model = ms.load_safetensors("hf://org/tiny", mapping=wm)
    out = ms.save_safetensors(
        tmp_path / "out.safetensors", model, reference="hf://org/tiny", mapping=wm
    )
    assert load_file(str(out))["fc.weight"].tobytes() == W.tobytes()
    back = ms.unmap(model, reference="hf://org/tiny", mapping=wm)
    assert back["fc.weight"].tobytes() == W.tobytes()


def test_a_repo_not_in_the_cache_offline_is_a_checkpoint_error(hub, monkeypatch):
    import huggingface_hub

    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def spy(repo_id, **kw):
        calls.append(kw)
        return real(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors("hf://org/absent")
    assert str(e.value) == (
        f"hf://org/absent: repository org/absent is not in the Hugging Face cache ({hub}) "
        "and HF_HUB_OFFLINE is set: nothing was downloaded"
    )
    assert [c["local_files_only"] for c in calls] == [True]  # the cache only, no download
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors("hf://org/tiny@nosuchbranch")
    assert str(e.value).startswith(
        "hf://org/tiny@nosuchbranch: repository org/tiny at revision nosuchbranch is not in"
    )


def test_without_offline_a_missing_repo_downloads_only_weights_and_json(hub, monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    save_file({"fc.weight": W}, str(fetched / "model.safetensors"))
    calls: list[dict] = []

    def fake(repo_id, **kw):  # the network: what was asked for, and a snapshot
        calls.append(dict(kw, repo_id=repo_id))
        if kw.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    out = ms.load_safetensors("hf://org/new@v1")
    assert (np.asarray(out["fc"]["weight"]) == W).all()
    assert [(c["repo_id"], c["revision"], c.get("local_files_only", False)) for c in calls] == [
        ("org/new", "v1", True),
        ("org/new", "v1", False),
    ]
    assert calls[1]["allow_patterns"] == ["*.safetensors", "*.json"]

    binonly = tmp_path / "binonly"
    binonly.mkdir()
    (binonly / "config.json").write_text("{}")  # what a .bin-only repository yields

    def bin_only(repo_id, **kw):
        if kw.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        return str(binonly)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", bin_only)
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors("hf://org/old")
    assert str(e.value) == (
        "hf://org/old: repository org/old holds no complete safetensors checkpoint (its "
        "*.safetensors and *.json files were fetched; weights only in PyTorch .bin files "
        "cannot be read)"
    )

    def refused(repo_id, **kw):
        if kw.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        raise OSError("[Errno 111] Connection refused")  # no network

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors("hf://org/gone")
    assert str(e.value) == (
        "hf://org/gone: repository org/gone could not be downloaded: "
        "OSError: [Errno 111] Connection refused"
    )


def test_malformed_ids_and_a_missing_huggingface_hub(hub, monkeypatch):
    for bad in ("hf://", "hf://org/name/extra", "hf://org/../x", "hf://org/name@"):
        with pytest.raises(ms.CheckpointError) as e:
            ms.load_safetensors(bad)
        assert str(e.value) == (
            f"{bad}: not a Hub repository id (want hf://org/name or hf://org/name@revision)"
        )
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors("hf://org/tiny")
    assert str(e.value) == (
        "hf://org/tiny: hf:// paths need huggingface_hub (pip install 'modelshard[hf]')"
    )


def test_import_modelshard_does_not_import_huggingface_hub():
    code = "import sys, modelshard; print('huggingface_hub' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_hub_snapshot_with_a_link_out_of_its_repo_is_refused(hub):
    """The cache's links into ``blobs/`` are allowed; one to anywhere else is not."""
    outside = hub.parent / "elsewhere.safetensors"
    save_file({"b": W}, str(outside))
    snap = hub / "models--org--sharded" / "snapshots" / REV
    (snap / "m-2.safetensors").unlink()
    (snap / "m-2.safetensors").symlink_to(outside)
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors("hf://org/sharded")
    assert str(e.value) == (
        f"{snap / 'model.safetensors.index.json'}: 1 problem in the index:\n"
        f"  m-2.safetensors: outside the index's directory (a link to {outside.resolve()}), "
        "named for b; refused"
    )


def test_cli_inspect_and_convert_take_hub_ids(hub, tmp_path, capsys):
    from modelshard.cli import main

    assert main(["inspect", "hf://org/sharded", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["format"] == "safetensors"
    assert sorted(t["name"] for t in data["tensors"]) == ["a", "b"]
    mapping = tmp_path / "map.toml"
    mapping.write_text(
        "[[rules]]\nsource = '(\\w+)\\.weight'\ntarget = '{1}/kernel'\ntranspose = [1, 0]\n"
    )
    ck = tmp_path / "ck"
    assert main(["convert", "hf://org/tiny@v2", str(ck), "--mapping", str(mapping)]) == 0
    assert (np.asarray(ms.restore(ck)["fc"]["kernel"]) == W2.T).all()
    out = tmp_path / "back.safetensors"
    args = ["convert", str(ck), str(out), "--to", "safetensors", "--mapping", str(mapping)]
    assert main([*args, "--reference", "hf://org/tiny"]) == 0
    assert load_file(str(out))["fc.weight"].tobytes() == W2.tobytes()
    capsys.readouterr()
    assert main(["convert", "hf://org/absent", str(tmp_path / "no")]) == 1
    assert "repository org/absent is not in the Hugging Face cache" in capsys.readouterr().err


def test_an_incomplete_cached_snapshot_is_downloaded_or_refused(hub, monkeypatch, tmp_path):
    """A download interrupted part-way (the index and one of its two files) is not taken
    for the checkpoint: offline it is an error saying so; online it is downloaded."""
    import huggingface_hub

    (hub / "models--org--sharded" / "snapshots" / REV / "m-2.safetensors").unlink()
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors("hf://org/sharded")
    assert str(e.value).startswith(
        "hf://org/sharded: repository org/sharded is not complete in the Hugging Face cache"
    )
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    save_file({"a": W}, str(fetched / "model.safetensors"))
    calls: list[bool] = []
    real = huggingface_hub.snapshot_download

    def net(repo_id, **kw):
        calls.append(bool(kw.get("local_files_only")))
        return real(repo_id, **kw) if kw.get("local_files_only") else str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", net)
    assert (np.asarray(ms.load_safetensors("hf://org/sharded")["a"]) == W).all()
    assert calls == [True, False]
