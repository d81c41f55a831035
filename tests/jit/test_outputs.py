"""How ``shard_jit`` cuts a step's output into parts (``_jit/outputs.py``): the state
coming back keeps its planned layout wherever it sits in the output."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import JIT_RULES, MAKERS, jit_params

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


# ---- outputs --------------------------------------------------------------------------


def test_out_specs_none_keeps_input_layouts_and_lets_the_compiler_choose(mesh24):
    def f(params, x):
        return {"new": params, "loss": x.sum(), "pair": (x * 2, "tag")}

    sj = ms.shard_jit(f, mesh=mesh24, in_specs=(JIT_RULES, P("data", "model")))
    out = sj(jit_params(), jnp.ones((4, 8)))
    assert out["new"]["w"].sharding.spec == P("data", None)
    assert out["pair"][1] == "tag" and out["pair"][0].shape == (4, 8)


def test_explicit_out_specs(mesh24):
    def f(params):
        return params, params["w"].sum()

    sj = ms.shard_jit(
        f,
        mesh=mesh24,
        in_specs=(JIT_RULES,),
        out_specs=(ms.Rules([("w$", P(None, "model")), ("b$", P("model"))]), P()),
    )
    new, total = sj(jit_params())
    assert new["w"].sharding.spec == P(None, "model") and new["b"].sharding.spec == P("model")
    assert total.sharding.spec == P()


def test_equinox_module_in_and_out(mesh8):
    import equinox as eqx

    mlp = MAKERS["equinox"]()
    # gathering the weights keeps the matmuls legal under Explicit axes too
    sj = ms.shard_jit(
        lambda m, x: (m, jax.vmap(ms.constrain(m, P()))(x)),
        mesh=mesh8,
        in_specs=(ms.fsdp("data", min_size=0), P("data")),
    )
    m2, y = sj(mlp, jnp.ones((8, 16)))
    assert isinstance(m2, eqx.nn.MLP) and y.shape == (8, 8)
    np.testing.assert_allclose(y, jax.vmap(mlp)(jnp.ones((8, 16))), rtol=1e-5)
    assert m2.layers[0].weight.sharding.spec == P("data")


# ---- out specs: the function's own shardings win; state coming back keeps its own -------


def _jax_jit_out_shardings(f, mesh, in_shardings, *args):
    """What ``jax.jit`` with the same input shardings gives each output leaf."""
    with jax.set_mesh(mesh):
        out = jax.jit(f, in_shardings=in_shardings)(*args)
    return [x.sharding.spec for x in jax.tree_util.tree_leaves(out)]


def _collectives(compiled_text: str) -> int:
    return sum(compiled_text.count(op) for op in ("all-gather", "all-to-all", "collective-permute"))


def test_a_constraint_inside_the_function_wins_over_the_input_sharding(mesh24):
    # The example: the output has the input's structure and shape, but the
    # function constrains it; jax.jit keeps the constraint, and so does shard_jit.
    def f(s):
        return {"h": ms.constrain(s["h"] * 2, P(None, "model"))}

    x = {"h": jnp.ones((8, 16))}
    sj = ms.shard_jit(f, mesh=mesh24, in_specs=(P("data"),))
    assert sj(x)["h"].sharding.spec == P(None, "model")
    ref = _jax_jit_out_shardings(f, mesh24, (NamedSharding(mesh24, P("data")),), x)
    assert ref == [P(None, "model")]
    placed = ms.shard(x, P("data"), mesh24)
    with jax.set_mesh(mesh24):
        raw = jax.jit(f, in_shardings=(NamedSharding(mesh24, P("data")),)).lower(placed)
    # The same program as jax.jit's: no resharding of the output after the constraint.
    assert _collectives(sj.lower(placed).compile().as_text()) == _collectives(
        raw.compile().as_text()
    )


def test_with_sharding_constraint_is_kept_and_state_coming_back_keeps_its_sharding(mesh24):
    explicit = jax.sharding.AxisType.Explicit in set(mesh24.axis_types)

    def pin(x, spec):
        if explicit:
            return jax.sharding.reshard(x, spec)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh24, spec))

    def step(state, x):
        new = {"w": state["w"] - 0.1, "b": pin(state["b"] + 1.0, P("model"))}
        return new, x + 1.0

    state = {"w": jnp.ones((8, 16)), "b": jnp.ones((16,))}
    sj = ms.shard_jit(step, mesh=mesh24, in_specs=(P("data"), P(None, "model")))
    new, y = sj(state, jnp.ones((8, 16)))
    assert new["w"].sharding.spec == P("data")  # the same state coming back
    assert new["b"].sharding.spec == P("model")  # set by the function
    assert y.sharding.spec == P(None, "model")  # a bare array: the compiler decides (jax.jit's)


def test_a_linen_model_with_an_internal_constraint(mesh24):
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return ms.constrain(nn.Dense(16)(x), P(None, "model"))

    x = jnp.ones((8, 16))
    with jax.set_mesh(mesh24):
        variables = Model().init(jax.random.key(0), x)

    def apply(v, x):
        return Model().apply(v, x)

    sj = ms.shard_jit(apply, mesh=mesh24, in_specs=(P(), P("data")))
    y = sj(variables, x)
    # y has x's structure and shape, but the model put it on "model".
    assert y.sharding.spec == P(None, "model")
    rep, dat = NamedSharding(mesh24, P()), NamedSharding(mesh24, P("data"))
    ref = _jax_jit_out_shardings(apply, mesh24, (rep, dat), ms.shard(variables, P(), mesh24), x)
    assert [y.sharding.spec] == ref


def test_an_nnx_model_with_an_internal_constraint(mesh24):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(16, 16, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return ms.constrain(self.dense(x), P(None, "model"))

    model = Model()
    sj = ms.shard_jit(lambda m, x: m(x), mesh=mesh24, in_specs=(P(), P("data")))
    y = sj(model, jnp.ones((8, 16)))
    assert y.sharding.spec == P(None, "model")
