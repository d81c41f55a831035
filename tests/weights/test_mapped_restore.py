"""``restore(..., mapping=...)``: stored leaves read straight onto the mesh in the sharding
the planned target needs, default specs carried from the saved ones, typed PRNG keys."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms

mapped = importlib.import_module("modelshard._checkpoint.mapped")
RNG = np.random.default_rng(2)

WM = ms.WeightMap(
    [
        ms.MapRule(r"params/layers/kernel", "blocks/{i}/kernel", unstack=ms.Unstack("i")),
        ms.MapRule(r"params/out/w", "head/kernel", transpose=(1, 0)),
    ]
)


def _saved(tmp_path, mesh8):
    k = RNG.standard_normal((3, 8, 16)).astype(np.float32)
    w = RNG.standard_normal((16, 8)).astype(np.float32)
    state = {"params": {"layers": {"kernel": jnp.asarray(k)}, "out": {"w": jnp.asarray(w)}}}
    specs = ms.Rules([("layers/kernel", P(None, None, "data")), ("out/w", P("data"))])
    ms.save(tmp_path / "ck", ms.shard(state, specs, mesh8))
    like = {
        "blocks": {str(i): {"kernel": jax.ShapeDtypeStruct((8, 16), np.float32)} for i in range(3)},
        "head": {"kernel": jax.ShapeDtypeStruct((8, 16), np.float32)},
    }
    return k, w, like


def test_transposed_and_unstacked_leaves_are_read_onto_the_mesh_as_their_blocks(
    tmp_path, mesh8, monkeypatch
):
    k, w, like = _saved(tmp_path, mesh8)
    reads: dict[str, P] = {}
    real = mapped.read_verified

    def spy(source, targets, verify):
        reads.update({p: t.sharding.spec for p, t in targets.items()})
        return real(source, targets, verify)

    monkeypatch.setattr(mapped, "read_verified", spy)
    out = ms.restore(
        tmp_path / "ck", like=like, mapping=WM, specs=ms.fsdp("data", min_size=0), mesh=mesh8
    )
    # the targets are FSDP along their last axis; each stored leaf is read sharded so that a
    # device's shard holds exactly its block of every target leaf reading it
    assert out["head"]["kernel"].sharding.spec == P(None, "data")
    assert reads == {"params/out/w": P("data", None), "params/layers/kernel": P(None, None, "data")}
    np.testing.assert_array_equal(np.asarray(out["head"]["kernel"]), w.T)
    for i in range(3):
        leaf = out["blocks"][str(i)]["kernel"]
        assert leaf.sharding.spec == P(None, "data")
        np.testing.assert_array_equal(np.asarray(leaf), k[i])
        assert {s.data.shape for s in leaf.addressable_shards} == {(8, 2)}


def test_default_specs_are_the_saved_ones_carried_through_the_recipes(tmp_path, mesh8):
    k, w, like = _saved(tmp_path, mesh8)
    out = ms.restore(tmp_path / "ck", like=like, mapping=WM, mesh=mesh8)
    # saved: out/w P("data") [16, 8] -> head/kernel transposed: P(None, "data")
    assert out["head"]["kernel"].sharding.spec == P(None, "data")
    # saved: layers/kernel P(None, None, "data") -> one layer: P(None, "data")
    assert out["blocks"]["1"]["kernel"].sharding.spec == P(None, "data")
    np.testing.assert_array_equal(np.asarray(out["blocks"]["1"]["kernel"]), k[1])
    np.testing.assert_array_equal(np.asarray(out["head"]["kernel"]), w.T)
    # explicit specs still win
    out = ms.restore(tmp_path / "ck", like=like, mapping=WM, specs=P(), mesh=mesh8)
    assert out["head"]["kernel"].sharding.spec == P()


def test_typed_prng_keys_are_renamed_unstacked_and_stacked(tmp_path, mesh8):
    keys = jax.random.split(jax.random.key(0), 8)
    layer_keys = jax.random.split(jax.random.key(1), 3)
    rbg = jax.random.split(jax.random.key(2, impl="rbg"), 2)  # key data [2, 4]
    per_layer = [jax.random.key(10 + i) for i in range(2)]
    ms.save(
        tmp_path / "ck",
        {
            "rngs": {"dropout": ms.shard(keys, P("data"), mesh8), "rbg": rbg},
            "scan": {"rng": layer_keys},
            "layers": {str(i): {"rng": per_layer[i]} for i in range(2)},
        },
    )
    wm = ms.WeightMap(
        [
            ms.MapRule(r"rngs/dropout", "model/rngs/dropout/key"),
            ms.MapRule(r"rngs/rbg", "model/rngs/rbg/key", transpose=(0,)),
            ms.MapRule(r"scan/rng", "blocks/{i}/rng", unstack=ms.Unstack("i")),
            ms.MapRule(r"layers/(\d+)/rng", "stacked/rng", stack=ms.Stack(1)),
        ]
    )
    out = ms.restore(tmp_path / "ck", mapping=wm, mesh=mesh8)
    got = out["model"]["rngs"]["dropout"]["key"]
    assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
    assert got.sharding.spec == P("data")  # the saved spec, read straight into it
    assert np.array_equal(jax.random.key_data(got), jax.random.key_data(keys))
    r = out["model"]["rngs"]["rbg"]["key"]
    assert jax.random.key_impl(r) == jax.random.key_impl(rbg)
    assert np.array_equal(jax.random.key_data(r), jax.random.key_data(rbg))
    for i in range(3):
        one = out["blocks"][str(i)]["rng"]
        assert one.shape == () and jax.dtypes.issubdtype(one.dtype, jax.dtypes.prng_key)
        assert np.array_equal(jax.random.key_data(one), jax.random.key_data(layer_keys[i]))
    st = out["stacked"]["rng"]
    assert st.shape == (2,)
    want = np.stack([jax.random.key_data(k) for k in per_layer])
    assert np.array_equal(jax.random.key_data(st), want)
    # the keys work as keys
    assert jax.random.normal(out["blocks"]["0"]["rng"]).shape == ()
    assert isinstance(got.sharding, NamedSharding)


def test_a_key_cannot_be_cast_or_stacked_with_arrays(tmp_path):
    ms.save(
        tmp_path / "ck",
        {"c": jax.random.key(0), "k": jax.random.key(1), "a": jnp.zeros((), jnp.uint32)},
    )
    wm = ms.WeightMap(
        [
            ms.MapRule("c", "c", cast="float32"),
            ms.MapRule("(k|a)", "both", stack=ms.Stack(1, order=("a", "k"))),
        ]
    )
    with pytest.raises(ms.MappingError) as e:
        ms.restore(tmp_path / "ck", mapping=wm)
    text = str(e.value)
    assert text.splitlines()[0].startswith("2 mapping problems found")
    assert (
        "  source:c key<fry>[]\n    problem: a PRNG key cannot be cast (cast = 'float32') "
        "(rules[0])"
    ) in text
    assert (
        "  target:both\n    problem: the stacked tensors differ in shape or dtype: "
        "a uint32[], k key<fry>[]"
    ) in text


def test_fused_and_split_leaves_restore_onto_the_mesh_and_unmap_back(tmp_path, mesh24):
    q, k, v = (RNG.standard_normal((16, n)).astype(np.float32) for n in (16, 8, 8))
    fused = RNG.standard_normal((16, 32)).astype(np.float32)
    ms.save(tmp_path / "ck", {"q": q, "k": k, "v": v, "fused": fused})
    wm = ms.WeightMap(
        [
            ms.MapRule("(q|k|v)", "qkv", concat=ms.Concat(1, axis=1, order=("q", "k", "v"))),
            ms.MapRule("fused", "{part}", split=ms.Split("part", ("a", "b"), axis=1)),
        ]
    )
    out = ms.restore(
        tmp_path / "ck", mapping=wm, specs=ms.Rules([(".*", P("data", "model"))]), mesh=mesh24
    )
    assert out["qkv"].sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(out["qkv"]), np.concatenate([q, k, v], axis=1))
    np.testing.assert_array_equal(np.asarray(out["a"]), fused[:, :16])
    np.testing.assert_array_equal(np.asarray(out["b"]), fused[:, 16:])
    ref = jax.eval_shape(lambda: {"q": q, "k": k, "v": v, "fused": fused})
    back = ms.unmap(out, reference=ref, mapping=wm)
    for name, want in (("q", q), ("k", k), ("v", v), ("fused", fused)):
        assert back[name].tobytes() == want.tobytes(), name
