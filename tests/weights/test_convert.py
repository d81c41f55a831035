"""``modelshard convert``: safetensors to a checkpoint and back, streamed (no whole state
in host memory, nothing placed on the devices)."""

from __future__ import annotations

import importlib
import io
import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import modelshard as ms
from modelshard._weights.safetensors import SafetensorsFiles
from modelshard.cli import main

reshard = importlib.import_module("modelshard._checkpoint.resharding")
weights_load = importlib.import_module("modelshard._weights.load")
RNG = np.random.default_rng(3)
D, F = 16, 24

MAP = r"""
[[rules]]
source = 'l\.(\d+)\.(q|k|v)\.weight'
target = "layers/{1}/qkv/kernel"
transpose = [1, 0]
concat = { group = 2, axis = 1, order = ["q", "k", "v"] }

[[rules]]
source = 'l\.(\d+)\.up\.weight'
target = "layers/{1}/up/kernel"
transpose = [1, 0]

[[rules]]
source = 'norm\.weight'
target = "norm/scale"
"""

RULES = """
[[rules]]
pattern = "kernel$"
spec = ["none", "data"]

[[rules]]
pattern = ".*"
spec = []
"""


def _files(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, np.ndarray]]:
    bf = ml_dtypes.bfloat16
    src = {"norm.weight": RNG.standard_normal(D).astype(bf)}
    for i in range(2):
        for n in "qkv":
            src[f"l.{i}.{n}.weight"] = RNG.standard_normal((D, D)).astype(bf)
        src[f"l.{i}.up.weight"] = RNG.standard_normal((F, D)).astype(bf)
    path = tmp_path / "model.safetensors"
    save_file(src, str(path))
    (tmp_path / "map.toml").write_text(MAP)
    (tmp_path / "rules.toml").write_text(RULES)
    return path, tmp_path / "map.toml", tmp_path / "rules.toml", src


def test_convert_streams_each_leaf_into_the_checkpoint(tmp_path, mesh8, monkeypatch, capsys):
    path, wm, rules, src = _files(tmp_path)
    read: dict[str, int] = {}
    real, real_map = SafetensorsFiles.read_rows, SafetensorsFiles.mapped

    def spy(self, name, lo, hi, *into):
        out = real(self, name, lo, hi, *into)
        read[name] = read.get(name, 0) + out.nbytes
        return out

    def spy_map(self, name):
        out = real_map(self, name)
        read[name] = read.get(name, 0) + out.nbytes
        return out

    def placed(*a, **k):
        raise AssertionError("convert placed a leaf on the devices")

    monkeypatch.setattr(SafetensorsFiles, "read_rows", spy)
    monkeypatch.setattr(SafetensorsFiles, "mapped", spy_map)
    monkeypatch.setattr(weights_load, "build_leaf", placed)
    args = ["convert", str(path), str(tmp_path / "ck"), "--mapping", str(wm)]
    args += ["--mesh", "data=8", "--rules", str(rules), "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["leaves"] == 5
    # every stored tensor read (or mapped) once: exactly its bytes
    assert read == {k: v.nbytes for k, v in src.items()}
    monkeypatch.undo()
    got = ms.restore(tmp_path / "ck")
    want = ms.load_safetensors(
        path, mapping=wm, specs=ms.load_rules(rules), mesh=ms.make_mesh({"data": 8})
    )
    assert got["layers"]["1"]["qkv"]["kernel"].sharding.spec == P(None, "data")
    for a, b in (
        (got["layers"]["1"]["qkv"]["kernel"], want["layers"]["1"]["qkv"]["kernel"]),
        (got["layers"]["0"]["up"]["kernel"], want["layers"]["0"]["up"]["kernel"]),
        (got["norm"]["scale"], want["norm"]["scale"]),
    ):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_convert_back_reads_one_checkpoint_leaf_at_a_time(tmp_path, monkeypatch, capsys):
    path, wm, _, src = _files(tmp_path)
    assert main(["convert", str(path), str(tmp_path / "ck"), "--mapping", str(wm)]) == 0
    capsys.readouterr()
    boxes: list[tuple[str, tuple[slice, ...]]] = []
    real = reshard.ArrayReader.__call__

    def spy(self, box):
        boxes.append((self.rec.path, box))
        return real(self, box)

    monkeypatch.setattr(reshard.ArrayReader, "__call__", spy)
    back = tmp_path / "back.safetensors"
    args = ["convert", str(tmp_path / "ck"), str(back), "--to", "safetensors"]
    assert main([*args, "--mapping", str(wm), "--reference", str(path)]) == 0
    # every checkpoint leaf read alone and once, straight from its store (no Orbax restore,
    # no device): never the whole state on the host
    layers = [f"layers/{i}/{n}/kernel" for i in range(2) for n in ("qkv", "up")]
    assert sorted(p for p, _ in boxes) == sorted([*layers, "norm/scale"])
    got = load_file(str(back))
    assert sorted(got) == sorted(src)
    assert all(got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes() for k, v in src.items())


def test_convert_back_verifies_each_leaf(tmp_path, capsys):
    path, wm, _, _ = _files(tmp_path)
    assert main(["convert", str(path), str(tmp_path / "ck"), "--mapping", str(wm)]) == 0
    record = tmp_path / "ck" / "modelshard.json"
    doc = json.loads(record.read_text())
    leaf = next(x for x in doc["leaves"] if x["path"] == "norm/scale")
    leaf["checksum"] = "00000000:00000000"
    record.write_text(json.dumps(doc))
    capsys.readouterr()
    back = tmp_path / "back.safetensors"
    args = ["convert", str(tmp_path / "ck"), str(back), "--to", "safetensors"]
    assert main([*args, "--mapping", str(wm), "--reference", str(path)]) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "norm/scale" in err
    assert not back.exists()


def test_convert_in_small_slabs_writes_the_same_checkpoint(tmp_path, capsys):
    """--chunk-mb bounds the host memory in flight: a tiny chunk cuts every leaf into
    row slabs, and the checkpoint holds the same bytes as one written in whole leaves."""
    path, wm, rules, _ = _files(tmp_path)
    common = ["--mapping", str(wm), "--mesh", "data=8", "--rules", str(rules)]
    assert main(["convert", str(path), str(tmp_path / "whole"), *common]) == 0
    assert (
        main(["convert", str(path), str(tmp_path / "small"), *common, "--chunk-mb", "0.001"]) == 0
    )
    capsys.readouterr()
    whole, small = ms.restore(tmp_path / "whole"), ms.restore(tmp_path / "small")
    a, b = jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(small)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b, strict=True):
        assert x.sharding == y.sharding and np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_convert_back_without_reference_in_the_sharded_layout(tmp_path, capsys):
    """--to safetensors without --reference: every leaf under its own path ('.' for '/');
    --max-shard-size: Hugging Face's sharded layout, read back bit for bit."""
    path, wm, _, _ = _files(tmp_path)
    assert main(["convert", str(path), str(tmp_path / "ck"), "--mapping", str(wm)]) == 0
    state = ms.restore(tmp_path / "ck")
    capsys.readouterr()
    out = tmp_path / "hf"
    args = ["convert", str(tmp_path / "ck"), str(out), "--to", "safetensors", "--json"]
    assert main([*args, "--max-shard-size", "2KB"]) == 0
    data = json.loads(capsys.readouterr().out)
    index = out / "model.safetensors.index.json"
    assert data["destination"] == str(index)
    doc = json.loads(index.read_text())
    assert sorted(doc["weight_map"]) == sorted(
        ["norm.scale"] + [f"layers.{i}.{n}.kernel" for i in range(2) for n in ("qkv", "up")]
    )
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(set(doc["weight_map"].values()))
    assert data["bytes"] == sum((out / s).stat().st_size for s in shards)
    back = ms.load_safetensors(index)
    for leaf in ("layers/1/qkv/kernel", "norm/scale"):
        a, b = state, back
        for k in leaf.split("/"):
            a, b = a[k], b[k]
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with safe_open(str(out / shards[0]), "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_convert_size_and_progress_flags(tmp_path, capsys, monkeypatch):
    path, wm, _, _ = _files(tmp_path)
    ck = str(tmp_path / "ck")
    assert main(["convert", str(path), ck, "--mapping", str(wm), "--json"]) == 0
    capsys.readouterr()
    assert main(["convert", str(path), str(tmp_path / "x"), "--max-shard-size", "1GB"]) == 1
    assert "--max-shard-size writes safetensors: pass --to safetensors" in capsys.readouterr().err
    bad = ["convert", ck, str(tmp_path / "y"), "--to", "safetensors", "--max-shard-size", "5XB"]
    assert main(bad) == 2
    assert "max_shard_size='5XB': want a positive number of bytes" in capsys.readouterr().err

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    for flags, drawn in (([], True), (["--no-progress"], False)):
        err = Tty()
        monkeypatch.setattr("sys.stderr", err)
        dest = str(tmp_path / f"out{len(flags)}.safetensors")
        assert main(["convert", ck, dest, "--to", "safetensors", *flags]) == 0
        assert ("writing" in err.getvalue()) is drawn, err.getvalue()


def test_convert_back_refuses_a_tied_leaf_changed_since_it_was_loaded(tmp_path, capsys):
    """An ``also`` rule (a head filled from the embedding): the export writes the tensor
    once, and refuses when the head no longer equals it, writing nothing."""
    emb = RNG.standard_normal((8, 4)).astype(np.float32)
    path = tmp_path / "tied.safetensors"
    save_file({"embed.weight": emb}, str(path))
    wm = tmp_path / "tied.toml"
    wm.write_text(
        "[[rules]]\nsource = 'embed\\.weight'\ntarget = 'embed/embedding'\n\n"
        "[[rules]]\nsource = 'embed\\.weight'\ntarget = 'head/kernel'\ntranspose = [1, 0]\n"
        "also = true\n"
    )
    state = ms.load_safetensors(path, mapping=wm)
    ok, bad = tmp_path / "ok", tmp_path / "bad"
    ms.save(ok, state)
    state["head"]["kernel"] = state["head"]["kernel"] + 1  # fine-tuned apart
    ms.save(bad, state)
    back = tmp_path / "back.safetensors"
    args = ["--to", "safetensors", "--mapping", str(wm), "--reference", str(path)]
    assert main(["convert", str(ok), str(back), *args]) == 0
    assert load_file(str(back))["embed.weight"].tobytes() == emb.tobytes()
    back.unlink()
    capsys.readouterr()
    assert main(["convert", str(bad), str(back), *args]) == 1
    err = capsys.readouterr().err
    assert "head/kernel" in err and not back.exists()
