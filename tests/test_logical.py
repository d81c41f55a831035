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
import pytest
import yaml
from flax import nnx
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._rulesfile import parse_rules, rules_to_toml

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
    axes, rules = maxtext()
    mesh = maxtext_mesh(axis_type)
    names = list(dict.fromkeys(n for n, _ in rules))
    rng = random.Random(0)
    cases = [(n,) for n in names] + [
        tuple(rng.sample(names, k)) + ((None,) if k == 3 else ()) for k in (2, 3, 4) for _ in range(120)
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
    loaded = parse_rules(tomllib.loads(rules_to_toml(r)))
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
    rules = ms.Rules([("x", P(("batch", "seq"), None))], logical=[("batch", "data"), ("seq", "model")])
    assert specs_of({"x": SDS((8, 8), jnp.float32)}, rules, mesh24) == {"x": P(("data", "model"), None)}


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
    assert r.logical == (("embed", ("data", "model")), ("embed", "data"), ("norm", None), ("x", None))
    assert parse_rules(tomllib.loads(rules_to_toml(r))).logical == r.logical
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
            jnp.ones((16, 8)), out_sharding=("mlp", "embed"), sharding_rules=(("mlp", "model"),), **kw
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
