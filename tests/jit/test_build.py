"""What a ``shard_jit`` cache miss builds (``_jit/build.py``): the entry it keeps holds the
arguments' structure (treedefs, specs, shardings), never the first call's values."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms


class _Net:
    """An NNX module class defined once (a class made per call is another structure)."""

    cls = None

    @classmethod
    def make(cls, seed: int):
        from flax import nnx

        if cls.cls is None:

            class Net(nnx.Module):
                def __init__(self, rngs: nnx.Rngs):
                    self.dense = nnx.Linear(8, 16, rngs=rngs)
                    self.bn = nnx.BatchNorm(16, rngs=rngs)

                def __call__(self, x):
                    return self.bn(self.dense(x))

            cls.cls = Net
        return cls.cls(nnx.Rngs(seed))


def _dict(seed: int):
    k = jax.random.key(seed)
    return {"w": jax.random.normal(k, (8, 16)), "b": jnp.zeros(16)}


def _equinox(seed: int):
    import equinox as eqx

    return eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(seed))


def _linen(seed: int):
    import flax.linen as nn

    variables = nn.Sequential([nn.Dense(16), nn.BatchNorm(use_running_average=False)]).init(
        jax.random.key(seed), jnp.ones((2, 8))
    )
    return dict(variables)


def _nnx_step(m, x):
    return m(x).sum()  # BatchNorm's statistics are written back into the module


def _tree_step(state, x):
    new = jax.tree_util.tree_map(
        lambda a: a * 2 if isinstance(a, jax.Array) and a.dtype == jnp.float32 else a, state
    )
    return new, x.sum()


KINDS = {
    "dict": (_dict, _tree_step),
    "nnx": (_Net.make, _nnx_step),
    "equinox": (_equinox, _tree_step),
    "linen": (_linen, _tree_step),
}


def _leaf(state):
    """An array leaf as the caller holds it (an NNX Variable's value, a dict's array)."""
    return ms.adapters.split(state).arrays[0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_call_keeps_none_of_its_arguments_alive(mesh8, count_compiles, kind):
    """After the call returns, the ``ShardJit`` holds neither the container nor any of its
    arrays (its cached plan held the first call's, and with them the module, as long as
    the ``ShardJit`` lived); a new container of the same structure still runs the entry
    compiled for the first."""
    make, step = KINDS[kind]
    f = ms.shard_jit(step, mesh=mesh8, in_specs=(P(), P()))
    x = jnp.ones((4, 8))
    state = ms.shard(make(0), P(), mesh8)  # placed: the call takes these very arrays
    leaf = _leaf(state)
    f(state, x)
    f(state, x)  # the route the second call takes is kept too
    refs = [weakref.ref(leaf)] + ([] if type(state) is dict else [weakref.ref(state)])
    del state, leaf
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
    again = ms.shard(make(1), P(), mesh8)
    with count_compiles() as n:
        out = f(again, x)
    assert n == {}
    assert f.cache_size == 1
    if kind == "dict":
        np.testing.assert_array_equal(out[0]["w"], np.asarray(again["w"]) * 2)


def test_the_cached_plan_holds_the_structure_and_still_describes_it(mesh8):
    """The plan kept with a compiled entry (``ShardJit.plan``) holds shapes, dtypes and
    shardings, no array, and reads as the plan of the arguments did."""
    state = {"w": jnp.ones((16, 4)), "n": 3, "b": jnp.ones(4)}
    f = ms.shard_jit(
        lambda s, x: s["w"].sum() + x.sum(),
        mesh=mesh8,
        in_specs=(ms.Rules([("w$", P("data", None)), ("b$", P())]), P()),
    )
    f(state, jnp.ones(2))
    plan = f.plan(state, jnp.ones(2))
    flat = plan.args[0].flat
    assert [type(x) for x in flat.arrays] == [jax.ShapeDtypeStruct] * 2
    assert [(x.shape, x.dtype) for x in flat.arrays] == [
        ((4,), jnp.float32),
        ((16, 4), jnp.float32),
    ]
    assert flat.leaves[1] == 3  # a static leaf is part of the signature: kept
    assert flat.paths == ["b", "w"]
    shardings, _ = plan.shardings
    assert shardings["w"].spec == P("data", None) and shardings["b"].spec == P()
    assert shardings["n"] == 3
    assert plan.specs[1] == P()
