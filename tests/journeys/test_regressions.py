"""One test per bug the fuzz suite (``tests/journeys/test_fuzz.py``) found, with its exact message.

Each test names the finding in ``docs/reliability.md`` it guards.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms


def test_fsdp_repeated_axis_is_rejected_when_built() -> None:
    """Finding 3: fsdp(('data', 'data')) silently replicated every leaf that was small or
    had no dimension divisible by data*data; only a big divisible leaf raised."""
    with pytest.raises(ms.SpecError) as e:
        ms.fsdp(("data", "data"), min_size=0)
    assert str(e.value).splitlines() == [
        "1 sharding problem found (every offending leaf is listed; paths are arg:path):",
        "  fsdp:axis",
        "    problem: mesh axis 'data' is used twice in ('data', 'data')",
        "    hint: each mesh axis may shard at most one dimension of a leaf",
    ]


def test_fsdp_distinct_axes_still_accepted(mesh24) -> None:
    p = ms.plan({"w": jnp.zeros((16, 3))}, ms.fsdp(("data", "model"), min_size=0), mesh24)
    assert p["w"].spec == P(("data", "model"))


def test_plan_counts_the_dtype_device_put_will_place(mesh8) -> None:
    """Finding 4: without jax_enable_x64, a NumPy float64 leaf is placed as float32, but the
    plan reported float64 and twice the bytes per device."""
    tree = {"w": np.ones((16, 4), np.float64), "i": np.ones(8, np.int64)}
    p = ms.plan(tree, P("data"), mesh8)
    out = ms.shard(tree, P("data"), mesh8)
    assert [p["w"].dtype, p["i"].dtype] == [out["w"].dtype, out["i"].dtype]
    assert [p["w"].dtype, p["i"].dtype] == [np.float32, np.int32]
    assert p.bytes_per_device(p["w"]) == out["w"].addressable_shards[0].data.nbytes == 2 * 4 * 4
    assert p.bytes_per_device(p["i"]) == out["i"].addressable_shards[0].data.nbytes == 4


def test_rules_junk_entry_with_logical_names_is_a_spec_error(mesh8) -> None:
    """Finding 2: a rule spec holding a non-name entry (P(3, None)) crashed the logical-name
    mapping with TypeError: 'int' object is not iterable."""
    rules = ms.Rules([("w", P(3, None))], logical={"embed": "data"})
    with pytest.raises(ms.SpecError) as e:
        ms.plan({"w": jnp.zeros((8, 4))}, rules, mesh8)
    assert str(e.value).splitlines()[1:] == [
        "  tree:w float32[8, 4]",
        "    problem: entry 0 is 3, not a mesh axis name, tuple of names or None",
        "    spec: P(3, None) (from rule 0 'w')",
        "    mesh: data=8",
        "    hint: spec entries are mesh axis names such as 'data', tuples of them, or None",
    ]


def test_strict_rules_that_match_nothing_are_reported_with_the_leaves(mesh8) -> None:
    """Finding 1: when no leaf matched any rule, only the leaves were reported; the rule
    that should have matched ('kernal$', a typo) was not listed as unused."""
    with pytest.raises(ms.SpecError) as e:
        ms.plan({"kernel": jnp.zeros(8)}, ms.Rules([("kernal$", P("data"))]), mesh8)
    assert [(p.arg, p.path) for p in e.value.problems] == [("tree", "kernel"), ("Rules", "rule 0")]
    assert "    problem: rule 0 'kernal$' matched no leaf" in str(e.value).splitlines()


@pytest.mark.parametrize("kind", ["unreduced", "reduced"])
def test_unreduced_or_reduced_specs_are_a_spec_error(kind: str, mesh24) -> None:
    """Finding 5: a PartitionSpec with unreduced=/reduced= axes made every step that iterates
    a spec raise JAX's ValueError ("Using *pspec is dangerous ..."), from plan, from Rules
    with logical names and from formatting the error itself."""
    spec = P("data", **{kind: {"model"}})
    tree = {"w": jnp.zeros((8, 4))}
    for spec_like in (spec, ms.Rules([("w", spec)], logical={"embed": "data"}), lambda p, x: spec):
        with pytest.raises(ms.SpecError) as e:
            ms.shard(tree, spec_like, mesh24)
        lines = str(e.value).splitlines()
        assert lines[1:3] == [
            "  tree:w float32[8, 4]",
            "    problem: the spec marks mesh axes 'model' unreduced or reduced, which placing "
            "arrays does not support",
        ]
        assert lines[3].startswith(f"    spec: P('data', {kind}={{'model'}}")


@pytest.mark.parametrize(
    ("leaf", "what"),
    [
        (np.array(["a", "b"] * 4), "dtype <U1 cannot be placed on devices"),
        (np.array([None] * 8, dtype=object), "dtype object cannot be placed on devices"),
        (np.arange(8).astype("datetime64[s]"), "dtype datetime64[s] cannot be placed on devices"),
        (np.ones(8, np.longdouble), f"dtype {np.dtype(np.longdouble)} cannot be placed on devices"),
        (
            np.ma.array(np.arange(8.0), mask=[0, 1] * 4),
            "a NumPy masked array cannot be placed on devices",
        ),
        (np.str_("x"), "dtype <U1 cannot be placed on devices"),
    ],
)
def test_numpy_leaves_jax_cannot_hold_are_a_spec_error(leaf, what: str, mesh8) -> None:
    """Finding 6: NumPy leaves JAX refuses (str/object/datetime/float128 dtypes, masked
    arrays) were planned as fine, then shard raised JAX's TypeError/ValueError naming no
    leaf."""
    tree = {"ok": np.ones(8, np.float32), "bad": leaf}
    for call in (ms.plan, ms.shard):
        with pytest.raises(ms.SpecError) as e:
            call(tree, P(), mesh8)
        assert [(p.arg, p.path) for p in e.value.problems] == [("tree", "bad")]
        assert str(e.value).splitlines()[2] == f"    problem: {what}"
