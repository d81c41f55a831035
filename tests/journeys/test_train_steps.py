"""A real training step (loss, grad, optax update) through ``shard_jit`` for NNX, linen and
Equinox models: FSDP on a (8,) mesh and tensor-parallel rules on a (2, 4) mesh, Auto and
Explicit axes. Each sharded step must equal the same step run unsharded, leave every output
in its planned sharding, and consume its donated inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import modelshard as ms

BATCH, D_IN, D_HID, D_OUT = 16, 16, 32, 8


@pytest.fixture(params=["fsdp(8)", "tp(2,4)"])
def mesh(request, axis_type):
    """FSDP on a (8,) mesh, tensor parallel on a (2, 4) mesh; Auto and Explicit axes."""
    axes = {"data": 8} if request.param == "fsdp(8)" else {"data": 2, "model": 4}
    return ms.make_mesh(axes, axis_types=axis_type)


def _data():
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (BATCH, D_IN)), jax.random.normal(ky, (BATCH, D_OUT))


def _explicit(mesh) -> bool:
    return AxisType.Explicit in set(mesh.axis_types)


def _gather(tree, gather: bool):
    # Under Explicit axes a matmul over a sharded contracting dimension needs an explicit
    # out sharding; FSDP-style, the step all-gathers the weights it computes with instead.
    return ms.constrain(tree, P()) if gather else tree


def _strategy(mesh):
    if len(mesh.axis_names) == 1:
        return ms.fsdp("data", min_size=0)
    return None  # per framework


def _close(a, b):
    arrays = lambda t: [v for v in jax.tree_util.tree_leaves(t) if ms.adapters.is_array(v)]  # noqa: E731
    for x, y in zip(arrays(a), arrays(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def _assert_planned(tree, plan_arg, p):
    got = ms.adapters.split(tree).arrays
    planned = [p.sharding(leaf.spec) for leaf in plan_arg.leaves]
    assert len(got) == len(planned)
    for x, s, leaf in zip(got, planned, plan_arg.leaves, strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim), (leaf.path, x.sharding, s)


# ---- Equinox ----------------------------------------------------------------------------


def _eqx_step(gather):
    import equinox as eqx
    import optax

    tx = optax.adam(1e-2)

    def step(model, opt_state, x, y):
        def loss_fn(m):
            m = _gather(m, gather)
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    return step, tx


def _eqx_model():
    import equinox as eqx

    return eqx.nn.MLP(D_IN, D_OUT, D_HID, 2, key=jax.random.key(0))


@pytest.fixture(scope="module")
def eqx_reference():
    """The step run unsharded, once for every mesh: (model, optimizer state, loss)."""
    import equinox as eqx

    ref_step, tx = _eqx_step(False)
    opt = tx.init(eqx.filter(_eqx_model(), eqx.is_array))
    return eqx.filter_jit(ref_step)(_eqx_model(), opt, *_data())


def test_equinox_train_step(mesh, count_compiles, eqx_reference):
    import equinox as eqx

    spec = _strategy(mesh) or ms.Rules([(r"weight$", P("model", None)), (r"bias$", P("model"))])
    make = _eqx_model
    x, y = _data()
    ref = eqx_reference

    step, tx = _eqx_step(_explicit(mesh))
    sj = ms.shard_jit(
        step, mesh=mesh, in_specs=(spec, spec, P("data"), P("data")), donate_argnums=(0, 1)
    )
    model = ms.shard(make(), spec, mesh)
    opt = ms.shard(tx.init(eqx.filter(model, eqx.is_array)), spec, mesh)
    p = sj.plan(model, opt, x, y)
    old = ms.adapters.split(model).arrays + ms.adapters.split(opt).arrays
    with count_compiles() as n:
        new_model, new_opt, loss = sj(model, opt, x, y)
    assert all(a.is_deleted() for a in old)
    _close((new_model, new_opt, loss), ref)
    _assert_planned(new_model, p.args[0], p)
    _assert_planned(new_opt, p.args[1], p)
    assert new_model.activation is jax.nn.relu  # static leaves come back as they were
    # a second step reuses the compiled function
    with count_compiles() as again:
        sj(new_model, new_opt, x, y)
    assert n["jit(step)"] == 1 and again["jit(step)"] == 0 and sj.cache_size == 1


# ---- linen + TrainState (boxed params: metadata drives the tensor-parallel layout) ------


def _linen(boxed):
    import flax.linen as nn

    # Boxes name the 'model' axis, which flax constrains to when unboxing: only on a mesh
    # that has it.
    box = nn.with_partitioning if boxed else (lambda init, _: init)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            x = nn.Dense(
                D_HID,
                kernel_init=box(init, (None, "model")),
                bias_init=box(nn.initializers.zeros, ("model",)),
            )(x)
            x = nn.relu(x)
            return nn.Dense(D_OUT, kernel_init=box(init, ("model", None)))(x)

    return MLP()


def _linen_state(boxed):
    import optax
    from flax.training import train_state

    model = _linen(boxed)
    params = model.init(jax.random.key(0), jnp.ones((1, D_IN)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def _strip_boxes(tree):
    from flax.core import meta

    box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: x.value if box(x) else x, tree, is_leaf=box)


def _linen_step(gather):
    def step(state, x, y):
        def loss_fn(params):
            if gather:  # flax would assert the boxes' layout on the gathered weights
                params = _gather(_strip_boxes(params), gather)
            return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


@pytest.fixture(scope="module")
def linen_references():
    """The step run unsharded, once for every mesh: (state, loss) by whether params are
    boxed."""
    return {
        boxed: jax.jit(_linen_step(False))(_linen_state(boxed), *_data()) for boxed in (False, True)
    }


def test_linen_train_state_step(mesh, linen_references):
    # Tensor parallel from the boxes' axis names; only the last (unboxed) bias needs a rule.
    spec = _strategy(mesh) or ms.Rules([(r"Dense_1/bias$", P())])
    x, y = _data()
    boxed = len(mesh.axis_names) == 2
    ref = linen_references[boxed]
    sj = ms.shard_jit(
        _linen_step(_explicit(mesh)),
        mesh=mesh,
        in_specs={"state": spec, "x": P("data"), "y": P("data")},
        donate_argnames="state",
    )
    state = ms.shard(_linen_state(boxed), spec, mesh)
    p = sj.plan(state, x, y)
    if boxed:
        assert p["state:params/Dense_0/kernel"].spec == P(None, "model")
        assert p["state:opt_state/0/mu/Dense_1/kernel"].spec == P("model", None)
    old = ms.adapters.split(state).arrays
    new_state, loss = sj(state, x=x, y=y)  # keyword arguments work
    assert all(a.is_deleted() for a in old)
    _close((new_state.params, new_state.opt_state, loss), (ref[0].params, ref[0].opt_state, ref[1]))
    assert int(new_state.step) == 1
    _assert_planned(new_state, p.args[0], p)


# ---- NNX: model and optimizer are modules, updated in place as with nnx.jit -------------


def _nnx_model():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            # no bias before BatchNorm: its gradient is ~0 and Adam would amplify the noise
            self.fc1 = nnx.Linear(D_IN, D_HID, use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(D_HID, rngs=rngs)
            self.fc2 = nnx.Linear(D_HID, D_OUT, rngs=rngs)

        def __call__(self, x):
            return self.fc2(nnx.relu(self.bn(self.fc1(x))))

    model = MLP(nnx.Rngs(0))
    import optax

    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _nnx_step(gather):
    from flax import nnx

    def step(model, opt, x, y):
        def loss_fn(m):
            _gather(m, gather)
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    return step


@pytest.fixture(scope="module")
def nnx_reference():
    """The step run unsharded, once for every mesh: the updated model, optimizer, loss."""
    from flax import nnx

    ref_model, ref_opt = _nnx_model()
    ref_loss = nnx.jit(_nnx_step(False))(ref_model, ref_opt, *_data())
    return ref_model, ref_opt, ref_loss


def test_nnx_train_step_updates_caller_modules(mesh, nnx_reference):
    from flax import nnx

    spec = _strategy(mesh) or ms.Rules(
        [(r"kernel$", P(None, "model")), (r"(bias|scale|mean|var)$", P("model"))]
    )
    x, y = _data()
    ref_model, ref_opt, ref_loss = nnx_reference

    model, opt = _nnx_model()
    ms.shard(model, spec, mesh)
    ms.shard(opt, spec, mesh)
    sj = ms.shard_jit(
        _nnx_step(_explicit(mesh)),
        mesh=mesh,
        in_specs=(spec, spec, P("data"), P("data")),
        donate_argnums=(0, 1),
    )
    p = sj.plan(model, opt, x, y)
    old_kernel = model.fc1.kernel[...]
    old_mean = model.bn.mean[...]
    loss = sj(model, opt, x, y)
    assert old_kernel.is_deleted() and not model.fc1.kernel[...].is_deleted()
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    # BatchNorm statistics and the optimizer step reached the caller's modules
    assert not np.allclose(model.bn.mean[...], 0) and old_mean.is_deleted()
    assert int(opt.step[...]) == 1
    _close(nnx.state(model), nnx.state(ref_model))
    _close(nnx.state(opt), nnx.state(ref_opt))
    _assert_planned(model, p.args[0], p)
    _assert_planned(opt, p.args[1], p)
