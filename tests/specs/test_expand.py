"""The rule engine: one spec per argument, expanded onto every leaf and validated at once."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS
from modelshard._specs.expand import expand_args

SDS = jax.ShapeDtypeStruct


def specs_by_path(tree, spec, mesh) -> dict[str, P]:
    return {leaf.path: leaf.spec for leaf in ms.plan(tree, spec, mesh)}


def rules_by_path(tree, spec, mesh) -> dict[str, str]:
    return {leaf.path: leaf.rule for leaf in ms.plan(tree, spec, mesh)}


# ---- one spec per argument, on every container kind -----------------------------------


def test_replicated_spec_reaches_every_leaf(container, mesh24):
    p = ms.plan(container, P(), mesh24)
    flat = ms.adapters.split(container)
    assert [leaf.path for leaf in p] == flat.paths
    assert all(leaf.spec == P() for leaf in p)
    assert p.bytes_per_device() == p.total_bytes


def test_fsdp_on_every_kind(container, mesh8):
    p = ms.plan(container, ms.fsdp("data", min_size=0), mesh8)
    for leaf in p:
        if leaf.spec == P():
            assert all(d % 8 for d in leaf.shape) or not leaf.shape, leaf
        else:
            dim = list(leaf.spec).index("data")
            assert leaf.shape[dim] % 8 == 0
            assert leaf.shape[dim] == max(d for d in leaf.shape if d % 8 == 0)


def test_invalid_spec_on_a_container_names_the_leaves(container, mesh24):
    too_long = P(None, None, None, None, "data")
    with pytest.raises(ms.SpecError) as e:
        ms.plan(container, too_long, mesh24)
    arrays = ms.adapters.split(container)
    bad = [p for p, x in zip(arrays.paths, arrays.arrays, strict=True) if x.ndim < 5]
    assert {p.path for p in e.value.problems} == set(bad)
    assert all("spec has 5 entries but the leaf has rank" in p.what for p in e.value.problems)
    assert isinstance(e.value, ValueError)


# ---- Rules --------------------------------------------------------------------------------

TREE = {
    "embed": {"embedding": SDS((64, 16), jnp.float32)},
    "layers": [
        {
            "attn": {"kernel": SDS((16, 16), jnp.float32)},
            "mlp": {"kernel": SDS((16, 32), jnp.float32), "bias": SDS((32,), jnp.float32)},
        },
    ],
    "count": SDS((), jnp.int32),
}


def test_rules_first_match_wins_and_search_semantics(mesh24):
    rules = ms.Rules(
        [
            (r"attn/kernel$", P("model", None)),
            (r"kernel", P(None, "model")),  # re.search: anywhere in the path
            (r"^embed/", P("model", "data")),
            (r".*", P()),
        ]
    )
    got = specs_by_path(TREE, rules, mesh24)
    assert got == {
        "embed/embedding": P("model", "data"),
        "layers/0/attn/kernel": P("model", None),
        "layers/0/mlp/kernel": P(None, "model"),
        "layers/0/mlp/bias": P(),
        "count": P(),
    }
    assert rules_by_path(TREE, rules, mesh24)["layers/0/mlp/kernel"] == "rule 1 'kernel'"
    assert rules_by_path(TREE, rules, mesh24)["count"] == "scalar (replicated)"


def test_scalars_replicate_under_rules_and_count_as_matched(mesh24):
    rules = ms.Rules([(r"count", P("data")), (r".*", P())])
    assert specs_by_path(TREE, rules, mesh24)["count"] == P()


def test_strict_unmatched_and_non_strict(mesh24):
    rules = [(r"kernel$", P(None, "model"))]
    with pytest.raises(ms.SpecError) as e:
        ms.plan(TREE, ms.Rules(rules), mesh24)
    assert [p.path for p in e.value.problems] == ["embed/embedding", "layers/0/mlp/bias"]
    p = ms.plan(TREE, ms.Rules(rules, strict=False), mesh24)
    assert p["layers/0/mlp/bias"].spec == P()
    assert p["layers/0/mlp/bias"].rule == "unmatched (replicated, strict=False)"


def test_unused_rule_is_reported_only_if_unused_everywhere(mesh24):
    rules = ms.Rules([(r"kernel$", P()), (r"embedding$", P()), (r"bias$", P())])
    # Used across the prefix tree as a whole: fine.
    ms.plan({"a": TREE, "b": {"bias": SDS((4,), jnp.float32)}}, {"a": rules, "b": rules}, mesh24)
    with pytest.raises(ms.SpecError) as e:
        ms.plan({"w": SDS((4, 4), jnp.float32)}, ms.Rules([("w$", P()), ("nope", P())]), mesh24)
    assert str(e.value).splitlines() == [
        "1 sharding problem found (every offending leaf is listed; paths are arg:path):",
        "  Rules:rule 1",
        "    problem: rule 1 'nope' matched no leaf",
        "    spec: P()",
        "    mesh: data=2, model=4",
        "    hint: fix the pattern (plan with Rules(..., strict=False) to list every path), "
        "remove the rule, or pass strict=False",
    ]
    ms.plan(
        {"w": SDS((4, 4), jnp.float32)},
        ms.Rules([("w$", P()), ("nope", P())], strict=False),
        mesh24,
    )


# ---- logical names --------------------------------------------------------------------


def test_logical_names_in_rules(mesh24):
    rules = ms.Rules(
        [(r"embedding$", P("vocab", "embed")), (r"kernel$", P("embed", "mlp")), (".*", P())],
        logical={"vocab": "model", "embed": None, "mlp": ("model",)},
    )
    got = specs_by_path(TREE, rules, mesh24)
    assert got["embed/embedding"] == P("model", None)
    assert got["layers/0/mlp/kernel"] == P(None, "model")


def test_linen_metadata_names_mapped_through_logical(mesh24):
    variables = MAKERS["linen"]()
    rules = ms.Rules(
        [(r"bias$|scale$|mean$|var$", P())],
        logical={"embed": "data", "mlp": "model", "layers": None},
    )
    p = ms.plan(variables, rules, mesh24)
    assert p["params/Dense_0/kernel"].spec == P("data", "model")
    assert p["params/Dense_0/kernel"].rule == "metadata (LogicallyPartitioned)"
    assert p["params/ScanLayer_0/Dense_0/kernel"].spec == P(None, "data", "model")
    placed = ms.shard(variables, rules, ms.make_mesh({"data": 2, "model": 4}))
    box = placed["params"]["Dense_0"]["kernel"]
    assert box.names == ("embed", "mlp") and box.value.sharding.spec == P("data", "model")


def test_unmapped_logical_name_is_an_error_not_a_replication(mesh24):
    variables = MAKERS["linen"]()
    with pytest.raises(ms.SpecError) as e:
        ms.plan(
            variables,
            ms.Rules([(r"bias$|scale$|mean$|var$", P())], logical={"embed": "data"}),
            mesh24,
        )
    whats = {(p.path, p.what) for p in e.value.problems}
    assert ("params/Dense_0/kernel", "axis 'mlp' (dimension 1) is not in the mesh") in whats
    assert (
        "params/ScanLayer_0/Dense_0/kernel",
        "axis 'layers' (dimension 0) is not in the mesh",
    ) in whats


def test_nnx_metadata_names(mesh24):
    from flax import nnx

    with nnx.use_eager_sharding(False):
        lin = nnx.Linear(
            16,
            32,
            kernel_init=nnx.with_partitioning(nnx.initializers.ones, ("embed", "mlp")),
            rngs=nnx.Rngs(0),
        )
    p = ms.plan(lin, ms.Rules([("bias", P())], logical={"embed": None, "mlp": "model"}), mesh24)
    assert p["kernel"].spec == P(None, "model")
    assert p["kernel"].rule == "metadata (Param)"


# ---- fsdp ------------------------------------------------------------------------------


def test_fsdp_rules(mesh8):
    tree = {
        "big": SDS((1024, 4096), jnp.float32),
        "tall": SDS((4096, 1000), jnp.float32),
        "odd": SDS((999, 333), jnp.float32),
        "small": SDS((64,), jnp.float32),
        "scalar": SDS((), jnp.float32),
    }
    p = ms.plan(tree, ms.fsdp("data"), mesh8)
    assert p["big"].spec == P(None, "data")
    assert p["tall"].spec == P("data")
    assert p["odd"].spec == P() and "no dimension divisible by 8" in p["odd"].rule
    assert p["small"].spec == P() and "min_size=16384" in p["small"].rule
    assert p["scalar"].spec == P()
    assert ms.plan(tree, ms.fsdp("data", min_size=0), mesh8)["small"].spec == P("data")


def test_fsdp_over_two_axes(mesh24):
    p = ms.plan({"w": SDS((64, 24), jnp.float32)}, ms.fsdp(("data", "model"), min_size=0), mesh24)
    assert p["w"].spec == P(("data", "model"))


def test_fsdp_bad_arguments():
    with pytest.raises(ms.SpecError, match="min_size must be an int >= 0"):
        ms.fsdp("data", min_size=-1)
    with pytest.raises(ms.SpecError, match="axis must be a mesh axis name"):
        ms.fsdp(3)  # type: ignore[arg-type]


# ---- callables and prefix trees -------------------------------------------------------------


def test_callable_spec(mesh24):
    def by_rank(path, leaf):
        return P("data") if leaf.ndim == 2 and leaf.shape[0] % 2 == 0 else P()

    p = ms.plan(TREE, by_rank, mesh24)
    assert p["embed/embedding"].spec == P("data")
    assert p["embed/embedding"].rule == "function by_rank"


def test_callable_that_raises_or_returns_junk(mesh24):
    def boom(path, leaf):
        raise RuntimeError("no idea")

    with pytest.raises(ms.SpecError) as e:
        ms.plan({"w": SDS((4,), jnp.float32)}, boom, mesh24)
    assert e.value.problems[0].what == "spec function boom raised RuntimeError: no idea"
    with pytest.raises(ms.SpecError) as e:
        ms.plan({"w": SDS((4,), jnp.float32)}, lambda p, x: "data", mesh24)
    assert e.value.problems[0].what == "spec function <lambda> returned 'data', not a PartitionSpec"


def test_prefix_tree_on_linen(mesh24):
    variables = MAKERS["linen"]()
    rules = ms.Rules([(r"kernel$", P()), (r"bias$", P()), (r"scale$", P())])
    p = ms.plan(variables, {"params": rules, "batch_stats": P()}, mesh24)
    assert p["batch_stats/BatchNorm_0/mean"].rule == "P() for the whole argument"


def test_prefix_tree_on_optax(mesh8):
    state = MAKERS["optax"]()
    # adamw = chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)
    prefix = (ms.fsdp("data", min_size=0), P(), P())
    p = ms.plan(state, prefix, mesh8)
    assert p["0/mu/embed"].spec == P("data")
    assert p["0/count"].spec == P()


def test_prefix_tree_mismatch_lists_both_sides(mesh24):
    with pytest.raises(ms.SpecError) as e:
        ms.plan(TREE, {"embed": P(), "layer": P(), "count": P()}, mesh24)
    lines = str(e.value).splitlines()
    assert (
        lines[0]
        == "4 sharding problems found (every offending leaf is listed; paths are arg:path):"
    )
    assert lines[1:4] == [
        "  tree:layers/0/attn/kernel float32[16, 16]",
        "    problem: no entry of the prefix tree covers this leaf",
        "    mesh: data=2, model=4",
    ]
    assert lines[4] == (
        "    hint: add its path (or a parent of it) to the spec tree; the container's "
        "top-level keys are 'count', 'embed', 'layers'"
    )
    assert lines[-4:] == [
        "  tree:layer",
        "    problem: this prefix-tree entry matches nothing in the container",
        "    spec: P()",
        "    hint: the container's top-level keys are 'count', 'embed', 'layers'",
    ]


def test_non_spec_objects_are_reported(mesh24):
    for junk in (3, "data", 1.5, [object()]):
        with pytest.raises(ms.SpecError) as e:
            ms.plan({"w": SDS((4,), jnp.float32)}, {"w": junk}, mesh24)
        assert e.value.problems[0].path == "w"
    with pytest.raises(ms.SpecError) as e:
        ms.plan({"w": SDS((4,), jnp.float32)}, None, mesh24)
    assert e.value.problems[0].hint == "use P() to replicate; None is not a spec in modelshard"


# ---- validation messages, line by line ------------------------------------------------------


def error_lines(tree, spec, mesh) -> list[str]:
    with pytest.raises(ms.SpecError) as e:
        ms.plan(tree, spec, mesh)
    return str(e.value).splitlines()


def test_message_unknown_axis(mesh24):
    assert error_lines({"w": SDS((8, 4), jnp.float32)}, ms.Rules([("w", P("batch"))]), mesh24) == [
        "1 sharding problem found (every offending leaf is listed; paths are arg:path):",
        "  tree:w float32[8, 4]",
        "    problem: axis 'batch' (dimension 0) is not in the mesh",
        "    spec: P('batch') (from rule 0 'w')",
        "    mesh: data=2, model=4",
        "    hint: mesh axes are 'data', 'model'; map logical names with "
        "Rules(..., logical={'batch': <mesh axes or None>}) or inside "
        "`with ms.logical_rules({'batch': ...}):`",
    ]


def test_message_repeated_axis(mesh24):
    assert error_lines({"w": SDS((8, 4), jnp.bfloat16)}, P("model", "model"), mesh24)[1:] == [
        "  tree:w bfloat16[8, 4]",
        "    problem: mesh axis 'model' is used twice (dimensions 0 and 1)",
        "    spec: P('model', 'model') (from P('model', 'model') for the whole argument)",
        "    mesh: data=2, model=4",
        "    hint: each mesh axis may shard at most one dimension of a leaf",
    ]


def test_message_not_divisible(mesh24):
    assert error_lines({"w": SDS((6, 4), jnp.float32)}, P(("data", "model")), mesh24)[1:] == [
        "  tree:w float32[6, 4]",
        "    problem: dimension 0 (size 6) is partitioned 8 times (data=2 x model=4), but 6 is "
        "not divisible by 8",
        "    spec: P(('data', 'model')) (from P(('data', 'model')) for the whole argument)",
        "    mesh: data=2, model=4",
        "    hint: shard this dimension over axes whose sizes divide it, pad it, or replicate it "
        "with None",
    ]


def test_message_rank(mesh24):
    assert error_lines({"b": SDS((4,), jnp.int8)}, ms.Rules([("b", P(None, "data"))]), mesh24)[
        1:
    ] == [
        "  tree:b int8[4]",
        "    problem: spec has 2 entries but the leaf has rank 1",
        "    spec: P(None, 'data') (from rule 0 'b')",
        "    mesh: data=2, model=4",
        "    hint: give at most 1 entries for this leaf (a rule with a shorter spec, or P() to "
        "replicate it)",
    ]


def test_message_unmatched(mesh24):
    assert error_lines(
        {"a": SDS((4,), jnp.float32), "b": SDS((4,), jnp.float32)}, ms.Rules([("a", P())]), mesh24
    )[1:] == [
        "  tree:b float32[4]",
        "    problem: no rule matches this leaf",
        "    mesh: data=2, model=4",
        "    hint: add a rule whose pattern matches 'b', a catch-all (r'.*', P()), or use "
        "Rules(..., strict=False) to replicate unmatched leaves",
    ]


def test_several_bad_leaves_across_arguments(mesh24):
    args = [
        (
            "params",
            {"w": SDS((6, 4), jnp.float32), "v": SDS((8, 4), jnp.float32)},
            ms.Rules([("w", P("model", "oops")), ("v", P("model"))]),
        ),
        ("batch", {"x": SDS((3, 5), jnp.float32)}, P("data")),
    ]
    with pytest.raises(ms.SpecError) as e:
        expand_args(args, jax.sharding.AbstractMesh((2, 4), ("data", "model")))
    lines = str(e.value).splitlines()
    assert (
        lines[0]
        == "3 sharding problems found (every offending leaf is listed; paths are arg:path):"
    )
    heads = [line for line in lines[1:] if not line.startswith("    ")]
    assert heads == [
        "  params:w float32[6, 4]",
        "  params:w float32[6, 4]",
        "  batch:x float32[3, 5]",
    ]
    assert [p.what for p in e.value.problems] == [
        "dimension 0 (size 6) is partitioned 4 times (model=4), but 6 is not divisible by 4",
        "axis 'oops' (dimension 1) is not in the mesh",
        "dimension 0 (size 3) is partitioned 2 times (data=2), but 3 is not divisible by 2",
    ]
    assert [p.rule for p in e.value.problems] == [
        "rule 0 'w'",
        "rule 0 'w'",
        "P('data') for the whole argument",
    ]


def test_invalid_rules_construction():
    with pytest.raises(ms.SpecError) as e:
        ms.Rules([("(", P()), ("ok", "data"), "junk", (3, P())])
    assert str(e.value).splitlines() == [
        "invalid Rules:",
        "  Rules:rule 0",
        "    problem: pattern '(' is not a valid regular expression: missing ), unterminated "
        "subpattern at position 0",
        "  Rules:rule 1",
        "    problem: 'data' (str) is not a PartitionSpec",
        "    hint: write P('data', None) (or a tuple such as ('data', None)); P() replicates",
        "  Rules:rule 2",
        "    problem: 'junk' is not a (pattern, spec) pair",
        "    hint: each rule is a 2-tuple like (r'kernel$', P('data'))",
        "  Rules:rule 3",
        "    problem: pattern 3 is not a string",
    ]
    with pytest.raises(ms.SpecError, match="is not a logical name -> mesh axes mapping"):
        ms.Rules([], logical={"embed": 3})
    assert ms.Rules([("k", ("data", None))]).rules == (("k", P("data", None)),)


def test_mesh_that_is_not_a_mesh():
    with pytest.raises(ms.MeshError, match=r"expected a jax\.sharding\.Mesh or AbstractMesh"):
        ms.plan(TREE, P(), "data=8")


def test_rules_repr_is_readable():
    r = ms.Rules([("kernel$", P("data", None))], logical={"embed": "model"})
    assert (
        repr(r) == "Rules([('kernel$', P('data', None))], logical={'embed': 'model'}, strict=True)"
    )


def test_one_rule_set_covers_params_and_their_adamw_moments(mesh24):
    """optax moments repeat the parameter paths, so anchored rules cover both at once."""
    import equinox as eqx
    import optax
    from flax import nnx

    rules = ms.Rules(
        [
            (r"(query|key|value)/kernel$", P(None, "model", None)),
            (r"out/kernel$", P("model", None, None)),
            (r"mlp/kernel$", P(None, "model")),
            (r"embedding$", P("model", None)),
            (r"weight$", P("model", None)),
            (r".*", P()),
        ],
        strict=False,
    )  # one rule set for two models: each leaves some rules unused
    nnx_params = nnx.state(MAKERS["nnx"](), nnx.Param)
    eqx_params = eqx.filter(MAKERS["equinox"](), eqx.is_array)
    for params in (nnx_params, eqx_params):
        opt = optax.adamw(1e-3).init(params)
        p = ms.plan({"params": params, "opt": opt}, rules, mesh24)
        by_path = {leaf.path: leaf.spec for leaf in p}
        param_paths = ms.adapters.split(params).paths
        for path in param_paths:
            assert by_path[f"opt/0/mu/{path}"] == by_path[f"params/{path}"]
            assert by_path[f"opt/0/nu/{path}"] == by_path[f"params/{path}"]
    assert by_path["params/layers/0/weight"] == P("model", None)  # type: ignore[possibly-undefined]


def test_rule_matches_shared_across_layer_indices_stay_exact():
    """Digit-free patterns share searches across ``layers/N``; patterns with digits do not."""
    blind = ms.Rules([(r"/\w\w/kernel$", P("model")), (r"\d/kernel$", P("data")), (".*", P())])
    sighted = ms.Rules([(r"layers/1\d*/kernel$", P("model")), (".*", P())])
    paths = [f"layers/{i}/kernel" for i in (0, 7, 10, 17, 99, 100, 123)]
    for rules in (blind, sighted):
        for path in paths * 2:  # the second pass is answered from the caches
            want = next(i for i, (pat, _) in enumerate(rules.rules) if re.search(pat, path))
            assert rules.match(path)[0] == want, (rules, path)  # type: ignore[index]
    assert blind.match("layers/17/kernel")[0] == 0  # type: ignore[index]
    assert blind.match("layers/7/kernel")[0] == 1  # type: ignore[index]
    assert sighted.match("layers/123/kernel")[0] == 0  # type: ignore[index]
    assert sighted.match("layers/23/kernel")[0] == 1  # type: ignore[index]


# ---- logical rules that place nothing ------------------------------------------------------


def test_logical_rules_that_place_no_leaf_of_an_unboxed_state_say_so():
    """A MaxText-style state (params unboxed, the names gone) under logical rules with
    strict=False was replicated leaf by leaf without a word; the boxed state is not told."""
    nn = pytest.importorskip("flax.linen")

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(16, kernel_init=init)(x)

    boxed = jax.eval_shape(lambda: Mlp().init(jax.random.key(0), jnp.zeros((1, 8))))
    rules = ms.Rules([], logical={"embed": None, "mlp": "model"}, strict=False)
    mesh = ms.make_mesh({"data": 2, "model": 4}, abstract=True)
    with pytest.warns(UserWarning) as caught:
        plan = ms.plan(nn.meta.unbox(boxed), rules, mesh)
    assert [str(w.message) for w in caught] == [
        "tree: logical rules placed none of the dict's 2 array leaves (no leaf carries logical "
        "names and no path rule matches), so every leaf is replicated. An unboxed state "
        "(nn.meta.unbox, MaxText) has lost its names: pass the boxed state, or its names as the "
        "spec (nn.get_partition_spec(boxed_state) inside ms.logical_rules(...)), or add path "
        "rules."
    ]
    assert caught[0].filename == __file__
    assert plan["params/Dense_0/kernel"].spec == P()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ms.plan(boxed, rules, mesh)["params/Dense_0/kernel"].spec == P(None, "model")
        with ms.logical_rules([("embed", None), ("mlp", "model")]):  # the fix the hint gives
            named = ms.plan(nn.meta.unbox(boxed), nn.get_partition_spec(boxed), mesh)
        assert named["params/Dense_0/kernel"].spec == P(None, "model")
