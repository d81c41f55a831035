"""``shard_jit``: placement of any input, mismatch errors, compiled shardings, the cache,
keyword and static arguments, outputs; ``shard`` gets the same input handling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS


def _arrays(tree):
    return ms.adapters.split(tree).arrays


def _params():
    return {"w": jnp.arange(64.0).reshape(16, 4), "b": jnp.ones(4)}


RULES = ms.Rules([("w$", P("data", None)), ("b$", P())])


# ---- placement of inputs wherever they live -------------------------------------------


def _committed_to_device0(tree):
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, jax.devices()[0]), tree)


def _sharded_otherwise(tree, mesh):
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(
            x,
            NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "data"))
            if x.shape[-1] % 8 == 0
            else NamedSharding(mesh, P()),
        ),
        tree,
    )


@pytest.mark.parametrize("where", ["numpy", "uncommitted", "device0", "other-sharding"])
def test_inputs_are_moved_to_the_plan(mesh8, where):
    params, x = _params(), jnp.ones((8, 3))
    if where == "numpy":
        params, x = jax.tree_util.tree_map(np.asarray, (params, x))
    elif where == "device0":
        params, x = _committed_to_device0((params, x))
        assert x.committed
    elif where == "other-sharding":
        params = {
            "w": jax.device_put(params["w"], NamedSharding(mesh8, P(None, None))),
            "b": params["b"],
        }
        x = jax.device_put(x, NamedSharding(mesh8, P()))
    f = ms.shard_jit(lambda p, x: (p, x.sum()), mesh=mesh8, in_specs=(RULES, P("data")))
    (out, total), p = f(params, x), f.plan(params, x)
    assert float(total) == 24.0
    np.testing.assert_array_equal(out["w"], np.arange(64.0).reshape(16, 4))
    assert out["w"].sharding.is_equivalent_to(p.sharding(P("data", None)), 2)
    assert out["b"].sharding.is_equivalent_to(p.sharding(P()), 1)


def test_raise_mode_names_every_leaf_and_both_shardings(mesh8):
    params, x = _committed_to_device0((_params(), jnp.ones((8, 3))))
    f = ms.shard_jit(
        lambda p, x: x.sum() + p["b"].sum(),
        mesh=mesh8,
        in_specs=(RULES, P("data")),
        on_mismatch="raise",
    )
    with pytest.raises(ms.ShardingMismatchError) as e:
        f(params, x)
    mesh = "mesh (data=8)"
    assert str(e.value).splitlines() == [
        "3 input leaves are not in the planned sharding (on_mismatch='raise'):",
        "  p:b float32[4]",
        f"    problem: is on device 0 (cpu, SingleDeviceSharding), but the plan places it P() on {mesh}",
        "    spec: P() (from rule 1 'b$')",
        "    hint: place inputs first with modelshard.shard(...), or pass on_mismatch='move' to let shard_jit move them",
        "  p:w float32[16, 4]",
        f"    problem: is on device 0 (cpu, SingleDeviceSharding), but the plan places it P('data', None) on {mesh}",
        "    spec: P('data', None) (from rule 0 'w$')",
        "    hint: place inputs first with modelshard.shard(...), or pass on_mismatch='move' to let shard_jit move them",
        "  x:<root> float32[8, 3]",
        f"    problem: is on device 0 (cpu, SingleDeviceSharding), but the plan places it P('data') on {mesh}",
        "    spec: P('data') (from P('data') for the whole argument)",
        "    hint: place inputs first with modelshard.shard(...), or pass on_mismatch='move' to let shard_jit move them",
    ]
    assert isinstance(e.value, ValueError)
    # placed inputs pass, and so do NumPy and uncommitted arrays (as with jax.jit)
    assert float(f(ms.shard(_params(), RULES, mesh8), np.ones((8, 3)))) == 28.0
    assert float(f(_params(), jnp.ones((8, 3)))) == 28.0


def test_raise_mode_differently_sharded(mesh8, count_compiles):
    f = ms.shard_jit(lambda p: p["w"].sum(), mesh=mesh8, in_specs=(RULES,), on_mismatch="raise")
    assert float(f(ms.shard(_params(), RULES, mesh8))) == float(np.arange(64.0).sum())
    params = ms.shard(_params(), P(), mesh8)  # replicated, planned P('data', None) for w
    with pytest.raises(ms.ShardingMismatchError) as e:
        f(params)
    lines = str(e.value).splitlines()
    assert lines[:3] == [
        "1 input leaf is not in the planned sharding (on_mismatch='raise'):",
        "  p:w float32[16, 4]",
        "    problem: is P() on mesh (data=8), but the plan places it P('data', None) on mesh (data=8)",
    ]
    # and in move mode the same call goes through, on the fast path too
    g = ms.shard_jit(lambda p: p["w"].sum(), mesh=mesh8, in_specs=(RULES,))
    with count_compiles() as n:
        for tree in (ms.shard(_params(), RULES, mesh8), params, params):
            assert float(g(tree)) == float(np.arange(64.0).sum())
    assert n["jit(<lambda>)"] == 1 and g.cache_size == 1


# ---- compiled shardings equal the plan, leaf for leaf ----------------------------------


def test_compiled_input_shardings_equal_the_plan(container, mesh24):
    spec = ms.fsdp("model", min_size=0)
    f = ms.shard_jit(lambda t: t, mesh=mesh24, in_specs=(spec,))
    compiled = f.lower(container).compile()
    planned = ms.plan(container, spec, mesh24)
    got = compiled.input_shardings[0]
    arrays = _arrays(container)
    assert len(got) == len(planned) == len(arrays)
    for s, leaf, x in zip(got, planned, arrays, strict=True):
        assert s.is_equivalent_to(planned.sharding(leaf.spec), x.ndim), leaf.path
    assert any(leaf.spec != P() for leaf in planned)


def test_lower_takes_abstract_arguments(mesh8):
    abstract = jax.eval_shape(_params)
    f = ms.shard_jit(lambda p: p["w"] * 2, mesh=mesh8, in_specs=(RULES,))
    compiled = f.lower(abstract).compile()
    assert compiled.input_shardings[0][1].spec == P("data", None)  # leaves in key order: b, w


# ---- the cache ------------------------------------------------------------------------


def test_cache_by_abstract_signature_replans_new_shapes(mesh8, count_compiles):
    calls = []

    def f(t):
        calls.append(1)
        return t

    sj = ms.shard_jit(f, mesh=mesh8, in_specs=(ms.fsdp("data", min_size=0),))
    with count_compiles() as n:
        a = sj({"w": jnp.ones((8, 3))})
        sj(a)  # the output fed back (placed as the trace was): no new trace
        assert n["jit(f)"] == sj.cache_size == 1 and len(calls) == 1  # one trace, one compile
        b = sj({"w": jnp.ones((3, 16))})  # FSDP now shards dimension 1
        assert a["w"].sharding.spec == P("data") and b["w"].sharding.spec == P(None, "data")
        assert n["jit(f)"] == sj.cache_size == 2 and len(calls) == 2
        c = sj({"w": np.ones((8, 3), np.float32)})  # the first shape: no new plan, trace, compile
        assert c["w"].sharding.spec == P("data") and len(calls) == 2
        assert n["jit(f)"] == sj.cache_size == 2
        sj({"w": jnp.ones((8, 3), jnp.int32)})  # new dtype
        assert n["jit(f)"] == sj.cache_size == 3


def test_a_new_signature_traces_the_function_once(mesh24, count_compiles):
    calls = []

    def step(state, x):
        calls.append(1)
        return {"w": ms.constrain(state["w"] * x.sum(), P(None, "model"))}, x.mean()

    sj = ms.shard_jit(step, mesh=mesh24, in_specs=(P("data"), P()))
    state = {"w": jnp.ones((8, 16))}
    x = ms.shard(jnp.ones((4,)), P(), mesh24)
    with count_compiles() as n:
        out, _ = sj(state, x)  # uncommitted state: placed by shard_jit as it was traced
        assert len(calls) == 1 and out["w"].sharding.spec == P(None, "model")
        sj(ms.shard(state, P("data"), mesh24), x)  # committed inputs: the same trace
        sj(state, np.ones((4,), np.float32))  # uncommitted and NumPy inputs: the same
    assert len(calls) == 1 and n["jit(step)"] == 1


def test_static_leaves_and_static_args_are_part_of_the_key(mesh8, count_compiles):
    def f(t, scale, *, power):
        return {"y": t["x"] * scale**power, "act": t["act"]}

    sj = ms.shard_jit(f, mesh=mesh8, in_specs={"t": P("data")}, static_argnames=("scale", "power"))
    tree = {"x": jnp.ones(8), "act": "relu"}
    with count_compiles() as n:
        out = sj(tree, 2.0, power=3)
        assert out["act"] == "relu" and float(np.asarray(out["y"])[0]) == 8.0
        assert float(np.asarray(sj(tree, 3.0, power=1)["y"])[0]) == 3.0
        assert sj({"x": jnp.ones(8), "act": "gelu"}, 3.0, power=1)["act"] == "gelu"
        sj({"x": jnp.ones(8), "act": "gelu"}, 3.0, power=1)  # seen before
    assert n["jit(f)"] == sj.cache_size == 3


def test_unhashable_static_leaf_is_a_clear_error(mesh8):
    sj = ms.shard_jit(lambda t: t["x"], mesh=mesh8, in_specs=(P(),))
    with pytest.raises(
        ms.AdapterError,
        match=r"t:cfg is a bytearray, which is neither an array nor "
        r"hashable",
    ):
        sj({"x": jnp.ones(2), "cfg": bytearray(b"ab")})


def test_unhashable_static_argument(mesh8):
    sj = ms.shard_jit(lambda x, n: x * len(n), mesh=mesh8, in_specs=(P(), None), static_argnums=1)
    assert float(sj(jnp.ones(2), (1, 2))[0]) == 2.0
    with pytest.raises(ms.SpecError) as e:
        sj(jnp.ones(2), [1, 2])
    assert str(e.value).splitlines()[:2] == ["invalid shard_jit arguments:", "  shard_jit:n"]


# ---- the route for plain containers: leaves gathered by the last call's layout -------


def _no_full_path(sj):
    """Make the full path (modelshard's own flattening) fail loudly if it is taken."""

    def refuse(*_a, **_k):
        raise AssertionError("took the full path")

    sj._take = refuse


def test_plain_containers_skip_the_full_path_after_the_first_call(mesh8):
    sj = ms.shard_jit(lambda p, x: (p, x.sum()), mesh=mesh8, in_specs=(RULES, P("data")))
    params = ms.shard(_params(), RULES, mesh8)
    sj(params, jnp.ones((8, 3)))
    full = sj._take
    _no_full_path(sj)
    out, total = sj(params, np.ones((8, 3)))  # NumPy input: jax.jit places it itself
    assert float(total) == 24.0 and out["w"].sharding.spec == P("data", None)
    sj._take = full
    with pytest.raises(AssertionError, match="full path"):
        _no_full_path(sj)
        sj({"w": params["w"]}, jnp.ones((8, 3)))  # another structure goes the full way


@pytest.mark.parametrize(
    "change",
    ["structure", "shape", "dtype", "python scalar", "string leaf", "device0", "sharding"],
)
def test_route_falls_back_to_the_full_path(mesh8, change):
    def f(p):
        return {k: v * 2 if hasattr(v, "shape") else v for k, v in p.items()}

    sj = ms.shard_jit(f, mesh=mesh8, in_specs=(ms.fsdp("data", min_size=0),))
    base = {"w": jnp.ones((8, 4)), "s": jnp.float32(1.0)}
    sj(base)
    assert sj._route is not None
    arg = {
        "structure": {"w": jnp.ones((8, 4)), "t": jnp.float32(1.0)},
        "shape": {"w": jnp.ones((16, 4)), "s": jnp.float32(1.0)},
        "dtype": {"w": jnp.ones((8, 4), jnp.int32), "s": jnp.float32(1.0)},
        "python scalar": {"w": jnp.ones((8, 4)), "s": 3},
        "string leaf": {"w": jnp.ones((8, 4)), "s": "tag"},
        "device0": {"w": jax.device_put(jnp.ones((8, 4)), jax.devices()[0]), "s": jnp.ones(())},
        "sharding": {"w": ms.shard(jnp.ones((8, 4)), P(), mesh8), "s": jnp.ones(())},
    }[change]
    out = sj(arg)
    for k, v in arg.items():
        if hasattr(v, "shape"):
            np.testing.assert_array_equal(out[k], np.asarray(v) * 2)
            assert out[k].sharding.spec == ms.plan(arg, ms.fsdp("data", min_size=0), mesh8)[k].spec
        else:
            assert out[k] == v  # non-array leaves stay static, as on the full path
    assert sj(base)["w"].sharding.spec == P("data")  # and back again


def test_route_layouts_of_every_plain_container(mesh8, count_compiles):
    optax = pytest.importorskip("optax")
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones(8)}  # insertion order is not JAX's
    state = {
        "params": params,
        "opt": optax.adam(0.1).init(params),  # NamedTuples: flattened by JAX, compared
        "layers": [{"k": jnp.ones((8, 2)), "skip": None}, (jnp.ones(8), jnp.ones(8))],
    }
    sj = ms.shard_jit(
        lambda s: jax.tree_util.tree_map(lambda x: x * 2, s),
        mesh=mesh8,
        in_specs=(ms.fsdp("data", min_size=0),),
    )
    with count_compiles() as n:
        first = sj(state)
        assert sj._route is not None
        full = sj._take
        _no_full_path(sj)
        again = sj(state)  # same layout: the route, with the keys reordered as JAX orders them
        for a, b in zip(
            jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(again), strict=True
        ):
            np.testing.assert_array_equal(a, b)
            assert a.sharding == b.sharding
        sj._take = full
        second = sj(first)  # JAX's own output (sorted keys): a new layout, the full path once
        _no_full_path(sj)
        third = sj(second)  # and the route from then on
        np.testing.assert_array_equal(third["params"]["w"], np.full((8, 4), 8.0))
    assert n["jit(<lambda>)"] == sj.cache_size == 1


def test_route_keeps_raise_mode(mesh8):
    sj = ms.shard_jit(lambda p: p["w"].sum(), mesh=mesh8, in_specs=(RULES,), on_mismatch="raise")
    placed = ms.shard(_params(), RULES, mesh8)
    assert float(sj(placed)) == float(sj(placed)) == float(np.arange(64.0).sum())
    assert sj._route is not None
    with pytest.raises(ms.ShardingMismatchError, match="p:w float32"):
        sj(ms.shard(_params(), P(), mesh8))
    with pytest.raises(ms.ShardingMismatchError, match="on device 0"):
        sj(_committed_to_device0(_params()))


def test_route_donates(mesh8):
    sj = ms.shard_jit(
        lambda p, x: jax.tree_util.tree_map(lambda v: v + x.sum(), p),
        mesh=mesh8,
        in_specs=(RULES, P("data")),
        donate_argnums=0,
    )
    x = ms.shard(jnp.ones((8, 3)), P("data"), mesh8)
    p = sj(ms.shard(_params(), RULES, mesh8), x)
    assert sj._route is not None
    q = sj(p, x)  # the route's call
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(p))
    assert not x.is_deleted()
    np.testing.assert_array_equal(q["b"], np.full(4, 49.0))


def test_route_stops_after_repeated_misses(mesh8, count_compiles):
    sj = ms.shard_jit(lambda p: p, mesh=mesh8, in_specs=(P(),))
    a, b = {"a": jnp.ones(2)}, {"b": jnp.ones(2)}
    with count_compiles() as n:
        for _ in range(40):  # alternating structures miss the route every call
            assert set(sj(a)) == {"a"} and set(sj(b)) == {"b"}
    assert sj._route is None and n["jit(<lambda>)"] == sj.cache_size == 2


def test_containers_with_static_leaves_take_the_full_path(mesh8):
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    sj = ms.shard_jit(lambda m, x: m(x), mesh=mesh8, in_specs=(P(), P()))
    sj(mlp, jnp.ones(4))
    assert sj._route is None  # the activation function is a static leaf
    sj2 = ms.shard_jit(lambda p, n: p["w"] * n, mesh=mesh8, in_specs=(RULES, None))
    sj2(_params(), 2)
    assert sj2._route is None  # a Python scalar argument is static


# ---- NNX modules on the route: the same module object taken again by its snapshot -----


def _full_paths(sj):
    """Count the calls that take the full path (modelshard's own flattening)."""
    full = sj._take
    calls = [0]

    def counted(*a, **k):
        calls[0] += 1
        return full(*a, **k)

    sj._take = counted
    return calls


def _nnx_net():
    from flax import nnx

    class Scale(nnx.Module):
        def __init__(self, k):
            self.w = nnx.Param(jnp.ones(8))
            self.k = k  # a static attribute

    class Net(nnx.Module):
        def __init__(self):
            # axis names as metadata: with no rule matching, the plan reads them
            self.ps = nnx.List(
                [nnx.Param(jnp.ones(8), out_sharding=("data",), eager_sharding=False)]
                + [nnx.Param(jnp.full(8, float(i))) for i in (1, 2)]
            )
            self.sub = Scale(1.0)
            self.steps = nnx.BatchStat(jnp.zeros(()))

    return Net, Scale


# ps/0 matches no rule: its axis names come from its metadata
NET_RULES = ms.Rules([(r"^(ps/[1-9]|sub/w)$", P("data"))], strict=False)


def _net_step(m):
    m.steps[...] = m.steps[...] + 1  # state the step updates: written back by the route too
    return sum(p[...].sum() for p in m.ps) + m.sub.w[...].sum() * m.sub.k


def _net_expected(m):
    return sum(float(np.asarray(p[...]).sum()) for p in m.ps) + float(
        np.asarray(m.sub.w[...]).sum()
    ) * float(m.sub.k)


def test_nnx_module_takes_the_route_and_writes_state_back(mesh8, count_compiles):
    Net, _ = _nnx_net()
    m = Net()
    sj = ms.shard_jit(_net_step, mesh=mesh8, in_specs=(NET_RULES,))
    with count_compiles() as n:
        assert float(sj(m)) == _net_expected(m)
        assert sj._route is not None
        _no_full_path(sj)
        for i in range(2, 6):
            assert float(sj(m)) == _net_expected(m)
            assert float(m.steps[...]) == i  # the update reached the caller's Variable
    assert n["jit(_net_step)"] == sj.cache_size == 1
    assert m.ps[0][...].sharding.spec == P("data")  # placed by the plan, from the metadata


@pytest.mark.parametrize(
    ("change", "compiles"),
    [
        ("value set in place", 1),
        ("Variable replaced", 1),  # same type, shape and metadata: the same signature
        ("submodule swapped", 1),
        ("Variable added", 2),
        ("Variable removed", 2),
        ("metadata set in place", 2),
        ("static attribute", 2),
    ],
)
def test_nnx_route_sees_every_change_between_calls(mesh8, count_compiles, change, compiles):
    from flax import nnx

    Net, Scale = _nnx_net()
    m = Net()
    sj = ms.shard_jit(_net_step, mesh=mesh8, in_specs=(NET_RULES,))
    with count_compiles() as n:
        sj(m)
        sj(m)
        full = _full_paths(sj)
        with jax.set_mesh(mesh8):  # Explicit axes: eager updates of sharded values need it
            if change == "value set in place":
                m.ps[0][...] = jnp.full(8, 5.0)
            elif change == "Variable replaced":
                m.ps[1] = nnx.Param(jnp.full(8, 3.0))
            elif change == "submodule swapped":
                m.sub = Scale(1.0)
                m.sub.w[...] = jnp.full(8, 4.0)
            elif change == "Variable added":
                m.ps.append(nnx.Param(jnp.full(8, 6.0)))
            elif change == "Variable removed":
                del m.ps[2]
            elif change == "metadata set in place":
                m.ps[0].set_metadata(out_sharding=(None,))
            else:
                m.sub.k = 3.0
        steps = m.steps  # the Variable the next call must update (replaced ones included)
        assert float(sj(m)) == _net_expected(m)
        assert float(steps[...]) == 3.0
        # A change of value is the route's own business; anything else is the full path's.
        assert full[0] == (0 if change == "value set in place" else 1)
        _no_full_path(sj)  # and the route again for the calls after that
        assert float(sj(m)) == _net_expected(m)
    assert n["jit(_net_step)"] == sj.cache_size == compiles
    spec = P(None) if change == "metadata set in place" else P("data")
    assert m.ps[0][...].sharding.spec == spec


def test_nnx_route_takes_the_same_object_only(mesh8, count_compiles):
    Net, _ = _nnx_net()
    a, b = Net(), Net()
    sj = ms.shard_jit(_net_step, mesh=mesh8, in_specs=(NET_RULES,))
    with count_compiles() as n:
        sj(a)
        full = _full_paths(sj)
        with jax.set_mesh(mesh8):
            b.ps[1][...] = jnp.full(8, 7.0)
        assert float(sj(b)) == _net_expected(b)  # another module of the same structure
        assert full[0] == 1 and float(b.steps[...]) == 1.0 and float(a.steps[...]) == 1.0
    assert n["jit(_net_step)"] == sj.cache_size == 1


# ---- arguments: kwargs, dict specs, missing specs --------------------------------------


def test_dict_in_specs_resolve_keywords_and_defaults(mesh24):
    def step(params, batch, lr=0.5):
        return jax.tree_util.tree_map(lambda p: p - lr * batch.mean(), params)

    sj = ms.shard_jit(step, mesh=mesh24, in_specs={"params": RULES, "batch": P("data")})
    a = sj(_params(), jnp.ones((4, 2)))
    b = sj(batch=jnp.ones((4, 2)), params=_params())
    c = sj(_params(), batch=jnp.ones((4, 2)), lr=0.5)
    for out in (a, b, c):
        np.testing.assert_allclose(out["b"], 0.5)
        assert out["w"].sharding.spec == P("data", None)


def test_argument_with_arrays_but_no_spec(mesh8):
    sj = ms.shard_jit(lambda a, b: a + b, mesh=mesh8, in_specs={"a": P()})
    with pytest.raises(ms.SpecError) as e:
        sj(jnp.ones(2), jnp.ones(2))
    assert str(e.value).splitlines()[1:4] == [
        "  b:<root>",
        "    problem: argument 'b' holds 1 array leaves but in_specs gives it no spec",
        "    hint: add an entry for 'b' to in_specs (P() replicates it), or make it static",
    ]
    assert float(sj(jnp.ones(2), 1.0)[0]) == 2.0  # a Python number is static: no spec needed


def test_bad_arguments_are_reported(mesh8):
    with pytest.raises(ms.SpecError) as e:
        ms.shard_jit(lambda a: a, mesh=mesh8, in_specs={"b": P()})
    assert str(e.value).splitlines() == [
        "invalid shard_jit arguments:",
        "  shard_jit:in_specs['b']",
        "    problem: <lambda> has no parameter 'b'",
        "    hint: its parameters are 'a'",
    ]
    with pytest.raises(ms.SpecError, match="on_mismatch='copy' is not 'move' or 'raise'"):
        ms.shard_jit(lambda a: a, mesh=mesh8, in_specs=(P(),), on_mismatch="copy")  # type: ignore[arg-type]
    with pytest.raises(ms.MeshError):
        ms.shard_jit(lambda a: a, mesh="mesh", in_specs=(P(),))
    sj = ms.shard_jit(lambda a, b=1: a, mesh=mesh8, in_specs=(P(),))
    with pytest.raises(ms.SpecError, match="in_specs has 1 entries but <lambda> was called with 2"):
        sj(jnp.ones(2), 2)


def test_spec_errors_list_every_argument(mesh8):
    sj = ms.shard_jit(lambda a, b: a, mesh=mesh8, in_specs=(P("data"), P("model")))
    with pytest.raises(ms.SpecError) as e:
        sj(jnp.ones(6), jnp.ones(8))
    text = str(e.value)
    assert "a:<root> float32[6]" in text and "b:<root> float32[8]" in text
    assert "axis 'model' (dimension 0) is not in the mesh" in text


# ---- outputs --------------------------------------------------------------------------


def test_out_specs_none_keeps_input_layouts_and_lets_the_compiler_choose(mesh24):
    def f(params, x):
        return {"new": params, "loss": x.sum(), "pair": (x * 2, "tag")}

    sj = ms.shard_jit(f, mesh=mesh24, in_specs=(RULES, P("data", "model")))
    out = sj(_params(), jnp.ones((4, 8)))
    assert out["new"]["w"].sharding.spec == P("data", None)
    assert out["pair"][1] == "tag" and out["pair"][0].shape == (4, 8)


def test_explicit_out_specs(mesh24):
    def f(params):
        return params, params["w"].sum()

    sj = ms.shard_jit(
        f,
        mesh=mesh24,
        in_specs=(RULES,),
        out_specs=(ms.Rules([("w$", P(None, "model")), ("b$", P("model"))]), P()),
    )
    new, total = sj(_params())
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


def test_decorator_and_wrapping(mesh8):
    @ms.shard_jit(mesh=mesh8, in_specs=(P("data"),))
    def double(x):
        """Doubles."""
        return x * 2

    assert double.__name__ == "double" and double.__doc__ == "Doubles."
    assert double(jnp.arange(8.0)).sharding.spec == P("data")


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


# ---- shard() places inputs wherever they live -----------------------------------------


@pytest.mark.parametrize("where", ["numpy", "device0", "other-sharding"])
def test_shard_moves_inputs_wherever_they_live(mesh8, where):
    params = _params()
    if where == "numpy":
        params = jax.tree_util.tree_map(np.asarray, params)
    elif where == "device0":
        params = _committed_to_device0(params)
    else:
        params = _sharded_otherwise(params, mesh8)
    out = ms.shard(params, RULES, mesh8)
    assert out["w"].sharding == NamedSharding(mesh8, P("data", None))
    assert out["b"].sharding == NamedSharding(mesh8, P())
    np.testing.assert_array_equal(out["w"], np.arange(64.0).reshape(16, 4))


def test_nnx_fast_route_repeated_calls_shared_variables_and_type_changes(mesh8, count_compiles):
    from flax import nnx

    class M(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.zeros(8))
            self.b = self.a  # the same Variable twice
            self.count = nnx.BatchStat(jnp.zeros(()))

    def f(m):
        m.a[...] = m.a[...] + 1
        m.count[...] = m.count[...] + 1
        return m.b[...].sum()

    m = M()
    sj = ms.shard_jit(f, mesh=mesh8, in_specs=(ms.fsdp("data", min_size=0),))
    with count_compiles() as n:
        for i in range(3):
            assert float(sj(m)) == 8.0 * (i + 1)
        assert float(m.count[...]) == 3.0 and m.a is m.b
        assert m.a[...].sharding.spec == P("data") and n["jit(f)"] == sj.cache_size == 1
        m.count = nnx.Param(m.count[...])  # same structure, another Variable type: replanned
        assert float(sj(m)) == 32.0 and float(m.count[...]) == 4.0
    assert n["jit(f)"] == sj.cache_size == 2


def test_nnx_same_module_called_again_sees_every_change_made_between_calls(mesh8, count_compiles):
    from flax import nnx

    class M(nnx.Module):
        def __init__(self):
            self.ps = nnx.List([nnx.Param(jnp.ones(8)) for _ in range(3)])
            self.scale = 1.0
            self.extra = nnx.data({"w": nnx.Param(jnp.zeros(8))})  # a plain dict of Variables

    def f(m):
        return sum(p[...].sum() for p in m.ps) * m.scale + m.extra["w"][...].sum()

    m = M()
    sj = ms.shard_jit(f, mesh=mesh8, in_specs=(ms.fsdp("data", min_size=0),))
    with count_compiles() as n:
        assert float(sj(m)) == 24.0 and float(sj(m)) == 24.0  # the second call: the snapshot
        with jax.set_mesh(mesh8):  # Explicit axes: eager updates of sharded values need it
            m.ps[0][...] = jnp.full(8, 2.0)  # a value set in place
        assert float(sj(m)) == 32.0
        m.ps[1] = nnx.Param(jnp.full(8, 3.0))  # a Variable replaced in an nnx.List
        assert float(sj(m)) == 48.0
        m.ps.append(nnx.Param(jnp.ones(8)))  # the list grew: a new structure
        assert float(sj(m)) == 56.0
        m.scale = 0.5  # a static attribute: part of the key
        assert float(sj(m)) == 28.0
        m.extra["w"] = nnx.Param(jnp.ones(8))  # a Variable replaced in a plain dict
        assert float(sj(m)) == 36.0
    assert n["jit(f)"] == sj.cache_size == 3


def test_nnx_static_attributes_are_part_of_the_key(mesh8, count_compiles):
    model = MAKERS["nnx"]()
    ids = jnp.zeros((8, 4), jnp.int32)
    sj = ms.shard_jit(lambda m, ids: m(ids), mesh=mesh8, in_specs=(P(), P()))
    with count_compiles() as n:
        train = sj(model, ids)
        model.eval()  # flips static flags (Dropout.deterministic, BatchNorm running averages)
        evaluated = sj(model, ids)
    assert n["jit(<lambda>)"] == sj.cache_size == 2
    assert not np.allclose(train, evaluated)
    np.testing.assert_allclose(sj(model, ids), evaluated, rtol=1e-6)


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


# ---- out specs: the function's own shardings win; state coming back keeps its own -------


def _jax_jit_out_shardings(f, mesh, in_shardings, *args):
    """What ``jax.jit`` with the same input shardings gives each output leaf."""
    with jax.set_mesh(mesh):
        out = jax.jit(f, in_shardings=in_shardings)(*args)
    return [x.sharding.spec for x in jax.tree_util.tree_leaves(out)]


def _collectives(compiled_text: str) -> int:
    return sum(compiled_text.count(op) for op in ("all-gather", "all-to-all", "collective-permute"))


def test_a_constraint_inside_the_function_wins_over_the_input_sharding(mesh24):
    # The issue's example: the output has the input's structure and shape, but the
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


def test_warns_once_when_the_same_inputs_are_moved_every_call(mesh8):
    """An input committed in another sharding is copied on every call: say so, once."""
    import warnings

    step = ms.shard_jit(lambda s: s["w"].sum(), in_specs=(P("data"),), mesh=mesh8)
    w = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh8, P(None, "data")))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(4):
            step({"w": w})
    assert [str(r.message) for r in rec] == [
        "<lambda>: moved s:w (16.00 KiB) to the planned sharding again on this call; every "
        "call copies them. Place them once with modelshard.shard(...) (or feed back the "
        "step's outputs), or pass on_mismatch='raise' to be told instead."
    ]
    assert rec[0].filename == __file__  # points at the caller's line
    placed = ms.shard({"w": w}, P("data"), mesh8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            step(placed)


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
        return _committed_to_device0(tree)
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
