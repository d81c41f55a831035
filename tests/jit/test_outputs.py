"""How ``shard_jit`` cuts a step's output into parts (``_jit/outputs.py``): the state
coming back keeps its planned layout wherever it sits in the output."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms

flax_linen = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")


class _Mlp(flax_linen.Module):
    @flax_linen.compact
    def __call__(self, x):
        part = flax_linen.with_logical_partitioning
        init = flax_linen.initializers.lecun_normal()
        h = flax_linen.Dense(32, kernel_init=part(init, ("embed", "mlp")))(x)
        return flax_linen.Dense(8, kernel_init=part(init, ("mlp", "embed")))(jax.nn.relu(h))


RULES = ms.Rules([], logical={"embed": None, "mlp": "model"}, strict=False)


def _train_state():
    from flax.training.train_state import TrainState

    model = _Mlp()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2))


def _step(state, x):
    def loss_fn(params):
        return jnp.mean(state.apply_fn({"params": params}, x) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_linen_state_loss_step_keeps_every_leaf_on_its_planned_sharding():
    """A TrainState of boxed params returned in a ``(state, loss)`` tuple: the biases (no
    logical names, planned replicated) came back split over ``model`` as the compiler
    propagated the kernels' layout, and every later call copied them. (Auto axes only:
    under Explicit axes linen's Dense cannot contract over a sharded dimension.)"""
    mesh24 = ms.make_mesh({"data": 2, "model": 4}, axis_types="auto")
    state = ms.shard(_train_state(), RULES, mesh24)
    planned = ms.plan(state, RULES, mesh24)
    step = ms.shard_jit(_step, mesh=mesh24, in_specs=(RULES, P("data")))
    x = jnp.ones((16, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a copy warning on the second call fails the test
        new, _ = step(state, x)
        new, _ = step(new, x)
    flat = ms.adapters.split(new)
    drifted = [
        (path, leaf.sharding.spec, want.spec)
        for path, leaf, want in zip(flat.paths, flat.arrays, planned.flat_shardings(), strict=True)
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim)
    ]
    assert drifted == []
    assert any(planned[p].spec != P() for p in flat.paths)  # the layout is not trivial
