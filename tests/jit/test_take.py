"""Taking an argument by its adapter (``_jit/take.py``): NNX modules and optimizers behave
as with ``nnx.jit``, their state written back to the caller."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS

# ---- NNX modules behave as with nnx.jit ------------------------------------------------


def test_nnx_state_updates_reach_the_caller(mesh8):
    from flax import nnx

    model = MAKERS["nnx"]()
    ids = jnp.zeros((8, 4), jnp.int32)

    def run(m, ids):
        ms.constrain(m, P())  # all-gather (FSDP); under Explicit axes the gather needs it
        return m(ids).sum()

    # (ids replicated: under Explicit axes an embedding gather of sharded ids needs an out
    # sharding that nnx.Embed does not take)
    sj = ms.shard_jit(run, mesh=mesh8, in_specs=(ms.fsdp("data", min_size=0), P()))
    counts = lambda: [int(c) for c in jax.tree_util.tree_leaves(nnx.state(model, nnx.RngCount))]  # noqa: E731
    before, before_counts = np.asarray(model.bn.mean[...]).copy(), counts()
    sj(model, ids)
    assert not np.allclose(model.bn.mean[...], before)  # BatchNorm stats updated in place
    assert before_counts and counts() != before_counts  # Dropout drew from the RNG stream
    assert isinstance(model, nnx.Module)


def test_nnx_optimizer_is_split_and_updated_like_a_module(mesh8):
    # Regression: nnx.Optimizer is an nnx.Pytree, not an nnx.Module; it used to go through the
    # plain-pytree adapter, so updates made inside shard_jit never reached the caller's object.
    import optax
    from flax import nnx

    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    assert ms.adapters.get_adapter(opt).kind == "nnx.Pytree"

    def step(model, opt, x):
        opt.update(model, nnx.grad(lambda m: m(x).sum())(model))

    ms.shard_jit(step, mesh=mesh8, in_specs=(P(), P(), P("data")))(model, opt, jnp.ones((8, 8)))
    assert int(opt.step[...]) == 1


def test_nnx_structure_change_inside_is_an_error(mesh8):
    from flax import nnx

    def grow(m):
        m.extra = nnx.Param(jnp.ones(2))

    sj = ms.shard_jit(grow, mesh=mesh8, in_specs=(P(),))
    with pytest.raises(ms.AdapterError, match=r"the nnx\.Module argument 'm' changed structure"):
        sj(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


# ---- NNX: inputs placed by shard_jit are written back, changed by the step or not --------


def test_nnx_variables_placed_by_shard_jit_are_written_back_even_when_unchanged(mesh8):
    from flax import nnx

    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))  # on one device, not as planned
    rules = ms.Rules([(r"kernel$", P("data", None)), (r".*", P())])
    sj = ms.shard_jit(lambda m, x: m(x), mesh=mesh8, in_specs=(rules, P("data")))
    sj(model, jnp.ones((8, 16)))
    kernel, bias = model.kernel[...], model.bias[...]
    assert kernel.sharding.spec == P("data", None)  # read only, yet now placed in the module
    assert bias.sharding.spec == P()
    sj(model, jnp.ones((8, 16)))
    # The second call found them in place: nothing moved, the same arrays are there.
    assert model.kernel[...] is kernel and model.bias[...] is bias
