"""save/restore: round trips of every container kind onto three meshes, interop with plain
Orbax, structure diffs, partial restore, checksums and damaged shards."""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS, array_bits, assert_bit_exact, boxed_train_state, guide_mlp, stored_codec


@pytest.fixture
def axis_type():
    """One axis type for conftest's ``mesh8``: these tests do not depend on it."""
    return "auto"


BIG = r"(kernel|weight|embedding|embed)$"

# (mesh axes, axis types, specs): three layouts with different rules.
LAYOUTS = {
    "8": ({"data": 8}, "auto", ms.fsdp("data", min_size=0)),
    "2x4": (
        {"data": 2, "model": 4},
        "explicit",
        ms.Rules([(BIG, P("data", "model")), (".*", P())], strict=False),
    ),
    "4x2": (
        {"data": 4, "model": 2},
        "auto",
        ms.Rules([(BIG, P("model", "data")), ("bias$", P("data"))], strict=False),
    ),
}


def assert_same_values(a, b):
    fa, fb = ms.adapters.split(a), ms.adapters.split(b)
    assert fa.paths == fb.paths
    for path, x, y in zip(fa.paths, fa.arrays, fb.arrays, strict=True):
        assert x.dtype == y.dtype, path
        assert array_bits(x) == array_bits(y), path


def test_round_trip_every_kind_onto_three_meshes(container, tmp_path):
    path = ms.save(tmp_path / "ckpt", container)
    for axes, types, specs in LAYOUTS.values():
        mesh = ms.make_mesh(axes, axis_types=types)
        out = ms.restore(path, like=container, specs=specs, mesh=mesh)
        assert type(out) is type(container)
        assert_same_values(container, out)
        planned = ms.plan(container, specs, mesh).flat_shardings(0)
        got = ms.adapters.split(out).arrays
        for leaf, want in zip(got, planned, strict=True):
            assert leaf.sharding == want
        assert any(s.spec != P() for s in planned)


def test_restore_onto_abstract_like_from_eval_shape(tmp_path, mesh24):
    from flax import nnx

    model = MAKERS["nnx"]()
    ms.save(tmp_path / "c", model)
    abstract = nnx.eval_shape(MAKERS["nnx"])
    specs = ms.Rules([("kernel$", P(None, "model")), (".*", P())])
    out = ms.restore(tmp_path / "c", like=abstract, specs=specs, mesh=mesh24)
    assert isinstance(out, nnx.Module)
    assert_same_values(model, out)
    assert out.mlp.kernel[...].sharding.spec == P(None, "model")


def test_restore_pytree_like_from_jax_eval_shape_and_abstract_mesh(tmp_path):
    tree = MAKERS["pytree"]()
    ms.save(tmp_path / "c", tree)
    like = jax.eval_shape(MAKERS["pytree"])
    mesh = ms.make_mesh({"data": 8}, abstract=True)
    out = ms.restore(tmp_path / "c", like=like, specs=ms.fsdp("data", min_size=0), mesh=mesh)
    assert_same_values(tree, out)
    assert out["embed"].sharding.spec == P("data")
    assert not isinstance(out["embed"].sharding.mesh, jax.sharding.AbstractMesh)


def test_bfloat16_and_sharded_typed_keys_round_trip(tmp_path, mesh8):
    rules = ms.Rules([("w|keys", P("data")), (".*", P())])
    state = ms.shard(
        {
            "w": jnp.arange(64, dtype=jnp.bfloat16).reshape(8, 8),
            "keys": jax.random.split(jax.random.key(3), 8),
            "rbg": jax.random.key(1, impl="rbg"),
        },
        rules,
        mesh8,
    )
    ms.save(tmp_path / "c", state)
    rec = json.loads((tmp_path / "c" / "modelshard.json").read_text())
    keys = next(leaf for leaf in rec["leaves"] if leaf["path"] == "keys")
    assert (keys["dtype"], keys["key_impl"], keys["stored_shape"]) == (
        "key<fry>",
        "threefry2x32",
        [8, 2],
    )
    assert keys["spec"] == ["data"]
    assert rec["mesh"]["axes"] == {"data": 8}
    out = ms.restore(tmp_path / "c", like=state, specs=rules, mesh=mesh8)
    assert_same_values(state, out)
    assert out["keys"].sharding.spec == P("data")
    assert str(jax.random.key_impl(out["rbg"])) == "rbg"


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_restore_without_like_gives_nested_dict_and_saved_shardings(tmp_path, axis_type):
    mesh = ms.make_mesh({"data": 8}, axis_types=axis_type)
    state = ms.shard(MAKERS["nnx"](), ms.fsdp("data", min_size=0), mesh)
    ms.save(tmp_path / "c", state)
    out = ms.restore(tmp_path / "c")
    assert isinstance(out, dict)
    assert out["mlp"]["kernel"].sharding.spec == P(None, "data")  # the saved mesh and spec
    assert jax.dtypes.issubdtype(out["drop"]["rngs"]["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(out["mlp"]["kernel"], state.mlp.kernel[...])


def test_restore_with_mesh_and_no_specs_uses_saved_specs(tmp_path, mesh8):
    state = ms.shard(MAKERS["pytree"](), ms.fsdp("data", min_size=0), mesh8)
    ms.save(tmp_path / "c", state)
    mesh = ms.make_mesh({"data": 8}, axis_types="explicit")
    out = ms.restore(tmp_path / "c", like=state, mesh=mesh)
    assert out["layers"][0]["kernel"].sharding == NamedSharding(mesh, P(None, "data"))


def test_dtype_casts_floating_leaves_after_verifying(tmp_path):
    tree = MAKERS["pytree"]()
    ms.save(tmp_path / "c", tree)
    out = ms.restore(tmp_path / "c", dtype="bfloat16")
    assert out["embed"].dtype == jnp.bfloat16 and out["step"].dtype == jnp.int32
    np.testing.assert_array_equal(out["embed"], tree["embed"].astype(jnp.bfloat16))


def test_numpy_leaves_and_default_single_device(tmp_path):
    ms.save(tmp_path / "c", {"a": np.arange(6, dtype=np.int32).reshape(2, 3)})
    out = ms.restore(tmp_path / "c", like={"a": np.zeros((2, 3), np.int32)})
    assert isinstance(out["a"].sharding, SingleDeviceSharding)
    np.testing.assert_array_equal(out["a"], np.arange(6).reshape(2, 3))


# ---- interop with plain Orbax ----------------------------------------------------------


def test_train_state_python_int_step_is_saved_and_restored(tmp_path, mesh8):
    optax = pytest.importorskip("optax")
    ts = pytest.importorskip("flax.training.train_state")

    def make(step):
        state = ts.TrainState.create(
            apply_fn=None, params={"w": jnp.ones((8, 2))}, tx=optax.sgd(0.1)
        )
        return state.replace(step=step)

    ms.save(str(tmp_path / "ck"), make(7))  # TrainState.create-style Python int step
    restored = ms.restore(str(tmp_path / "ck"), like=make(0), specs=P(), mesh=mesh8)
    assert int(restored.step) == 7 and restored.step.sharding.is_fully_replicated
    assert int(ms.restore(str(tmp_path / "ck"))["step"]) == 7  # in the record, too


def test_plain_orbax_standard_checkpointer_reads_ours(tmp_path):
    tree = MAKERS["linen"]()
    ms.save(tmp_path / "c", tree)
    plain = ocp.StandardCheckpointer().restore(str(tmp_path / "c"))
    kernel = plain["params"]["Dense_0"]["kernel"]
    np.testing.assert_array_equal(kernel, tree["params"]["Dense_0"]["kernel"].value)
    nnx_path = ms.save(tmp_path / "n", MAKERS["nnx"]())
    key_data = ocp.StandardCheckpointer().restore(str(nnx_path))["drop"]["rngs"]["key"]
    assert key_data.dtype == jnp.uint32 and key_data.shape == (2,)


FRAMEWORKS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "frameworks.md"


def _doc_block(marker: str) -> str:
    """The one ```python block of the frameworks guide that holds ``marker``."""
    text = FRAMEWORKS_PAGE.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if marker in b]
    return block


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_the_flax_guides_restore_reads_ours_by_the_documented_lines(tmp_path, axis_type):
    """Rolling back: the lines docs/guides/frameworks.md gives, run as shown, read
    ``ms.save``'s checkpoints of a sharded NNX model (the Flax guide's restore with
    ``nnx.replace_by_pure_dict``) and of a linen ``TrainState`` with boxed params and
    adamw moments (boxes rebuilt), bit-exact."""
    import flax.linen as nn
    from flax import nnx

    mesh = ms.make_mesh({"data": 8}, axis_types=axis_type)
    model = guide_mlp(seed=0)
    ms.shard(model, ms.fsdp("data", min_size=0), mesh)
    ns = {"ms": ms, "nnx": nnx, "ocp": ocp, "ckpt_dir": str(tmp_path), "model": model}
    ns["TwoLayerMLP"] = type(model)
    exec(_doc_block("# the Flax guide's restore, reading a modelshard checkpoint"), ns)
    assert type(ns["model"]) is type(model) and ns["model"] is not model
    assert_bit_exact(nnx.state(model), nnx.state(ns["model"]))

    state = ms.shard(boxed_train_state(seed=0, step=4), ms.fsdp("data", min_size=0), mesh)
    ms.save(tmp_path / "linen", state)
    ns = {"jax": jax}
    exec(_doc_block("def restore_modelshard_checkpoint("), ns)
    like = jax.eval_shape(lambda: boxed_train_state(seed=1))
    back = ns["restore_modelshard_checkpoint"](str(tmp_path / "linen"), like)
    kernel = back.opt_state[0].mu["Dense_0"]["kernel"]
    assert type(kernel) is nn.LogicallyPartitioned and kernel.names == ("embed", "mlp")
    assert type(back.params["Dense_1"]["kernel"]) is nn.Partitioned
    assert_bit_exact(state, back)


def test_we_read_plain_standard_checkpointer(tmp_path, mesh24):
    tree = MAKERS["pytree"]()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(str(tmp_path / "plain"), tree)
    out = ms.restore(tmp_path / "plain", like=tree, specs=ms.fsdp("model", min_size=0), mesh=mesh24)
    assert_same_values(tree, out)
    assert out["embed"].sharding.spec == P("model")
    nested = ms.restore(tmp_path / "plain")
    np.testing.assert_array_equal(nested["layers"][0]["kernel"], tree["layers"][0]["kernel"])


def test_we_read_plain_orbax_checkpoint_manager(tmp_path, mesh8):
    tree = MAKERS["optax"]()
    with ocp.CheckpointManager(str(tmp_path / "m")) as mngr:
        for step in (9, 10, 11):  # sorted as numbers, the latest is 11 (as text, 9)
            mngr.save(step, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
    out = ms.restore(
        tmp_path / "m" / "11", like=tree, specs=ms.fsdp("data", min_size=0), mesh=mesh8
    )
    assert_same_values(tree, out)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "m")
    assert str(e.value).endswith(
        "It looks like a CheckpointManager directory (steps 9, 10, 11): pass a step directory "
        f"such as {tmp_path / 'm' / '11'}, or restore with "
        "modelshard.CheckpointManager(...).restore()."
    )


# ---- structure mismatches and partial restore ------------------------------------------


def test_structure_mismatch_is_a_path_first_diff(tmp_path):
    ms.save(tmp_path / "c", {"a": jnp.ones((2, 3)), "b": jnp.ones(4), "gone": jnp.ones(1)})
    like = {"a": jnp.ones((3, 3)), "b": jnp.ones(4), "new": jnp.ones(2)}
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like=like)
    assert str(e.value).splitlines() == [
        f"checkpoint {tmp_path / 'c'} does not match the target dict (3 differences: 1 changed, "
        "1 missing, 1 extra; paths first):",
        "  changed  a     checkpoint float32[2, 3] -> target float32[3, 3]",
        "  missing  new   float32[2] (in the target, not in the checkpoint)",
        "  extra    gone  float32[1] (in the checkpoint, not in the target)",
        "hint: pass partial=True to restore only the leaves both have (missing leaves then keep "
        "like's values, so like must be concrete for them; a warning names them); shapes must "
        "match; pass dtype=... to cast floating leaves",
    ]


def _layers(n: int, d: int) -> dict:
    return {
        "embed": jnp.ones((32, d)),
        **{f"layer_{i}": {"w": jnp.ones((d, 2 * d)), "b": jnp.ones(2 * d)} for i in range(n)},
    }


def test_model_only_like_of_a_model_and_optimizer_checkpoint(tmp_path):
    """A {model, optimizer} checkpoint restored into the model alone: the hint names the
    subtree restore, and the rows fold over layers instead of listing every leaf."""
    model = _layers(25, 8)
    ms.save(tmp_path / "c", {"model": model, "optimizer": {"mu": model, "nu": model}})
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like=model)
    lines = str(e.value).splitlines()
    assert len(lines) <= 30
    assert lines[0].endswith("(204 differences: 51 missing, 153 extra; paths first):")
    assert "  missing  layer_{0..24}/w" in "\n".join(lines)
    assert lines[-1] == (
        "hint: every leaf of the target is in the checkpoint under 'model/': restore that part "
        "with like={'model': like}, partial=True (and take ['model'] of the result)"
    )
    out = ms.restore(tmp_path / "c", like={"model": model}, partial=True)["model"]
    assert out["layer_3"]["w"].shape == (8, 16)


def test_changed_sizes_do_not_suggest_partial(tmp_path):
    """d_model 8 -> 16 before a restore: the sizes that changed, not partial=True."""
    ms.save(tmp_path / "c", _layers(20, 8))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like=_layers(20, 16))
    text = str(e.value)
    assert len(text.splitlines()) <= 8 and "partial=True cannot help" in text
    assert "(sizes 16 -> 32 (40 leaves); 8 -> 16 (21 leaves)): build the target with the " in text
    assert (
        "  changed  layer_{0..19}/w  checkpoint float32[8, 16] -> target float32[16, 32]  (20 leaves)"
        in text
    )


def test_dtype_change_needs_dtype_argument(tmp_path):
    ms.save(tmp_path / "c", {"a": jnp.ones(2)})
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", like={"a": jnp.ones(2, jnp.bfloat16)})
    assert str(e.value).splitlines()[1:] == [
        "  changed  a  checkpoint float32[2] -> target bfloat16[2]",
        "hint: shapes must match; pass dtype=... to cast floating leaves",
    ]
    out = ms.restore(tmp_path / "c", like={"a": jnp.ones(2, jnp.bfloat16)}, dtype=jnp.bfloat16)
    assert out["a"].dtype == jnp.bfloat16


def test_partial_restore_skips_extra_and_keeps_concrete_missing(tmp_path, mesh8):
    ms.save(tmp_path / "c", {"a": jnp.arange(8.0), "extra": jnp.ones(3)})
    like = {"a": jnp.zeros(8), "fresh": jnp.full((8,), 5.0)}
    out = ms.restore(tmp_path / "c", like=like, specs=P("data"), mesh=mesh8, partial=True)
    np.testing.assert_array_equal(out["a"], np.arange(8.0))
    np.testing.assert_array_equal(out["fresh"], np.full(8, 5.0))
    assert out["fresh"].sharding.spec == P("data")
    with pytest.raises(ms.CheckpointError, match="missing  fresh"):
        ms.restore(tmp_path / "c", like=jax.eval_shape(lambda: like), partial=True)


# ---- damage ------------------------------------------------------------------------------


def _flip_largest_shard(ckpt):
    files = sorted(glob.glob(str(ckpt / "ocdbt.process_*" / "d" / "*")), key=os.path.getsize)
    with open(files[-1], "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    with open(files[-1], "wb") as f:
        f.write(bytes(data))


def test_flipped_bytes_in_a_shard_name_the_leaf(tmp_path, mesh8):
    big = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    ms.save(
        tmp_path / "c",
        {"big": ms.shard(jnp.asarray(big), P("data"), mesh8), "small": jnp.arange(8.0)},
    )
    _flip_largest_shard(tmp_path / "c")
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c")
    msg = str(e.value)
    assert "\n  big float32[256, 64]" in msg or "\n  big:" in msg
    assert "small" not in msg


def test_checksum_mismatch_message(tmp_path):
    ms.save(tmp_path / "c", {"w": jnp.arange(4.0), "v": jnp.ones(2)})
    rec_file = tmp_path / "c" / "modelshard.json"
    rec = json.loads(rec_file.read_text())
    rec["leaves"][1]["checksum"] = "00000000:00000000"
    rec_file.write_text(json.dumps(rec))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c")
    lines = str(e.value).splitlines()
    assert lines[0] == (
        f"checksum mismatch in {tmp_path / 'c'}: the stored bytes of 1 leaf changed "
        "since they were saved:"
    )
    assert lines[1].startswith("  w float32[4]: recorded 00000000:00000000, read ")
    assert lines[2] == (
        "hint: the checkpoint is damaged; restore an earlier one, or pass "
        "verify=False to load it anyway."
    )
    assert ms.restore(tmp_path / "c", verify=False)["w"][3] == 3.0


# ---- save errors and atomic overwrite ----------------------------------------------------


def test_save_refuses_existing_and_abstract(tmp_path):
    ms.save(tmp_path / "c", {"w": jnp.ones(2)})
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", {"w": jnp.ones(2)})
    assert str(e.value) == (
        f"{tmp_path / 'c'} already exists; pass overwrite=True to replace it "
        "(the old checkpoint is kept until the new one is complete)."
    )
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "d", {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
    assert str(e.value).splitlines() == [
        "cannot save 1 leaf (nothing was written):",
        "  w: it is an abstract ShapeDtypeStruct float32[2], not an array",
    ]
    ms.save(tmp_path / "c", {"w": jnp.zeros(2)}, overwrite=True, metadata={"note": "v2"})
    assert ms.restore(tmp_path / "c")["w"][0] == 0.0
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_save_refuses_paths_that_do_not_form_a_tree(tmp_path):
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", {"a": jnp.ones(1), "a/b": jnp.ones(1)})
    assert str(e.value) == (
        "save: leaf 'a' is also a parent of 'a/b'; canonical paths must form a tree."
    )


def test_restore_errors(tmp_path, mesh8):
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "nope")
    assert str(e.value) == f"no checkpoint at {tmp_path / 'nope'}: the directory does not exist."
    ms.save(tmp_path / "c", {"w": jnp.ones(8)})
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(tmp_path / "c", specs=P("data"))
    assert str(e.value) == "restore(specs=...) needs mesh=...: specs are planned on a mesh."
    with pytest.raises(ms.SpecError, match="axis 'model'"):
        ms.restore(tmp_path / "c", specs=P("model"), mesh=mesh8)


def test_restore_reads_a_shard_larger_than_the_read_cap(tmp_path, monkeypatch, mesh8):
    """A read larger than the cap on bytes in flight is not refused: it runs alone (here a
    128 KiB leaf under a 4 KiB cap)."""
    from modelshard._checkpoint import reader

    monkeypatch.setattr(reader, "RESTORE_CONCURRENT_BYTES", 4096)
    values = np.arange(32 * 1024, dtype=np.float32).reshape(256, 128)
    path = ms.save(tmp_path / "c", {"w": jnp.asarray(values), "b": jnp.ones(8)})
    np.testing.assert_array_equal(ms.restore(path)["w"], values)
    out = ms.restore(path, specs=ms.fsdp("data", min_size=0), mesh=mesh8)
    assert out["w"].sharding.spec == P("data")
    np.testing.assert_array_equal(out["w"], values)


def test_partial_reads_of_plain_orbax_keep_its_lists(tmp_path, mesh8):
    from modelshard._checkpoint.resharding import reshard

    tree = {"layers": [{"w": jnp.ones((8, 4))}, {"w": jnp.zeros((8, 4))}], "b": jnp.arange(8.0)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(str(tmp_path / "src"), tree)
    out = ms.restore(tmp_path / "src", like={"b": jnp.zeros(8)}, partial=True)
    np.testing.assert_array_equal(out["b"], np.arange(8.0))
    reshard(
        tmp_path / "src",
        tmp_path / "dst",
        specs=ms.fsdp("data", min_size=0),
        mesh=mesh8,
        chunk_bytes=64,
    )
    back = ms.restore(tmp_path / "dst")
    assert back["layers"]["1"]["w"].sharding.spec == P("data")
    np.testing.assert_array_equal(back["layers"]["0"]["w"], np.ones((8, 4)))


def test_like_with_abstract_mesh_shardings_is_made_concrete(tmp_path):
    ms.save(tmp_path / "c", {"w": jnp.arange(16.0)})
    abstract = ms.make_mesh({"data": 8}, abstract=True)
    like = {
        "w": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(abstract, P("data")))
    }
    out = ms.restore(tmp_path / "c", like=like)
    assert out["w"].sharding.spec == P("data")
    assert not isinstance(out["w"].sharding.mesh, jax.sharding.AbstractMesh)
    np.testing.assert_array_equal(out["w"], np.arange(16.0))


# ---- compression, checkpoints of earlier versions, compilations of a save ------------------

OLD = os.path.join(os.path.dirname(__file__), "data", "ckpt_5ada014")


def test_a_checkpoint_written_before_uncompressed_saves_still_restores(tmp_path, mesh24):
    """tests/checkpoint/data/ckpt_5ada014: written by ``ms.save`` at commit 5ada014 (zstd chunks,
    record format 1) from the state rebuilt here; read back bit for bit, verified."""
    assert stored_codec(OLD, "dense/kernel") == {"id": "zstd", "level": 1}
    want = {
        "dense": {
            "kernel": jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 7,
            "bias": jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16),
        },
        "step": jnp.int32(1234),
        "key": jax.random.key(42),
    }
    assert_same_values(ms.restore(OLD, like=want), want)
    moved = ms.restore(OLD, like=want, specs=ms.fsdp("model", min_size=0), mesh=mesh24)
    assert_same_values(moved, want)
    assert moved["dense"]["kernel"].sharding.spec == P("model")
    assert ms.read_metadata(OLD) == {"written_by": "5ada014"}
    # and rewritten by today's save, uncompressed, it still reads in plain Orbax
    path = ms.save(tmp_path / "again", moved)
    assert stored_codec(path, "dense/kernel") is None
    plain = ocp.StandardCheckpointer().restore(str(path))
    np.testing.assert_array_equal(plain["dense"]["kernel"], want["dense"]["kernel"])


def test_save_stores_raw_chunks_unless_compression_zstd(tmp_path, mesh8):
    zeros = ms.shard({"w": jnp.zeros((512, 256)), "b": jnp.ones(8)}, ms.fsdp("data"), mesh8)
    raw = ms.save(tmp_path / "raw", zeros)
    packed = ms.save(tmp_path / "zstd", zeros, compression="zstd")
    assert stored_codec(raw, "w") is None
    assert stored_codec(packed, "w") == {"id": "zstd", "level": 1}

    def data_bytes(p):
        return sum(os.path.getsize(f) for f in glob.glob(f"{p}/**/d/*", recursive=True))

    assert data_bytes(raw) >= 512 * 256 * 4 > 20 * data_bytes(packed)
    for p in (raw, packed):
        assert_same_values(ms.restore(p, like=zeros), zeros)
        plain = ocp.StandardCheckpointer().restore(str(p))
        np.testing.assert_array_equal(plain["w"], np.zeros((512, 256), np.float32))
        np.testing.assert_array_equal(plain["b"], np.ones(8, np.float32))


@pytest.mark.parametrize("bad", ["gzip", "ZSTD", True, 1])
def test_save_refuses_an_unknown_compression_before_writing(tmp_path, bad):
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(tmp_path / "c", {"w": jnp.ones(4)}, compression=bad)
    assert str(e.value).splitlines() == [
        f"compression={bad!r} is not one of None (each chunk's raw bytes, the default) or "
        "'zstd' (Orbax's default codec: smaller files, several times the CPU)."
    ]
    assert not (tmp_path / "c").exists()


def test_the_first_save_of_a_small_state_compiles_nothing(tmp_path, mesh8):
    """Orbax's replica-parallel save cut each replicated leaf into per-replica parts, one
    ``jit(slice)`` program per part and shape (48 at the first save of a small state);
    one process saves each replicated leaf whole, and small leaves are summed on the host."""
    names = []

    def listen(event: str, duration_secs: float, **kw: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kw.get("fun_name"))

    state = ms.shard(
        {
            "a": {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))},
            "c": {"w": jnp.ones((16, 8)), "s": jnp.ones(())},
            "n": {f"b{i}": jnp.full((3 + i,), float(i)) for i in range(6)},
            "key": jax.random.key(0),
        },
        ms.fsdp("data"),
        mesh8,
    )
    jax.block_until_ready(state)
    assert state["a"]["b"].sharding.is_fully_replicated  # what Orbax used to slice
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        path = ms.save(tmp_path / "c", state)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert names == []
    assert_same_values(ms.restore(path, like=state), state)


FRESH_PROCESS = """
import collections, json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import modelshard as ms

names = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: names.append(kw.get("fun_name"))
    if e == "/jax/core/compile/backend_compile_duration" else None
)
mesh = ms.make_mesh({"data": 8})
state = ms.shard({"w": jnp.ones((2048, 1024)), "b": jnp.ones(16)}, ms.fsdp("data"), mesh)
jax.block_until_ready(state)
out = {}
steps = ("save", "save", "save") if sys.argv[2] == "save" else ("restore", "restore")
for step in steps:
    names.clear()
    if step == "save":
        ms.save(sys.argv[1], state, overwrite=True)
    else:
        jax.block_until_ready(ms.restore(sys.argv[1], mesh=mesh))
    out.setdefault(step, []).append(collections.Counter(names))
print(json.dumps(out))
"""


def test_a_fresh_process_compiles_each_checksum_program_once(tmp_path):
    """Orbax's first import defines JAX config options, part of every jit cache key: a
    checksum traced before it missed the cache once after it (the second save compiled
    it again, the first restore twice). Counted in a fresh process, where that import
    has not happened yet."""
    import subprocess
    import sys

    script = tmp_path / "fresh.py"
    script.write_text(FRESH_PROCESS)

    def fresh(what):
        run = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "c"), what],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.strip().splitlines()[-1])[what]

    # the big leaf's shards are summed on the host by a program of a fixed size, compiled
    # once per process; the vector with NumPy
    assert fresh("save") == [{"jit(_sums_of)": 1}, {}, {}]
    assert fresh("restore") == [{"jit(_sums_of)": 1}, {}]
