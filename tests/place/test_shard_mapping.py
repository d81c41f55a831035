"""``ms.shard_map``: containers in and out, one spec-like per argument, checked against
``jax.shard_map`` on the flattened leaves, on Auto and Explicit meshes."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import KINDS, MAKERS

SPEC = ms.fsdp("data", min_size=0)


def per_shard(tree):
    """Double every array leaf and add its local size (a sharded leaf's differs)."""
    flat = ms.adapters.split(tree)
    return flat.rebuild([bump(x) for x in flat.arrays])


def bump(x):
    return x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x * 2 + x.size


# Every kind on an Auto mesh, and the kinds with metadata, keys and static leaves on an
# Explicit one too (each case compiles twice: the file stays fast).
CASES = [(k, "auto") for k in KINDS] + [(k, "explicit") for k in ("nnx", "linen", "equinox")]


@pytest.mark.parametrize(("kind", "axis_type"), CASES)
def test_matches_jax_shard_map_on_flat_leaves(kind, axis_type):
    container = MAKERS[kind]()
    mesh24 = ms.make_mesh({"data": 2, "model": 4}, axis_types=axis_type)
    p = ms.plan(container, SPEC, mesh24)
    specs = [leaf.spec for leaf in p]
    placed = ms.adapters.split(ms.shard(container, SPEC, mesh24)).arrays
    ref = jax.shard_map(
        lambda *xs: [bump(x) for x in xs],
        mesh=mesh24,
        in_specs=tuple(specs),
        out_specs=specs,
    )(*placed)
    by_path = {leaf.path: leaf.spec for leaf in p}
    got = ms.shard_map(
        per_shard, mesh=mesh24, in_specs=(SPEC,), out_specs=lambda path, _: by_path[path]
    )(container)
    assert type(got) is type(container)
    out = ms.adapters.split(got).arrays
    assert len(out) == len(ref) == len(specs)
    for a, b, s in zip(out, ref, specs, strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(NamedSharding(mesh24, s), a.ndim)


def test_by_name_unmapped_constant_and_default_mesh(mesh24):
    calls = []

    def f(params, x, *, scale):
        calls.append(1)
        return jax.lax.psum((x @ params["w"]).sum(), "data") * scale

    params = {"w": jnp.ones((4, 2))}
    x = jnp.arange(32.0).reshape(8, 4)
    g = ms.shard_map(f, in_specs={"params": P(), "x": P("data")}, out_specs=P())
    with jax.set_mesh(mesh24):
        out = g(params, x=x, scale=2.0)
        assert float(out) == float((x @ params["w"]).sum() * 2)
        g(params, x=x, scale=2.0)  # same signature: compiled once
        assert len(calls) == 2  # one shape-only trace, one real trace
        g(params, x=x, scale=3.0)  # a new constant: planned and traced again
        assert len(calls) == 4
    with pytest.raises(ms.MeshError, match="no mesh given and none is active"):
        g(params, x=x, scale=2.0)


def test_every_input_problem_listed_before_tracing(mesh24):
    calls = []

    def f(a, b):
        calls.append(1)
        return a

    g = ms.shard_map(f, mesh=mesh24, in_specs=(P("data", "model"), P("modle")), out_specs=P())
    with pytest.raises(ms.SpecError) as e:
        g({"w": jnp.ones((3, 8))}, {"v": jnp.ones((4,)), "u": jnp.ones(6)})
    lines = str(e.value).splitlines()
    assert (
        lines[0]
        == "3 sharding problems found (every offending leaf is listed; paths are arg:path):"
    )
    assert "  a:w float32[3, 8]" in lines
    assert (
        "    problem: dimension 0 (size 3) is partitioned 2 times (data=2), but 3 is not divisible by 2"
        in lines
    )
    assert "  b:u float32[6]" in lines and "  b:v float32[4]" in lines
    assert "    problem: axis 'modle' (dimension 0) is not in the mesh" in lines
    assert calls == []


def test_out_specs_problems(mesh24):
    g = ms.shard_map(
        lambda x: {"y": x, "z": x}, mesh=mesh24, in_specs=(P("data"),), out_specs={"y": P("mdl")}
    )
    with pytest.raises(ms.SpecError) as e:
        g(jnp.ones((4, 4)))
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid shard_map out_specs:"
    assert "  out:y float32[2, 4]" in lines
    assert "    problem: axis 'mdl' (dimension 0) is not in the mesh" in lines
    assert "    mesh: data=2, model=4" in lines
    assert "  out:z float32[2, 4]" in lines
    assert "    problem: no entry of the prefix tree covers this leaf" in lines


def test_out_specs_fsdp_is_refused(mesh24):
    g = ms.shard_map(lambda x: x, mesh=mesh24, in_specs=(SPEC,), out_specs={"w": SPEC})
    with pytest.raises(ms.SpecError) as e:
        g({"w": jnp.ones((4, 4))})
    assert str(e.value).splitlines()[:3] == [
        "invalid shard_map arguments:",
        "  shard_map:out_specs",
        "    problem: fsdp(...) chooses a dimension from a leaf's global shape, which an output "
        "of shard_map does not have until its shards are concatenated",
    ]


def test_call_errors(mesh24):
    with pytest.raises(
        ms.SpecError, match=r"in_specs has 1 entries but <lambda> was called with 2"
    ):
        ms.shard_map(lambda a, b: a, mesh=mesh24, in_specs=(P(),), out_specs=P())(1.0, 2.0)
    with pytest.raises(ms.SpecError) as e:
        ms.shard_map(lambda a: a, mesh=mesh24, in_specs={"b": P(), "c": P()}, out_specs=P())
    assert str(e.value).splitlines()[1:] == [
        "  shard_map:in_specs['b']",
        "    problem: <lambda> has no parameter 'b'",
        "    hint: its parameters are 'a'",
        "  shard_map:in_specs['c']",
        "    problem: <lambda> has no parameter 'c'",
        "    hint: its parameters are 'a'",
    ]
    with pytest.raises(ms.SpecError, match="in_specs must be a tuple"):
        ms.shard_map(lambda a: a, mesh=mesh24, in_specs=P(), out_specs=P())
    with pytest.raises(TypeError, match="shard_map needs a callable"):
        ms.shard_map(3, in_specs=(), out_specs=P())
    # no signature (a builtin): arguments by position only, errors naming shard_map
    with pytest.raises(ms.SpecError, match="so arguments can only be given by position"):
        ms.shard_map(max, mesh=mesh24, in_specs={"a": P()}, out_specs=P())
    f = ms.shard_map(max, mesh=mesh24, in_specs=(P(), P()), out_specs=P())
    with pytest.raises(ms.SpecError) as e:
        f(1.0, 2.0, key=None)
    assert str(e.value).splitlines()[:2] == ["invalid shard_map arguments:", "  shard_map:kwargs"]


def test_nnx_module_in_and_out(mesh24):
    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    x = jnp.arange(32.0).reshape(8, 4)
    rules = ms.Rules([("kernel$", P(None, "model")), ("bias$", P("model"))])

    def f(m, x):
        return m(x), m

    y, m2 = ms.shard_map(
        f, mesh=mesh24, in_specs=(rules, P("data")), out_specs=(P("data", "model"), rules)
    )(model, x)
    # float32 dots of terms up to |31 x kernel| summed by other kernels on other shapes:
    # an absolute bound of a few ulps of the largest term, not of a cancelled result
    np.testing.assert_allclose(np.asarray(y), np.asarray(model(x)), rtol=1e-6, atol=1e-5)
    assert isinstance(m2, nnx.Linear) and m2 is not model
    assert m2.kernel.get_value().sharding.spec == P(None, "model")
    np.testing.assert_array_equal(
        np.asarray(m2.kernel.get_value()), np.asarray(model.kernel.get_value())
    )


def test_equinox_module_inside(mesh24):
    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    x = jnp.arange(32.0).reshape(8, 4)
    g = ms.shard_map(
        lambda m, x: jax.vmap(m)(x), mesh=mesh24, in_specs=(P(), P("data")), out_specs=P("data")
    )
    np.testing.assert_allclose(np.asarray(g(mlp, x)), np.asarray(jax.vmap(mlp)(x)), rtol=1e-5)


def test_linen_variables_inside(mesh24):
    model = nn.Dense(
        8,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
    )
    x = jnp.arange(32.0).reshape(8, 4)
    variables = model.init(jax.random.key(0), x)
    # linen checks parameter shapes against the module's features: inside shard_map the
    # kernel stays whole (its boxes survive the round trip), the batch is sharded.
    rules = ms.Rules([], logical={"embed": None, "mlp": None}, strict=False)

    def f(v, x):
        return model.apply(v, x)

    g = ms.shard_map(f, mesh=mesh24, in_specs=(rules, P("data")), out_specs=P("data"))
    np.testing.assert_allclose(
        np.asarray(g(variables, x)), np.asarray(model.apply(variables, x)), rtol=1e-6
    )


def test_logical_rules_context(mesh24):
    g = ms.shard_map(
        lambda x: x * 2, in_specs=(P("batch", "embed"),), out_specs=P("batch", "embed")
    )
    x = jnp.arange(32.0).reshape(8, 4)
    with jax.set_mesh(mesh24), ms.logical_rules({"batch": "data", "embed": "model"}):
        y = g(x)
    assert y.sharding.spec == P("data", "model")
    with jax.set_mesh(mesh24), ms.logical_rules([("batch", "model"), ("embed", None)]):
        y = g(x)  # a new context: planned again
    assert y.sharding.is_equivalent_to(NamedSharding(mesh24, P("model", None)), 2)
    with jax.set_mesh(mesh24), pytest.raises(ms.SpecError, match="axis 'batch'"):
        g(x)
