"""Restoring damaged checkpoints (``_checkpoint/restoring.py``): every file truncated, flipped or
deleted errors clearly or restores bit for bit."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import DAMAGED_HINT, assert_bit_exact, checksums, largest_data_file, truncate_file
from modelshard._checkpoint import restoring


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    if data:
        data[len(data) // 2] ^= 0x5A
    f.write_bytes(bytes(data))


DAMAGE = {"truncated": truncate_file, "flipped": _flip, "deleted": Path.unlink}


def test_every_file_damaged_every_way_errors_or_restores_bit_exact(tmp_path):
    """Each file of a checkpoint truncated, flipped or deleted: restore is bit-exact (the file
    was not needed) or a CheckpointError; nothing else escapes, no wrong value comes back."""

    mesh = ms.make_mesh({"data": 8})
    rng = np.random.default_rng(0)
    state = {
        "big": jax.device_put(
            rng.standard_normal((256, 64)).astype(np.float32), NamedSharding(mesh, P("data"))
        ),
        "small": jnp.arange(8.0),
        "k": jax.random.key(5),
    }
    base = ms.save(tmp_path / "base", state)
    files = sorted(f.relative_to(base) for f in base.rglob("*") if f.is_file())
    outcomes: dict[str, list[str]] = {"bit-exact": [], "CheckpointError": []}
    for rel in files:
        for how, damage in DAMAGE.items():
            case = (
                tmp_path / f"{how}-{len(outcomes['bit-exact']) + len(outcomes['CheckpointError'])}"
            )
            shutil.copytree(base, case)
            damage(case / rel)
            try:
                out = ms.restore(case)
            except ms.CheckpointError:
                outcomes["CheckpointError"].append(f"{how} {rel}")
            else:
                assert_bit_exact(state, out, f"{how} {rel}")
                outcomes["bit-exact"].append(f"{how} {rel}")
            shutil.rmtree(case)
    print("damage outcomes:", {k: len(v) for k, v in outcomes.items()}, "files:", len(files))
    # every data file, the record and the Orbax metadata are checked
    for must_fail in ["modelshard.json", "_METADATA", "manifest.ocdbt"]:
        assert f"flipped {must_fail}" in outcomes["CheckpointError"], outcomes
    assert any(s.startswith("truncated d/") for s in outcomes["CheckpointError"]), outcomes


def _after_locate(monkeypatch, damage) -> None:
    """``damage`` done once ``restore``'s ``locate`` has looked at the checkpoint (which
    names a data file lost before it looked: ``test_sources.py``): a file lost while the
    restore runs, what the reads themselves say."""
    real = restoring.locate

    def locate(directory):
        source = real(directory)
        damage()
        return source

    monkeypatch.setattr(restoring, "locate", locate)


def test_truncated_data_names_the_leaf_and_the_file(tmp_path, monkeypatch):
    mesh = ms.make_mesh({"data": 8})
    big = np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)
    path = ms.save(
        tmp_path / "c",
        {"big": jax.device_put(big, NamedSharding(mesh, P("data"))), "small": jnp.ones(3)},
    )
    _after_locate(monkeypatch, lambda: truncate_file(largest_data_file(path)))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 1 leaf of {path} (damaged or incomplete checkpoint):"
    assert lines[1].startswith("  big: ValueError: ")
    assert lines[2].startswith(f"    file: {path}")
    assert lines[3:] == [DAMAGED_HINT]
    assert "small" not in str(e.value)


def test_one_damaged_file_shared_by_many_leaves_is_one_entry(tmp_path, monkeypatch):
    """OCDBT keeps several arrays' metadata in one file: deleting it fails every leaf with
    the same error, shown once with the leaves it names (the first eight, then a count), and
    without the TensorStore spec JSON TensorStore appends to it."""
    state = {f"w{i:02d}": jnp.full((4, 4), float(i)) for i in range(10)}
    path = ms.save(tmp_path / "c", state)
    (shared,) = sorted((path / "d").iterdir())
    _after_locate(monkeypatch, shared.unlink)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 10 leaves of {path} (damaged or incomplete checkpoint):"
    assert lines[1].startswith(
        "  w00, w01, w02, w03, w04, w05, w06, w07 and 2 more: ValueError: NOT_FOUND: "
    )
    assert lines[3] == DAMAGED_HINT
    assert "tensorstore_spec" not in str(e.value) and len(lines) == 4
    assert lines[2] == f"    file: {shared}"


def test_deleted_process_shard_directory(tmp_path):

    path = ms.save(tmp_path / "c", {"w": jnp.arange(4096.0), "v": jnp.ones(3)})
    process = next(path.glob("ocdbt.process_*"))
    (data,) = [f for f in process.glob("d/*") if f.stat().st_size >= 16384]  # w's bytes
    shutil.rmtree(process)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)  # v (12 bytes) lives in the root's index itself
    assert str(e.value).splitlines() == [
        f"checkpoint {path} is damaged: 1 file of its OCDBT database is missing or cut short:",
        f"  {data}: missing; it holds the array w",
        "Restore a complete copy of the checkpoint.",
    ]


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_a_restore_without_a_mesh_rebuilds_the_saved_one_with_its_axis_types(tmp_path, axis_types):
    mesh = ms.make_mesh({"data": 2, "model": 4}, axis_types=axis_types)
    w = ms.shard(jnp.arange(64.0).reshape(8, 8), P("data", "model"), mesh)
    out = ms.restore(ms.save(tmp_path / "c", {"w": w}))
    assert out["w"].sharding.spec == P("data", "model")
    assert out["w"].sharding.mesh.axis_types == mesh.axis_types


# ---- partial restores say what they left out -------------------------------------------


def _partial_warnings(caught: list[warnings.WarningMessage]) -> list[ms.PartialRestoreWarning]:
    return [c.message for c in caught if isinstance(c.message, ms.PartialRestoreWarning)]


def test_partial_restore_warns_naming_every_leaf_it_left_out(tmp_path, mesh8):
    """Kept and skipped leaves named in the message and listed in full for code; the warning
    points at the caller's line; a partial restore that left nothing out says nothing."""
    ms.save(tmp_path / "c", {"a": jnp.arange(8.0), "extra": jnp.ones(3)})
    like = {"a": jnp.zeros(8), "fresh": jnp.full((8,), 5.0)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ms.restore(tmp_path / "c", like=like, specs=P("data"), mesh=mesh8, partial=True)
    (w,) = _partial_warnings(caught)
    assert str(w) == (
        f"restored 1 of the target's 2 leaves from {tmp_path / 'c'}; 1 kept like's values "
        "(not in the checkpoint): fresh; 1 checkpoint leaves not restored: extra (partial=True)"
    )
    assert (w.restored, w.kept, w.skipped) == (("a",), ("fresh",), ("extra",))
    assert [c.filename for c in caught if c.message is w] == [__file__]
    np.testing.assert_array_equal(out["a"], np.arange(8.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ms.restore(tmp_path / "c", like={"a": like["a"], "extra": jnp.ones(3)}, partial=True)
    assert not _partial_warnings(caught)


def test_partial_restore_names_the_first_five_and_counts_the_rest(tmp_path):
    ms.save(tmp_path / "c", {"a": jnp.ones(2), **{f"old{i}": jnp.ones(1) for i in range(7)}})
    like = {"a": jnp.ones(2), **{f"new{i}": jnp.ones(1) for i in range(6)}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ms.restore(tmp_path / "c", like=like, partial=True)
    (w,) = _partial_warnings(caught)
    assert str(w) == (
        f"restored 1 of the target's 7 leaves from {tmp_path / 'c'}; 6 kept like's values (not "
        "in the checkpoint): new0, new1, new2, new3, new4 and 1 more; 7 checkpoint leaves not "
        "restored: old0, old1, old2, old3, old4 and 2 more (partial=True)"
    )
    assert len(w.kept) == 6 and len(w.skipped) == 7


def _renamed_module(path: Path):
    """An NNX model saved, then a new version of its class whose layer has another name."""
    from flax import nnx

    class Old(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.proj = nnx.Linear(4, 3, rngs=rngs)

    class New(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(4, 3, rngs=rngs)

    ms.save(path, Old(nnx.Rngs(0)))
    return New(nnx.Rngs(1))


def _renamed_layer(path: Path):
    ms.save(path, {"layers": {"0": {"kernel": jnp.ones((4, 3))}}})
    return {"blocks": {"0": {"kernel": jnp.zeros((4, 3))}}}


@pytest.mark.parametrize("case", [_renamed_module, _renamed_layer], ids=["nnx", "dict"])
def test_a_partial_restore_that_would_restore_nothing_is_refused(tmp_path, case):
    """Following the mismatch hint once gave 0 of N leaves and no word: now the mismatch
    does not suggest partial=True, and partial=True with no shared path is refused."""
    target = case(tmp_path / "c")
    with pytest.raises(ms.CheckpointError) as plain:
        ms.restore(tmp_path / "c", like=target)
    assert "partial=True to restore" not in str(plain.value)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like=target, partial=True)
    lines = str(e.value).splitlines()
    n = len(lines) - 2
    assert lines[0] == (
        f"restore(partial=True) would restore nothing from checkpoint {tmp_path / 'c'}: none of "
        f"the target {type(target).__name__}'s {n // 2} leaves is in it ({n} differences: "
        f"{n // 2} missing, {n // 2} extra; paths first):"
    )
    old, new = ("proj", "linear") if case is _renamed_module else ("layers", "blocks")
    mapping = f'ms.WeightMap([ms.MapRule(r"{old}/(.*)", "{new}/{{1}}")])'
    assert lines[-1] == (
        "hint: the target and the checkpoint share no leaf path, so partial=True would restore "
        f"nothing: leaves that match in shape look renamed ({old}/ -> {new}/): restore them "
        f"with mapping={mapping}"
    )
    assert plain.value.args[0].splitlines()[-1] == lines[-1]
    out = ms.restore(tmp_path / "c", like=target, mapping=eval(mapping))  # the hint, pasted
    saved = ms.adapters.split(ms.restore(tmp_path / "c")).arrays
    for a, b in zip(saved, ms.adapters.split(out).arrays, strict=True):
        np.testing.assert_array_equal(a, b)


def test_renamed_leaves_get_a_mapping_to_paste(tmp_path):
    """A renamed layer beside kept ones, a new head and a dropped leaf: the hint's mapping,
    pasted as it is, restores the renamed leaves (partial=True would keep like's values)."""
    ms.save(
        tmp_path / "c",
        {
            "up": {"kernel": jnp.ones((16, 32))},
            "down": {"kernel": jnp.ones((32, 16))},
            "gone": jnp.ones(3),
        },
    )
    like = {
        "up_proj": {"kernel": jnp.zeros((16, 32))},
        "down": {"kernel": jnp.zeros((32, 16))},
        "head": {"kernel": jnp.zeros((16, 2))},
    }
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like=like)
    hint = str(e.value).splitlines()[-1]
    mapping = (
        'ms.WeightMap([ms.MapRule(r"up/(.*)", "up_proj/{1}"), ms.MapRule(r"gone", None), '
        'ms.MapRule(r"(.*)", "{1}")], keep=[\'head/kernel\'])'
    )
    assert hint.startswith(
        "hint: leaves that match in shape look renamed (up/ -> up_proj/): restore them with "
        f"mapping={mapping} (the last rule keeps every other path as it is); pass partial=True"
    )
    out = ms.restore(tmp_path / "c", like=like, mapping=eval(mapping))
    np.testing.assert_array_equal(out["up_proj"]["kernel"], np.ones((16, 32)))
    np.testing.assert_array_equal(out["head"]["kernel"], np.zeros((16, 2)))


def test_nothing_shared_and_nothing_pairs_up_says_how_to_write_the_mapping(tmp_path):
    ms.save(tmp_path / "c", {"a": jnp.ones(2)})
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like={"b": jnp.ones(3)}, partial=True)
    assert str(e.value).splitlines()[-1] == (
        "hint: the target and the checkpoint share no leaf path, so partial=True would restore "
        "nothing: compare the paths (modelshard inspect shows the checkpoint's) and restore with "
        'mapping=ms.WeightMap([...]): a rule per renamed path, then ms.MapRule(r"(.*)", "{1}") '
        "to keep the other paths"
    )


def test_a_value_of_another_type_says_so_in_the_hint(tmp_path):
    ms.save(tmp_path / "c", {"w": jnp.ones(2), "k": 1})
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like={"w": jnp.ones(2), "k": 1.5})
    assert str(e.value).splitlines()[1:] == [
        "  changed  k  checkpoint int 1 -> target float",
        "hint: a Python value must keep its type: build like with the saved value's type "
        "(ms.restore without like shows them)",
    ]


def test_partial_with_an_abstract_like_hints_at_a_concrete_one(tmp_path):
    ms.save(tmp_path / "c", {"a": jnp.ones(2)})
    like = jax.eval_shape(lambda: {"a": jnp.ones(2), "fresh": jnp.ones(3)})
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like=like, partial=True)
    assert str(e.value).splitlines()[1:] == [
        "  missing  fresh  float32[3] (in the target, not in the checkpoint)",
        "hint: partial=True keeps like's values for the missing leaves, but like is abstract "
        "there: pass a concrete like (a freshly initialised model)",
    ]


def test_a_manager_partial_restore_warns_too(tmp_path):
    with ms.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"a": jnp.ones(2)})
    with (
        ms.CheckpointManager(tmp_path / "run") as mgr,
        pytest.warns(ms.PartialRestoreWarning, match="kept like's values .*: head"),
    ):
        mgr.restore(like={"a": jnp.zeros(2), "head": jnp.zeros(1)}, partial=True)


class _Counter:
    """What each container kind holds of Python values: a saved state and a like with
    other values of the same types (restore must give the saved ones back)."""

    @staticmethod
    def make(kind: str, epoch: int, name: str, rate: float) -> Any:
        w = jnp.arange(4.0)
        if kind == "pytree":
            return {"w": w, "epoch": epoch, "name": name, "rate": rate, "none": None, "empty": {}}
        if kind == "linen":  # variables with a Python counter among the collections
            return {"params": {"kernel": w}, "state": {"step": epoch, "tag": name, "ema": rate}}
        if kind == "nnx":
            from flax import nnx

            class NnxModel(nnx.Module):
                def __init__(self) -> None:
                    self.w = nnx.Param(w)
                    self.step = nnx.Variable(epoch)
                    self.tag = nnx.Variable(name)
                    self.rate = nnx.Variable(rate)
                    self.act = jax.nn.relu  # static: part of the graph, not a leaf

            return NnxModel()
        import equinox as eqx

        class Model(eqx.Module):
            w: jax.Array
            drop: eqx.nn.Dropout  # its p (a float) and inference (a bool) are leaves
            step: int
            tag: str
            act: Any = jax.nn.relu  # code among the leaves: taken from like

        return Model(w, eqx.nn.Dropout(rate, inference=epoch % 2 == 0), epoch, name)


def _values_of(tree: Any) -> dict[str, Any]:
    """Path -> (type, value) of every leaf that is not an array."""
    flat = ms.adapters.split(tree)
    return {p: (type(x), x) for _, p, x in flat.statics() if not callable(x)}


@pytest.mark.parametrize("kind", ["pytree", "linen", "nnx", "equinox"])
def test_python_values_come_back_from_the_checkpoint_not_from_like(tmp_path, kind):
    """Python values (an epoch, a run name, a dropout rate, an NNX Variable's int) were
    dropped by save, and restore(like=) handed back like's as if restored."""
    saved = _Counter.make(kind, 3, "run1", 0.25)
    path = ms.save(tmp_path / "c", saved)
    want = _values_of(saved)
    assert len(want) >= 3
    restored = ms.restore(path, like=_Counter.make(kind, 0, "other", 0.5))
    assert _values_of(restored) == want
    assert type(restored).__qualname__ == type(saved).__qualname__
    # without like: nested dicts, the values in them at their paths
    assert _values_of(ms.restore(path)) == want


def test_a_value_the_checkpoint_lacks_is_a_missing_leaf(tmp_path):
    """like's value for a leaf the checkpoint does not hold was returned as if restored."""
    path = ms.save(tmp_path / "c", {"w": jnp.ones(2), "name": "run1"})
    like = {"w": jnp.zeros(2), "epoch": 0, "name": ""}
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path, like=like)
    lines = str(e.value).splitlines()
    assert lines[:2] == [
        f"checkpoint {path} does not match the target dict (1 difference: 1 missing; paths first):",
        "  missing  epoch  int (in the target, not in the checkpoint)",
    ]
    assert lines[2].startswith("hint: pass partial=True")
    with pytest.warns(ms.PartialRestoreWarning, match="epoch"):
        out = ms.restore(path, like=like, partial=True)
    assert out["epoch"] == 0 and out["name"] == "run1"  # kept, and said so; restored


def test_a_value_of_another_type_is_a_changed_leaf(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(2), "epoch": 3, "name": "run1"})
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path, like={"w": jnp.zeros(2), "epoch": 0.0, "name": "x"})
    assert str(e.value).splitlines()[:2] == [
        f"checkpoint {path} does not match the target dict (1 difference: 1 changed; paths first):",
        "  changed  epoch  checkpoint int 3 -> target float",
    ]
    with pytest.raises(ms.CheckpointError, match="checkpoint int 3 -> target float"):
        ms.restore(path, like={"w": jnp.zeros(2), "epoch": 0.0, "name": "x"}, partial=True)


def test_a_value_like_lacks_is_an_extra_leaf(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(2), "epoch": 3})
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path, like={"w": jnp.zeros(2)})
    assert str(e.value).splitlines()[1] == (
        "  extra    epoch  int 3 (in the checkpoint, not in the target)"
    )


def test_a_typed_key_where_a_number_was_saved_is_a_difference_not_a_crash(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(2), "epoch": 3})
    with pytest.raises(ms.CheckpointError) as e:  # a scalar key: no NumPy dtype to hold 3
        ms.restore(path, like={"w": jnp.zeros(2), "epoch": jax.random.key(0)})
    assert str(e.value).splitlines()[1:3] == [
        "  missing  epoch  key<fry>[] (in the target, not in the checkpoint)",
        "  extra    epoch  int 3 (in the checkpoint, not in the target)",
    ]


def test_a_record_that_predates_values_keeps_likes_values(tmp_path):
    """A checkpoint written before values were recorded holds none: like's are kept, as
    they were, rather than every restore of it failing, and a warning says so."""
    import json

    path = ms.save(tmp_path / "c", {"w": jnp.ones(2)})
    record = json.loads((path / "modelshard.json").read_text())
    del record["values"]
    (path / "modelshard.json").write_text(json.dumps(record))
    with pytest.warns(UserWarning) as caught:
        out = ms.restore(path, like={"w": jnp.zeros(2), "epoch": 4, "act": jax.nn.relu})
    assert [str(w.message) for w in caught] == [
        f"checkpoint {path} holds no Python values (written before modelshard saved them, or "
        "by plain Orbax): 1 kept like's values: epoch"
    ]
    assert caught[0].filename == __file__  # the user's line, not modelshard's
    assert out["epoch"] == 4
    assert_bit_exact({"w": jnp.ones(2)}, {"w": out["w"]})


def test_an_abstract_like_takes_the_saved_numbers_as_its_arrays(tmp_path):
    """jax.eval_shape turns a Python int into an int32[]: the saved 3 fills it (it was a
    'missing' array and an 'extra' value, refused)."""
    ms.save(tmp_path / "c", {"w": jnp.ones(3), "epoch": 3, "lr": 0.5, "flag": True})
    like = jax.eval_shape(lambda: {"w": jnp.ones(3), "epoch": 3, "lr": 0.5, "flag": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ms.restore(tmp_path / "c", like=like)
    assert {k: (v.dtype.name, v.item()) for k, v in out.items() if k != "w"} == {
        "epoch": ("int32", 3),
        "lr": ("float32", 0.5),
        "flag": ("bool", True),
    }


def test_checksums_of_arrays_added_one_by_one_match_checksums(mesh8):
    from modelshard._checkpoint import checksum as cs

    xs = {
        "a": jax.device_put(
            jnp.arange(4096, dtype=jnp.int32).reshape(64, 64), NamedSharding(mesh8, P("data"))
        ),
        "b": jnp.ones((3, 5), jnp.bfloat16),
        "c": jnp.arange(10, dtype=jnp.uint8),
    }
    want = dict(zip(xs, checksums(list(xs.values())), strict=True))
    batch = cs.Checksums(xs)
    batch.add("c", xs["c"])
    batch.add("a", xs["a"])
    batch.add("not checked", xs["a"])
    got = batch.collect({"b": xs["b"]})  # "b" was never added: summed from the mapping
    assert list(got) == ["a", "b", "c"] and got == want
