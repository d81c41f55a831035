"""``save_safetensors`` called by every process of a 2-process run, and the state it writes.

Usage: ``python mp_export.py OUT`` under ``modelshard launch -n 2 --devices-per-process 4``.
Every process builds the same state (from NumPy, no communication) on a ``data=2, model=4``
mesh and calls each export below on the same path under ``OUT``; each writes
``OUT/result_<process>.json`` with what every call returned or raised. Imported by the test
(``state``, ``EXPORTS``), which writes the same exports from one process to compare.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

SIZES = {"tiny": (8, 16), "big": (512, 1024)}  # big: 2 MiB in float32, at least 1 MiB
# (kind, spec): replicated, split within each process, split across processes (rows,
# rows and columns, columns only: written run by run), process-local (NumPy, one device)
LEAVES = [
    ("replicated", ()),
    ("within", (None, "model")),
    ("rows", ("data", None)),
    ("grid", ("data", "model")),
    ("columns", (None, ("data", "model"))),
    ("numpy", None),
    ("device", None),
]


def values() -> dict[str, np.ndarray]:
    """Every leaf's value: distinct per leaf, exact in bfloat16 casts of small integers."""
    out = {}
    for i, (kind, _) in enumerate(LEAVES):
        for size, shape in SIZES.items():
            n = int(np.prod(shape))
            dt = np.int32 if kind == "device" and size == "tiny" else np.float32
            out[f"{kind}/{size}"] = ((np.arange(n) * 7 + i) % 1000).astype(dt).reshape(shape)
    return out


def state(mesh: Any) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    specs = dict(LEAVES)
    out: dict[str, Any] = {}
    for path, v in values().items():
        kind, size = path.split("/")
        spec = specs[kind]
        if kind == "numpy":
            x: Any = v
        elif kind == "device":
            x = jax.device_put(v, jax.local_devices()[0])
        else:
            x = jax.make_array_from_callback(
                v.shape, NamedSharding(mesh, P(*spec)), lambda idx, v=v: v[idx]
            )
        out.setdefault(kind, {})[size] = x
    return out


def mapped(st: dict[str, Any]) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """A mapped export: every leaf written transposed under ``NAME.weight`` (PyTorch's
    ``[out, in]``), reading leaves that span processes."""
    import jax

    import modelshard as ms

    flat = {f"{k}_{s}": x for k, d in st.items() for s, x in d.items()}
    reference = {
        f"{k}.weight": jax.ShapeDtypeStruct(tuple(reversed(x.shape)), x.dtype)
        for k, x in flat.items()
    }
    wm = ms.WeightMap([ms.MapRule(r"(\w+)\.weight", "{1}/kernel", transpose=(1, 0))])
    return {k: {"kernel": x} for k, x in flat.items()}, wm, reference


EXPORTS: dict[str, dict[str, Any]] = {
    "one": {"path": "one/model.safetensors"},
    "sharded": {"path": "sharded", "max_shard_size": "3MB"},
    "bf16": {"path": "bf16/model.safetensors", "dtype": "bfloat16"},
}


def main(out: str) -> None:
    import modelshard as ms

    ms.distributed.initialize()
    import jax

    me = jax.process_index()
    mesh = ms.make_mesh({"data": 2, "model": 4})
    st = state(mesh)
    result: dict[str, Any] = {}

    def wchar() -> int:  # bytes this process has written (its writes, not the others')
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))

    def attempt(key: str, fn: Any) -> None:
        t0, w0 = time.monotonic(), wchar()
        try:
            got = fn()
            result[key] = {"ok": str(got), "s": time.monotonic() - t0, "wrote": wchar() - w0}
        except Exception as e:
            result[key] = {"error": type(e).__name__, "message": str(e)}

    for key, kw in EXPORTS.items():
        kw = dict(kw)
        path = os.path.join(out, kw.pop("path"))
        attempt(key, lambda path=path, kw=kw: ms.save_safetensors(path, st, **kw))
    like, wm, reference = mapped(st)
    attempt(
        "mapped",
        lambda: ms.save_safetensors(
            os.path.join(out, "mapped/model.safetensors"),
            like,
            reference=reference,
            mapping=wm,
            max_shard_size="5MB",
        ),
    )
    one = os.path.join(out, "one/model.safetensors")
    attempt("again", lambda: ms.save_safetensors(one, st))  # refused on every process
    attempt("bad", lambda: ms.save_safetensors(os.path.join(out, "bad.safetensors"), {"w": 1j}))
    mine = os.path.join(out, f"mine_{me}.safetensors")  # another path on each process
    attempt("paths", lambda: ms.save_safetensors(mine, st))

    # A disk that fills up under process 1 alone: both processes raise, the export that
    # was there stays whole and no temporary is left.
    real = os.pwrite

    def full(fd: int, data: Any, pos: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def digest() -> str:
        with open(one, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    # a peft adapter: process 0 writes it, slowly here; every process returns once it exists
    from safetensors.numpy import save_file

    from modelshard._weights import peft_adapter

    ref = os.path.join(out + "_peft", f"reference_{me}")
    os.makedirs(ref, exist_ok=True)
    save_file({"fc.weight": np.ones((4, 3), np.float32)}, os.path.join(ref, "m.safetensors"))
    lora_b = np.full((2, 4), 3.0, np.float32)
    tuned = {
        "fc": {
            "kernel": np.ones((3, 4), np.float32),
            "lora": {"lora_a": np.ones((3, 2), np.float32), "lora_b": lora_b},
        }
    }
    fc = ms.WeightMap([ms.MapRule(r"fc\.weight", "fc/kernel", transpose=(1, 0))])
    write_adapter = peft_adapter._write_adapter
    if me == 0:
        peft_adapter._write_adapter = lambda *a: (time.sleep(0.5), write_adapter(*a))[1]
    adapter = os.path.join(out + "_peft", "adapter")
    attempt(
        "peft",
        lambda: ms.save_peft_adapter(adapter, tuned, reference=ref, mapping=fc, base_model="b"),
    )
    result["peft_files_on_return"] = sorted(os.listdir(adapter)) if os.path.isdir(adapter) else []
    peft_adapter._write_adapter = write_adapter

    result["before_full"] = digest()
    if me == 1:
        os.pwrite = full
    # process 0 removes the temporaries slowly: process 1 must still not see them after
    # its error (every process returns once they are gone)
    from modelshard._weights import multiprocess_writing as shared

    remove = shared._remove
    if me == 0:
        shared._remove = lambda paths: (time.sleep(0.5), remove(paths))[1]
    attempt("full", lambda: ms.save_safetensors(one, st, overwrite=True))
    os.pwrite = real
    shared._remove = remove
    result["after_full"] = digest()
    result["after_full_files"] = sorted(os.listdir(os.path.dirname(one)))
    attempt("replace", lambda: ms.save_safetensors(one, st, dtype="bfloat16", overwrite=True))
    ms.distributed.barrier("modelshard:test:done")
    result["files"] = sorted(
        os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs
    )
    with open(os.path.join(out, f"result_{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
