"""Argument layout (``_place/arguments.py``): keywords, defaults and dict ``in_specs``, arguments
without a spec, and the errors for bad ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import JIT_RULES, jit_params

# ---- arguments: kwargs, dict specs, missing specs --------------------------------------


def test_dict_in_specs_resolve_keywords_and_defaults(mesh24):
    def step(params, batch, lr=0.5):
        return jax.tree_util.tree_map(lambda p: p - lr * batch.mean(), params)

    sj = ms.shard_jit(step, mesh=mesh24, in_specs={"params": JIT_RULES, "batch": P("data")})
    a = sj(jit_params(), jnp.ones((4, 2)))
    b = sj(batch=jnp.ones((4, 2)), params=jit_params())
    c = sj(jit_params(), batch=jnp.ones((4, 2)), lr=0.5)
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
    with pytest.raises(TypeError, match=r"shard_jit needs a callable, got 3 \(int\)"):
        ms.shard_jit(3, mesh=mesh8, in_specs=())  # type: ignore[arg-type]
    with pytest.raises(ms.SpecError, match=r"in_specs must be a tuple .* got str"):
        ms.shard_jit(lambda a: a, mesh=mesh8, in_specs="a")  # type: ignore[arg-type]
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
