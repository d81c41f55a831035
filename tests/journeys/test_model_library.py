"""A model library as its users meet it, end to end: ``tinylm`` (linen and NNX, logical
names only) trained by an FSDP user on ``data=8``, its checkpoint restored by a
tensor-parallel user (``data=2, model=4``) into the other variant, every placement what
Flax's ``nn.logical_to_mesh_axes`` says for that user's layered rules, and the library
written against Flax's own activation API constrained exactly as with ``ms.constrain``."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import modelshard as ms
import tinylm
from tinylm import linen_model, nnx_model

# one worker runs this file (its module fixture trains and saves once)
pytestmark = pytest.mark.xdist_group("model-library")

CONFIG = tinylm.Config(layers=1)
IDS = (jnp.arange(64, dtype=jnp.int32).reshape(8, 8) * 7) % CONFIG.vocab
BY_METADATA = ms.Rules([], strict=False)  # every leaf by its logical names
# FSDP as Flax's ordered pairs: 'embed' takes 'data' unless 'batch' already has it.
FSDP = [("batch", "data"), ("embed", "data"), ("heads", None), ("mlp", None), ("vocab", None)]
USERS = {"fsdp": ({"data": 8}, FSDP), "tp": ({"data": 2, "model": 4}, {})}


def flax_spec(names: tuple[str, ...], rules: ms.LogicalRules) -> P:
    """Flax's placement of ``names`` under the layered ``rules``, trailing Nones dropped."""
    return strip(nn.logical_to_mesh_axes(names, rules.flax_rules))


def strip(spec) -> P:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def linen_names(params) -> dict[str, tuple[str, ...]]:
    """Each named parameter's logical names, as Flax reads them from linen's boxes."""
    specs = nn.get_partition_spec(params)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {
        jax.tree_util.keystr(k, simple=True, separator="/"): tuple(v)
        for k, v in flat
        if isinstance(v, P) and tuple(v)
    }


def loss_fn(params, ids):
    logits = linen_model.TinyLM(CONFIG).apply({"params": params}, ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(ids, -1, 1)).mean()


TX = optax.adam(1e-2)


def train_step(params, opt, ids):
    loss, grads = jax.value_and_grad(loss_fn)(params, ids)
    updates, opt = TX.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The FSDP user's run: one linen Adam step on ``data=8`` under tinylm's defaults and
    their overrides, its parameters saved; and the same step on one device, no mesh."""
    params = linen_model.TinyLM(CONFIG).init(jax.random.key(0), IDS)["params"]
    opt = TX.init(params)
    one_params, _, one_loss = jax.jit(train_step)(params, opt, IDS)
    mesh = ms.make_mesh({"data": 8})
    with ms.logical_rules(tinylm.AXES, FSDP) as rules:
        step = ms.shard_jit(
            train_step,
            mesh=mesh,
            in_specs=(BY_METADATA, BY_METADATA, P("batch")),
            out_specs=(BY_METADATA, BY_METADATA, P()),
        )
        new_params, _, loss = step(
            ms.shard(params, BY_METADATA, mesh), ms.shard(opt, BY_METADATA, mesh), IDS
        )
    path = tmp_path_factory.mktemp("tinylm") / "fsdp"
    ms.save(path, new_params)
    return {
        "path": path,
        "rules": rules,
        "params": new_params,
        "loss": float(loss),
        "one_device": (one_params, float(one_loss)),
        "names": linen_names(params),
    }


def test_the_fsdp_user_trains_as_on_one_device(fsdp_run):
    one_params, one_loss = fsdp_run["one_device"]
    assert abs(fsdp_run["loss"] - one_loss) < 1e-5
    flat = dict(jax.tree_util.tree_flatten_with_path(fsdp_run["params"])[0])
    ref = dict(jax.tree_util.tree_flatten_with_path(one_params)[0])
    checked = 0
    for key, x in flat.items():
        path = jax.tree_util.keystr(key, simple=True, separator="/").removesuffix("/value")
        np.testing.assert_allclose(np.asarray(x), np.asarray(ref[key]), rtol=1e-4, atol=1e-6)
        if path in fsdp_run["names"]:
            want = flax_spec(fsdp_run["names"][path], fsdp_run["rules"])
            assert strip(x.sharding.spec) == want, path
            checked += 1
    # embedding, q, k, v, o, up, down, head: 'embed' over data where 'batch' is absent
    assert checked == 8
    up = fsdp_run["params"]["block_0"]["up"]["kernel"].value  # ('embed', 'mlp')
    assert up.sharding.spec == P("data", None)


def test_the_tp_user_restores_the_fsdp_checkpoint_into_nnx(fsdp_run, axis_type):
    """The tensor-parallel user restores the linen checkpoint into the NNX variant on their
    own layout: every parameter where Flax places it, the values bit for bit, and (Auto
    mesh: an Explicit one needs an out_sharding for the embedding's gather that JAX cannot
    infer, whatever places the table) the same logits as the linen model on one device."""
    mesh = ms.make_mesh({"data": 2, "model": 4}, axis_types=axis_type)
    with ms.logical_rules(tinylm.AXES) as rules:
        abstract = nnx.eval_shape(lambda: nnx_model.TinyLM(CONFIG, rngs=nnx.Rngs(0)))
        model = ms.restore(fsdp_run["path"], like=abstract, specs=BY_METADATA, mesh=mesh)
    saved = fsdp_run["params"]
    checked = 0
    for key, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = "/".join(map(str, key))
        value = param.get_value()
        want = saved
        for k in key:
            want = want[k]
        np.testing.assert_array_equal(np.asarray(value), np.asarray(getattr(want, "value", want)))
        names = fsdp_run["names"].get(path)
        assert strip(value.sharding.spec) == (flax_spec(names, rules) if names else P()), path
        checked += 1
    assert checked == 9  # the 8 named parameters and the norm's scale
    assert model.block_0.q.kernel.get_value().sharding.spec == P(None, "model", None)
    if axis_type == "auto":
        one_params, _ = fsdp_run["one_device"]
        want = jax.jit(linen_model.TinyLM(CONFIG).apply)({"params": one_params}, IDS)
        with ms.logical_rules(tinylm.AXES), jax.set_mesh(mesh):
            ids = ms.shard(IDS, P("batch"), mesh)
            got = nnx.jit(lambda m, ids: m(ids))(model, ids)
        assert got.sharding.spec == P("data", None, "model")  # 'batch', 'seq', 'vocab'
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def constraints(lowered_text: str) -> list[str]:
    """The shardings of every sharding constraint in a lowered program, in order."""
    return re.findall(r"sdy\.sharding_constraint %\S+ <@\w+, (\[.*?\])>", lowered_text)


@pytest.mark.parametrize("user", ["fsdp", "tp"])
def test_flax_activation_constraints_are_honoured(user):
    """The linen variant written with Flax's nn.with_logical_constraint gets, under the
    user's ms.logical_rules, exactly the constraints ms.constrain gives it (counted in the
    lowered program), the NNX variant the same activation constraints; outside the rules
    neither API adds any."""
    sizes, overrides = USERS[user]
    mesh = ms.make_mesh(sizes)
    params = linen_model.TinyLM(CONFIG).init(jax.random.key(0), IDS)["params"]
    nnx_tinylm = nnx_model.TinyLM(CONFIG, rngs=nnx.Rngs(0))

    def lowered(flax_constraints: bool) -> str:
        model = linen_model.TinyLM(tinylm.Config(layers=1, flax_constraints=flax_constraints))
        return jax.jit(lambda p, i: model.apply({"params": p}, i)).lower(params, IDS).as_text()

    with jax.set_mesh(mesh):
        assert constraints(lowered(True)) == constraints(lowered(False)) == []
        with ms.logical_rules(tinylm.AXES, overrides):
            by_flax, by_modelshard = constraints(lowered(True)), constraints(lowered(False))
            by_nnx = constraints(nnx.jit(lambda m, i: m(i)).lower(nnx_tinylm, IDS).as_text())
    activations = 2 + 6 * CONFIG.layers
    named_params = len(linen_names(params))  # Flax constrains each boxed parameter it unboxes
    assert len(by_flax) == activations + named_params == 16
    assert by_flax == by_modelshard
    assert len(by_nnx) == activations
    # the embedding's output, constrained to ('batch', 'seq', 'embed'): batch over data
    assert by_nnx[0] == '[{"data"}, {}, {}]'
