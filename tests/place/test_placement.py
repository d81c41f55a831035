"""``shard``: every container kind placed by its plan, whatever the inputs are and wherever
they live."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS
from modelshard.adapters import split


def assert_placed(out, p):
    flat = split(out)
    assert len(flat.arrays) == len(p)
    for x, s in zip(flat.arrays, p.flat_shardings(0), strict=True):
        assert x.sharding == s


def values(tree):
    out = []
    for x in split(tree).arrays:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


@pytest.mark.parametrize("spec", ["fsdp", "replicated"])
def test_shard_every_kind(kind, container, mesh8, spec):
    specs = ms.fsdp("data", min_size=0) if spec == "fsdp" else P()
    before = values(container)
    p = ms.plan(container, specs, mesh8)
    out = ms.shard(container, specs, mesh8)
    assert type(out) is type(container)
    assert_placed(out, p)
    for a, b in zip(values(out), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_shard_tensor_parallel_rules_on_2x4(mesh24):
    model = MAKERS["nnx"]()
    rules = ms.Rules(
        [
            (r"attn/(query|key|value)/kernel$", P(None, "model", None)),
            (r"attn/out/kernel$", P("model", None, None)),
            (r"mlp/kernel$", P(None, "model")),
            (r"embedding$", P("model", None)),
            (r".*", P()),
        ]
    )
    out = ms.shard(model, rules, mesh24)
    assert out is model  # NNX modules are updated in place, as nnx.update does
    assert model.mlp.kernel[...].sharding.spec == P(None, "model")
    assert model.attn.query.kernel[...].sharding.spec == P(None, "model", None)
    if mesh24.axis_types[0] == jax.sharding.AxisType.Auto:
        # Under Explicit axes, a vocab-sharded embedding lookup needs an explicit out
        # sharding inside the model: that is the model's business, not the placement's.
        from flax import nnx

        y = nnx.jit(lambda m, ids: m(ids))(model, jnp.arange(8).reshape(2, 4) % 64)
        assert y.shape == (2, 4, 32)


def test_shard_equinox_keeps_static_fields_and_runs(mesh8):
    import equinox as eqx

    mlp = MAKERS["equinox"]()
    out = ms.shard(mlp, ms.fsdp("data", min_size=0), mesh8)
    assert out.activation is mlp.activation
    assert out.layers[1].weight.sharding.spec == P("data")
    if mesh8.axis_types[0] == jax.sharding.AxisType.Auto:  # Explicit needs out shardings
        y = eqx.filter_jit(lambda m, x: m(x))(out, jnp.ones(16))
        np.testing.assert_allclose(np.asarray(y), np.asarray(mlp(jnp.ones(16))), rtol=1e-5)


def test_linen_boxes_survive(mesh24):
    variables = MAKERS["linen"]()
    rules = ms.Rules(
        [(r"bias$|scale$|mean$|var$", P())], logical={"embed": None, "mlp": "model", "layers": None}
    )
    out = ms.shard(variables, rules, mesh24)
    kernel = out["params"]["ScanLayer_0"]["Dense_0"]["kernel"]
    assert kernel.names == ("layers", "embed", "mlp")
    assert kernel.value.sharding.spec == P(None, None, "model")


@pytest.mark.parametrize("where", ["numpy", "device0", "device5", "other_sharding", "uncommitted"])
def test_inputs_from_anywhere_end_up_planned(where, mesh24):
    host = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    x = {
        "numpy": lambda: host,
        "device0": lambda: jax.device_put(host, jax.devices()[0]),
        "device5": lambda: jax.device_put(host, jax.devices()[5]),
        "other_sharding": lambda: jax.device_put(
            host, NamedSharding(ms.make_mesh({"a": 8}), P(None, "a"))
        ),
        "uncommitted": lambda: jnp.asarray(host),
    }[where]()
    out = ms.shard({"x": x, "b": np.ones(8, np.float32)}, P("model"), mesh24)
    assert out["x"].sharding == NamedSharding(mesh24, P("model"))
    np.testing.assert_array_equal(np.asarray(out["x"]), host)


def test_already_placed_arrays_are_not_copied(mesh8):
    x = ms.shard({"x": jnp.ones((16, 4))}, P("data"), mesh8)["x"]
    again = ms.shard({"x": x}, P("data"), mesh8)["x"]
    assert again is x


def test_abstract_leaves_get_shardings(mesh24):
    import equinox as eqx

    abstract = eqx.filter_eval_shape(MAKERS["equinox"])
    out = ms.shard(abstract, ms.fsdp("data", min_size=0), mesh24)
    w = out.layers[0].weight
    assert isinstance(w, jax.ShapeDtypeStruct)
    assert w.sharding == NamedSharding(mesh24, P("data"))


def test_abstract_mesh_refuses_concrete_arrays():
    mesh = ms.make_mesh({"data": 8}, abstract=True)
    with pytest.raises(ms.MeshError, match="cannot place concrete arrays on an AbstractMesh"):
        ms.shard({"x": jnp.ones(8)}, P("data"), mesh)


def test_shard_reports_every_bad_leaf_before_moving_anything(mesh24):
    tree = {"a": jnp.ones((3, 4)), "b": jnp.ones((5, 4)), "c": jnp.ones((8, 4))}
    before = tree["c"].sharding
    with pytest.raises(ms.SpecError) as e:
        ms.shard(tree, P("data"), mesh24)
    assert [p.path for p in e.value.problems] == ["a", "b"]
    assert tree["c"].sharding == before
