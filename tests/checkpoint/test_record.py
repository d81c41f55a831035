"""The record read as untrusted input (``_checkpoint/record.py``): edited, not an object, too
deep or too large, each refused naming the leaf and the file."""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any

import jax.numpy as jnp
import pytest

import modelshard as ms
from modelshard._checkpoint.record import Record


def _leaf(record: dict[str, Any], path: str) -> dict[str, Any]:
    return next(leaf for leaf in record["leaves"] if leaf["path"] == path)


EDITS = {
    "storage key walks up": (
        lambda r: _leaf(r, "w").update(key=["..", "..", "w"]),
        "leaf 'w' of the record is invalid: its storage key ['..', '..', 'w'] is not the one "
        "its path gives, ['w'].",
    ),
    "storage key names another leaf": (
        lambda r: _leaf(r, "w").update(key=["n", "i"]),
        "leaf 'w' of the record is invalid: its storage key ['n', 'i'] is not the one its "
        "path gives, ['w'].",
    ),
    "path walks up": (
        lambda r: _leaf(r, "w").update(path="../../etc/passwd"),
        "leaf '../../etc/passwd' of the record is invalid: its storage key ['w'] is not the "
        "one its path gives, ['..', '..', 'etc', 'passwd'].",
    ),
    "shape": (
        lambda r: _leaf(r, "w").update(shape=[4, 3]),
        "leaf 'w' of the record is invalid: a float32[4, 3] leaf is never stored as float32[3, 4].",
    ),
    "dtype": (
        lambda r: _leaf(r, "w").update(dtype="int32"),
        "leaf 'w' of the record is invalid: a int32[3, 4] leaf is never stored as float32[3, 4].",
    ),
    "object dtype": (
        lambda r: _leaf(r, "w").update(dtype="object", stored_dtype="object"),
        "leaf 'w' of the record is invalid: dtype 'object' is not a numeric dtype.",
    ),
    "dtype that is code": (
        lambda r: _leaf(r, "w").update(stored_dtype="os.system"),
        "leaf 'w' of the record is invalid: unknown dtype 'os.system' in the checkpoint record.",
    ),
    "negative shape": (
        lambda r: _leaf(r, "w").update(shape=[-3, 4], stored_shape=[-3, 4]),
        "leaf 'w' of the record is invalid: negative dimension in [-3, 4] (stored [-3, 4]).",
    ),
    "key impl": (
        lambda r: _leaf(r, "k").update(key_impl="evil"),
        "leaf 'k' of the record is invalid: it is not key data of PRNG impl 'evil': "
        'unrecognized PRNG implementation "evil".',
    ),
    "key data shape": (
        lambda r: _leaf(r, "k").update(stored_shape=[3]),
        "leaf 'k' of the record is invalid: it is not key data of PRNG impl 'threefry2x32': "
        "JAX encountered invalid PRNG key data",
    ),
    "spec axis": (
        lambda r: (r.update(mesh={"axes": {"data": 8}}), _leaf(r, "w").update(spec=["model"])),
        "leaf 'w' of the record is invalid: its spec P('model',) names 'model', not an axis "
        "of the recorded mesh.",
    ),
    "spec rank": (
        lambda r: (
            r.update(mesh={"axes": {"data": 8}}),
            _leaf(r, "n/i").update(spec=[None, "data"]),
        ),
        "leaf 'n/i' of the record is invalid: its spec P(None, 'data') is longer than its rank 1.",
    ),
    "mesh": (
        lambda r: r.update(mesh={"axes": {"data": -8}}),
        "the modelshard record is malformed (ValueError: mesh axes {'data': -8} are not names "
        "and positive sizes).",
    ),
    "leaves not a list of objects": (
        lambda r: r.update(leaves=["w"]),
        "the modelshard record is malformed (AttributeError: 'str' object has no attribute 'get').",
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_edited_record_is_refused_naming_leaf_and_file(small_ckpt, edit):
    import json

    path, record = small_ckpt
    change, message = EDITS[edit]
    change(record)
    (path / "modelshard.json").write_text(json.dumps(record))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value).startswith(f"{path / 'modelshard.json'}: {message}")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1]", "the record is a JSON list, not an object."),
        ('{"format": "modelshard.checkpoint/1", "kind": 1', "is not valid JSON"),
    ],
)
def test_record_that_is_not_an_object_is_refused(small_ckpt, text, message):
    path, _ = small_ckpt
    (path / "modelshard.json").write_text(text)
    with pytest.raises(ms.CheckpointError, match=message):
        ms.restore(path)


def test_deeply_nested_record_is_refused(small_ckpt):
    path, _ = small_ckpt
    (path / "modelshard.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value).startswith(
        f"{path / 'modelshard.json'} is not valid JSON: maximum recursion"
    )


@pytest.mark.parametrize("name", ["modelshard.json", "_METADATA"])
def test_oversized_metadata_is_refused_unread(small_ckpt, monkeypatch, name):
    # the package's attribute `locate` is the function, not this module
    ckpt = importlib.import_module("modelshard._checkpoint.sources")

    path, _ = small_ckpt
    with open(path / name, "a") as f:
        f.write(" " * 4096)  # still valid JSON, now the largest metadata file
    size = (path / name).stat().st_size
    monkeypatch.setattr(ckpt, "MAX_METADATA_BYTES", size - 1)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == (
        f"{path / name} is {size} bytes, more than the {size - 1} that checkpoint metadata "
        "may have; refusing to read it."
    )
    monkeypatch.setattr(ckpt, "MAX_METADATA_BYTES", size)
    assert ms.restore(path)["w"].shape == (3, 4)


def test_the_saved_meshs_axis_types_are_read_back_or_auto():
    def record(mesh):
        return Record(kind="pytree", leaves=[], mesh=mesh)

    axes = {"data": 2, "model": 4}
    assert record({"axes": axes, "axis_types": ["Explicit", "Auto"]}).mesh_axis_types() == [
        "explicit",
        "auto",
    ]
    for unknown in ([], ["Explicit"], ["Manual", "Auto"], "Explicit", None):
        assert record({"axes": axes, "axis_types": unknown}).mesh_axis_types() == ["auto"] * 2
    assert record(None).mesh_axis_types() == []


@pytest.fixture
def values_ckpt(tmp_path):
    """A checkpoint holding Python values beside its array, and its record as a dict."""
    import json

    state = {"w": jnp.ones(3), "epoch": 3, "name": "run1", "lr": 0.1}
    path = ms.save(tmp_path / "c", state)
    return path, json.loads((path / "modelshard.json").read_text())


def _value(record: dict[str, Any], path: str) -> dict[str, Any]:
    return next(v for v in record["values"] if v["path"] == path)


VALUE_EDITS = {
    "type unknown": (
        lambda r: _value(r, "epoch").update(type="pickle"),
        "value 'epoch' of the record is invalid: type 'pickle' is not one of ['bool', "
        "'bytes', 'complex', 'float', 'int', 'none', 'str'].",
    ),
    "value of another type": (
        lambda r: _value(r, "epoch").update(value="3"),
        "value 'epoch' of the record is invalid: '3' is not an int as the record writes it.",
    ),
    "bool for an int": (
        lambda r: _value(r, "epoch").update(value=True),
        "value 'epoch' of the record is invalid: True is not an int as the record writes it.",
    ),
    "float not a number": (
        lambda r: _value(r, "lr").update(value="fast"),
        "value 'lr' of the record is invalid: 'fast' is not a float (a JSON number, 'inf', "
        "'-inf' or 'nan').",
    ),
    "str not a str": (
        lambda r: _value(r, "name").update(value=[1]),
        "value 'name' of the record is invalid: [1] is not a str.",
    ),
    "key walks up": (
        lambda r: _value(r, "name").update(key=["..", "name"]),
        "value 'name' of the record is invalid: its key ['..', 'name'] is not the one its "
        "path gives, ['name'].",
    ),
    "path of an array": (
        lambda r: _value(r, "name").update(path="w", key=["w"]),
        "two leaves have the canonical path 'w'; rename one of them.",
    ),
    "values not a list of objects": (
        lambda r: r.update(values=["epoch"]),
        "the modelshard record is malformed (TypeError: string indices must be integers, not "
        "'str').",
    ),
}


@pytest.mark.parametrize("edit", list(VALUE_EDITS))
def test_edited_values_are_refused_naming_value_and_file(values_ckpt, edit):
    import json

    path, record = values_ckpt
    change, message = VALUE_EDITS[edit]
    change(record)
    (path / "modelshard.json").write_text(json.dumps(record))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == f"{path / 'modelshard.json'}: {message}"


VALUES = {
    "int": 3,
    "negative": -7,
    "big int": 2**200,
    "negative big int": -(2**64) - 1,
    "float": 0.1,
    "negative zero": -0.0,
    "inf": math.inf,
    "minus inf": -math.inf,
    "largest float": 1.7976931348623157e308,
    "complex": complex(1.5, -math.inf),
    "bool": True,
    "str": "ü 🎉\x00\n",
    "empty str": "",
    "bytes": b"\x00\xff",
    "none": None,
}


@pytest.mark.parametrize("name", list(VALUES))
def test_values_survive_the_records_json_with_their_types(name):
    """Each value read back from the record's JSON is the value written, of its type
    (ints of any size, every float including -0.0 and the infinities)."""
    import json

    from modelshard._checkpoint.record import ValueRecord

    x = VALUES[name]
    text = json.dumps(
        ValueRecord("v", ("v",), type(x).__name__.replace("NoneType", "none"), x).to_json()
    )
    back = ValueRecord.from_json(json.loads(text)).value
    assert type(back) is type(x)
    assert repr(back) == repr(x)  # -0.0 and 0.0 differ here, as do inf and -inf


def test_nan_survives_the_records_json():
    import json

    from modelshard._checkpoint.record import ValueRecord

    text = json.dumps(ValueRecord("v", ("v",), "float", math.nan).to_json())
    assert "NaN" not in text  # the record stays strict JSON
    assert math.isnan(ValueRecord.from_json(json.loads(text)).value)


def test_a_record_without_values_is_read_as_predating_them(small_ckpt):
    """Records written before values were stored have no ``values`` key: read as None
    (``like``'s values are then kept), not as an empty list."""
    _, record = small_ckpt
    assert record["values"] == []
    del record["values"]
    assert Record.from_json(record).values is None
    assert Record.from_json({**record, "values": []}).values == []
