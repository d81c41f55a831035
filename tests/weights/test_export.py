"""``save_safetensors`` without a reference, Hugging Face's sharded layout, the progress
bar, where an export may be written, what it refuses and when it replaces; and the export
that every process of a run writes together.

The multi-process test starts ``modelshard launch -n 2 --devices-per-process 4`` on
``mp_export.py`` (bounded by the launcher's ``--timeout`` and a SIGKILL backstop around
it) and compares the files the two processes wrote together with a one-process export of
the same state, here, on this process's 8 CPU devices: byte for byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import itertools
import json
import os
import struct
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import modelshard as ms
from helpers import launch_argv
from modelshard._base import progress as progress_mod
from modelshard._weights import multiprocess_writing as shared

# one worker runs this file (its module fixtures start processes once)
pytestmark = pytest.mark.xdist_group("export")


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
    out = ms.save_safetensors(d / "weights.safetensors", state, max_shard_size=2048, overwrite=True)
    assert out == d / "weights.safetensors.index.json"
    assert sorted(p.name for p in d.iterdir()) == [  # the 3-shard files are gone
        "weights-00001-of-00002.safetensors",
        "weights-00002-of-00002.safetensors",
        "weights.safetensors.index.json",
    ]
    out = ms.save_safetensors(
        d / "weights.safetensors", state, max_shard_size="1MB", overwrite=True
    )
    assert out == d / "weights.safetensors"
    assert sorted(p.name for p in d.iterdir()) == ["weights.safetensors"]
    assert (np.asarray(ms.load_safetensors(d)["w2"]) == 2).all()


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
    # any other path is a model directory, the weights in it under save_pretrained's name
    assert ms.save_safetensors(tmp_path / "new", state) == tmp_path / "new" / "model.safetensors"


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
        path = ms.save_safetensors(tmp_path / "m.safetensors", state, overwrite=True)
        ms.load_safetensors(path)
        text = err.getvalue()
        if shown:
            assert "Writing safetensors" in text and "Loading safetensors" in text
            assert "256.0/256.0 KiB" in text
        else:
            assert text == ""
    err = _Stream(True)
    monkeypatch.setattr("sys.stderr", err)
    path = ms.save_safetensors(tmp_path / "m.safetensors", state, progress=False, overwrite=True)
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


# ---- every process of a run: one export; what is refused; when it replaces ----------------

SCRIPT = Path(__file__).parent / "mp_export.py"
_spec = importlib.util.spec_from_file_location("mp_export", SCRIPT)
assert _spec is not None and _spec.loader is not None
mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mp)

LAUNCH_TIMEOUT = 300  # seconds: a bound for a loaded 2-core machine, not an expectation


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("mp_export")
    cmd = launch_argv(sys.executable, str(SCRIPT), str(out), timeout=LAUNCH_TIMEOUT)
    # The launcher bounds its processes; killing it (the backstop) kills them too.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT + 30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((out / f"result_{i}.json").read_text()) for i in range(2)]
    return out, results


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The same exports from this one process (8 devices, the same data=2, model=4 mesh)."""
    out = tmp_path_factory.mktemp("one_export")
    st = mp.state(ms.make_mesh({"data": 2, "model": 4}))
    for kw in mp.EXPORTS.values():
        kw = dict(kw)
        ms.save_safetensors(out / kw.pop("path"), st, **kw)
    like, wm, reference = mp.mapped(st)
    ms.save_safetensors(
        out / "mapped/model.safetensors",
        like,
        reference=reference,
        mapping=wm,
        max_shard_size="5MB",
    )
    return out


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux")
def test_every_process_writes_one_export_equal_to_a_one_process_export(two_processes, one_process):
    out, results = two_processes
    single = _files(one_process)
    both = _files(out)
    # "one" was replaced last by its bfloat16 export: as the "bf16" export
    assert both.pop("one/model.safetensors") == single["bf16/model.safetensors"]
    fp32 = hashlib.sha256(single.pop("one/model.safetensors")).hexdigest()
    assert {k: v for k, v in both.items() if not k.startswith("result_")} == single
    assert "sharded/model-00007-of-00007.safetensors" in single  # several files, one index
    assert "mapped/model-00004-of-00004.safetensors" in single
    # the tensors themselves, against the values every process started from
    want = mp.values()
    stored = load_file(str(out / "bf16/model.safetensors"))
    assert sorted(stored) == sorted(k.replace("/", ".") for k in want)
    for k, v in want.items():
        cast = v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v
        assert stored[k.replace("/", ".")].tobytes() == cast.tobytes(), k
    back = ms.load_safetensors(out / "sharded")
    for k, v in want.items():
        kind, size = k.split("/")
        assert np.asarray(back[kind][size]).tobytes() == v.tobytes(), k
    index = json.loads((out / "mapped/model.safetensors.index.json").read_text())
    for k, v in want.items():
        name = k.replace("/", "_") + ".weight"
        f = out / "mapped" / index["weight_map"][name]
        assert load_file(str(f))[name].tobytes() == v.T.tobytes(), name

    r0, r1 = results
    assert not any(k.startswith("mine_") for k in both)  # refused before anything is written
    for key in ("one", "sharded", "bf16", "mapped", "replace"):
        assert r0[key]["ok"] == r1[key]["ok"], key
    # the writing is shared: each process wrote part of the 14.7 MB, neither all of it
    total = sum(v.nbytes for v in want.values())
    for key in ("one", "sharded"):
        w0, w1 = r0[key]["wrote"], r1[key]["wrote"]
        assert w0 + w1 < 1.05 * total and min(w0, w1) > 0.25 * total, (key, w0, w1, total)

    refused = f"{out / 'one/model.safetensors'} already exists; pass overwrite=True to replace it"
    for r in results:
        assert r["again"] == {"error": "CheckpointError", "message": refused}
        assert r["bad"] == {
            "error": "MappingError",
            "message": "1 mapping problem found (every offending leaf is listed; paths are "
            "arg:path):\n"
            "  state:w\n"
            "    problem: a builtins.complex, not an array: safetensors holds arrays only\n"
            "    hint: make it an array (np.asarray(x)), or leave it out of the exported state",
        }
        assert r["paths"] == {
            "error": "DistributedError",
            "message": "save_safetensors: processes 1 would write another export than process "
            "0 (another path, other leaf names, shapes or dtypes, or other options); every "
            "process must call it with the same path, the same state structure and the same "
            "options",
        }
        # a disk that filled under process 1 alone: raised on both; the old export whole
        assert r["before_full"] == r["after_full"] == fp32
        assert r["after_full_files"] == ["model.safetensors"]  # no temporary left
    for r in results:  # the same error on every process, naming the one that failed
        assert r["full"] == {
            "error": "CheckpointError",
            "message": "save_safetensors: writing the export failed on process 1: "
            "OSError: [Errno 28] No space left on device",
        }


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux")
def test_every_process_returns_from_a_peft_adapter_once_its_files_exist(two_processes):
    """Process 0 writes the adapter (slowed down here); process 1 returns only after."""
    _, results = two_processes
    for r in results:
        assert r["peft"]["ok"].endswith("_peft/adapter"), r["peft"]
        assert r["peft_files_on_return"] == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_state_with_nothing_to_write_is_refused_and_the_file_kept(tmp_path):
    p = tmp_path / "model.safetensors"
    save_file({"w": np.arange(4, dtype=np.float32)}, str(p))
    with pytest.raises(ms.MappingError) as e:
        ms.save_safetensors(p, {"w": object(), "b": [jnp.ones(2), "text"]}, overwrite=True)
    assert str(e.value).splitlines() == [
        "2 mapping problems found (every offending leaf is listed; paths are arg:path):",
        "  state:b/1",
        "    problem: a builtins.str, not an array: safetensors holds arrays only",
        "    hint: make it an array (np.asarray(x)), or leave it out of the exported state",
        "  state:w",
        "    problem: a builtins.object, not an array: safetensors holds arrays only",
        "    hint: make it an array (np.asarray(x)), or leave it out of the exported state",
    ]
    for empty in ({}, {"a": {}, "b": []}):
        with pytest.raises(ms.CheckpointError) as e:
            ms.save_safetensors(p, empty, overwrite=True)
        assert str(e.value) == (
            "nothing to export: the dict has no array leaves (save_safetensors writes arrays only)"
        )
    assert load_file(str(p))["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_registered_containers_static_parts_are_not_weights(tmp_path):
    mlp = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.gelu, key=jax.random.key(0))
    out = ms.save_safetensors(tmp_path / "mlp.safetensors", mlp)
    stored = load_file(str(out))
    assert sorted(stored) == [
        "layers.0.bias",
        "layers.0.weight",
        "layers.1.bias",
        "layers.1.weight",
    ]
    assert stored["layers.1.weight"].tobytes() == np.asarray(mlp.layers[1].weight).tobytes()


def test_an_existing_export_is_replaced_only_with_overwrite(tmp_path):
    p = tmp_path / "model.safetensors"
    ms.save_safetensors(p, {"w": jnp.zeros(3)})
    with pytest.raises(ms.CheckpointError) as e:
        ms.save_safetensors(p, {"w": jnp.ones(3)})
    assert str(e.value) == f"{p} already exists; pass overwrite=True to replace it"
    assert load_file(str(p))["w"].tolist() == [0.0] * 3
    d = tmp_path / "hf"
    ms.save_safetensors(d, {"a": jnp.zeros(256), "b": jnp.zeros(256)}, max_shard_size=1024)
    with pytest.raises(ms.CheckpointError) as e:
        ms.save_safetensors(d / "model.safetensors", {"a": jnp.ones(8)}, max_shard_size="1GB")
    assert str(e.value) == (
        f"{d / 'model.safetensors'} (model-00001-of-00002.safetensors) already exists; pass "
        "overwrite=True to replace it"
    )
    out = ms.save_safetensors(d, {"a": jnp.ones(8)}, max_shard_size="1GB", overwrite=True)
    assert sorted(f.name for f in d.iterdir()) == ["model.safetensors"] and out.parent == d
    # a write that fails midway leaves the old file whole and no temporary behind
    gone = jnp.ones(3)
    gone.delete()
    with pytest.raises(RuntimeError):
        ms.save_safetensors(p, {"a": jnp.ones(3), "w": gone}, overwrite=True)
    assert load_file(str(p))["w"].tolist() == [0.0] * 3
    assert sorted(f.name for f in tmp_path.iterdir()) == ["hf", "model.safetensors"]
    ms.save_safetensors(p, {"w": jnp.ones(3)}, overwrite=True)
    assert load_file(str(p))["w"].tolist() == [1.0] * 3


def test_blocks_written_at_their_offsets_make_the_tensor(tmp_path):
    """What the owners of a leaf split across processes write: every block (whole rows
    in one write, anything else run by run) lands where a C-order tensor has it."""
    rng = np.random.default_rng(0)
    for shape in [(6,), (4, 6), (3, 4, 5), (2, 3, 2, 4)]:
        x = rng.integers(0, 1 << 30, size=shape).astype(np.int32)
        cuts = [sorted({0, d, *rng.integers(0, d, size=2).tolist()}) for d in shape]
        blocks = [tuple(b) for b in itertools.product(*[pairwise(c) for c in cuts])]
        got = {b: x[tuple(slice(lo, hi) for lo, hi in b)] for b in blocks}
        f = tmp_path / "t.bin"
        f.write_bytes(b"\xff" * (8 + x.nbytes))
        fd = os.open(f, os.O_WRONLY)
        try:
            shared._write_blocks(fd, 8, shape, x.dtype, got)
        finally:
            os.close(fd)
        assert f.read_bytes() == b"\xff" * 8 + x.tobytes(), shape
