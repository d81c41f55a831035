"""Logical rules: Flax's ordered list (repeats, fallback), the mapping form, rules files,
NNX ``sharding_rules`` metadata, and the ``logical_rules`` context; checked against Flax."""

from __future__ import annotations

import random
import threading
import tomllib
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._specs.rulesfile import parse_rules

SDS = jax.ShapeDtypeStruct
DATA = Path(__file__).parent / "data" / "maxtext_logical_axis_rules.yml"


def maxtext() -> tuple[list[str], list[list]]:
    """MaxText's mesh axes and logical_axis_rules (configs/base.yml of maxtext 0.2.5)."""
    d = yaml.safe_load(DATA.read_text())
    return d["mesh_axes"], d["logical_axis_rules"]


def maxtext_mesh(axis_type: str = "auto"):
    axes, _ = maxtext()
    sizes = dict.fromkeys(axes, 1) | {"fsdp": 2, "fsdp_transpose": 2, "tensor": 2}
    return ms.make_mesh(sizes, axis_types=axis_type)


def specs_of(tree, spec, mesh) -> dict[str, P]:
    return {leaf.path: leaf.spec for leaf in ms.plan(tree, spec, mesh)}


def boxed(cases: list[tuple]) -> dict:
    """One linen LogicallyPartitioned leaf per case of logical names (each dim 8)."""
    return {
        f"l{i}": nn.LogicallyPartitioned(SDS((8,) * len(names), jnp.float32), names)
        for i, names in enumerate(cases)
    }


def flax_specs(tree: dict, mesh, rules) -> dict[str, P]:
    got = nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)
    return {k: v.spec for k, v in got.items()}


def test_maxtext_rule_list_matches_flax(axis_type):
    _, rules = maxtext()
    mesh = maxtext_mesh(axis_type)
    names = list(dict.fromkeys(n for n, _ in rules))
    rng = random.Random(0)
    cases = [(n,) for n in names] + [
        tuple(rng.sample(names, k)) + ((None,) if k == 3 else ())
        for k in (2, 3, 4)
        for _ in range(120)
    ]
    tree = boxed(cases)
    ours = specs_of(tree, ms.Rules([], logical=rules, strict=False), mesh)
    assert ours == flax_specs(tree, mesh, rules)
    # The repeats matter: dict(rules) keeps the last 'embed' entry, Flax the first free one.
    assert ours["l" + str(names.index("embed"))] == P(
        ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")
    )
    assert dict(rules)["embed"] == ["fsdp", "context", "context_usp_ulysses", "expert"]


def test_maxtext_rules_file_matches_flax():
    _, rules = maxtext()
    mesh = maxtext_mesh()
    r = ms.Rules([(r"w$", P("embed", "mlp")), (r"e$", P("vocab", "embed"))], logical=rules)
    loaded = parse_rules(tomllib.loads(r.to_toml()))
    assert loaded.logical == r.logical
    tree = {"w": SDS((16, 32), jnp.float32), "e": SDS((64, 16), jnp.float32)}
    want = {
        k: nn.logical_to_mesh_axes(n, rules)
        for k, n in {"w": ("embed", "mlp"), "e": ("vocab", "embed")}.items()
    }
    assert specs_of(tree, loaded, mesh) == want == specs_of(tree, r, mesh)
    assert want["w"] == P(
        ("fsdp", "context", "context_usp_ulysses", "expert"),
        ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"),
    )


def test_flax_docstring_example_and_fallback(mesh24):
    rules = [("batch", "data"), ("features", "data"), ("heads", "model"), ("batch", "model")]
    names = ("batch", "length", "heads", "features")
    want = nn.logical_to_mesh_axes(names, rules)
    assert want == P("data", None, "model", None)
    tree = {"x": SDS((8, 3, 4, 6), jnp.float32)}
    # A name in no rule is an error here, where Flax silently replicates it.
    with pytest.raises(ms.SpecError, match="'length' is not a logical name of Rules"):
        ms.plan(tree, ms.Rules([("x", P(*names))], logical=rules), mesh24)
    rules.append(("length", None))
    assert nn.logical_to_mesh_axes(names, rules) == want
    assert specs_of(tree, ms.Rules([("x", P(*names))], logical=rules), mesh24) == {"x": want}
    # 'heads' is absent, so 'features' is blocked by 'batch' and nothing else is tried.
    names = ("batch", "features")
    assert specs_of(
        {"x": SDS((8, 8), jnp.float32)}, ms.Rules([("x", P(*names))], logical=rules), mesh24
    ) == {"x": nn.logical_to_mesh_axes(names, rules)}


def test_literal_mesh_axis_takes_its_axis_first(mesh24):
    rules = ms.Rules([("x", P("embed", "model"))], logical=[("embed", "model"), ("embed", "data")])
    assert specs_of({"x": SDS((8, 8), jnp.float32)}, rules, mesh24) == {"x": P("data", "model")}


def test_tuple_entries_resolve_each_name(mesh24):
    rules = ms.Rules(
        [("x", P(("batch", "seq"), None))], logical=[("batch", "data"), ("seq", "model")]
    )
    assert specs_of({"x": SDS((8, 8), jnp.float32)}, rules, mesh24) == {
        "x": P(("data", "model"), None)
    }


def test_mapping_form_keeps_conflicts_an_error(mesh24):
    rules = ms.Rules([("x", P("embed", "mlp"))], logical={"embed": "model", "mlp": "model"})
    with pytest.raises(ms.SpecError, match="mesh axis 'model' is used twice"):
        ms.plan({"x": SDS((8, 8), jnp.float32)}, rules, mesh24)
    # the same pairs as Flax's list: the second name finds its axis taken and replicates
    rules = ms.Rules([("x", P("embed", "mlp"))], logical=[("embed", "model"), ("mlp", "model")])
    assert specs_of({"x": SDS((8, 8), jnp.float32)}, rules, mesh24) == {"x": P("model", None)}


def test_name_twice_in_one_spec_is_an_error(mesh24):
    rules = ms.Rules([("x", P("embed", "embed"))], logical=[("embed", "model")])
    with pytest.raises(ms.SpecError) as e:
        ms.plan({"x": SDS((8, 8), jnp.float32)}, rules, mesh24)
    lines = str(e.value).splitlines()
    assert lines[2] == (
        "    problem: logical name 'embed' names dimensions 0 and 1; Flax-style logical "
        "rules map each name to one dimension"
    )
    assert lines[-1] == "    hint: give each dimension its own logical name"
    with pytest.raises(ValueError, match="occur more than once"):  # Flax refuses it too
        nn.logical_to_mesh_axes(("embed", "embed"), [("embed", "model")])


def test_invalid_logical_lists_every_entry():
    with pytest.raises(ms.SpecError) as e:
        ms.Rules([], logical=[("embed", "model"), ("mlp",), ("x", 3), (4, "data")])
    assert str(e.value).splitlines() == [
        "invalid Rules:",
        "  Rules:logical[1]",
        "    problem: ('mlp',) is not a (logical name, mesh axes) pair",
        "    hint: each entry is a pair like ('embed', 'model') or ('batch', ('data', 'fsdp'))",
        "  Rules:logical[2]",
        "    problem: 'x' -> 3 is not a logical name -> mesh axes mapping",
        "    hint: map to a mesh axis name, a list of names, or None (replicate)",
        "  Rules:logical[3]",
        "    problem: 4 -> 'data' is not a logical name -> mesh axes mapping",
        "    hint: map to a mesh axis name, a list of names, or None (replicate)",
    ]
    with pytest.raises(ms.SpecError, match="logical must be a mapping of logical name"):
        ms.Rules([], logical="embed")


def test_repr_and_public_form():
    r = ms.Rules([("k", P("embed"))], logical=[("embed", ["fsdp", "tensor"]), ("embed", [])])
    assert r.logical == (("embed", ("fsdp", "tensor")), ("embed", None))
    assert repr(r) == (
        "Rules([('k', P('embed'))], logical=(('embed', ('fsdp', 'tensor')), "
        "('embed', None)), strict=True)"
    )


def test_rules_file_list_form_and_errors():
    text = """
logical = [["embed", ["data", "model"]], ["embed", "data"], ["norm", []], ["x", "none"]]
[[rules]]
pattern = "k$"
spec = ["embed"]
"""
    r = parse_rules(tomllib.loads(text))
    assert r.logical == (
        ("embed", ("data", "model")),
        ("embed", "data"),
        ("norm", None),
        ("x", None),
    )
    assert parse_rules(tomllib.loads(r.to_toml())).logical == r.logical
    bad = 'logical = [["embed"], ["mlp", 3], "x"]'
    with pytest.raises(ms.SpecError) as e:
        parse_rules(tomllib.loads(bad), "r.toml")
    assert str(e.value).splitlines() == [
        "invalid rules file r.toml:",
        "  r.toml:logical[0]",
        "    problem: ['embed'] is not a [logical name, mesh axes] pair",
        '    hint: write ["embed", ["fsdp", "tensor"]], ["embed", "fsdp"] or ["norm", []]',
        "  r.toml:logical[1][1]",
        "    problem: 3 is not an axis name, a list of axis names, or 'none'",
        '    hint: write "data", ["data", "model"] or "none" (TOML has no null)',
        "  r.toml:logical[2]",
        "    problem: 'x' is not a [logical name, mesh axes] pair",
        '    hint: write ["embed", ["fsdp", "tensor"]], ["embed", "fsdp"] or ["norm", []]',
    ]
    with pytest.raises(ms.SpecError, match="logical must be a table of name = axis"):
        parse_rules({"logical": 3})


# ---- NNX sharding_rules metadata ---------------------------------------------------------


class Local(nnx.Module):
    def __init__(self):
        kw = {"eager_sharding": False}
        self.w = nnx.Param(
            jnp.ones((8, 16)),
            out_sharding=("embed", "mlp"),
            sharding_rules=(("embed", "data"), ("mlp", "model")),
            **kw,
        )
        self.u = nnx.Param(
            jnp.ones((16, 8)),
            out_sharding=("mlp", "embed"),
            sharding_rules=(("mlp", "model"),),
            **kw,
        )
        self.b = nnx.Param(jnp.ones((16,)), out_sharding=("mlp",), **kw)


def test_nnx_sharding_rules_metadata_as_flax(mesh24):
    state = nnx.state(Local())
    flax = {k: v.get_value() for k, v in nnx.get_partition_spec(state).items()}
    # Flax leaves names its rules do not map as they are; modelshard maps them through
    # the plan's logical rules (here 'embed' of u, and b's 'mlp').
    logical = ms.Rules([], logical={"embed": None, "mlp": "model"}, strict=False)
    ours = specs_of(state, logical, mesh24)
    assert ours["w"] == flax["w"] == P("data", "model")
    assert ours["u"] == P("model", None) and flax["u"] == P("model", "embed")
    with nn.logical_axis_rules((("embed", "data"), ("mlp", "model"))):
        flax = {k: v.get_value() for k, v in nnx.get_partition_spec(state).items()}
        assert specs_of(state, ms.Rules([], strict=False), mesh24) == flax
    assert flax["u"] == P("model", "data")


# ---- the logical_rules context (issue 20) ------------------------------------------------

X = jnp.arange(64.0).reshape(8, 8)
BATCH_EMBED = P("batch", "embed")
RULES = {"batch": "data", "embed": "model"}


def spec_of(x) -> P:
    return x.sharding.spec


def test_context_every_entry_point(mesh24):
    tree = {"h": X}
    with ms.logical_rules(RULES):
        assert ms.plan(tree, BATCH_EMBED, mesh24)["h"].spec == P("data", "model")
        assert spec_of(ms.shard(tree, BATCH_EMBED, mesh24)["h"]) == P("data", "model")
        with jax.set_mesh(mesh24):  # Explicit meshes need it around jax.jit
            constrained = jax.jit(lambda t: ms.constrain(t, BATCH_EMBED))(tree)
        assert spec_of(constrained["h"]) == P("data", "model")
        jitted = ms.shard_jit(lambda t: t["h"] * 2, mesh=mesh24, in_specs=(BATCH_EMBED,))
        assert jitted.plan(tree)["h"].spec == P("data", "model")
        np.testing.assert_array_equal(np.asarray(jitted(tree)), np.asarray(X) * 2)
        mapped = ms.shard_map(
            lambda t: t["h"] * 2, mesh=mesh24, in_specs=(BATCH_EMBED,), out_specs=BATCH_EMBED
        )
        assert spec_of(mapped(tree)) == P("data", "model")
    # outside the context, the names mean nothing: model code's constrain does nothing
    # (as Flax's nn.with_logical_constraint), and everywhere else the same clear error
    assert ms.constrain(tree, BATCH_EMBED, mesh24)["h"] is X
    for call in (
        lambda: ms.plan(tree, BATCH_EMBED, mesh24),
        lambda: ms.shard(tree, BATCH_EMBED, mesh24),
        lambda: ms.constrain(tree, BATCH_EMBED, mesh24, strict=True),
        lambda: jitted(tree),
        lambda: mapped(tree),
    ):
        with pytest.raises(ms.SpecError, match="axis 'batch' \\(dimension 0\\) is not in the mesh"):
            call()


def test_model_code_constrains_inside_shard_jit_trace(mesh24, count_compiles):
    def model(params, x):  # names no mesh axis
        h = ms.constrain(x @ params["w"], BATCH_EMBED)
        return h.sum()

    step = ms.shard_jit(model, mesh=mesh24, in_specs=(P(), P("data")))
    params = {"w": jnp.ones((8, 8))}
    with count_compiles() as n:
        with ms.logical_rules(RULES):
            assert float(step(params, X)) == float((X @ params["w"]).sum())
            step(params, X)
        with ms.logical_rules({"batch": "model", "embed": "data"}):  # new rules: traced again
            assert float(step(params, X)) == float((X @ params["w"]).sum())
    assert n["jit(model)"] == step.cache_size == 2
    # no rules: the model's constraint does nothing (as Flax's), unless constraints are strict
    assert float(step(params, X)) == float((X @ params["w"]).sum())
    step.clear_cache()  # strictness is read while tracing
    with ms.strict_constraints(), pytest.raises(ms.SpecError, match="axis 'batch'"):
        step(params, X)


def test_explicit_logical_wins_and_nesting(mesh24):
    tree = {"h": X}
    explicit = ms.Rules([("h", BATCH_EMBED)], logical={"batch": "model", "embed": None})
    with ms.logical_rules(RULES):
        assert ms.plan(tree, explicit, mesh24)["h"].spec == P("model", None)
        assert ms.plan(tree, ms.Rules([("h", BATCH_EMBED)]), mesh24)["h"].spec == P("data", "model")
        with ms.logical_rules([("batch", ("data", "model")), ("embed", None)]):
            assert ms.plan(tree, BATCH_EMBED, mesh24)["h"].spec == P(("data", "model"), None)
            with ms.logical_rules(None), pytest.raises(ms.SpecError):
                ms.plan(tree, BATCH_EMBED, mesh24)
        assert ms.plan(tree, BATCH_EMBED, mesh24)["h"].spec == P("data", "model")
    with ms.logical_rules(explicit):  # a Rules gives its logical names
        assert ms.plan(tree, BATCH_EMBED, mesh24)["h"].spec == P("model", None)


def test_unmapped_name_names_the_context_rules(mesh24):
    with ms.logical_rules({"batch": "data"}), pytest.raises(ms.SpecError) as e:
        ms.plan({"h": X}, BATCH_EMBED, mesh24)
    assert str(e.value).splitlines()[2:] == [
        "    problem: axis 'embed' (dimension 1) is not in the mesh",
        "    spec: P('data', 'embed') (from P('batch', 'embed') for the whole argument)",
        "    mesh: data=2, model=4",
        "    hint: mesh axes are 'data', 'model', and 'embed' is not a logical name of the "
        "active ms.logical_rules context (names: batch); add 'embed': <mesh axes or None> "
        "there",
    ]
    with pytest.raises(ms.SpecError) as e, ms.logical_rules({"batch": 3}):
        pass
    assert str(e.value).splitlines() == [
        "invalid logical rules:",
        "  logical_rules:rules['batch']",
        "    problem: 'batch' -> 3 is not a logical name -> mesh axes mapping",
        "    hint: map to a mesh axis name, a list of names, or None (replicate)",
    ]


def test_a_misspelt_logical_name_gets_did_you_mean(mesh24):
    rules = {"batch": "data", "embed": None, "mpl": "model"}
    with ms.logical_rules(rules), pytest.raises(ms.SpecError) as e:
        ms.plan({"h": X}, P("batch", "mlp"), mesh24)
    assert str(e.value).splitlines()[2:] == [
        "    problem: axis 'mlp' (dimension 1) is not in the mesh",
        "    spec: P('data', 'mlp') (from P('batch', 'mlp') for the whole argument)",
        "    mesh: data=2, model=4",
        "    hint: mesh axes are 'data', 'model', and 'mlp' is not a logical name of the "
        "active ms.logical_rules context (names: batch, embed, mpl); it has 'mpl': 'model': "
        "did you mean 'mlp': 'model'? (or add 'mlp': <mesh axes or None> there)",
    ]


def test_context_is_per_thread(mesh24):
    results = {}
    barrier = threading.Barrier(2)

    def worker(name, rules):
        with ms.logical_rules(rules):
            barrier.wait(timeout=30)  # both contexts are active at once
            results[name] = ms.plan({"h": X}, BATCH_EMBED, mesh24)["h"].spec

    threads = [
        threading.Thread(target=worker, args=("a", RULES)),
        threading.Thread(target=worker, args=("b", {"batch": "model", "embed": "data"})),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {"a": P("data", "model"), "b": P("model", "data")}


def test_flax_context_is_honoured(mesh24):
    _, rules = maxtext()
    mesh = maxtext_mesh()
    names = ("activation_batch", "activation_length", "activation_embed")
    tree = {"h": SDS((8, 8, 8), jnp.float32)}
    with nn.logical_axis_rules(rules):
        want = nn.logical_to_mesh_sharding(P(*names), mesh).spec
        assert ms.plan(tree, P(*names), mesh)["h"].spec == want
        with ms.logical_rules(
            {"activation_batch": "fsdp", "activation_length": None, "activation_embed": "tensor"}
        ):  # modelshard's wins
            assert ms.plan(tree, P(*names), mesh)["h"].spec == P("fsdp", None, "tensor")
    with pytest.raises(ms.SpecError, match="not in the mesh"):
        ms.plan(tree, P(*names), mesh)


def test_shard_jit_uses_the_set_mesh(mesh24, count_compiles):
    step = ms.shard_jit(lambda x: x * 2, in_specs=(P("data"),))
    with count_compiles() as n:
        with jax.set_mesh(mesh24):
            assert spec_of(step(X)) == P("data")
        other = ms.make_mesh({"data": 4, "model": 2})
        with jax.set_mesh(other):
            y = step(X)
    assert y.sharding.mesh.shape == other.shape
    assert n["jit(<lambda>)"] == step.cache_size == 2
    with pytest.raises(ms.MeshError, match="no mesh given and none is active"):
        step(X)


def test_sharded_initialisation_never_whole_on_one_device(mesh24):
    """The recipe of the model-code guide: shard_jit the constructor with out_specs; the
    transfer guard refuses any copy, so every leaf is created on its devices."""
    import equinox as eqx

    init = nn.initializers.lecun_normal()
    rules = [("embed", None), ("mlp", "model")]
    named = ms.Rules([], strict=False)
    by_path = ms.Rules([(r"weight$", P("mlp", "embed")), (r".*", P())])
    x = jnp.zeros((2, 16))
    # modelshard's context only (flax=False: out_specs alone places every leaf; NNX's eager
    # sharding, which reads Flax's context, is off here).
    with (
        jax.set_mesh(mesh24),
        ms.logical_rules(rules, flax=False),
        nnx.use_eager_sharding(False),
        jax.transfer_guard("disallow"),
    ):
        dense = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))
        linen = ms.shard_jit(
            lambda: dense.init(jax.random.key(0), x), in_specs=(), out_specs=named
        )()
        module = ms.shard_jit(
            lambda: nnx.Linear(
                16, 32, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=nnx.Rngs(0)
            ),
            in_specs=(),
            out_specs=named,
        )()
        eqx_linear = ms.shard_jit(
            lambda: eqx.nn.Linear(16, 32, key=jax.random.key(0)), in_specs=(), out_specs=by_path
        )()
    assert linen["params"]["kernel"].value.sharding.spec == P(None, "model")
    assert module.kernel.get_value().sharding.spec == P(None, "model")
    assert eqx_linear.weight.sharding.spec == P("model", None)
    assert isinstance(module, nnx.Linear) and isinstance(eqx_linear, eqx.nn.Linear)


MISSPELT_AXIS = [
    "logical rules that misspell an axis of the mesh (data=2, model=4):",
    "  logical_rules:rules['mlp']",
    "    problem: 'mlp' maps to mesh axis 'modle', which is not in the mesh",
    "    hint: did you mean 'model'? (mesh axes are 'data', 'model')",
]


def test_a_misspelt_mesh_axis_is_refused_on_entry_under_a_mesh(mesh24):
    misspelt = {"batch": "data", "mlp": "modle"}
    with jax.set_mesh(mesh24), pytest.raises(ms.SpecError) as e, ms.logical_rules(misspelt):
        pass
    assert str(e.value).splitlines() == MISSPELT_AXIS
    # an axis this mesh lacks and resembles none is left to the plan (shared rules)
    with jax.set_mesh(mesh24), ms.logical_rules({"batch": ("data", "fsdp")}) as rules:
        assert rules is not None


def test_a_misspelt_mesh_axis_is_refused_before_plain_jit_unboxes_linen_params(mesh24):
    """The trial's path: jax.jit over linen's init and nn.unbox, which Flax resolves
    itself; with the mesh set before the rules, the entry check names the rule entry."""

    class Embed(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "vocab"))
            return x @ self.param("w", init, (16, 32))

    x = jnp.ones((8, 16))
    with (
        jax.set_mesh(mesh24),
        pytest.raises(ms.SpecError) as e,
        ms.logical_rules({"embed": None, "vocab": "modle"}),
    ):
        jax.jit(lambda: nn.unbox(Embed().init(jax.random.key(0), x)))()
    assert str(e.value).splitlines() == [
        MISSPELT_AXIS[0],
        "  logical_rules:rules['vocab']",
        "    problem: 'vocab' maps to mesh axis 'modle', which is not in the mesh",
        MISSPELT_AXIS[3],
    ]


def test_a_misspelt_mesh_axis_is_refused_by_shard_jit_before_flax_sees_it(mesh24):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.with_logical_constraint(nn.Dense(16)(x), ("batch", "mlp"))

    init = ms.shard_jit(
        lambda x: MLP().init(jax.random.key(0), x), mesh=mesh24, in_specs=(P("batch"),)
    )
    with ms.logical_rules({"batch": "data", "mlp": "modle"}), pytest.raises(ms.SpecError) as e:
        init(jnp.ones((8, 16)))
    assert str(e.value).splitlines() == MISSPELT_AXIS


# ---- Flax's own constraint paths under ms.logical_rules (issue 44) ----------------------
# Each path run under ms.logical_rules inside shard_jit against Flax's own rules mechanism:
# nn.logical_axis_rules with jax.jit where Flax's own path runs, nn.logical_to_mesh_sharding
# / nnx.get_partition_spec (the specs Flax's rules give each leaf) where it does not.

FLAX_RULES = [("batch", "data"), ("embed", None), ("heads", "model"), ("kv", None)]
FLAX_RULES += [("mlp", "model")]
LECUN = nn.initializers.lecun_normal()
UNPLACED = ms.Rules([], strict=False)  # each leaf by its own logical names


def same_placement(got, want, mesh) -> None:
    """Every leaf of ``got`` on ``mesh`` as ``want`` (a tree of arrays or specs) places it."""
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        w = w.sharding if hasattr(w, "sharding") else jax.sharding.NamedSharding(mesh, w)
        assert g.sharding.is_equivalent_to(w, g.ndim), (jax.tree_util.keystr(path), g.sharding)


def flax_spec_tree(boxed_tree, mesh):
    """The spec of every leaf as Flax's own rules give it (nn.logical_to_mesh_sharding)."""
    got = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_tree), mesh, FLAX_RULES)
    return jax.tree.map(lambda s: s.spec, nn.unbox(got))


class Heads(nn.Module):
    """An attention projection: linen's DenseGeneral creates its kernel (and bias) flat, boxed
    with the three (two) names of the final shape, unboxes that box, then reshapes it."""

    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning(LECUN, ("embed", "heads", "kv"))
        bias = nn.with_logical_partitioning(nn.initializers.ones_init(), ("heads", "kv"))
        return nn.DenseGeneral((4, 2), kernel_init=kernel, bias_init=bias)(x)


class FullRank(nn.Module):
    """Heads' params created at their full rank: what Flax's own path runs under a mesh
    (Flax constrains DenseGeneral's flat kernel by three names there and fails, flax#3676,
    in init and in apply, whose shape check calls the initializer)."""

    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning(LECUN, ("embed", "heads", "kv"))
        bias = nn.with_logical_partitioning(nn.initializers.ones_init(), ("heads", "kv"))
        w = self.param("kernel", kernel, (16, 4, 2))
        b = self.param("bias", bias, (4, 2))
        return jnp.einsum("bi,ihk->bhk", x, w) + jnp.asarray(b)


class FullRankHeads(nn.Module):
    @nn.compact
    def __call__(self, x):
        return FullRank(name="DenseGeneral_0")(x)  # Heads' variable tree


def test_linen_boxed_params_created_flat_then_reshaped_unbox_as_flax(mesh24):
    """LogicallyPartitioned.unbox under ms.logical_rules, init and apply: DenseGeneral's flat
    kernel and bias are left unconstrained (Flax's own unbox leaves every box so without a
    mesh, and fails on these with one); every param is constrained at full rank as Flax's
    rules place it, where Flax's own context places the same params created at full rank."""
    x = jnp.arange(128.0).reshape(8, 16)
    key = jax.random.key(0)
    with nn.logical_axis_rules(FLAX_RULES):  # Flax's own, where its path runs: no mesh
        flax_init = jax.jit(lambda x: Heads().init(key, x))(x)
    with ms.logical_rules(FLAX_RULES):
        init = ms.shard_jit(lambda x: nn.unbox(Heads().init(key, x)), in_specs=(P("batch"),))
        boxed = ms.shard_jit(lambda x: Heads().init(key, x), in_specs=(P("batch"),))
        apply = ms.shard_jit(lambda v, x: Heads().apply(v, x), in_specs=(UNPLACED, P("batch")))
        with jax.set_mesh(mesh24):
            params = init(x)  # unboxed by Flax inside the step: its constraints kept
            variables = boxed(x)
            y = apply(variables, x)
    want = flax_spec_tree(flax_init, mesh24)
    assert want["params"]["DenseGeneral_0"] == {
        "kernel": P(None, "model", None),
        "bias": P("model", None),
    }
    same_placement(params, want, mesh24)
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(nn.unbox(flax_init)), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    with jax.set_mesh(mesh24), nn.logical_axis_rules(FLAX_RULES):
        if mesh24.axis_types[0] == jax.sharding.AxisType.Auto:  # Explicit: Flax's asserts
            flax_params = jax.jit(lambda x: nn.unbox(FullRankHeads().init(key, x)))(x)
            same_placement(params, flax_params, mesh24)
        placed = ms.shard(variables, UNPLACED, mesh24)
        y_flax = jax.jit(lambda v, x: FullRankHeads().apply(v, x))(
            placed, ms.shard(x, P("data"), mesh24)
        )
    assert y.sharding.is_equivalent_to(y_flax.sharding, 3)
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh24, P("data", "model")), 3)
    np.testing.assert_allclose(y, y_flax, rtol=1e-4)


class ConstrainedMLP(nn.Module):
    """nn.with_logical_constraint on an activation inside __call__ (returned, to be seen)."""

    @nn.compact
    def __call__(self, x):
        up = nn.with_logical_partitioning(LECUN, ("embed", "mlp"))
        h = nn.Dense(32, use_bias=False, kernel_init=up)(x)
        h = nn.with_logical_constraint(h, ("batch", "mlp"))
        return h, nn.with_logical_constraint(h.sum(-1), ("batch",))


def test_linen_with_logical_constraint_in_call_as_flax(mesh24):
    """nn.with_logical_constraint inside __call__, init and apply, as Flax's own context
    places it (on Explicit meshes too: there it reshards where Flax's would assert)."""
    x = jnp.arange(128.0).reshape(8, 16)
    key = jax.random.key(0)
    with ms.logical_rules(FLAX_RULES), jax.set_mesh(mesh24):
        init = ms.shard_jit(
            lambda x: ConstrainedMLP().init_with_output(key, x), in_specs=(P("batch"),)
        )
        (h, s), variables = init(x)
        apply = ms.shard_jit(
            lambda v, x: ConstrainedMLP().apply(v, x), in_specs=(UNPLACED, P(None))
        )
        h2, s2 = apply(variables, x)  # x replicated: the constraint moves h
    want = nn.logical_to_mesh_sharding(P("batch", "mlp"), mesh24, FLAX_RULES)
    for got in (h, h2):
        assert got.sharding.is_equivalent_to(want, 2)
    for got in (s, s2):
        assert got.sharding.spec in (P("data"), P("data", None))
    with jax.set_mesh(mesh24), nn.logical_axis_rules(FLAX_RULES):
        if mesh24.axis_types[0] == jax.sharding.AxisType.Auto:  # Explicit: Flax's asserts
            (h_init, _), _ = jax.jit(lambda x: ConstrainedMLP().init_with_output(key, x))(x)
            assert h.sharding.is_equivalent_to(h_init.sharding, 2)
        placed = ms.shard(variables, UNPLACED, mesh24)
        h_flax, _ = jax.jit(lambda v, x: ConstrainedMLP().apply(v, x))(
            placed, ms.shard(x, P("data"), mesh24)
        )
    assert h2.sharding.is_equivalent_to(h_flax.sharding, 2)
    np.testing.assert_allclose(h2, h_flax, rtol=1e-4)


class NNXHeads(nnx.Module):
    """NNX's flat-then-reshaped kernel (LinearGeneral, multi-dim features), an Einsum, and a
    Variable's own sharding_rules ('h' is mesh axis 'model' for this Variable only)."""

    def __init__(self, rngs: nnx.Rngs):
        self.proj = nnx.LinearGeneral(
            16,
            (4, 2),
            kernel_init=nnx.with_partitioning(LECUN, ("embed", "heads", "kv")),
            bias_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("heads", "kv")),
            rngs=rngs,
        )
        self.out = nnx.Einsum(
            "bhk,hkd->bhd",
            (4, 2, 16),
            kernel_init=nnx.with_partitioning(
                LECUN, ("h", "kv", "embed"), sharding_rules=(("h", "model"),)
            ),
            rngs=rngs,
        )

    def __call__(self, x):
        return self.out(self.proj(x))


def test_nnx_metadata_under_the_context_as_flax(mesh24):
    """NNX's eager sharding and nnx.get_partition_spec, init and apply, under ms.logical_rules
    inside shard_jit: every Param and the output placed as under Flax's own context."""
    x = jnp.arange(128.0).reshape(8, 16)
    with jax.set_mesh(mesh24), nn.logical_axis_rules(FLAX_RULES):
        flax_model = nnx.jit(lambda: NNXHeads(nnx.Rngs(0)))()
        flax_specs = nnx.get_partition_spec(nnx.state(flax_model, nnx.Param))
        y_flax = nnx.jit(lambda m, x: m(x))(flax_model, ms.shard(x, P("data"), mesh24))
    with ms.logical_rules(FLAX_RULES), jax.set_mesh(mesh24):
        model = ms.shard_jit(lambda: NNXHeads(nnx.Rngs(0)), in_specs=())()
        y = ms.shard_jit(lambda m, x: m(x), in_specs=(UNPLACED, P("batch")))(model, x)
        assert nnx.get_partition_spec(nnx.state(model, nnx.Param)) == flax_specs
    state = nnx.state(model, nnx.Param)
    same_placement(jax.tree.leaves(state), jax.tree.leaves(flax_specs), mesh24)
    same_placement(
        jax.tree.leaves(state), jax.tree.leaves(nnx.state(flax_model, nnx.Param)), mesh24
    )
    assert model.proj.kernel.get_value().sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh24, P(None, "model")), 3
    )
    assert model.out.kernel.get_value().sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh24, P("model")), 3
    )
    assert y.sharding.is_equivalent_to(y_flax.sharding, 3)
    np.testing.assert_allclose(y, y_flax, rtol=1e-4)
