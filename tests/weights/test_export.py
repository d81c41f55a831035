"""``save_safetensors`` from every process of a run, what it refuses, and when it replaces.

The multi-process test starts ``modelshard launch -n 2 --devices-per-process 4`` on
``mp_export.py`` (bounded by the launcher's ``--timeout`` and a SIGKILL backstop around
it) and compares the files the two processes wrote together with a one-process export of
the same state, here, on this process's 8 CPU devices: byte for byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
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
from safetensors.numpy import load_file, save_file

import modelshard as ms
from modelshard import _launch
from modelshard._weights import shared

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
    cmd = [
        sys.executable,
        _launch.__file__,
        "-n",
        "2",
        "--devices-per-process",
        "4",
        "--timeout",
        str(LAUNCH_TIMEOUT),
        "--grace",
        "1",
        "--",
        sys.executable,
        str(SCRIPT),
        str(out),
    ]
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
    assert r0["full"] == {
        "error": "DistributedError",
        "message": "save_safetensors: process 1 failed to write its part of the export: "
        "OSError: [Errno 28] No space left on device",
    }
    assert r1["full"] == {"error": "OSError", "message": "[Errno 28] No space left on device"}


# ---- one process -------------------------------------------------------------------------


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
