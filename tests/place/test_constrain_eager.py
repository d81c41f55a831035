"""``constrain`` outside a trace under ``jax.set_mesh``: a concrete array is placed on the
mesh that ``set_mesh`` made current, as with ``mesh=`` (the abstract mesh cannot place it)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import modelshard as ms

RULES = {"batch": "data", "embed": "model"}


def test_a_single_device_array_is_placed_on_the_current_mesh(mesh24):
    x = jnp.arange(128.0).reshape(8, 16)  # made before the mesh: on one device
    with jax.set_mesh(mesh24):
        out = ms.constrain(x, P("data", "model"))
    assert out.sharding.mesh == mesh24
    assert out.sharding.spec == P("data", "model")
    assert len(out.addressable_shards) == 8
    np.testing.assert_array_equal(out, x)


def test_an_unjitted_nnx_init_places_its_param(mesh24):
    class Layer(nnx.Module):
        def __init__(self, w: jax.Array):
            self.w = nnx.Param(ms.constrain(w, P("batch", "embed")))

    w = jnp.arange(128.0).reshape(8, 16)
    with jax.set_mesh(mesh24), ms.logical_rules(RULES):
        layer = Layer(w)
    assert layer.w.value.sharding.mesh == mesh24
    assert layer.w.value.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(layer.w.value, w)


def test_an_unjitted_linen_init_places_its_constrained_input(mesh24):
    x = jnp.ones((8, 16))  # made before the mesh: on one device

    seen = []

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = ms.constrain(x, P("batch", "embed"))
            seen.append(y.sharding)
            return nn.Dense(16)(y)

    with jax.set_mesh(mesh24), ms.logical_rules(RULES):
        variables = Model().init(jax.random.key(0), x)
    assert [k.shape for k in jax.tree.leaves(variables)] == [(16,), (16, 16)]
    assert seen[0].mesh == mesh24
    assert seen[0].spec == P("data", "model")
