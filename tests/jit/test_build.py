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
from helpers import committed_to_device0


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


def test_train_state_from_create_compiles_once(mesh8, count_compiles):
    optax = pytest.importorskip("optax")
    ts = pytest.importorskip("flax.training.train_state")
    state = ts.TrainState.create(apply_fn=None, params={"w": jnp.ones((8, 2))}, tx=optax.sgd(0.1))
    assert type(state.step) is int  # Flax starts the step as a Python int

    @ms.shard_jit(mesh=mesh8, in_specs=(ms.fsdp("data", min_size=0), P("data")))
    def step(state, x):
        grads = jax.grad(lambda p: (p["w"] * x.sum()).sum())(state.params)
        return state.apply_gradients(grads=grads)

    with count_compiles() as n:
        for _ in range(3):
            state = step(state, jnp.ones((8, 3)))
    assert int(state.step) == 3 and n["jit(step)"] == step.cache_size == 1
    assert state.step.sharding.is_fully_replicated


# ---- one XLA compilation per signature, whatever the inputs are --------------------------

# numpy arrays, unplaced jax arrays, arrays committed to one device, arrays already in the
# planned sharding, and state placed first with unplaced batches ("planned-state"); in every
# case the step's own outputs come back on the next call.
INPUT_KINDS = ["numpy", "jnp", "device0", "planned", "planned-state"]
TP_RULES = ms.Rules([(r"0/kernel$", P(None, "model")), (r".*", P())])


def _state_kind(kind):
    return "planned" if kind == "planned-state" else kind


def _batch_kind(kind):
    return "jnp" if kind == "planned-state" else kind


def _as_kind(tree, kind, spec, mesh):
    if kind == "numpy":
        return jax.tree_util.tree_map(np.asarray, tree)
    if kind == "device0":
        return committed_to_device0(tree)
    if kind == "planned":
        return ms.shard(tree, spec, mesh)
    assert all(not x.committed for x in jax.tree_util.tree_leaves(tree))
    return tree


_EXPECTED: dict[str, list[float]] = {}  # losses of the same steps run unsharded


def _batches():
    return [jax.random.normal(jax.random.key(i), (8, 16)) for i in range(6)]


def _moves(rec):
    return [str(r.message) for r in rec if "to the planned sharding again" in str(r.message)]


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_dict_and_optax_train_step_compiles_once(mesh24, kind, donate, count_compiles):
    """The README's step: a dict of NNX params and optax state, fed back six times."""
    import warnings

    import optax
    from flax import nnx

    model = nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 16, rngs=nnx.Rngs(1))
    )
    graphdef, params = nnx.split(model)
    tx = optax.adam(1e-2)

    def train_step(state, x):
        loss_fn = lambda p: ((nnx.merge(graphdef, p)(x) - x) ** 2).mean()  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    if "dict" not in _EXPECTED:  # the same steps unsharded (once for every parameter)
        reference, state, _EXPECTED["dict"] = jax.jit(train_step), {"params": params}, []
        state["opt"] = tx.init(params)
        for x in _batches():
            state, loss = reference(state, x)
            _EXPECTED["dict"].append(float(loss))

    step = ms.shard_jit(
        train_step, mesh=mesh24, in_specs=(TP_RULES, P("data")), donate_argnums=0 if donate else ()
    )
    state = {"params": params, "opt": tx.init(params)}
    state = _as_kind(state, _state_kind(kind), TP_RULES, mesh24)
    losses = []
    with count_compiles() as n, warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for x in _batches():
            state, loss = step(state, _as_kind(x, _batch_kind(kind), P("data"), mesh24))
            losses.append(float(loss))
    assert n["jit(train_step)"] == 1 and step.cache_size == 1
    # a batch committed to one device is moved every call, and said so once
    assert len(_moves(rec)) == (1 if kind == "device0" else 0)
    np.testing.assert_allclose(losses, _EXPECTED["dict"], rtol=1e-5)
    kernel = state["params"]["layers"][0]["kernel"][...]
    assert kernel.sharding.spec == P(None, "model")


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("kind", INPUT_KINDS)
def test_nnx_module_and_optimizer_train_step_compiles_once(mesh24, kind, donate, count_compiles):
    """An NNX model and ``nnx.Optimizer`` updated in place six times, batches of each kind
    (the module as built, on one device; placed first for ``planned`` and ``planned-state``)."""
    import warnings

    import optax
    from flax import nnx

    def make():
        model = nnx.Sequential(
            nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 16, rngs=nnx.Rngs(1))
        )
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def train_step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - x) ** 2).mean())(model)
        opt.update(model, grads)
        return loss

    if "nnx" not in _EXPECTED:
        reference, (model, opt) = nnx.jit(train_step), make()
        _EXPECTED["nnx"] = [float(reference(model, opt, x)) for x in _batches()]
    model, opt = make()
    if _state_kind(kind) == "planned":
        ms.shard(model, TP_RULES, mesh24)
        ms.shard(opt, TP_RULES, mesh24)
    step = ms.shard_jit(
        train_step,
        mesh=mesh24,
        in_specs=(TP_RULES, TP_RULES, P("data")),
        donate_argnums=(0, 1) if donate else (),
    )
    with count_compiles() as n, warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        losses = [
            float(step(model, opt, _as_kind(x, _batch_kind(kind), P("data"), mesh24)))
            for x in _batches()
        ]
    assert n["jit(train_step)"] == 1 and step.cache_size == 1
    assert len(_moves(rec)) == (1 if kind == "device0" else 0)
    np.testing.assert_allclose(losses, _EXPECTED["nnx"], rtol=1e-5)
    assert int(opt.step[...]) == 6
    assert model.layers[0].kernel[...].sharding.spec == P(None, "model")
