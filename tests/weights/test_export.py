"""``save_safetensors`` without a reference, Hugging Face's sharded layout, the progress
bar, and where an export may be written."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file

import modelshard as ms
from modelshard._base import progress as progress_mod
from modelshard._weights.safetensors import parse_size, write_sharded


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.norm = nnx.RMSNorm(16, param_dtype=jnp.bfloat16, rngs=rngs)


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(3)])
        self.count = nnx.Variable(jnp.arange(4, dtype=jnp.int32))


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def _leaves(tree: Any) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(
        nnx.state(tree) if isinstance(tree, nnx.Module) else tree
    )[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def _sharded_model(mesh) -> Model:
    model = Model(nnx.Rngs(0))
    rules = ms.Rules([(r"kernel$", P(None, "data")), (r"embedding$", P("data")), (r".*", P())])
    return ms.shard(model, rules, mesh)


def test_export_without_reference_reads_back_bit_exact(tmp_path, mesh8):
    model = _sharded_model(mesh8)
    kernel = model.layers[1].up.kernel[...]
    assert isinstance(kernel.sharding, NamedSharding) and kernel.sharding.spec == P(None, "data")
    out = ms.save_safetensors(tmp_path / "model.safetensors", model)
    stored = load_file(str(out))
    assert sorted(stored) == sorted(
        ["embed.embedding", "count"]
        + [f"layers.{i}.up.{w}" for i in range(3) for w in ("kernel", "bias")]
        + [f"layers.{i}.norm.scale" for i in range(3)]
    )
    assert stored["layers.1.up.kernel"].tobytes() == np.asarray(kernel).tobytes()
    assert stored["layers.2.norm.scale"].dtype == ml_dtypes.bfloat16
    assert stored["count"].dtype == np.int32
    assert _header(out)["__metadata__"] == {"format": "pt"}
    # the default mapping reads it back as the same tree
    fresh = Model(nnx.Rngs(1))
    back = ms.load_safetensors(out, like=fresh)
    assert isinstance(back, Model)
    want, got = _leaves(model), _leaves(back)
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k
    nested = ms.load_safetensors(out)  # no like: a nested dict of the same paths
    assert np.asarray(nested["layers"]["0"]["up"]["bias"]).tobytes() == (
        np.asarray(model.layers[0].up.bias[...]).tobytes()
    )


def test_export_dtype_casts_floats_only_and_metadata_is_the_users(tmp_path):
    state = {"w": jnp.linspace(0, 1, 12, dtype=jnp.float32).reshape(3, 4), "n": jnp.arange(3)}
    out = ms.save_safetensors(
        tmp_path / "bf16.safetensors", state, dtype="bfloat16", metadata={"source": "test"}
    )
    stored = load_file(str(out))
    assert stored["w"].dtype == ml_dtypes.bfloat16 and stored["n"].dtype == np.int32
    assert stored["w"].tobytes() == np.asarray(state["w"]).astype(ml_dtypes.bfloat16).tobytes()
    assert _header(out)["__metadata__"] == {"source": "test"}


def test_leaves_that_cannot_be_written_in_their_own_names_are_listed(tmp_path):
    state = {
        "v1.2": {"w": jnp.ones(2)},
        "rng": jax.random.key(0),
        "ok": jnp.ones(2),
    }
    with pytest.raises(ms.MappingError) as e:
        ms.save_safetensors(tmp_path / "x.safetensors", state)
    text = e.value.report()
    assert "state:v1.2/w" in text
    assert "path component 'v1.2' holds a '.', which loading reads as '/'" in text
    assert "state:rng" in text and "has no safetensors code" in text
    assert not any(tmp_path.iterdir())  # nothing written
    with pytest.raises(ms.MappingError) as e:
        ms.save_safetensors(
            tmp_path / "x.safetensors", {"a": jnp.ones(2)}, mapping=ms.WeightMap([])
        )
    assert "no reference= was given" in e.value.report()


def _hf_split(tensors: dict[str, np.ndarray], max_shard_size: int | str) -> Any:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    return huggingface_hub.split_state_dict_into_shards_factory(
        tensors,
        get_storage_size=lambda a: a.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )


@pytest.mark.parametrize(
    ("max_shard_size", "nbytes"), [(2200, 2200), ("3KB", 3000), ("4KiB", 4096), ("1GB", 10**9)]
)
def test_sharded_layout_is_the_one_huggingface_writes(tmp_path, mesh8, max_shard_size, nbytes):
    state = {
        "a": jnp.ones((8, 64), jnp.float32),  # 2 KiB
        "big": jnp.arange(8 * 256, dtype=jnp.float32).reshape(8, 256),  # 8 KiB: a shard alone
        "c": jnp.zeros((8, 32), jnp.bfloat16),  # 512 B
        "d": jnp.full((8, 64), 3, jnp.int32),  # 2 KiB
    }
    state = ms.shard(state, P("data"), mesh8)
    out = ms.save_safetensors(tmp_path / "ckpt", state, max_shard_size=max_shard_size)
    stored = {k.replace("/", "."): np.asarray(v) for k, v in state.items()}
    split = _hf_split(stored, nbytes)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    if not split.is_sharded:
        assert out == tmp_path / "ckpt" / "model.safetensors" and files == ["model.safetensors"]
        return
    assert out == tmp_path / "ckpt" / "model.safetensors.index.json"
    assert files == sorted([*split.filename_to_tensors, "model.safetensors.index.json"])
    index = json.loads(out.read_text())
    assert index == {"metadata": {"total_size": 12800}, "weight_map": split.tensor_to_filename}
    assert out.read_text() == json.dumps(index, indent=2, sort_keys=True) + "\n"  # transformers'
    for file, names in split.filename_to_tensors.items():
        with safe_open(str(tmp_path / "ckpt" / file), "np") as f:
            assert sorted(f.keys()) == sorted(names)
            assert f.metadata() == {"format": "pt"}
    back = ms.load_safetensors(out, like=state)
    for k in state:
        assert np.asarray(back[k]).tobytes() == stored[k].tobytes()


def test_sharded_names_from_a_file_or_index_path_and_stale_shards(tmp_path):
    state = {f"w{i}": jnp.full((256,), i, jnp.float32) for i in range(3)}  # 1 KiB each
    d = tmp_path / "out"
    out = ms.save_safetensors(d / "weights.safetensors.index.json", state, max_shard_size=1024)
    assert out == d / "weights.safetensors.index.json"
    assert sorted(p.name for p in d.iterdir()) == [
        "weights-00001-of-00003.safetensors",
        "weights-00002-of-00003.safetensors",
        "weights-00003-of-00003.safetensors",
        "weights.safetensors.index.json",
    ]
    out = ms.save_safetensors(d / "weights.safetensors", state, max_shard_size=2048)
    assert out == d / "weights.safetensors.index.json"
    assert sorted(p.name for p in d.iterdir()) == [  # the 3-shard files are gone
        "weights-00001-of-00002.safetensors",
        "weights-00002-of-00002.safetensors",
        "weights.safetensors.index.json",
    ]
    out = ms.save_safetensors(d / "weights.safetensors", state, max_shard_size="1MB")
    assert out == d / "weights.safetensors"
    assert sorted(p.name for p in d.iterdir()) == ["weights.safetensors"]
    assert (np.asarray(ms.load_safetensors(d)["w2"]) == 2).all()


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
        write_sharded(tmp_path, items, compute, None, 1024)
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


def test_where_an_export_may_go(tmp_path):
    state = {"w": jnp.ones(4)}
    deep = tmp_path / "new" / "dir" / "model.safetensors"
    assert ms.save_safetensors(deep, state) == deep  # parents made, as save_pretrained does
    assert load_file(str(deep))["w"].tolist() == [1.0] * 4
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ms.CheckpointError) as e:
        ms.save_safetensors(tmp_path / "afile" / "model.safetensors", state)
    assert str(e.value) == (
        f"{tmp_path / 'afile'}: cannot be the directory to write safetensors into (it, or a "
        "parent of it, is a file)"
    )
    index = tmp_path / "model.safetensors.index.json"
    with pytest.raises(ms.CheckpointError) as e:
        ms.save_safetensors(index, state)
    assert str(e.value) == (
        f"{index}: an index file name; a safetensors file would be written under it. Pass a "
        ".safetensors file name, or max_shard_size= to write a sharded checkpoint with this "
        "index"
    )
    assert not index.exists()
    with pytest.raises(ms.CheckpointError) as e:
        ms.save_safetensors(tmp_path / "new", state)
    assert str(e.value) == f"{tmp_path / 'new'}: a directory; pass a .safetensors file name in it"


# ---- progress ----------------------------------------------------------------------------


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def small_threshold(monkeypatch):
    """Every load and export counts as large (the threshold is 256 MiB)."""
    monkeypatch.setattr(progress_mod, "MIN_BYTES", 0)


def test_a_bar_in_bytes_on_a_terminal_only(tmp_path, monkeypatch, small_threshold):
    state = {"w": jnp.ones((256, 256))}  # 256 KiB
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich would draw into a pipe; we do not
    for tty, shown in ((True, True), (False, False)):
        err = _Stream(tty)
        monkeypatch.setattr("sys.stderr", err)
        path = ms.save_safetensors(tmp_path / "m.safetensors", state)
        ms.load_safetensors(path)
        text = err.getvalue()
        if shown:
            assert "Writing safetensors" in text and "Loading safetensors" in text
            assert "256.0/256.0 KiB" in text
        else:
            assert text == ""
    err = _Stream(True)
    monkeypatch.setattr("sys.stderr", err)
    path = ms.save_safetensors(tmp_path / "m.safetensors", state, progress=False)
    ms.load_safetensors(path, progress=False)
    assert err.getvalue() == ""


def test_small_work_draws_no_bar_and_a_callable_gets_bytes(tmp_path, monkeypatch, capfd):
    err = _Stream(True)
    monkeypatch.setattr("sys.stderr", err)
    state = {"a": jnp.ones((64, 64)), "b": jnp.zeros((32,), jnp.bfloat16)}
    path = ms.save_safetensors(tmp_path / "m.safetensors", state)  # 16 KiB < 256 MiB
    ms.load_safetensors(path)
    assert err.getvalue() == ""
    seen: list[tuple[int, int]] = []
    ms.save_safetensors(
        tmp_path / "n", state, max_shard_size=1, progress=lambda d, t: seen.append((d, t))
    )
    assert seen == [(16384, 16448), (16448, 16448)]
    seen.clear()
    ms.load_safetensors(tmp_path / "n", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (16448, 16448) and len(seen) == 2
    assert capfd.readouterr() == ("", "")


def test_a_tensor_computed_in_row_blocks_must_fill_its_entry(tmp_path):
    """The writer takes a tensor as blocks of whole rows (a leaf sharded along its first
    axis, shard by shard); blocks that do not make up the entry are refused, nothing left."""
    from modelshard._weights.safetensors import write_safetensors

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


def test_a_reference_export_in_the_sharded_layout(tmp_path):
    """max_shard_size with reference=: the reference's names, shapes and dtypes, in shards."""
    from safetensors.numpy import save_file

    ref = {f"l.{i}.weight": np.full((8, 32), i, ml_dtypes.bfloat16) for i in range(3)}  # 512 B
    save_file(ref, str(tmp_path / "ref.safetensors"))
    wm = ms.WeightMap([ms.MapRule(r"l\.(\d+)\.weight", "layers/{1}/kernel", transpose=(1, 0))])
    state = ms.load_safetensors(tmp_path / "ref.safetensors", mapping=wm, dtype="float32")
    out = ms.save_safetensors(
        tmp_path / "out",
        state,
        reference=tmp_path / "ref.safetensors",
        mapping=wm,
        dtype="float32",
        max_shard_size=1100,
    )
    index = json.loads(out.read_text())
    assert index["weight_map"] == {
        "l.0.weight": "model-00001-of-00002.safetensors",
        "l.1.weight": "model-00001-of-00002.safetensors",
        "l.2.weight": "model-00002-of-00002.safetensors",
    } and index["metadata"] == {"total_size": 1536}
    back = {}
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        back.update(load_file(str(tmp_path / "out" / f)))
    assert all(
        back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes() for k, v in ref.items()
    )
