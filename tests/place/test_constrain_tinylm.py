"""A model library naming logical axes only (``tinylm``, linen and NNX): it runs with no
mesh, its users' FSDP and tensor-parallel rules place every parameter, moment and
activation as Flax's ``logical_to_mesh_axes`` says, and every mistake is told in the
user's terms (the logical name, the dimension, the rule entry)."""

from __future__ import annotations

import inspect
import os
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

IDS = (jnp.arange(64, dtype=jnp.int32).reshape(8, 8) * 7) % 32

# The two users: FSDP over one axis (Flax's ordered pairs: 'embed' falls back to
# replication where 'batch' already took 'data'), and tensor parallelism (tinylm's
# defaults as they are).
FSDP = [("batch", "data"), ("embed", "data"), ("heads", None), ("mlp", None), ("vocab", None)]
USERS = {"fsdp": ({"data": 8}, FSDP), "tp": ({"data": 2, "model": 4}, {})}


def strip(spec) -> P:
    """``P('model', None)`` as ``P('model')``: trailing replicated dimensions dropped."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def linen_state():
    """Parameters (LogicallyPartitioned boxes) and Adam moments (boxed alike)."""
    params = linen_model.TinyLM().init(jax.random.key(0), IDS)["params"]
    return {"params": params, "opt": optax.adam(1e-2).init(params)}


def nnx_model_state():
    model = nnx_model.TinyLM(rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def logical_names(tree) -> dict[str, tuple]:
    """Each leaf's logical names, as Flax reads them from its metadata."""
    if isinstance(tree, nnx.Module):
        specs = nnx.get_partition_spec(nnx.state(tree))
        flat = nnx.to_flat_state(specs)
        return {"/".join(map(str, k)): tuple(v.get_value()) for k, v in flat}
    specs = nn.get_partition_spec(tree)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {
        jax.tree_util.keystr(k, simple=True, separator="/"): tuple(v)
        for k, v in flat
        if isinstance(v, P)
    }


# ---- no mesh, no rules ---------------------------------------------------------------


def test_runs_without_a_mesh_or_rules():
    """On one device, with no mesh and no rules, both variants run: every constrain in the
    model does nothing, as Flax's nn.with_logical_constraint does."""
    variables = linen_model.TinyLM().init(jax.random.key(0), IDS)
    out = jax.jit(linen_model.TinyLM().apply)(variables, IDS)
    model = nnx_model.TinyLM(rngs=nnx.Rngs(0))
    out_nnx = nnx.jit(lambda m, x: m(x))(model, IDS)
    assert out.shape == out_nnx.shape == (8, 8, 32)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(out_nnx)).all()
    with ms.logical_rules(tinylm.AXES):  # rules, still no mesh: nothing to do either
        again = linen_model.TinyLM().apply(variables, IDS)
    np.testing.assert_allclose(np.asarray(again), np.asarray(out), rtol=1e-6, atol=1e-6)


def test_strict_constraints_raise_at_the_model_line():
    """strict_constraints() turns the silent no-op into an error that names the model's
    line, not tinylm's constrain wrapper (stacklevel=2)."""
    variables = linen_model.TinyLM().init(jax.random.key(0), IDS)
    lines, first = inspect.getsourcelines(linen_model.TinyLM.__call__)
    at = first + next(i for i, line in enumerate(lines) if "constrain(embed(ids)" in line)
    where = os.path.relpath(linen_model.__file__)
    with ms.strict_constraints(), pytest.raises(ms.MeshError) as e:
        linen_model.TinyLM().apply(variables, IDS)
    assert str(e.value) == (
        f"constrain at {where}:{at} in TinyLM.__call__: no mesh given and none is active; "
        "pass mesh=..., or call inside `with jax.set_mesh(mesh):` (shard_jit sets it while "
        "tracing)."
    )
    mesh = ms.make_mesh({"data": 8})
    with jax.set_mesh(mesh), ms.strict_constraints(), pytest.raises(ms.SpecError) as e:
        linen_model.TinyLM().apply(variables, IDS)  # a mesh, but no rules for the names
    assert e.value.site == f"constrain at {where}:{at} in TinyLM.__call__"


# ---- the two users -------------------------------------------------------------------


def merged_pairs(rules) -> list:
    """The layered rules as Flax's pairs, for nn.logical_to_mesh_axes."""
    return list(rules.flax_rules)


@pytest.mark.parametrize("user", ["fsdp", "tp"])
@pytest.mark.parametrize("variant", ["linen", "nnx"])
def test_placements_equal_flax(user, variant, axis_type):
    """Every parameter and moment is placed as Flax's logical_to_mesh_axes says under the
    user's layered rules (tinylm's defaults, then the user's overrides)."""
    sizes, overrides = USERS[user]
    mesh = ms.make_mesh(sizes, axis_types=axis_type)
    if variant == "linen":
        state = linen_state()
        names = logical_names(state["params"])
    else:
        state, _ = nnx_model_state()
        names = logical_names(state)
    with ms.logical_rules(tinylm.AXES, overrides) as rules:
        plan = ms.plan(state, ms.Rules([], strict=False), mesh)
    pairs = merged_pairs(rules)
    checked = 0
    for leaf in plan:
        key = leaf.path.split("/", 1)[1] if variant == "linen" else leaf.path
        key = re.sub(r"^opt/\d+/(mu|nu)/", "", leaf.path) if leaf.path.startswith("opt/") else key
        if key not in names or not names[key]:
            assert leaf.spec == P() or not names.get(key)
            continue
        assert strip(leaf.spec) == strip(nn.logical_to_mesh_axes(names[key], pairs)), leaf.path
        checked += 1
    assert checked == (3 * 14 if variant == "linen" else 14)  # 14 named parameters


def loss_fn(apply, params, ids):
    logits = apply(params, ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(ids, -1, 1)).mean()


@pytest.mark.parametrize("user", ["fsdp", "tp"])
def test_a_training_step_places_activations_as_flax(user, count_compiles):
    """A linen training step under each user's rules: the loss matches one device, one
    compilation, and every activation constraint the step applies (plan.activations)
    is Flax's logical_to_mesh_axes of the names the model wrote. (Auto meshes: on an
    Explicit one, nn.Embed's gather from a sharded table needs an out_sharding JAX
    cannot infer, whatever places it.)"""
    sizes, overrides = USERS[user]
    mesh = ms.make_mesh(sizes)
    model = linen_model.TinyLM()
    tx = optax.adam(1e-2)
    state = linen_state()

    def step(state, ids):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model.apply, {"params": p}, ids))(
            state["params"]
        )
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    base_state, base_loss = jax.jit(step)(state, IDS)  # one device, no mesh
    specs = ms.Rules([], strict=False)
    with ms.logical_rules(tinylm.AXES, overrides) as rules, count_compiles() as n:
        train = ms.shard_jit(step, mesh=mesh, in_specs=(specs, P("batch")), out_specs=(specs, P()))
        new_state, loss = train(ms.shard(state, specs, mesh), IDS)
        train(new_state, IDS)
        acts = train.plan(new_state, IDS).activations
    assert n["jit(step)"] == train.cache_size == 1
    assert abs(float(loss) - float(base_loss)) < 1e-5
    pairs = merged_pairs(rules)
    # the forward pass runs the model's Python once (the gradient reuses its trace)
    assert len(acts) == 2 + 6 * model.config.layers
    for a in acts:
        written = tuple(a.name.replace("-", "").split("/"))
        assert strip(a.spec) == strip(nn.logical_to_mesh_axes(written, pairs)), a.name
    top = next(a for a in acts if a.name == "batch/seq/vocab")
    # fsdp: batch over data=8; tp: batch over data=2 and vocab over model=4
    assert top.bytes_per_device == 8 * 8 * 32 * 4 // 8
    np.testing.assert_allclose(
        np.asarray(new_state["params"]["head"]["kernel"].value),
        np.asarray(base_state["params"]["head"]["kernel"].value),
        rtol=1e-4,
        atol=1e-6,
    )


def test_the_plan_shows_logical_names_and_activations():
    mesh24 = ms.make_mesh({"data": 2, "model": 4})  # Auto: see the training step's test
    state = linen_state()
    specs = ms.Rules([], strict=False)
    with ms.logical_rules(tinylm.AXES):
        step = ms.shard_jit(
            lambda p, ids: linen_model.TinyLM().apply({"params": p}, ids),
            mesh=mesh24,
            in_specs=(specs, P("batch")),
        )
        plan = step.plan(state["params"], IDS)
    row = next(r for r in plan.rows() if r["path"] == "p:block_0/q/kernel")
    assert row["logical"] == [
        [{"name": "embed", "axes": [], "rule": "tinylm defaults['embed']"}],
        [{"name": "heads", "axes": ["model"], "rule": "tinylm defaults['heads']"}],
        [{"name": "kv", "axes": [], "rule": "tinylm defaults['kv']"}],
    ]
    assert plan.activation_rows()[0] == {
        "name": "batch/seq/embed",
        "path": "",
        "shape": [8, 8, 16],
        "dtype": "float32",
        "written": "P('batch', 'seq', 'embed')",
        "logical": [
            [{"name": "batch", "axes": ["data"], "rule": "tinylm defaults['batch']"}],
            [{"name": "seq", "axes": [], "rule": "tinylm defaults['seq']"}],
            [{"name": "embed", "axes": [], "rule": "tinylm defaults['embed']"}],
        ],
        "spec": ["data", None, None],
        "bytes_per_device": 8 * 8 * 16 * 4 // 2,
    }
    text = str(plan.table())
    assert "metadata: embed, heads->model, kv (tinylm defaults)" in text
    assert "activation constraints" in text


# ---- every mistake, in the user's terms -----------------------------------------------


def test_a_non_dividing_logical_axis_names_the_name_dimension_and_rule():
    """'heads' -> 'model' on model=8 with 4 heads: one cause, the parameter as example
    with its two moments counted, the fix the user can make."""
    mesh = ms.make_mesh({"data": 1, "model": 8})
    state = linen_state()
    with (
        ms.logical_rules(tinylm.AXES, {"vocab": None, "mlp": None}),
        pytest.raises(ms.SpecError) as e,
    ):
        ms.plan(state, ms.Rules([], strict=False), mesh)
    lines = str(e.value).splitlines()
    [c] = e.value.causes  # one cause: dimension 1 of q/k/v, dimension 0 of o
    assert c.what == (
        "'heads' (dimension 1, size 4) maps to 'model' (8) by tinylm defaults['heads']: 4 is "
        "not divisible by 8"
    )
    assert c.example.path == "params/block_0/k/kernel"  # the parameter, not opt/0/mu/...
    assert [p.path for p in c.mirrors] == ["opt/0/mu/block_0/k/kernel", "opt/0/nu/block_0/k/kernel"]
    assert c.hint == "map 'heads' to an axis whose size divides 4, or to None"
    p = c.example
    assert (p.dimension, p.logical_name, p.logical_rule) == (1, "heads", "tinylm defaults['heads']")
    o = next(p for p in e.value.problems if p.path == "params/block_0/o/kernel")
    assert o.what == (
        "'heads' (dimension 0, size 4) maps to 'model' (8) by tinylm defaults['heads']: 4 is "
        "not divisible by 8"
    )
    assert {k: p.to_json()[k] for k in ("dimension", "logical_name", "logical_rule")} == {
        "dimension": 1,
        "logical_name": "heads",
        "logical_rule": "tinylm defaults['heads']",
    }
    assert e.value.to_json()["causes"][0]["mirrors"] == [m.path for m in c.mirrors]
    assert lines[:4] == [
        "24 sharding problems, 1 cause (paths are arg:path; numbered layers folded as {0..N}):",
        f"  [1] {c.what}: 24 leaves like it (their numbers differ)",
        "      e.g. tree:params/block_0/k/kernel float32[16, 4, 4], spec P(None, 'model', None) "
        "from metadata (LogicallyPartitioned), mesh (data=1, model=8) (and 2 leaves mirroring "
        "its path, e.g. tree:opt/0/mu/block_0/k/kernel)",
        f"      hint: {c.hint}",
    ]
