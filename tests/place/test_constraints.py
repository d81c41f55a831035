"""``constrain``: a sharding constraint per leaf by the plan, on Auto and Explicit meshes."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms

RULES = ms.Rules([("w$", P("data", "model")), ("b$", P("model"))])


def _tree():
    return {"w": jnp.arange(128.0).reshape(16, 8), "b": jnp.ones(8)}


def _specs(tree):
    """Leaf -> spec, trailing ``None`` entries dropped (``P('model', None)`` is ``P('model')``)."""
    out = {}
    for k, v in tree.items():
        entries = list(v.sharding.spec)
        while entries and entries[-1] is None:
            entries.pop()
        out[k] = P(*entries)
    return out


def test_inside_jit_with_a_mesh(mesh24):
    placed = ms.shard(_tree(), P(), mesh24)
    out = jax.jit(lambda t: ms.constrain(t, RULES, mesh24))(placed)
    assert _specs(out) == {"w": P("data", "model"), "b": P("model")}
    np.testing.assert_array_equal(out["w"], _tree()["w"])


def test_gathering_sharded_leaves_back_to_replicated(mesh24):
    # On Explicit axes with_sharding_constraint refuses this; constrain reshards instead.
    placed = ms.shard(_tree(), RULES, mesh24)
    out = jax.jit(lambda t: ms.constrain(t, P()))  # mesh from the context below
    with jax.set_mesh(mesh24):
        got = out(placed)
    assert _specs(got) == {"w": P(), "b": P()}


def test_mesh_from_the_active_context_eagerly_and_traced(mesh24):
    with jax.set_mesh(mesh24):
        eager = ms.constrain(_tree(), ms.fsdp("model", min_size=0))
        traced = jax.jit(lambda t: ms.constrain(t, ms.fsdp("model", min_size=0)))(_tree())
    assert _specs(eager) == _specs(traced) == {"w": P("model"), "b": P("model")}


def test_inside_shard_jit_the_mesh_is_set(mesh24):
    def f(t):
        # (a new structure: an output shaped like the input would keep the input's layout)
        return ms.constrain(
            {"w2": t["w"] * 2, "b2": t["b"]},
            ms.Rules([("w2", P("data", "model")), ("b2", P("model"))]),
        )

    out = ms.shard_jit(f, mesh=mesh24, in_specs=(P(),))(_tree())
    assert _specs(out) == {"w2": P("data", "model"), "b2": P("model")}


def _no_mesh_block(x):
    return ms.constrain(x, P(), strict=True)


def test_no_mesh_is_a_clear_error_naming_the_call():
    """No mesh given and none active, strict: the MeshError names the constrain call
    (file:line, function) and, while tracing, the traced function, as a SpecError does."""
    here = os.path.relpath(__file__)
    call = f"{here}:{_line(_no_mesh_block, 'ms.constrain(')}"
    says = (
        "no mesh given and none is active; pass mesh=..., or call inside "
        "`with jax.set_mesh(mesh):` (shard_jit sets it while tracing)."
    )
    with pytest.raises(ms.MeshError) as e:
        _no_mesh_block(_tree())
    assert str(e.value) == f"constrain at {call} in _no_mesh_block: {says}"

    @jax.jit
    def step(x):
        return _no_mesh_block(x)

    with pytest.raises(ms.MeshError) as e:
        step(_tree())
    assert str(e.value) == (
        f"constrain at {call} in _no_mesh_block, while tracing "
        "test_no_mesh_is_a_clear_error_naming_the_call.<locals>.step "
        f"({here}:{_line(step, '_no_mesh_block(x)')}): {says}"
    )


def test_lenient_by_default_and_strict_inside_the_context_for_one_jitted_function():
    """No mesh: a lenient constrain returns its input; the same jitted function is traced
    again inside strict_constraints (jax.jit keys on it) and raises there; strict=False on
    the call wins over the context."""
    x = jnp.arange(8.0)

    @jax.jit
    def step(x):
        return ms.constrain(x * 2, P("data"))

    np.testing.assert_array_equal(np.asarray(step(x)), np.arange(8.0) * 2)
    with ms.strict_constraints(), pytest.raises(ms.MeshError, match="no mesh given"):
        step(x)
    with ms.strict_constraints():
        with ms.strict_constraints(False):
            assert step(x).shape == (8,)
        assert ms.constrain(x, P("data"), strict=False) is x
    assert step(x).shape == (8,)


def test_spec_errors_come_from_the_rule_engine(mesh24):
    with pytest.raises(ms.SpecError) as e:
        ms.constrain({"w": jnp.ones((6, 8))}, P("model"), mesh24)
    assert str(e.value).splitlines()[1:3] == [
        "  tree:w float32[6, 8]",
        "    problem: dimension 0 (size 6) is partitioned 4 times (model=4), but 6 is not "
        "divisible by 4",
    ]


def test_every_container_kind_eagerly(container, mesh24):
    spec = ms.fsdp("model", min_size=0)
    planned = ms.plan(container, spec, mesh24)
    out = ms.constrain(container, spec, mesh24)
    got = ms.adapters.split(out).arrays
    assert len(got) == len(planned)
    for x, leaf in zip(got, planned, strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh24, leaf.spec), x.ndim), leaf.path
    assert type(out) is type(container)
    if ms.adapters.get_adapter(container).kind == "nnx.Module":
        assert out is container  # updated in place


def test_shard_and_plan_use_the_set_mesh(mesh24):
    tree = {"w": jnp.ones((8, 4))}
    with jax.set_mesh(mesh24):
        p = ms.plan(tree, P("data", "model"))
        placed = ms.shard(tree, P("data", "model"))
    assert p.mesh is mesh24
    assert placed["w"].sharding == NamedSharding(mesh24, P("data", "model"))
    with pytest.raises(ms.MeshError, match="no mesh given and none is active"):
        ms.shard(tree, P())


def _bad_block(x, mesh):
    return ms.constrain(x, P("data", "modle"), mesh)  # the call site named by the error


def _line(fn, text):
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_errors_name_the_constrain_call_and_the_traced_function(mesh24):
    """A bad activation constraint deep in model code names the ``constrain`` call (file,
    line, function) and the function being traced, in the text and in the JSON."""
    here = os.path.relpath(__file__)

    @jax.jit
    def step(x):
        return _bad_block(x, mesh24) * 2

    with pytest.raises(ms.SpecError) as e:
        step(jnp.zeros((8, 16), jnp.int32))
    site = (
        f"constrain at {here}:{_line(_bad_block, 'ms.constrain(')} in _bad_block, while tracing "
        f"test_errors_name_the_constrain_call_and_the_traced_function.<locals>.step "
        f"({here}:{_line(step, '_bad_block(x, mesh24)')})"
    )
    assert e.value.site == site
    assert str(e.value).splitlines() == [
        f"{site}: 1 sharding problem found (every offending leaf is listed; paths are arg:path):",
        "  tree:<root> int32[8, 16]",
        "    problem: axis 'modle' (dimension 1) is not in the mesh",
        "    spec: P('data', 'modle') (from P('data', 'modle') for the whole argument)",
        "    mesh: data=2, model=4",
        "    hint: did you mean 'model'? (mesh axes are 'data', 'model')",
    ]
    assert e.value.to_json()["site"] == site
    # eagerly: the call site alone
    with pytest.raises(ms.SpecError) as e:
        _bad_block(jnp.zeros((8, 16), jnp.int32), mesh24)
    assert e.value.site == f"constrain at {here}:{_line(_bad_block, 'ms.constrain(')} in _bad_block"
    # many problems: the grouped report is headed by the call site too
    layers = {f"layer_{i}": jnp.zeros((8, 16)) for i in range(12)}
    with pytest.raises(ms.SpecError) as e:
        jax.jit(lambda t: _bad_block(t, mesh24))(layers)
    first = str(e.value).splitlines()[0]
    assert first.startswith(f"constrain at {here}:{_line(_bad_block, 'ms.constrain(')} in ")
    assert first.endswith(
        ": 12 sharding problems, 1 cause (paths are arg:path; numbered layers folded as {0..N}):"
    )
    assert e.value.report().splitlines()[0] == e.value.site + ": 12 sharding problems (every one):"


def test_inside_shard_jit_the_site_is_the_users_and_the_problem_in_logical_terms():
    """Traced by shard_jit, a constraint's error names the model line and the step, never
    shard_jit's own frames; a logical name that does not divide is told by its name, its
    dimension and the rule entry that mapped it."""
    import tinylm
    from tinylm.sharding import constrain

    here = os.path.relpath(__file__)

    def model(x):
        return constrain(x * 2, "batch", "seq", "heads", "kv")

    def step(x):
        return model(x).sum()

    mesh = ms.make_mesh({"data": 1, "model": 8})
    name = "test_inside_shard_jit_the_site_is_the_users_and_the_problem_in_logical_terms"
    with ms.logical_rules(tinylm.AXES), pytest.raises(ms.SpecError) as e:
        ms.shard_jit(step, mesh=mesh, in_specs=(P("batch"),))(jnp.ones((8, 8, 4, 4)))
    site = (
        f"constrain at {here}:{_line(model, 'constrain(x * 2')} in {name}.<locals>.model, "
        f"while tracing {name}.<locals>.step ({here}:{_line(step, 'model(x)')})"
    )
    what = (
        "'heads' (dimension 2, size 4) maps to 'model' (8) by tinylm defaults['heads']: 4 is "
        "not divisible by 8"
    )
    assert str(e.value).splitlines() == [
        f"{site}: 1 sharding problem found (every offending leaf is listed; paths are arg:path):",
        "  tree:<root> float32[8, 8, 4, 4]",
        f"    problem: {what}",
        "    spec: P('data', None, 'model', None) (from P('batch', 'seq', 'heads', 'kv') for the "
        "whole argument)",
        "    mesh: data=1, model=8",
        "    hint: map 'heads' to an axis whose size divides 4, or to None",
    ]
    [p] = e.value.to_json()["problems"]
    assert (p["what"], p["dimension"], p["logical_name"], p["logical_rule"]) == (
        what,
        2,
        "heads",
        "tinylm defaults['heads']",
    )
    assert e.value.to_json()["site"] == site


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return ms.constrain(nn.Dense(16)(x), P("data", "modle"))


def test_the_traced_function_named_is_the_one_given_to_jit_not_an_inner_call(mesh24):
    """A constraint in a linen module's __call__, under jax.value_and_grad in a jitted
    train_step: the header names train_step (the function given to jax.jit or shard_jit,
    at the line it is running), not the module Flax called nor the loss grad traced."""
    here = os.path.relpath(__file__)
    x = jnp.ones((8, 16))
    params = {"params": {"Dense_0": nn.Dense(16).init(jax.random.key(0), x)["params"]}}
    call = f"constrain at {here}:{_line(_Block.__call__, 'ms.constrain(')} in _Block.__call__"

    def loss_fn(p, x):
        return _Block().apply(p, x).sum()

    def train_step(p, x):
        return jax.value_and_grad(loss_fn)(p, x)

    name = "test_the_traced_function_named_is_the_one_given_to_jit_not_an_inner_call"
    site = (
        f"{call}, while tracing {name}.<locals>.train_step "
        f"({here}:{_line(train_step, 'jax.value_and_grad(')})"
    )
    with jax.set_mesh(mesh24), pytest.raises(ms.SpecError) as e:
        jax.jit(train_step)(params, x)
    assert e.value.site == site
    with pytest.raises(ms.SpecError) as e:
        ms.shard_jit(train_step, mesh=mesh24, in_specs=(P(), P("data")))(params, x)
    assert e.value.site == site
