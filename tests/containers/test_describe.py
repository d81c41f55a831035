"""Leaf descriptions: canonical paths per leaf, and the per-structure cache behind plans."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._containers.describe import describe_cached, describe_pytree
from modelshard.adapters import split


def paths(tree) -> list[str]:
    return [i.path for i in describe_cached(tree, jax.tree_util.tree_structure(tree))]


def test_describe_follows_tree_flatten_order():
    tree = {"b": [np.ones(1), (np.ones(2), None)], "a": {"y": np.ones(3), "x": 1.0}}
    got = [i.path for i in describe_pytree(tree)]
    assert got == ["a/x", "a/y", "b/0", "b/1/0"]
    assert len(got) == len(jax.tree_util.tree_leaves(tree))


def test_same_structure_is_described_once():
    tree = {"w": np.ones(2), "layers": [{"k": np.ones(1)}]}
    first = describe_cached(tree, jax.tree_util.tree_structure(tree))
    other = {"w": np.zeros(2), "layers": [{"k": np.zeros(1)}]}  # same structure, new values
    assert describe_cached(other, jax.tree_util.tree_structure(other)) is first


def test_same_shaped_trees_with_other_keys_get_their_own_paths():
    # JAX's structure hash ignores dict keys: these collide, and must not share paths.
    assert paths({"a": np.ones(1), "b": np.ones(1)}) == ["a", "b"]
    assert paths({"c": np.ones(1), "d": np.ones(1)}) == ["c", "d"]
    assert paths({"a": np.ones(1), "b": np.ones(1)}) == ["a", "b"]


@pytest.mark.parametrize(
    "keys", [(1, True), (True, 1), (1, 1.0), ("1", 1), (1, "1")], ids=lambda k: repr(k)
)
def test_equal_keys_of_other_types_never_share_paths(keys):
    # 1, True and 1.0 are equal dict keys, so their structures compare equal; their paths
    # ("1", "True", "1.0") differ, so structures with non-str keys are never cached.
    for key in keys * 2:
        assert paths({key: np.ones(1)}) == [str(key)]
        assert paths([{key: np.ones(1)}]) == [f"0/{key}"]


def test_cache_is_keyed_by_structure_not_object_identity(mesh8):
    tree = {"w": jnp.ones((8, 2)), "b": jnp.ones(2)}
    p1 = ms.plan(tree, P(), mesh8)
    tree2 = {"w": jnp.ones((8, 2)), "b": jnp.ones(2), "extra": jnp.ones(3)}
    p2 = ms.plan(tree2, P(), mesh8)
    assert [leaf.path for leaf in p1] == ["b", "w"]
    assert [leaf.path for leaf in p2] == ["b", "extra", "w"]


def test_box_metadata_is_part_of_the_structure(mesh24):
    nn = pytest.importorskip("flax.linen")
    a = {"w": nn.Partitioned(jnp.ones((4, 8)), names=("data", "model"))}
    b = {"w": nn.Partitioned(jnp.ones((4, 8)), names=("model", None))}
    assert split(a).infos[0].names == ("data", "model")
    assert split(b).infos[0].names == ("model", None)
    assert split(a).infos[0].names == ("data", "model")


def test_planning_leaves_the_garbage_collector_as_it_was(mesh8):
    tree = {"w": jnp.ones((8, 2))}
    assert gc.isenabled()
    ms.plan(tree, P("data"), mesh8)
    assert gc.isenabled()
    with pytest.raises(ms.SpecError):
        ms.plan(tree, P("nope"), mesh8)
    assert gc.isenabled()
    gc.disable()
    try:
        ms.plan(tree, P("data"), mesh8)
        assert not gc.isenabled()
    finally:
        gc.enable()


def _random_tree(rng, depth=0):
    kind = rng.choice(["leaf", "dict", "list", "stack"] if depth < 4 else ["leaf"])
    if kind == "leaf":
        return rng.choice([np.ones(1), np.float32(1), 1.0, None, "s"])
    if kind == "dict":
        keys = rng.sample(["a", "b", "c", "kernel", "bias", "10", "2"], rng.randint(0, 4))
        return {k: _random_tree(rng, depth + 1) for k in keys}
    if kind == "list":
        return [_random_tree(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    # a stack of layers: mostly one structure, sometimes another, sometimes other keys
    layer = _random_tree(rng, depth + 1)
    if not isinstance(layer, dict):
        layer = {"w": layer}
    out = []
    for _ in range(rng.randint(2, 5)):
        pick = rng.random()
        if pick < 0.6:
            out.append(dict(layer))
        elif pick < 0.8:
            out.append({**layer, "extra": np.ones(2)})
        else:
            out.append({1: np.ones(1)} if rng.random() < 0.5 else {True: np.ones(1)})
    return out


def test_paths_agree_with_jax_key_paths_on_random_trees():
    import random

    from modelshard._base.paths import format_path

    rng = random.Random(0)
    for _ in range(300):
        tree = {"root": _random_tree(rng)}
        want = [format_path(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        assert [i.path for i in describe_pytree(tree)] == want
        assert paths(tree) == want
