"""Errors at model scale: problems grouped by cause, layer numbers folded, every problem kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import gemma_like, gemma_text_rules
from modelshard._base.errors import LIST_IN_FULL, Problem, SpecError

MESH = {"data": 16, "model": 8}


def _raise(tree, specs, sizes=MESH) -> SpecError:
    with pytest.raises(SpecError) as e:
        ms.plan(tree, specs, ms.make_mesh(sizes, abstract=True))
    return e.value


def test_gemma_like_with_text_only_rules_fits_in_40_lines():
    """Gemma-3-27B-like, planned with rules for its text decoder only: the 383 leaves of the
    vision encoder are one cause, folded over the 27 blocks."""
    err = _raise(gemma_like(), gemma_text_rules())
    lines = str(err).splitlines()
    assert len(err.problems) == 383 and len(lines) <= 40
    assert lines[0] == (
        "383 sharding problems, 1 cause (paths are arg:path; numbered layers folded as {0..N}):"
    )
    assert lines[1] == "  [1] no rule matches this leaf: 383 leaves"
    assert lines[3].startswith("      hint: no rule covers anything under 'vision_encoder/': add ")
    assert (
        "      tree:vision_encoder/Transformer/encoder/encoderblock_{0..26}/MlpBlock_0/"
        "Dense_{0..1}/kernel  (54 leaves)"
    ) in lines
    assert "      tree:vision_encoder/pos_embedding" in lines
    assert lines[-1].startswith("All 383 problems are on this error: err.problems")
    # every problem stays on the exception, in full, structured and as JSON
    paths = {p.path for p in err.problems}
    assert "vision_encoder/Transformer/encoder/encoderblock_26/MlpBlock_0/Dense_1/bias" in paths
    assert err.report().count("    problem: no rule matches this leaf") == 383
    data = err.to_json()
    assert len(data["problems"]) == 383
    assert [(c["what"], c["count"]) for c in data["causes"]] == [("no rule matches this leaf", 383)]
    assert sum(p["count"] for p in data["causes"][0]["paths"]) == 383


def test_fsdp_axis_missing_gets_the_fsdp_hint():
    err = _raise(gemma_like(layers=4, vision_blocks=2), ms.fsdp("fsdp"), {"data": 2, "model": 4})
    text = str(err)
    assert len(text.splitlines()) <= 40 and len(err.causes) == 1
    assert text.splitlines()[1] == (
        "  [1] axis 'fsdp' (dimension 0) is not in the mesh: 63 leaves like it (their numbers "
        "differ)"
    )
    assert (
        "hint: fsdp('fsdp') shards over the mesh axis 'fsdp', which this mesh "
        "(data=2, model=4) does not have: write fsdp('data'), or build the mesh with an "
        "'fsdp' axis"
    ) in text
    assert "logical" not in text


def test_no_specs_at_all_is_one_cause():
    """plan(state, None, mesh) on a small transformer: one line per kind of leaf, not 4 per leaf."""
    tree = gemma_like(layers=16, vision_blocks=0)
    n = len(jax.tree.leaves(tree))
    err = _raise(tree, None)
    lines = str(err).splitlines()
    assert len(err.problems) == n > 100
    assert len(err.causes) == 1 and len(lines) <= 20
    assert "      tree:transformer/layer_{0..15}/mlp/linear  (16 leaves)" in lines


def test_causes_group_numbers_and_keep_each_example():
    """Divisibility problems differing only in sizes are one cause; its heading is the first
    example's real sentence (never numbers replaced by N)."""
    tree = {
        f"layer_{i}": {"w": jax.ShapeDtypeStruct((5 + 2 * i, 4), jnp.float32)} for i in range(9)
    }
    tree["odd"] = {"w": jax.ShapeDtypeStruct((4, 7), jnp.float32)}
    err = _raise(tree, ms.Rules([("layer", P("model")), ("odd", P(None, "model"))]))
    assert len(err.problems) == 10 > LIST_IN_FULL
    [cause] = err.causes
    assert cause.what == (
        "dimension 0 (size 5) is partitioned 8 times (model=8), but 5 is not divisible by 8"
    )
    lines = str(err).splitlines()
    assert lines[1:3] == [
        "  [1] dimension 0 (size 5) is partitioned 8 times (model=8), but 5 is not divisible "
        "by 8: 10 leaves like it (their numbers differ)",
        "      e.g. tree:layer_0/w float32[5, 4], spec P('model') from rule 0 'layer', mesh "
        "(data=16, model=8)",
    ]
    assert "N" not in lines[1].split(":")[0]
    [summary] = err.to_json()["causes"]
    assert (summary["what"], summary["numbers_differ"], summary["count"]) == (cause.what, True, 10)
    assert "      tree:layer_{0..8}/w  (9 leaves)" in str(err).splitlines()


def test_many_causes_are_capped():
    problems = [
        Problem("tree", f"m{i}/w_{j}", f"problem kind {chr(65 + i)}")
        for i in range(12)
        for j in range(30)
    ]
    err = SpecError(problems)
    lines = str(err).splitlines()
    assert len(lines) <= 40
    assert "... 4 more causes (120 problems)" in lines
    assert len(err.causes) == 12 and len(err.problems) == 360


def test_explicit_cause_groups_different_sentences():
    problems = [
        Problem("tree", f"p{i}", f"sentence {chr(65 + i)}", cause="one cause") for i in range(9)
    ]
    [cause] = SpecError(problems).causes
    assert (cause.what, cause.count) == ("one cause", 9)


def test_strict_rules_do_not_report_an_unused_catch_all():
    tree = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
    p = ms.plan(
        tree, ms.Rules([("w$", P("data")), (r".*", P())]), ms.make_mesh(MESH, abstract=True)
    )
    assert p["w"].spec == P("data")
    # a rule that is not a catch-all still must match something
    err = _raise(tree, ms.Rules([("w$", P("data")), ("nope", P())]))
    assert "rule 1 'nope' matched no leaf" in str(err)


def test_logical_name_errors_name_the_logical_name():
    tree = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    err = _raise(tree, ms.Rules([("w", P(None, "embed"))], logical={"embed": "fsdp"}), {"data": 2})
    [problem] = err.problems
    assert problem.what == (
        "logical name 'embed' (dimension 1) maps to mesh axis 'fsdp', which is not in the mesh"
    )
    assert problem.hint is not None
    assert problem.hint.startswith("mesh axes are 'data': map 'embed' to one of them")


def test_a_large_mapping_error_calls_its_problems_mapping_problems() -> None:
    problems = [
        ms.Problem("target", f"layers/{i}/w", "no source tensor maps to this leaf")
        for i in range(12)
    ]
    err = ms.MappingError(problems)
    first = str(err).splitlines()[0]
    assert first.startswith("12 mapping problems, 1 cause ")
    assert (
        ms.SpecError(problems).args[0].splitlines()[0].startswith("12 sharding problems, 1 cause ")
    )


def test_problem_spells_spec_and_mesh_for_people_and_for_json():
    """One value, two spellings: ``P(None, 'model')`` / ``model=3`` in the text, a list with
    nulls / an object in the JSON (as every JSON output spells them)."""
    p = Problem(
        "tree",
        "w",
        "dimension 1 (size 4) is partitioned 3 times (model=3), but 4 is not divisible by 3",
        shape=(8, 4),
        dtype="float32",
        spec=P(None, ("model", "data")),
        rule="rule 0 'w'",
        mesh={"data": 1, "model": 3},
    )
    assert p.lines() == [
        "  tree:w float32[8, 4]",
        "    problem: dimension 1 (size 4) is partitioned 3 times (model=3), but 4 is not "
        "divisible by 3",
        "    spec: P(None, ('model', 'data')) (from rule 0 'w')",
        "    mesh: data=1, model=3",
    ]
    assert (p.spec, p.mesh) == ("P(None, ('model', 'data'))", "data=1, model=3")
    [problem] = SpecError([p]).to_json()["problems"]
    assert problem == {
        "arg": "tree",
        "path": "w",
        "what": p.what,
        "shape": [8, 4],
        "dtype": "float32",
        "spec": [None, ["model", "data"]],
        "rule": "rule 0 'w'",
        "mesh": {"data": 1, "model": 3},
        "hint": None,
        "cause": None,
        "dimension": None,
        "logical_name": None,
        "logical_rule": None,
    }


def _hint(tree, specs, sizes=None):
    err = _raise(tree, specs, sizes or {"data": 2, "model": 4})
    return [(p.what, p.hint) for p in err.problems]


def test_hints_speak_python_to_python():
    tree = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    # a logical name the Rules' own mapping lacks: the Python entry to add to it
    assert _hint(tree, ms.Rules([("w", P("heads"))], logical={"embed": "model"})) == [
        (
            "axis 'heads' (dimension 0) is not in the mesh",
            "mesh axes are 'data', 'model', and 'heads' is not a logical name of "
            "Rules(logical=...) (names: embed); add 'heads': <mesh axes or None> there",
        )
    ]
    assert _hint(tree, ms.Rules([("w", P("heads"))], logical=[("embed", "model")]))[0][1] == (
        "mesh axes are 'data', 'model', and 'heads' is not a logical name of "
        "Rules(logical=...) (names: embed); add ('heads', <mesh axes or None>) there"
    )
    # no logical rules at all
    assert _hint(tree, ms.Rules([("w", P("heads"))]))[0][1] == (
        "mesh axes are 'data', 'model'; map logical names with "
        "Rules(..., logical={'heads': <mesh axes or None>}) or inside "
        "`with ms.logical_rules({'heads': ...}):`"
    )


def test_a_mesh_axis_typo_gets_did_you_mean_not_a_logical_name_hint():
    tree = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    for specs in (P(None, "modle"), ms.Rules([("w", P(None, "modle"))], logical={"x": None})):
        assert _hint(tree, specs) == [
            (
                "axis 'modle' (dimension 1) is not in the mesh",
                "did you mean 'model'? (mesh axes are 'data', 'model')",
            )
        ]
    # a logical name mapped to a misspelt mesh axis: the corrected entry, in Python
    assert _hint(tree, ms.Rules([("w", P("embed"))], logical={"embed": "modle"})) == [
        (
            "logical name 'embed' (dimension 0) maps to mesh axis 'modle', which is not in the "
            "mesh",
            "did you mean 'model'? write 'embed': 'model' in Rules(logical=...) (mesh axes are "
            "'data', 'model')",
        )
    ]


def test_grouped_report_speaks_the_command_line_there():
    """Under the ``modelshard`` command (its vocabulary), the grouped hint is a rules-file
    fix and the last line points at --json, not at Python attributes."""
    from modelshard._base.text import speaking

    with speaking("cli"):
        err = _raise(gemma_like(), gemma_text_rules())
    lines = str(err).splitlines()
    assert lines[3] == (
        "      hint: no rule covers anything under 'vision_encoder/': add [[rules]] tables for it "
        "to the rules file, e.g. pattern = '^vision_encoder/' with spec = [] to replicate it, "
        "a catch-all last (pattern = '.*', spec = []), or strict = false to replicate unmatched "
        "leaves"
    )
    assert lines[-1] == "All 383 problems, each in full: the same command with --json."
