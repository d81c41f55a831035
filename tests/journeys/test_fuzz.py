"""Fuzzing the one pipeline (``expand_args`` -> ``plan`` -> ``shard``) against its own oracle.

Random containers (nested dicts/lists/tuples, NamedTuples, Equinox modules, NNX states; ranks
0-4; sizes with 0 and primes; many dtypes; NumPy, committed, resharded and abstract leaves),
random meshes (1-3 axes, Auto and Explicit) and random specs, valid and invalid. The oracle
in ``tests/journeys/strategies.py`` decides validity on its own; then:

- a valid case places every array leaf exactly as ``jax.device_put(leaf, NamedSharding(mesh,
  spec))`` does (sharding, values, dtype, bytes per device), leaves static leaves alone and
  does not touch the input;
- an invalid case raises ``SpecError`` naming exactly the offending leaves (and unused rules);
- nothing else ever escapes.

Profiles: ``MODELSHARD_FUZZ_EXAMPLES`` (default 60) examples per default test; the ``slow``
test (``pytest -m slow tests/journeys/test_fuzz.py``) runs ``MODELSHARD_FUZZ_SLOW_EXAMPLES`` (default
10,000).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._specs.expand import expand_args
from strategies import (
    Container,
    Leaf,
    build,
    containers,
    expect,
    mesh_of,
    meshes,
    reach,
    sizes_of,
    spec_recipes,
)

FUZZ_EXAMPLES = int(os.environ.get("MODELSHARD_FUZZ_EXAMPLES", "60"))
SLOW_EXAMPLES = int(os.environ.get("MODELSHARD_FUZZ_SLOW_EXAMPLES", "10000"))

_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.filter_too_much,
    ],
}
# CI gates on a repeatable sample (set MODELSHARD_FUZZ_RANDOM=1 to draw fresh ones); the
# slow profile explores with fresh random draws every run.
DEFAULT = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=not os.environ.get("MODELSHARD_FUZZ_RANDOM"),
    database=None,
    **_COMMON,
)
SLOW = settings(max_examples=SLOW_EXAMPLES, **_COMMON)


def _bytes(x: Any) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def _abstract(mesh: Any) -> Any:
    return ms.make_mesh(sizes_of(mesh), axis_types=list(mesh.axis_types), abstract=True)


def _problems(e: ms.SpecError) -> set[tuple[str, str]]:
    return {(p.arg, p.path) for p in e.problems}


def check(mesh: Any, c: Container, recipe: tuple[Any, ...]) -> None:
    """Run one case through plan and shard and hold it to the oracle's verdict."""
    v = expect(recipe, c, sizes_of(mesh))
    try:
        spec = build(recipe)
    except ms.SpecError:
        event("outcome: rejected when built")
        assert v.build_fails, f"building {recipe!r} raised but the oracle accepts it"
        return
    assert not v.build_fails, f"building {recipe!r} should have raised SpecError"
    try:
        p = ms.plan(c.tree, spec, mesh)
    except ms.SpecError as e:
        event("outcome: SpecError")
        assert v.bad, f"plan raised but the oracle accepts every leaf:\n{e}"
        assert _problems(e) == v.bad, f"named {_problems(e)}, oracle says {v.bad}:\n{e}"
        with pytest.raises(ms.SpecError) as again:
            ms.shard(c.tree, spec, mesh)
        assert _problems(again.value) == v.bad
        with pytest.raises(ms.SpecError) as abstract:
            ms.plan(c.tree, spec, _abstract(mesh))
        assert _problems(abstract.value) == v.bad
        return
    assert not v.bad, f"plan accepted a case the oracle rejects at {v.bad}"
    planned = {leaf.path: leaf for leaf in p}
    assert set(planned) == set(v.specs)
    for path, leaf in planned.items():
        want = NamedSharding(mesh, P(*v.specs[path]))
        assert p.sharding(leaf.spec).is_equivalent_to(want, len(leaf.shape)), (path, leaf.spec)
    # The plan renders, and its container mirrors hold each leaf's spec at the leaf's place.
    assert len(p.rows()) == len(planned) and str(p) and p.summary()
    specs, shardings = p.specs, p.shardings
    for leaf in c.arrays:
        assert reach(specs, leaf.access) == planned[leaf.path].spec, leaf.path
        assert reach(shardings, leaf.access) == p.sharding(planned[leaf.path].spec), leaf.path
    # Planning needs no devices: an abstract mesh of the same shape plans the same.
    assert [(x.path, x.spec) for x in ms.plan(c.tree, spec, _abstract(mesh))] == [
        (x.path, x.spec) for x in p
    ]

    out = ms.shard(c.tree, spec, mesh)
    event(f"outcome: placed ({'no' if not planned else 'some'} array leaves)")
    for leaf in c.values:
        assert reach(c.tree, leaf.access) is leaf.value, f"input leaf {leaf.path} was replaced"
        got = reach(out, leaf.access)
        if not leaf.is_array:
            assert got is leaf.value, f"static leaf {leaf.path} changed"
            continue
        sharding = NamedSharding(mesh, P(*v.specs[leaf.path]))
        ndim = len(leaf.shape)
        if isinstance(leaf.value, jax.ShapeDtypeStruct):
            assert isinstance(got, jax.ShapeDtypeStruct)
            assert got.shape == leaf.value.shape and got.dtype == leaf.value.dtype
            assert got.sharding.is_equivalent_to(sharding, ndim)
            continue
        want = jax.device_put(leaf.value, sharding)
        assert isinstance(got, jax.Array), (leaf.path, type(got))
        assert got.shape == want.shape and got.dtype == want.dtype, leaf.path
        assert got.sharding.is_equivalent_to(want.sharding, ndim), (leaf.path, got.sharding)
        assert _bytes(got) == _bytes(want), f"values of {leaf.path} changed"
        shard_bytes = got.addressable_shards[0].data.nbytes
        assert p.bytes_per_device(planned[leaf.path]) == shard_bytes, leaf.path


@st.composite
def cases(draw: st.DrawFn) -> tuple[Any, Container, tuple[Any, ...]]:
    mesh = draw(meshes())
    c = draw(containers())
    return mesh, c, draw(spec_recipes(c, mesh))


@DEFAULT
@given(cases())
def test_fuzz_plan_and_shard(case: tuple[Any, Container, tuple[Any, ...]]) -> None:
    check(*case)


@DEFAULT
@given(meshes(), st.lists(containers(), min_size=2, max_size=3), st.data())
def test_fuzz_expand_args_reports_every_argument(
    mesh: Any, trees: list[Container], data: st.DataObject
) -> None:
    """Several arguments at once: one SpecError naming the offenders of every argument."""
    sizes = sizes_of(mesh)
    recipes = [data.draw(spec_recipes(c, mesh)) for c in trees]
    verdicts = [
        expect(r, c, sizes, arg=f"x{i}")
        for i, (r, c) in enumerate(zip(recipes, trees, strict=True))
    ]
    if any(v.build_fails for v in verdicts):
        return
    args = [
        (f"x{i}", c.tree, build(r)) for i, (c, r) in enumerate(zip(trees, recipes, strict=True))
    ]
    bad = set().union(*(v.bad for v in verdicts))
    try:
        plans = expand_args(args, mesh)
    except ms.SpecError as e:
        assert _problems(e) == bad, f"named {_problems(e)}, oracle says {bad}:\n{e}"
        return
    assert not bad, f"expand_args accepted a case the oracle rejects at {bad}"
    for arg, v in zip(plans, verdicts, strict=True):
        assert {leaf.path: leaf.spec for leaf in arg.leaves}.keys() == v.specs.keys()
        for leaf in arg.leaves:
            want = NamedSharding(mesh, P(*v.specs[leaf.path]))
            assert NamedSharding(mesh, leaf.spec).is_equivalent_to(want, len(leaf.shape))


@pytest.mark.slow
@SLOW
@given(cases())
def test_fuzz_plan_and_shard_slow(case: tuple[Any, Container, tuple[Any, ...]]) -> None:
    check(*case)


@pytest.mark.parametrize("catch_all", [".*", "$", "^"])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_unused_catch_all_of_strict_rules_is_a_fallback(catch_all: str, axis_type: str) -> None:
    """A strict `Rules` whose earlier rules take every leaf leaves its catch-all unused:
    the engine accepts that (docs/concepts/validation.md), and so must the oracle. The slow
    profile once drew exactly this case and the oracle called it an error."""
    mesh = mesh_of(("data",), (len(jax.devices()),), axis_type)
    value = np.arange(16, dtype=np.float32).reshape(8, 2)
    c = Container({"w": value}, [Leaf((("item", "w"),), value)])
    recipe = ("rules", (("^w$", ("data",), False), (catch_all, (), False)), None, True)
    assert not expect(recipe, c, sizes_of(mesh)).bad

    @settings(max_examples=1, database=None, deadline=None)
    @given(st.just(recipe))
    def run(recipe: tuple[Any, ...]) -> None:  # `check` records hypothesis events
        check(mesh, c, recipe)

    run()
