"""TensorStore's JSON conversion keeps no reference once ``stop_leaks`` ran (``leaks.py``)."""

from __future__ import annotations

import gc
import sys

import tensorstore as ts

from modelshard._checkpoint.leaks import kept_references, stop_leaks


def _blocks_per_call(convert) -> float:
    convert()
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(500):
        convert()
    gc.collect()
    return (sys.getallocatedblocks() - before) / 500


def test_to_json_gives_back_every_key_and_value():
    """The specs Orbax converts on every save (a kvstore spec) and for its array metadata
    (a TensorStore spec, nested dicts, booleans and defaults included) come back whole and
    leave nothing behind: unpatched, each key and value kept one reference (4 blocks a
    kvstore spec)."""
    stop_leaks()
    path = "/ckpt/7.orbax-checkpoint-tmp/state/ocdbt.process_0/"
    kv = ts.KvStore.Spec({"driver": "file", "path": path})
    spec = ts.Spec({"driver": "zarr", "kvstore": {"driver": "file", "path": path}})
    assert kv.to_json() == {"driver": "file", "path": path}
    assert spec.to_json() == {"driver": "zarr", "kvstore": {"driver": "file", "path": path}}
    assert kept_references(kv.to_json) == 0
    assert kept_references(spec.to_json) == 0
    assert _blocks_per_call(kv.to_json) < 0.5
    assert _blocks_per_call(lambda: spec.to_json(include_defaults=True)) < 0.5
    assert spec.to_json(include_defaults=True)["kvstore"]["path"] == path


def test_stop_leaks_is_idempotent():
    """A second call wraps nothing twice (each save's handler calls it)."""
    stop_leaks()
    wrapped = ts.KvStore.Spec.to_json
    stop_leaks()
    assert ts.KvStore.Spec.to_json is wrapped
