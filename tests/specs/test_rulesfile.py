"""Rules files: TOML -> Rules, every problem reported at once, and a lossless round trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._specs.rulesfile import load_rules, parse_rules

EXAMPLE = """
strict = false

[[rules]]
pattern = 'embedding$'
spec = ["vocab", "embed"]

[[rules]]
pattern = 'kernel$'
spec = ["none", ["data", "model"]]

[[rules]]
pattern = ".*"
spec = []

[logical]
vocab = "model"
embed = "none"
"""


def test_example_file_maps_to_rules(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text(EXAMPLE)
    rules = load_rules(path)
    assert rules.rules == (
        ("embedding$", P("vocab", "embed")),
        ("kernel$", P(None, ("data", "model"))),
        (".*", P()),
    )
    assert dict(rules.logical or {}) == {"vocab": "model", "embed": None}
    assert rules.strict is False


def test_rules_file_plans_like_the_python_rules(mesh24):
    import jax
    import jax.numpy as jnp

    tree = {
        "embed": {"embedding": jax.ShapeDtypeStruct((64, 16), jnp.float32)},
        "mlp": {"kernel": jax.ShapeDtypeStruct((16, 32), jnp.float32)},
    }
    rules = parse_rules(
        {
            "rules": [
                {"pattern": "embedding$", "spec": ["vocab", "none"]},
                {"pattern": "kernel$", "spec": ["none", "model"]},
            ],
            "logical": {"vocab": "model"},
        }
    )
    p = ms.plan(tree, rules, mesh24)
    assert [leaf.spec for leaf in p] == [P("model", None), P(None, "model")]


def test_round_trip_through_toml(tmp_path):
    rules = ms.Rules(
        [(r"attn/(q|k)'s$", P("data", None)), ("w", P(("data", "model"))), (r'a"b\d', P())],
        logical={"x": ("data", "model"), "y": None},
        strict=False,
    )
    path = tmp_path / "r.toml"
    path.write_text(rules.to_toml())
    back = load_rules(path)
    assert back.rules == rules.rules
    assert dict(back.logical or {}) == dict(rules.logical or {})
    assert back.strict is False


def test_every_problem_is_listed_at_once():
    data = {
        "strickt": True,
        "strict": "yes",
        "rules": [
            {"pattern": "a", "spec": ["data", 3]},
            {"pattern": 5, "spec": []},
            {"pattern": "b", "spec": "data", "color": "red"},
            "c",
        ],
        "logical": {"vocab": ["none"]},
    }
    with pytest.raises(ms.SpecError) as e:
        parse_rules(data, "r.toml")
    assert str(e.value).splitlines() == [
        "invalid rules file r.toml:",
        "  r.toml:strickt",
        "    problem: unknown top-level key 'strickt' (did you mean 'strict'?)",
        "    hint: allowed: strict, rules, logical",
        "  r.toml:strict",
        "    problem: strict must be true or false, got 'yes'",
        "  r.toml:rules[0].spec[1]",
        "    problem: 3 is not an axis name, a list of axis names, or 'none'",
        '    hint: write "data", ["data", "model"] or "none" (TOML has no null)',
        "  r.toml:rules[1].pattern",
        "    problem: pattern must be a string, got 5",
        "  r.toml:rules[2].color",
        "    problem: unknown key 'color'",
        "    hint: allowed: pattern, spec",
        "  r.toml:rules[2].spec",
        "    problem: spec must be an array of entries, got 'data'",
        '    hint: spec = [] replicates; spec = ["data", "none"] shards dimension 0',
        "  r.toml:rules[3]",
        "    problem: 'c' is not a table with pattern and spec",
        "  r.toml:logical.vocab",
        "    problem: ['none'] is not an axis name, a list of axis names, or 'none'",
        '    hint: write "data", ["data", "model"] or "none" (TOML has no null)',
    ]


def test_a_misspelt_pattern_key_is_named_and_the_pattern_said_missing():
    with pytest.raises(ms.SpecError) as e:
        parse_rules({"rules": [{"paterns": "d", "spec": []}]}, "r.toml")
    assert str(e.value).splitlines() == [
        "invalid rules file r.toml:",
        "  r.toml:rules[0].paterns",
        "    problem: unknown key 'paterns' (did you mean 'pattern'?)",
        "    hint: allowed: pattern, spec",
        "  r.toml:rules[0].pattern",
        "    problem: pattern is missing",
    ]


def test_bad_regex_is_reported_at_its_place_in_the_file_with_the_others(tmp_path):
    """An invalid regular expression is one of the file's problems, at rules[i].pattern,
    listed with the others in one error (not found only after they are fixed)."""
    with pytest.raises(ms.SpecError) as e:
        parse_rules({"strickt": 1, "rules": [{"pattern": "(", "spec": []}]}, "bad.toml")
    assert str(e.value).splitlines() == [
        "invalid rules file bad.toml:",
        "  bad.toml:strickt",
        "    problem: unknown top-level key 'strickt' (did you mean 'strict'?)",
        "    hint: allowed: strict, rules, logical",
        "  bad.toml:rules[0].pattern",
        "    problem: '(' is not a valid regular expression: missing ), unterminated subpattern "
        "at position 0",
        "    hint: write a Python regular expression, in single quotes (a TOML literal string, "
        r"backslashes kept as written): pattern = 'norm\d?/weight$'",
    ]


def test_unreadable_and_invalid_toml(tmp_path):
    # a missing file is the OSError itself (as open() raises it), not a SpecError
    with pytest.raises(FileNotFoundError) as missing:
        load_rules(tmp_path / "missing.toml")
    assert (missing.value.errno, missing.value.filename) == (2, str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[[rules]\npattern = 'x'\n")
    with pytest.raises(ms.SpecError) as e:
        load_rules(bad)
    assert str(e.value).splitlines()[1:2] == [f"  {bad}"]
    assert str(e.value).splitlines()[2].startswith("    problem: not valid TOML: ")
    assert e.value.problems[0].to_json()["path"] is None
    assert e.value.problems[0].hint is None  # nothing to do with backslashes


def test_backslash_in_a_double_quoted_pattern_hints_single_quotes(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[rules]]\npattern = "norm\\d?$"\nspec = []\n')
    with pytest.raises(ms.SpecError) as e:
        load_rules(bad)
    assert str(e.value).splitlines()[1:] == [
        f"  {bad}",  # the whole file: no path inside it
        "    problem: not valid TOML: Unescaped '\\' in a string (at line 2, column 18)",
        r"    hint: in a double-quoted TOML string a backslash starts an escape (\n, \t, \\; "
        r"\d and \. are none): write regular expressions in single quotes, pattern = "
        r"'norm\d?$' (a TOML literal string, backslashes kept as written)",
    ]
    bad.write_text("[[rules]]\npattern = 'norm\\d?$'\nspec = []\n")  # what the hint says
    assert load_rules(bad).rules[0][0] == r"norm\d?$"


SDS = jax.ShapeDtypeStruct
HEADS = {"q": SDS((16, 4), jnp.float32), "o": SDS((4, 16), jnp.float32)}
QO = [("q", P("embed", "heads")), ("o", P("heads", "embed"))]


def test_a_misspelt_logical_name_in_the_table_gets_did_you_mean(tmp_path, mesh24):
    """``hedas = "none"`` in [logical]: every leaf naming 'heads' says which entry is the
    likely typo and the line to write instead, in TOML; Python rules say it in Python."""
    path = tmp_path / "tp.toml"
    path.write_text(
        "".join(f"[[rules]]\npattern = '^{p}$'\nspec = {list(s)!r}\n\n" for p, s in QO).replace(
            "'", '"'
        )
        + '[logical]\nembed = "none"\nhedas = "none"\n'
    )
    with pytest.raises(ms.SpecError) as e:
        ms.plan(HEADS, load_rules(path), mesh24)
    table = f"the [logical] table of {path} (names: embed, hedas)"
    hint = (
        f"    hint: mesh axes are 'data', 'model', and 'heads' is not a logical name of {table}; "
        'it has hedas = "none": did you mean heads = "none"? (or add heads = "<mesh axis>" there)'
    )
    assert str(e.value).splitlines() == [
        "2 sharding problems found (every offending leaf is listed; paths are arg:path):",
        "  tree:o float32[4, 16]",
        "    problem: axis 'heads' (dimension 0) is not in the mesh",
        "    spec: P('heads', None) (from rule 1 '^o$')",
        "    mesh: data=2, model=4",
        hint,
        "  tree:q float32[16, 4]",
        "    problem: axis 'heads' (dimension 1) is not in the mesh",
        "    spec: P(None, 'heads') (from rule 0 '^q$')",
        "    mesh: data=2, model=4",
        hint,
    ]
    python = ms.Rules(QO, logical={"embed": None, "hedas": "model"})
    with pytest.raises(ms.SpecError) as e:
        ms.plan(HEADS, python, mesh24)
    assert str(e.value).splitlines()[5] == (
        "    hint: mesh axes are 'data', 'model', and 'heads' is not a logical name of "
        "Rules(logical=...) (names: embed, hedas); it has 'hedas': 'model': did you mean "
        "'heads': 'model'? (or add 'heads': <mesh axes or None> there)"
    )
