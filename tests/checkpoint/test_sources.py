"""Finding a checkpoint (``_checkpoint/sources.py``): symlinks that lead outside, a missing
record, broken Orbax metadata."""

from __future__ import annotations

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import (
    DAMAGED_HINT,
    assert_bit_exact,
    boxed_train_state,
    flip_byte,
    guide_mlp,
    largest_data_file,
    truncate_file,
)
from modelshard._checkpoint.sources import locate


@pytest.mark.parametrize("what", ["data file", "directory", "record"])
def test_symlinks_leading_outside_are_not_followed(small_ckpt, tmp_path, what):

    path, _ = small_ckpt
    outside = tmp_path / "outside"
    outside.mkdir()
    if what == "data file":
        link = largest_data_file(path)
    elif what == "directory":
        link = next(path.glob("ocdbt.process_*"))
    else:
        link = path / "modelshard.json"
    target = outside / link.name
    shutil.move(link, target)  # the same bytes, now reached through a link
    link.symlink_to(target)
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == (
        f"{link} is a symbolic link to {target}, outside the checkpoint {path}; "
        "refusing to follow it."
    )


def test_symlinks_inside_the_checkpoint_are_fine(small_ckpt):
    path, _ = small_ckpt
    (path / "alias").symlink_to(path / "modelshard.json")
    assert ms.restore(path)["w"].shape == (3, 4)


def test_broken_orbax_metadata_names_the_file(tmp_path):
    path = ms.save(tmp_path / "c", {"w": jnp.ones(3)})
    truncate_file(path / "_METADATA")
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"cannot read 1 leaf of {path} (damaged or incomplete checkpoint):"
    assert lines[1].startswith("  w: JSONDecodeError: ")
    assert lines[2] == f"    file: {path / '_METADATA'}"
    assert lines[3:] == [DAMAGED_HINT]


@pytest.mark.parametrize("layout", ["save", "manager"])
def test_deleted_tree_metadata_says_the_checkpoint_is_damaged(tmp_path, layout):
    if layout == "save":
        path = ms.save(tmp_path / "c", {"w": jnp.ones(3)})
        meta, record = path / "_METADATA", path / "modelshard.json"
    else:
        with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
            mngr.save(2, {"w": jnp.ones(3)})
        path = tmp_path / "m" / "2"
        meta, record = path / "state" / "_METADATA", path / "modelshard" / "modelshard.json"
    meta.unlink()
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == (
        f"checkpoint {path} is damaged: Orbax's tree metadata {meta} is missing, though "
        f"modelshard's record {record} is there: the save completed and the file was lost "
        "since. Restore a complete copy of the checkpoint."
    )


@pytest.mark.parametrize("layout", ["save", "manager"])
def test_deleted_record_is_an_error_not_a_plain_orbax_checkpoint(tmp_path, layout):

    state = {"w": jnp.ones(3), "k": jax.random.key(0)}
    if layout == "save":
        path = ms.save(tmp_path / "c", state)
        record = path / "modelshard.json"
        record.unlink()
    else:
        with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
            mngr.save(1, state)
        path = tmp_path / "m" / "1"
        record = path / "modelshard" / "modelshard.json"
        shutil.rmtree(path / "modelshard")
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == (
        f"{record} is missing, but modelshard wrote {path}: without the record the leaves' "
        "paths, dtypes (typed PRNG keys) and checksums are unknown. Restore a complete copy "
        "of the checkpoint."
    )


def test_a_manager_steps_state_item_given_alone_is_read_as_the_step(tmp_path):
    """``root/<step>/state`` holds the arrays and no record (it is beside them): given on
    its own it is read as the step, with the record's paths, dtypes and checksums (it read
    as a plain Orbax checkpoint: PRNG keys as raw data, and damage unchecked)."""
    state = {"w": jnp.arange(65536.0), "k": jax.random.key(0)}  # w: most of the data file
    with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
        mngr.save(1, state)
    item = tmp_path / "m" / "1" / "state"
    source = locate(item)
    assert source.path == tmp_path / "m" / "1" and source.template is None
    out = ms.restore(item)
    assert jax.dtypes.issubdtype(out["k"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(65536.0))
    flip_byte(largest_data_file(item))
    with pytest.raises(ms.CheckpointError, match=r"^checksum mismatch in "):
        ms.restore(item)


@pytest.mark.parametrize("layout", ["save", "manager"])
def test_a_lost_ocdbt_manifest_is_named_before_any_read(tmp_path, capsys, layout):
    """Without the manifest that indexes its arrays a checkpoint is damaged: ``locate``
    says so (``modelshard inspect`` exited 0 on it; a restore failed leaf by leaf)."""
    from modelshard.cli import main

    if layout == "save":
        path = ms.save(tmp_path / "c", {"w": jnp.ones(3)})
        manifest = path / "manifest.ocdbt"
    else:
        with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
            mngr.save(2, {"w": jnp.ones(3)})
        path = tmp_path / "m" / "2"
        manifest = path / "state" / "manifest.ocdbt"
    manifest.unlink()
    message = (
        f"checkpoint {path} is damaged: its OCDBT manifest {manifest}, the file that indexes "
        "its arrays, is missing. Restore a complete copy of the checkpoint."
    )
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path)
    assert str(e.value) == message
    assert main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err == f"modelshard inspect: error: {message}\n"


def _data_file(tree_dir, leaf_bytes):
    """The data file of the one array stored out of line (values of up to 1,024 bytes live
    in the index itself), found by its size: the array's bytes and the writing process's
    own index after them."""
    (f,) = [f for f in tree_dir.glob("ocdbt.process_*/d/*") if f.stat().st_size >= leaf_bytes]
    return f


@pytest.mark.parametrize("layout", ["save", "manager"])
@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_lost_data_file_is_named_with_its_arrays_before_any_read(tmp_path, layout, damage):
    """A data file the OCDBT index refers to, deleted or cut short, is named by ``locate``
    (so by ``restore`` and ``modelshard inspect``, which exited 0) with the arrays it holds;
    only the index is read, the data files are stat'ed."""
    state = {"layers": [{"w": jnp.arange(4096.0)}], "b": jnp.ones(3)}  # w: 16 KiB, raw
    if layout == "save":
        path = ms.save(tmp_path / "c", state)
        tree_dir = path
    else:
        with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
            mngr.save(2, state)
        path = tmp_path / "m" / "2"
        tree_dir = path / "state"
    f = _data_file(tree_dir, 16384)
    if damage == "deleted":
        f.unlink()
        state_line = "missing"
    else:
        with open(f, "r+b") as fh:
            fh.truncate(1000)
        state_line = "cut short: 1000 bytes, the index needs 16384"
    with pytest.raises(ms.CheckpointError) as e:
        locate(path)
    assert str(e.value).splitlines() == [
        f"checkpoint {path} is damaged: 1 file of its OCDBT database is missing or cut short:",
        f"  {f}: {state_line}; it holds the array layers/0/w",
        "Restore a complete copy of the checkpoint.",
    ]
    with pytest.raises(ms.CheckpointError) as again:
        ms.restore(path)
    assert str(again.value) == str(e.value)


def test_a_lost_index_node_and_a_file_of_many_arrays(tmp_path):
    """A file holding part of the index itself (the B-tree node of the root's database) is
    named as such; a file holding many arrays names the first six (in natural order) and
    counts the rest."""
    state = {f"w{i}": jnp.full((512,), float(i)) for i in range(24)}  # 2 KiB each: out of line
    path = ms.save(tmp_path / "c", state)
    (node,) = (path / "d").iterdir()
    node.unlink()
    with pytest.raises(ms.CheckpointError) as e:
        locate(path)
    assert str(e.value).splitlines() == [
        f"checkpoint {path} is damaged: 1 file of its OCDBT database is missing or cut short:",
        f"  {node}: missing; it holds part of the index of its arrays",
        "Restore a complete copy of the checkpoint.",
    ]
    shutil.rmtree(path)
    path = ms.save(tmp_path / "c", state)
    data = largest_data_file(path)  # the writes share out the arrays among a few files
    held = data.stat().st_size // 2048
    data.unlink()
    with pytest.raises(ms.CheckpointError) as e:
        locate(path)
    line = str(e.value).splitlines()[1]
    m = re.fullmatch(
        rf"  {re.escape(str(data))}: missing; it holds the arrays (.*) and (\d+) more", line
    )
    assert m is not None, line
    names = m[1].split(", ")
    assert len(names) == 6 and len(names) + int(m[2]) == held
    assert names == sorted(names, key=lambda n: int(n[1:])) and set(names) <= set(state)


def test_a_plain_orbax_checkpoint_with_a_lost_data_file(tmp_path):
    import orbax.checkpoint as ocp

    path = tmp_path / "plain"
    with ocp.StandardCheckpointer() as c:
        c.save(str(path), {"a": {"b": jnp.arange(8192.0)}, "c": jnp.ones(2)})
    (f,) = [f for f in path.glob("ocdbt.process_*/d/*") if f.stat().st_size >= 1024]
    assert locate(path).record.source == "orbax"
    f.unlink()
    with pytest.raises(ms.CheckpointError) as e:
        locate(path)
    assert str(e.value).splitlines() == [
        f"checkpoint {path} is damaged: 1 file of its OCDBT database is missing or cut short:",
        f"  {f}: missing; it holds the array a/b",
        "Restore a complete copy of the checkpoint.",
    ]


# ---- plain Orbax checkpoints of boxed states: read as the state they came from ----------


def _orbax_save(path, state):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(path), state)
    return path


def _paths(path):
    return [leaf.path for leaf in locate(path).record.leaves]


def test_the_flax_nnx_guides_checkpoint_restores_onto_another_mesh(tmp_path, mesh24):
    """The Flax guide's save of ``nnx.state(model)`` (Orbax stores ``kernel/value``) is
    restored into the model with no mapping, bit-exact, under the paths ``plan`` shows."""
    from flax import nnx

    model = guide_mlp(seed=0)
    path = _orbax_save(tmp_path / "state", nnx.state(model))
    assert sorted(_paths(path)) == sorted(ms.adapters.split(model).paths)
    abstract = nnx.eval_shape(lambda: guide_mlp(seed=1))
    specs = ms.Rules([(r"kernel$", P(None, "model")), (r".*", P())])
    out = ms.restore(path, like=abstract, specs=specs, mesh=mesh24)
    assert type(out) is type(model)
    assert out.linear1.kernel[...].sharding.spec == P(None, "model")
    assert out.linear1.kernel[...].sharding.mesh.axis_types == mesh24.axis_types
    assert_bit_exact(nnx.state(model), nnx.state(out))
    plain = ms.restore(path)  # without like: nested dicts under the same paths
    np.testing.assert_array_equal(plain["bn"]["mean"], model.bn.mean[...])


def test_a_linen_train_state_with_boxed_params_and_adamw_restores(tmp_path, mesh8):
    """A ``TrainState`` whose params (and so adamw's moments) are ``Partitioned`` /
    ``LogicallyPartitioned``, saved by Orbax with its Python int step: restored into
    the boxed state, boxes and their names kept, bit-exact."""
    import flax.linen as nn

    state = boxed_train_state(seed=0, step=7)
    path = _orbax_save(tmp_path / "ts", state)
    assert "opt_state/0/mu/Dense_1/kernel" in _paths(path)
    like = jax.eval_shape(lambda: boxed_train_state(seed=1))
    out = ms.restore(path, like=like, specs=ms.fsdp("data", min_size=0), mesh=mesh8)
    kernel = out.params["Dense_0"]["kernel"]
    assert type(kernel) is nn.LogicallyPartitioned and kernel.names == ("embed", "mlp")
    assert type(out.opt_state[0].nu["Dense_1"]["kernel"]) is nn.Partitioned
    assert kernel.value.sharding.spec == P(None, "data")
    assert kernel.value.sharding.mesh.axis_types == mesh8.axis_types
    assert int(out.step) == 7 and out.step.dtype == jnp.int32
    assert_bit_exact(state.replace(step=jnp.asarray(7)), out)


def test_a_dict_whose_leaf_really_is_named_value(tmp_path):
    """Only a node whose one child is ``value`` is a box: a dict with other keys beside
    ``value``, or a root ``{"value": ...}``, keeps its names; a target that really has a
    leaf named ``value`` under a dict is restored under its own paths."""
    tree = {"w": {"value": jnp.arange(4.0)}, "n": {"value": jnp.ones(2), "scale": jnp.zeros(2)}}
    path = _orbax_save(tmp_path / "d", tree)
    assert sorted(_paths(path)) == ["n/scale", "n/value", "w"]
    assert_bit_exact(tree, ms.restore(path, like=tree))
    assert_bit_exact({"w": tree["w"]["value"], "n": tree["n"]}, ms.restore(path))
    root = _orbax_save(tmp_path / "r", {"value": jnp.arange(3.0)})
    assert _paths(root) == ["value"]
    np.testing.assert_array_equal(ms.restore(root)["value"], np.arange(3.0))


def test_mappings_written_for_orbaxs_own_names_still_restore(tmp_path):
    """Mappings written before boxes were read (rules for ``kernel/value``) keep working,
    and so do ones written for the canonical paths."""
    from flax import nnx

    model = guide_mlp(seed=0)
    path = _orbax_save(tmp_path / "state", nnx.state(model))
    abstract = nnx.eval_shape(lambda: guide_mlp(seed=1))
    for mapping in (
        ms.WeightMap([ms.MapRule(r"(.+)/value", "{1}")]),
        ms.WeightMap(
            [
                ms.MapRule(r"linear1/kernel/value", "linear1/kernel"),
                ms.MapRule(r"(.+)/value", "{1}"),
            ]
        ),
        ms.WeightMap(
            [ms.MapRule(r"linear(\d)/kernel", "linear{1}/kernel"), ms.MapRule(r"(.*)", "{1}")]
        ),
    ):
        out = ms.restore(path, like=abstract, mapping=mapping)
        assert_bit_exact(nnx.state(model), nnx.state(out))
    state = boxed_train_state(seed=0, step=3)
    path = _orbax_save(tmp_path / "ts", state)
    mapping = ms.WeightMap([ms.MapRule(r"(.+)/value", "{1}"), ms.MapRule(r"(.*)", "{1}")])
    out = ms.restore(path, like=jax.eval_shape(lambda: boxed_train_state(seed=1)), mapping=mapping)
    assert_bit_exact(state.replace(step=jnp.asarray(3)), out)


def test_a_lost_data_file_of_a_boxed_orbax_state_names_canonical_paths(tmp_path):
    from flax import nnx

    model = guide_mlp(dim=64, seed=0)
    path = _orbax_save(tmp_path / "state", nnx.state(model))
    lost = largest_data_file(path)
    lost.unlink()
    with pytest.raises(ms.CheckpointError) as e:
        locate(path)
    # both kernels are the same size: either may be in the largest file
    assert "/value" not in str(e.value)
    assert re.search(r"it holds the arrays? .*linear[12]/kernel", str(e.value)), str(e.value)


def test_an_nnx_models_rng_key_orbax_stored_comes_back_a_key(tmp_path, mesh8):
    """Orbax stores an ``nnx.Rngs``'s typed key as its key data, naming no implementation
    in ``_METADATA``: a ``like`` holding a typed key there gets it back, bit-exact."""
    from flax import nnx

    class WithDropout(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(8, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    model = WithDropout(nnx.Rngs(0))
    path = _orbax_save(tmp_path / "state", nnx.state(model))
    like = nnx.eval_shape(lambda: WithDropout(nnx.Rngs(1)))
    out = ms.restore(path, like=like, specs=ms.fsdp("data", min_size=0), mesh=mesh8)
    key = out.drop.rngs.key[...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert out.linear.kernel[...].sharding.spec == P("data")
    assert_bit_exact(nnx.state(model), nnx.state(out))


def test_a_mismatch_with_a_boxed_orbax_state_names_the_canonical_paths(tmp_path):
    from flax import nnx

    path = _orbax_save(tmp_path / "state", nnx.state(guide_mlp(dim=16)))
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(path, like=nnx.eval_shape(lambda: guide_mlp(dim=8)))
    lines = str(e.value).splitlines()
    assert lines[1:] == [
        "  changed  bn/bias              checkpoint float32[16] -> target float32[8]",
        "  changed  bn/mean              checkpoint float32[16] -> target float32[8]",
        "  changed  bn/scale             checkpoint float32[16] -> target float32[8]",
        "  changed  bn/var               checkpoint float32[16] -> target float32[8]",
        "  changed  linear{1..2}/kernel  checkpoint float32[16, 16] -> target float32[8, 8]  "
        "(2 leaves)",
        "hint: the checkpoint's shapes differ from the target's (sizes 16 -> 8 (8 leaves)): build "
        "the target with the configuration the checkpoint was saved with (partial=True cannot "
        "help: these leaves exist on both sides)",
    ]


def test_a_python_int_orbax_stored_is_read_as_jax_holds_it_unless_it_does_not_fit(tmp_path):
    """Orbax stores a Python int 64-bit: one that fits is read as an int32 (as
    ``jnp.asarray`` holds it without x64); a larger one is never wrapped, its restore
    asks for x64."""
    path = _orbax_save(tmp_path / "small", {"step": 2**31 - 1, "epoch": -(2**31)})
    out = ms.restore(path)
    assert out["step"].dtype == jnp.int32 and int(out["step"]) == 2**31 - 1
    assert int(out["epoch"]) == -(2**31)
    big = _orbax_save(tmp_path / "big", {"step": 2**33 + 5, "w": jnp.ones(2)})
    assert locate(big).record.by_path()["step"].dtype == "int64"
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(big)
    assert str(e.value).splitlines()[1:] == [
        "  step: int64[]",
        "hint: jax.config.update('jax_enable_x64', True) before using JAX.",
    ]


def test_a_plain_orbax_checkpoints_chunks_and_format_come_from_its_metadata(tmp_path):
    path = _orbax_save(tmp_path / "plain", {"w": {"value": jnp.ones((64, 8))}, "b": jnp.ones(3)})
    source = locate(path)
    assert source.tree_metadata()["use_ocdbt"] is True
    assert source.write_shapes() == {("w", "value"): (64, 8), ("b",): (3,)}
