"""Named items beside a manager step's state (``_checkpoint/items.py``): JSON values, data
iterators and PRNG keys, checked before a byte is written, read back by ``items()`` and
``read_items``, each JSON item also written where Orbax's own manager reads it, and the
items of a step Orbax's manager wrote."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard._checkpoint import extras_json
from modelshard._checkpoint.items import (
    decode_items,
    encode_items,
    orbax_items,
    orbax_json_items,
)
from modelshard._checkpoint.storage import read_json


def _w(step):
    return {"w": jnp.arange(8.0) + step}


class Loader:
    """The get_state/set_state protocol of grain's iterators, with a state of either kind."""

    def __init__(self, state):
        self.state = state

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


def test_items_beside_the_state(tmp_path):
    class Loader:  # the get_state/set_state protocol of grain's iterators
        def __init__(self):
            self.pos = 0

        def get_state(self):
            return {"pos": self.pos, "epoch": 1}

        def set_state(self, state):
            self.pos = state["pos"]

    loader, key = Loader(), jax.random.key(7)
    loader.pos = 42
    items = {
        "config": {"lr": 1e-3, "layers": [4, 4], "name": "run"},
        "data": loader,
        "rng": key,
        "raw": jax.random.PRNGKey(3),
    }
    with ms.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, _w(0), items=items, metadata={"note": "first"})
        fresh = Loader()
        got = mngr.items(like={"data": fresh})
        assert mngr.metadata() == {"note": "first"}
    assert got["config"] == items["config"]
    assert got["data"] is fresh and fresh.pos == 42
    np.testing.assert_array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(key))
    assert jax.random.key_impl(got["rng"]) == jax.random.key_impl(key)
    np.testing.assert_array_equal(got["raw"], jax.random.PRNGKey(3))
    # without ``like`` the iterator's state comes back; the public readers agree
    step = tmp_path / "0"
    assert ms.read_items(step)["data"] == {"pos": 42, "epoch": 1}
    assert ms.read_metadata(step) == {"note": "first"}


@pytest.mark.parametrize("removed", ["the file", "the item directory"])
def test_a_step_whose_items_are_gone_is_an_error_not_no_items(tmp_path, removed):
    """A damaged step must not hand back ``{}`` for the RNG and data position it was saved
    with; a step saved without items still reads as ``{}``."""
    with ms.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(0, _w(0))
        mngr.save(1, _w(1), items={"rng": jax.random.key(1), "config": {"lr": 0.1}})
    items = tmp_path / "1" / "items"
    if removed == "the file":
        (items / "items.json").unlink()
    else:
        shutil.rmtree(items)
    with ms.CheckpointManager(tmp_path) as mngr:
        assert mngr.items(0) == {}
        with pytest.raises(ms.CheckpointError) as e:
            mngr.items(1)
        np.testing.assert_array_equal(np.asarray(mngr.restore(1)["w"]), np.asarray(_w(1)["w"]))
    assert str(e.value) == (
        f"{items / 'items.json'} is missing: the step was saved with its items, so it is "
        "damaged and they cannot be read. Its arrays still restore (their checksums are "
        "verified); restore a complete copy of the step to get the items back."
    )
    with pytest.raises(ms.CheckpointError) as again:
        ms.read_items(tmp_path / "1")
    assert str(again.value) == str(e.value)
    assert ms.read_items(tmp_path / "0") == {}


def test_items_that_cannot_be_saved_are_all_listed_and_nothing_is_written(tmp_path):
    with ms.CheckpointManager(tmp_path) as mngr:
        with pytest.raises(ms.CheckpointError) as e:
            mngr.save(
                0,
                _w(0),
                items={"cfg": {"lr": np.float32(1), 3: "x"}, "big": jnp.ones((4, 4)), "": 1},
            )
        assert os.listdir(tmp_path) == [".modelshard-lock"] or mngr.all_steps() == []
    assert str(e.value).splitlines() == [
        "cannot save these items (nothing was written):",
        "  items['cfg']['lr']: numpy.float32 is not JSON (use int(...) or float(...))",
        "  items['cfg']: key 3 is a int, JSON keys are strings",
        "  items['big']: an array of float32[4, 4]; put arrays in the sharded state (only "
        "PRNG keys are items)",
        "  item name '': names are non-empty strings",
        "Items are JSON values, data iterators with get_state()/set_state(), or PRNG keys.",
    ]
    assert not any(n[0].isdigit() for n in os.listdir(tmp_path))


def test_grain_iterator_resumes_where_it_was_saved(tmp_path):
    grain = pytest.importorskip("grain")
    ds = grain.MapDataset.range(100).map(lambda x: x * 2).to_iter_dataset()
    it = iter(ds)
    seen = [next(it) for _ in range(7)]
    with ms.CheckpointManager(tmp_path, handle_signals=False) as mngr:
        mngr.save(7, _w(7), items={"data": it})
        fresh = iter(ds)
        resumed = mngr.items(like={"data": fresh})["data"]
    assert seen == list(range(0, 14, 2))
    assert resumed is fresh
    assert [next(resumed) for _ in range(3)] == [next(it) for _ in range(3)] == [14, 16, 18]
    assert ms.read_items(tmp_path / "7")["data"] == {"next_index": 7}


def test_every_kind_of_item_comes_back_from_its_json_document():
    """The document is plain JSON (what ``items.json`` holds) and decodes to the items:
    typed keys keep their implementation and shape, raw keys stay uint32, an iterator's
    bytes state survives base64, and infinities stay numbers."""
    typed = jax.random.split(jax.random.key(3, impl="rbg"), 2)
    items = {
        "config": {"lr": 1e-3, "warmup": math.inf, "layers": [4, 4], "name": None},
        "typed": typed,
        "raw": jax.random.PRNGKey(9),
        "bytes": Loader(b"\x00\xffstate"),
        "json": Loader({"pos": 3}),
    }
    doc = json.loads(json.dumps(encode_items(items), allow_nan=True))
    like = Loader(None)
    got = decode_items(doc, like={"json": like})
    assert got["config"] == items["config"]
    assert str(jax.random.key_impl(got["typed"])) == str(jax.random.key_impl(typed))
    assert got["typed"].shape == (2,)
    np.testing.assert_array_equal(jax.random.key_data(got["typed"]), jax.random.key_data(typed))
    assert got["raw"].dtype == jnp.uint32
    np.testing.assert_array_equal(got["raw"], jax.random.PRNGKey(9))
    assert got["bytes"] == b"\x00\xffstate"  # no iterator given: its saved state
    assert got["json"] is like and like.state == {"pos": 3}
    assert encode_items(None) == {} and encode_items({}) == {}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([("a", 1)], "items must be a dict of name -> item, got list."),
        ({"m": {"x": math.nan}}, "  items['m']['x']: NaN is not JSON"),
        ({"s": {1, 2}}, "  items['s']: builtins.set is not JSON"),
        (
            {"bad": Loader({1: "x"})},
            "  items['bad'].get_state(): key 1 is a int, JSON keys are strings",
        ),
        ({3: "x"}, "  item name 3: names are non-empty strings"),
    ],
)
def test_an_item_that_is_not_json_is_named(items, message):
    with pytest.raises(ms.CheckpointError) as e:
        encode_items(items)
    assert message in str(e.value).splitlines() or str(e.value) == message


def test_an_iterator_whose_get_state_fails_is_named():
    class Broken(Loader):
        def get_state(self):
            raise RuntimeError("closed")

    with pytest.raises(ms.CheckpointError) as e:
        encode_items({"data": Broken(None)})
    assert "  items['data']: get_state() failed: RuntimeError: closed" in str(e.value).splitlines()


def test_an_item_of_an_unknown_kind_is_an_error_not_returned_raw():
    with pytest.raises(ms.CheckpointError) as e:
        decode_items({"x": {"__modelshard_item__": "tensor"}})
    assert str(e.value) == "items['x'] has an unknown kind 'tensor'; written by a newer modelshard?"


def test_only_plain_json_items_with_a_plain_folder_name_are_written_as_orbax_items():
    items = {
        "config": {"lr": 0.1},
        "run-2.b": [1, 2],
        "CONFIG": {"lr": 0.2},  # the same folder as config on a case-insensitive disk
        "State": 1,  # a step's own items, whatever the case
        "metrics": 1,
        "commit_success.txt": 1,
        "a/b": 1,
        ".hidden": 1,
        "x.orbax-checkpoint-tmp-1": 1,
        "rng": jax.random.key(0),
        "data": Loader({"pos": 1}),
    }
    encoded = encode_items(items)
    assert orbax_json_items(items, encoded) == {"config": {"lr": 0.1}, "run-2.b": [1, 2]}
    assert orbax_json_items(None, {}) == {}


@pytest.fixture(scope="module")
def step_with_items(tmp_path_factory):
    """A manager step saved with a JSON item, a key, an iterator's state and metrics."""
    root = tmp_path_factory.mktemp("items")
    items = {"config": {"lr": 0.1}, "rng": jax.random.PRNGKey(1), "data": Loader({"pos": 5})}
    with ms.CheckpointManager(root, async_save=False, handle_signals=False) as mngr:
        mngr.save(1, _w(1), items=items, metrics={"loss": 0.5})
    return root / "1"


def test_a_steps_json_items_are_what_orbaxs_manager_reads(step_with_items):
    """Each JSON item is also ``<step>/<name>/metadata``, Orbax's ``JsonSave`` layout,
    read by Orbax's own manager with ``JsonRestore``; keys and iterators are not."""
    import orbax.checkpoint as ocp

    assert json.loads((step_with_items / "config" / "metadata").read_text()) == {"lr": 0.1}
    assert not (step_with_items / "rng").exists() and not (step_with_items / "data").exists()
    with ocp.CheckpointManager(step_with_items.parent) as orbax_mngr:
        got = orbax_mngr.restore(1, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    assert got["config"] == {"lr": 0.1}


def test_extras_json_gives_the_items_as_stored_and_the_metrics(step_with_items, tmp_path):
    extras = extras_json(step_with_items)
    assert extras["metrics"] == {"loss": 0.5}
    assert extras["items"]["config"] == {"lr": 0.1}
    assert extras["items"]["data"] == {"__modelshard_item__": "iterator", "state": {"pos": 5}}
    assert extras["items"]["rng"]["__modelshard_item__"] == "raw_key"
    assert extras_json(ms.save(tmp_path / "ck", _w(0))) == {}


def test_read_json_is_none_for_no_file_and_an_error_for_a_damaged_one(tmp_path):
    from etils import epath

    path = epath.Path(tmp_path) / "doc.json"
    assert read_json(path) is None
    path.write_text('{"a": [1, 2]}')
    assert read_json(path) == {"a": [1, 2]}
    path.write_text('{"a": ')
    with pytest.raises(ms.CheckpointError) as e:
        read_json(path)
    assert str(e.value).startswith(f"{path} is not valid JSON: ")


def test_the_json_items_of_orbaxs_own_step(tmp_path):
    """A step Orbax's manager wrote: every JSON item its metadata lists, not the state nor
    the metrics; one whose file is gone is a damaged step, named."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path) as orbax_mngr:
        orbax_mngr.save(
            4,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": np.arange(4.0)}),
                config=ocp.args.JsonSave({"lr": 0.1}),
                notes=ocp.args.JsonSave({"tags": ["a", "b"]}),
            ),
            metrics={"loss": 0.25},  # Orbax's own item, not one of the step's JSON items
        )
        orbax_mngr.wait_until_finished()
    step = tmp_path / "4"
    assert orbax_items(step, "state") == {"config": {"lr": 0.1}, "notes": {"tags": ["a", "b"]}}
    assert ms.read_items(step) == {"config": {"lr": 0.1}, "notes": {"tags": ["a", "b"]}}
    assert extras_json(step)["items"] == {"config": {"lr": 0.1}, "notes": {"tags": ["a", "b"]}}
    for f in os.listdir(step / "notes"):
        os.remove(step / "notes" / f)
    with pytest.raises(ms.CheckpointError) as e:
        orbax_items(step, "state")
    assert str(e.value) == (
        f"{step / 'notes'} is missing its JSON file: Orbax's step 4 was saved with the JSON "
        "item 'notes', so it is damaged and that item cannot be read. Its arrays still "
        "restore; restore a complete copy of the step to get it back."
    )
    shutil.rmtree(step / "notes")
    with pytest.raises(ms.CheckpointError, match="is missing its JSON file"):
        orbax_items(step, "state")
