"""qwix quantized parameters: ``WithAux(QArray(...))`` leaves are named without the wrapper
(``kernel/qvalue``, ``kernel/scale``) and plan exactly as Flax shards qwix's own metadata."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms

qwix = pytest.importorskip("qwix")
nn = pytest.importorskip("flax.linen")

LOGICAL = [("embed", "data"), ("mlp", "model")]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        def part(*names):
            return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

        x = nn.Dense(64, kernel_init=part("embed", "mlp"))(x)
        return nn.Dense(16, kernel_init=part("mlp", "embed"))(nn.relu(x))


def quantized():
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8)]
    model = qwix.quantize_model(MLP(), qwix.PtqProvider(rules))
    x = jax.random.normal(jax.random.key(1), (4, 16))
    return model, model.init(jax.random.key(0), x), x


def test_quantized_paths_drop_the_wrapper() -> None:
    _, variables, _ = quantized()
    paths = ms.adapters.split(variables).paths
    assert "params/Dense_0/kernel/qvalue" in paths
    assert "params/Dense_0/kernel/scale" in paths
    assert not any("/array/" in p for p in paths)


def test_quantized_plan_equals_flax_sharding_of_qwix_metadata(mesh24) -> None:
    _, variables, _ = quantized()
    rules = ms.Rules([(r"bias$", P())], logical=dict(LOGICAL))
    plan = ms.plan(variables, rules, mesh24)
    theirs = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh24, LOGICAL)
    leaves = jax.tree_util.tree_leaves(
        theirs, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    assert len(leaves) == len(plan)
    assert [leaf.spec for leaf in plan] == [s.spec for s in leaves]
    assert plan["params/Dense_0/kernel/qvalue"].spec == P("data", "model")
    assert plan["params/Dense_0/kernel/scale"].spec == P(None, "model")


def test_sharded_quantized_model_runs() -> None:
    # An Auto mesh: on an Explicit one JAX asks the model's matmuls for an out_sharding.
    mesh24 = ms.make_mesh({"data": 2, "model": 4})
    model, variables, x = quantized()
    want = model.apply(variables, x)
    rules = ms.Rules([(r"bias$", P())], logical=dict(LOGICAL))
    placed = ms.shard(variables, rules, mesh24)
    qvalue = placed["params"]["Dense_0"]["kernel"].array.qvalue
    assert qvalue.value.sharding.spec == P("data", "model")
    np.testing.assert_allclose(model.apply(placed, x), want, rtol=1e-5, atol=1e-5)
