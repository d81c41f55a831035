"""The per-call route (``_jit/route.py``): plain containers gathered by the last call's
layout, and NNX modules taken again by their snapshot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import JIT_RULES, MAKERS, committed_to_device0, jit_params

# ---- the route for plain containers: leaves gathered by the last call's layout -------


def _no_full_path(sj):
    """Make the full path (modelshard's own flattening) fail loudly if it is taken."""

    def refuse(*_a, **_k):
        raise AssertionError("took the full path")

    sj._take = refuse


def test_plain_containers_skip_the_full_path_after_the_first_call(mesh8):
    sj = ms.shard_jit(lambda p, x: (p, x.sum()), mesh=mesh8, in_specs=(JIT_RULES, P("data")))
    params = ms.shard(jit_params(), JIT_RULES, mesh8)
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
    sj = ms.shard_jit(
        lambda p: p["w"].sum(), mesh=mesh8, in_specs=(JIT_RULES,), on_mismatch="raise"
    )
    placed = ms.shard(jit_params(), JIT_RULES, mesh8)
    assert float(sj(placed)) == float(sj(placed)) == float(np.arange(64.0).sum())
    assert sj._route is not None
    with pytest.raises(ms.ShardingMismatchError, match="p:w float32"):
        sj(ms.shard(jit_params(), P(), mesh8))
    with pytest.raises(ms.ShardingMismatchError, match="on device 0"):
        sj(committed_to_device0(jit_params()))


def test_route_donates(mesh8):
    sj = ms.shard_jit(
        lambda p, x: jax.tree_util.tree_map(lambda v: v + x.sum(), p),
        mesh=mesh8,
        in_specs=(JIT_RULES, P("data")),
        donate_argnums=0,
    )
    x = ms.shard(jnp.ones((8, 3)), P("data"), mesh8)
    p = sj(ms.shard(jit_params(), JIT_RULES, mesh8), x)
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
    sj2 = ms.shard_jit(lambda p, n: p["w"] * n, mesh=mesh8, in_specs=(JIT_RULES, None))
    sj2(jit_params(), 2)
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
