"""``ShardJit`` (``_jit/wrapper.py``): placement of any input, mismatch handling,
compiled shardings, the two entry tables, decorators; ``shard`` gets the same input handling."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import JIT_RULES, committed_to_device0, jit_params, sharded_otherwise

# ---- placement of inputs wherever they live -------------------------------------------


@pytest.mark.parametrize("where", ["numpy", "uncommitted", "device0", "other-sharding"])
def test_inputs_are_moved_to_the_plan(mesh8, where):
    params, x = jit_params(), jnp.ones((8, 3))
    if where == "numpy":
        params, x = jax.tree_util.tree_map(np.asarray, (params, x))
    elif where == "device0":
        params, x = committed_to_device0((params, x))
        assert x.committed
    elif where == "other-sharding":
        params = {
            "w": jax.device_put(params["w"], NamedSharding(mesh8, P(None, None))),
            "b": params["b"],
        }
        x = jax.device_put(x, NamedSharding(mesh8, P()))
    f = ms.shard_jit(lambda p, x: (p, x.sum()), mesh=mesh8, in_specs=(JIT_RULES, P("data")))
    (out, total), p = f(params, x), f.plan(params, x)
    assert float(total) == 24.0
    np.testing.assert_array_equal(out["w"], np.arange(64.0).reshape(16, 4))
    assert out["w"].sharding.is_equivalent_to(p.sharding(P("data", None)), 2)
    assert out["b"].sharding.is_equivalent_to(p.sharding(P()), 1)


def test_raise_mode_names_every_leaf_and_both_shardings(mesh8):
    params, x = committed_to_device0((jit_params(), jnp.ones((8, 3))))
    f = ms.shard_jit(
        lambda p, x: x.sum() + p["b"].sum(),
        mesh=mesh8,
        in_specs=(JIT_RULES, P("data")),
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
    assert float(f(ms.shard(jit_params(), JIT_RULES, mesh8), np.ones((8, 3)))) == 28.0
    assert float(f(jit_params(), jnp.ones((8, 3)))) == 28.0


def test_raise_mode_differently_sharded(mesh8, count_compiles):
    f = ms.shard_jit(lambda p: p["w"].sum(), mesh=mesh8, in_specs=(JIT_RULES,), on_mismatch="raise")
    assert float(f(ms.shard(jit_params(), JIT_RULES, mesh8))) == float(np.arange(64.0).sum())
    params = ms.shard(jit_params(), P(), mesh8)  # replicated, planned P('data', None) for w
    with pytest.raises(ms.ShardingMismatchError) as e:
        f(params)
    lines = str(e.value).splitlines()
    assert lines[:3] == [
        "1 input leaf is not in the planned sharding (on_mismatch='raise'):",
        "  p:w float32[16, 4]",
        "    problem: is P() on mesh (data=8), but the plan places it P('data', None) on mesh (data=8)",
    ]
    # and in move mode the same call goes through, on the fast path too
    g = ms.shard_jit(lambda p: p["w"].sum(), mesh=mesh8, in_specs=(JIT_RULES,))
    with count_compiles() as n:
        for tree in (ms.shard(jit_params(), JIT_RULES, mesh8), params, params):
            assert float(g(tree)) == float(np.arange(64.0).sum())
    assert n["jit(<lambda>)"] == 1 and g.cache_size == 1


# ---- compiled shardings equal the plan, leaf for leaf ----------------------------------


def test_compiled_input_shardings_equal_the_plan(container, mesh24):
    spec = ms.fsdp("model", min_size=0)
    f = ms.shard_jit(lambda t: t, mesh=mesh24, in_specs=(spec,))
    compiled = f.lower(container).compile()
    planned = ms.plan(container, spec, mesh24)
    got = compiled.input_shardings[0]
    arrays = ms.adapters.split(container).arrays
    assert len(got) == len(planned) == len(arrays)
    for s, leaf, x in zip(got, planned, arrays, strict=True):
        assert s.is_equivalent_to(planned.sharding(leaf.spec), x.ndim), leaf.path
    assert any(leaf.spec != P() for leaf in planned)


def test_lower_takes_abstract_arguments(mesh8):
    abstract = jax.eval_shape(jit_params)
    f = ms.shard_jit(lambda p: p["w"] * 2, mesh=mesh8, in_specs=(JIT_RULES,))
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


def test_decorator_and_wrapping(mesh8):
    @ms.shard_jit(mesh=mesh8, in_specs=(P("data"),))
    def double(x):
        """Doubles."""
        return x * 2

    assert double.__name__ == "double" and double.__doc__ == "Doubles."
    assert double(jnp.arange(8.0)).sharding.spec == P("data")


# ---- shard() places inputs wherever they live -----------------------------------------


@pytest.mark.parametrize("where", ["numpy", "device0", "other-sharding"])
def test_shard_moves_inputs_wherever_they_live(mesh8, where):
    params = jit_params()
    if where == "numpy":
        params = jax.tree_util.tree_map(np.asarray, params)
    elif where == "device0":
        params = committed_to_device0(params)
    else:
        params = sharded_otherwise(params, mesh8)
    out = ms.shard(params, JIT_RULES, mesh8)
    assert out["w"].sharding == NamedSharding(mesh8, P("data", None))
    assert out["b"].sharding == NamedSharding(mesh8, P())
    np.testing.assert_array_equal(out["w"], np.arange(64.0).reshape(16, 4))


def test_warns_once_when_the_same_inputs_are_moved_every_call(mesh8):
    """An input committed in another sharding is copied on every call: say so, once."""

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
