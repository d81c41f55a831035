"""Python values among a state's leaves (``_checkpoint/values.py``): saved in the record and
restored with their types in every container kind, or refused by name; code is neither.

The property test draws random trees of Python scalars, strings, bytes, NumPy scalars, None
and empty containers, inside dicts, linen-style variable dicts, Equinox and NNX modules, and
checks every leaf comes back (value and type) with and without ``like``, or that save
refuses exactly the objects it cannot hold; a reshard and a manager step keep them too."""

from __future__ import annotations

import json
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import modelshard as ms
from helpers import assert_every_leaf_restored


class _Opaque:
    """An object no checkpoint can hold: save must refuse it, naming its path."""

    def __repr__(self) -> str:
        return "_Opaque()"


class _Holder(eqx.Module):
    w: jax.Array
    tree: Any
    act: Any = jax.nn.gelu  # code among the leaves: kept from like, never saved


NUMPY_SCALARS = st.one_of(
    st.floats(width=32, allow_nan=True).map(np.float32),
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.integers(0, 255).map(np.uint8),
    st.booleans().map(np.bool_),
)
SCALARS = st.one_of(
    st.booleans(),
    st.integers(),
    st.integers(-(2**200), 2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.none(),
    NUMPY_SCALARS,
)
EMPTIES = st.sampled_from([{}, [], ()])
KEYS = st.sampled_from(["a", "b", "epoch", "name", "0", "ü"])
TREES = st.recursive(
    st.one_of(SCALARS, EMPTIES),
    lambda kids: st.one_of(
        st.dictionaries(KEYS, kids, max_size=3), st.lists(kids, max_size=3).map(tuple)
    ),
    max_leaves=8,
)


def _scalars(tree: Any) -> list[Any]:
    """The non-container leaves of a generated tree, None included, in order."""
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in _scalars(tree[k])]
    if isinstance(tree, tuple | list):
        return [x for v in tree for x in _scalars(v)]
    return [tree]


def _container(kind: str, tree: Any) -> Any:
    w = jnp.arange(3.0)
    if kind == "pytree":
        return {"w": w, "t": tree}
    if kind == "linen":
        return {"params": {"dense": {"kernel": w}}, "state": {"t": tree}}
    if kind == "equinox":
        return _Holder(w, tree)
    model = nnx.Module()
    model.w = nnx.Param(w)  # pyright: ignore[reportAttributeAccessIssue]
    for i, x in enumerate(_scalars(tree)):
        setattr(model, f"v{i}", nnx.Variable(x))  # an NNX Variable holding a Python value
    return model


PROPERTY = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@PROPERTY
@given(tree=TREES, kind=st.sampled_from(["pytree", "linen", "equinox", "nnx"]))
def test_every_value_comes_back_with_its_type(tmp_path_factory, tree, kind):
    state = _container(kind, tree)
    path = ms.save(tmp_path_factory.mktemp("v") / "c", state)
    assert_every_leaf_restored(state, ms.restore(path, like=state), "like")
    assert_every_leaf_restored(state, ms.restore(path), "no like")


@PROPERTY
@given(tree=TREES, where=st.lists(KEYS, min_size=1, max_size=3, unique=True))
def test_objects_among_the_values_are_refused_by_name(tmp_path_factory, tree, where):
    """Opaque objects put at random places: save refuses naming each of them (and no
    other leaf), and writes nothing."""
    state = {"w": jnp.ones(2), "t": tree, **{f"odd_{k}": _Opaque() for k in where}}
    target = tmp_path_factory.mktemp("v") / "c"
    with pytest.raises(ms.CheckpointError) as e:
        ms.save(target, state)
    named = [line for line in str(e.value).splitlines() if line.startswith("  ")]
    assert named == [f"  odd_{k}: a {__name__}._Opaque" for k in sorted(where)]
    assert not target.exists()


def test_a_reshard_carries_the_values(tmp_path, mesh8):
    state = {"w": jnp.arange(8.0), "epoch": 12, "run": "r1", "lr": 3e-4, "none": None}
    src = ms.save(tmp_path / "src", state)
    dst = ms.reshard(src, tmp_path / "dst", mesh=mesh8)
    assert_every_leaf_restored(state, ms.restore(dst))
    record = json.loads((dst / "modelshard.json").read_text())
    assert [v["path"] for v in record["values"]] == ["epoch", "lr", "run", "none"]


def test_a_manager_step_keeps_the_values(tmp_path):
    state = {"w": jnp.arange(4.0), "epoch": 2, "name": "run1", "best": -math.inf}
    with ms.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(2, state)
        mgr.wait_until_finished()
        assert_every_leaf_restored(state, mgr.restore(2))
        assert_every_leaf_restored(state, mgr.restore(2, like={**state, "epoch": 0}))


def test_code_and_optax_states_save_without_refusal(tmp_path):
    """An Equinox MLP's activations are leaves, and code: saved without them, restored
    from like; an optax state with injected hyperparameters is all arrays."""
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.1).init({"w": jnp.ones(3)})
    state = {"mlp": mlp, "opt": opt, "step": 5}
    path = ms.save(tmp_path / "c", state)
    assert [v["path"] for v in json.loads((path / "modelshard.json").read_text())["values"]] == [
        "step"
    ]
    back = ms.restore(path, like=state)
    assert back["mlp"].activation is mlp.activation
    assert_every_leaf_restored(state, back)


def test_nones_come_back_without_like(tmp_path):
    """JAX flattens None to no leaf: it was lost by a restore without like (Orbax keeps it),
    and is a match, not an extra leaf, for a like holding it."""
    state = {"w": jnp.ones(2), "sched": None, "sub": {"z": None, "k": 1}}
    ms.save(tmp_path / "c", state)
    back = ms.restore(tmp_path / "c")
    assert back["sched"] is None and back["sub"] == {"z": None, "k": 1}
    out = ms.restore(tmp_path / "c", like=state)
    assert out["sched"] is None and out["sub"] == {"z": None, "k": 1}
