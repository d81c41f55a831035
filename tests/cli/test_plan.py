"""``modelshard plan`` (``_cli/plan.py``): tables, JSON, folding and budgets, and spec problems
explained in rules-file words."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS, one_line
from modelshard.cli import main


def test_plan_table_json_and_errors(ckpt, capsys):
    rules = str(ckpt.parent / "rules.toml")
    assert main(["plan", str(ckpt), "--mesh", "data=2,model=4", "--rules", rules]) == 0
    out = capsys.readouterr().out
    assert "rule 0 'embedding$'" in out and "P('model', None)" in out
    assert main(["plan", str(ckpt), "--mesh", "data=2,model=4", "--rules", rules, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == {"data": 2, "model": 4}
    assert data["bytes_per_device"] == sum(r["bytes_per_device"] for r in data["leaves"])
    # model=3 divides nothing: every offending leaf is listed, exit status 1
    assert main(["plan", str(ckpt), "--mesh", "data=2,model=3", "--rules", rules]) == 1
    err = capsys.readouterr().err
    assert err.startswith("modelshard plan: error: 6 sharding problems found")
    assert err.count("is not divisible by 3") == 6
    # the listing keeps its indentation (naming flags rewrites keywords, nothing else)
    assert err.splitlines()[1:3] == [
        "  tree:attn/key/kernel float32[16, 4, 4]",
        "    problem: dimension 1 (size 4) is partitioned 3 times (model=3), but 4 is not "
        "divisible by 3",
    ]
    # without --rules the saved specs are planned
    assert main(["plan", str(ckpt), "--mesh", "data=8", "--json"]) == 0
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["leaves"]}
    assert rows["mlp/kernel"]["spec"] == [None, "data"]


def test_plan_uses_recorded_metadata_names(tmp_path, capsys):
    variables = MAKERS["linen"]()
    ms.save(tmp_path / "linen", variables)
    (tmp_path / "rules.toml").write_text(
        '[[rules]]\npattern = "bias$|scale$|mean$|var$"\nspec = []\n\n'
        '[logical]\nembed = "none"\nmlp = "model"\nlayers = "none"\n'
    )
    argv = [
        "plan",
        str(tmp_path / "linen"),
        "--mesh",
        "data=2,model=4",
        "--json",
        "--rules",
        str(tmp_path / "rules.toml"),
    ]
    assert main(argv) == 0
    rows = {r["path"]: r for r in json.loads(capsys.readouterr().out)["leaves"]}
    kernel = rows["params/ScanLayer_0/Dense_0/kernel"]
    assert (kernel["spec"], kernel["rule"]) == (
        [None, None, "model"],
        "metadata (LogicallyPartitioned)",
    )
    # the same plan as on the live variables
    live = ms.plan(
        variables,
        ms.load_rules(tmp_path / "rules.toml"),
        ms.make_mesh({"data": 2, "model": 4}, abstract=True),
    )
    assert [r["spec"] for r in rows.values()] == [row["spec"] for row in live.rows()]


def test_problems_as_json(ckpt, capsys):
    rules = str(ckpt.parent / "rules.toml")
    assert main(["plan", str(ckpt), "--mesh", "data=2,model=3", "--rules", rules, "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        "modelshard plan: error: SpecError, exit status 1 (the JSON on stdout says what "
        "and where)\n"
    )
    err = json.loads(captured.out)
    assert (err["ok"], err["exit_status"], err["error"]["type"]) == (False, 1, "SpecError")
    problems = err["error"]["problems"]
    assert len(problems) == 6 and all("is not divisible by 3" in p["what"] for p in problems)
    # specs and meshes spelled as in every JSON output: a list with nulls, an object
    assert problems[0] == {
        "arg": "tree",
        "path": "attn/key/kernel",
        "what": "dimension 1 (size 4) is partitioned 3 times (model=3), but 4 is not divisible "
        "by 3",
        "shape": [16, 4, 4],
        "dtype": "float32",
        "spec": [None, "model"],
        "rule": "rule 1 'kernel$'",
        "mesh": {"data": 2, "model": 3},
        "hint": "shard this dimension over axes whose sizes divide it, pad it, or replicate it "
        f'with "none": in {rules} set rules[1].spec = ["none", "none"]',
        "cause": None,
        "dimension": 1,
        "logical_name": None,
        "logical_rule": None,
    }


def test_an_indivisible_dimension_is_explained_in_rules_file_words(ckpt, tmp_path, capsys):
    """Under the command line a spec reads as the rules file writes it, a replicated
    dimension is "none" (not None), and the hint names the rules[i] to edit."""
    rules = str(ckpt.parent / "rules.toml")
    assert main(["plan", str(ckpt), "--mesh", "data=2,model=3", "--rules", rules]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[1:6] == [
        "  tree:attn/key/kernel float32[16, 4, 4]",
        "    problem: dimension 1 (size 4) is partitioned 3 times (model=3), but 4 is not "
        "divisible by 3",
        '    spec: ["none", "model"] (from rule 1 \'kernel$\')',
        "    mesh: data=2, model=3",
        "    hint: shard this dimension over axes whose sizes divide it, pad it, or replicate it "
        f'with "none": in {rules} set rules[1].spec = ["none", "none"]',
    ]
    # the saved specs (no --rules): the fix is a rules file
    saved = tmp_path / "saved"
    ms.save(saved, ms.shard({"w": jnp.ones((4, 6))}, P(None, "data"), ms.make_mesh({"data": 2})))
    assert main(["plan", str(saved), "--mesh", "data=4"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-3] == '    spec: ["none", "data"] (from the specs it was saved with)'
    assert err[-1] == (
        "    hint: shard this dimension over axes whose sizes divide it, pad it, or replicate it "
        'with "none": pass --rules RULES.toml with a rule for this leaf, spec = ["none", "none"]'
    )
    # from Python the same problem speaks Python
    with pytest.raises(ms.SpecError) as e:
        ms.plan(ms.restore(saved), P(None, "data"), ms.make_mesh({"data": 4}, abstract=True))
    assert str(e.value).splitlines()[3:] == [
        "    spec: P(None, 'data') (from P(None, 'data') for the whole argument)",
        "    mesh: data=4",
        "    hint: shard this dimension over axes whose sizes divide it, pad it, or replicate it "
        "with None",
    ]


def test_help_explains_rules_inline(capsys):
    assert main(["plan", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "[[rules]] tables" in out and "[logical]" in out
    assert "docs/" not in out and ".md" not in out


def test_plan_fold_filter_and_budget(ckpt, capsys):
    rules = str(ckpt.parent / "rules.toml")
    base = ["plan", str(ckpt), "--mesh", "data=2,model=4", "--rules", rules]
    assert main([*base, "--filter", "kernel$", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["leaves"] and all(r["path"].endswith("kernel") for r in data["leaves"])
    assert sum(r["count"] for r in data["rows"]) == len(data["leaves"])
    assert sum(m["bytes_per_device"] for m in data["modules"]) == sum(
        r["bytes_per_device"] for r in data["leaves"]
    )
    assert main([*base, "--filter", "kernel$"]) == 0
    out = capsys.readouterr().out
    assert "filter kernel$:" in out and "embedding" not in out
    assert main([*base, "--no-fold", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == len(data["leaves"]) == 19
    # a budget the plan exceeds: the table, then the problem; exit status 1
    assert main([*base, "--budget", "1KiB"]) == 1
    captured = capsys.readouterr()
    assert "modelshard plan" in captured.out
    assert captured.err.startswith(
        "modelshard plan: error: the plan does not fit the memory budget:"
    )
    assert "per device > budget 1.00 KiB (by module: " in captured.err
    # no single leaf: the problem is labelled by the budget, its hint is a command to run
    lines = captured.err.splitlines()
    assert lines[1] == "  budget" and lines[-1] == (
        "    hint: shard the largest leaves over more mesh axes (--rules, or a bigger --mesh), "
        "or write them in a smaller dtype: modelshard reshard SRC DST --dtype bfloat16"
    )
    assert main([*base, "--budget", "1KiB", "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["causes"][0]["what"] == "bytes per device > budget"
    assert (error["problems"][0]["arg"], error["problems"][0]["path"]) == ("budget", None)
    assert error["problems"][0]["hint"] == lines[-1].removeprefix("    hint: ")
    assert (error["causes"][0]["example"], error["causes"][0]["paths"]) == (
        None,
        [{"path": "budget", "count": 1}],
    )
    assert main([*base, "--budget", "1GiB"]) == 0
    capsys.readouterr()
    for flag, value in (("--budget", "lots"), ("--filter", "(")):
        assert main([*base, flag, value]) == 2
        assert f"argument {flag}: '{value}' is not" in one_line(capsys.readouterr().err, "plan")


def _problem_hints(capsys):
    doc = json.loads(capsys.readouterr().out)
    return sorted({(p["what"], p["hint"]) for p in doc["error"]["problems"]})


def test_hints_speak_the_rules_file_to_a_cli_user(ckpt, tmp_path, capsys):
    """``--rules tp.toml``: the fix is a line of that file, not ``Rules(logical=...)``."""
    with_table = tmp_path / "tp.toml"
    with_table.write_text(
        '[[rules]]\npattern = "kernel$"\nspec = ["none", "heads"]\n\n'
        '[[rules]]\npattern = ".*"\nspec = []\n\n[logical]\nvocab = "model"\n'
    )
    base = ["plan", str(ckpt), "--mesh", "data=2,model=4", "--json", "--rules"]
    assert main([*base, str(with_table)]) == 1
    assert _problem_hints(capsys) == [
        (
            "axis 'heads' (dimension 1) is not in the mesh",
            f"mesh axes are 'data', 'model', and 'heads' is not a logical name of the [logical] "
            f'table of {with_table} (names: vocab); add heads = "<mesh axis>" there',
        )
    ]
    no_table = tmp_path / "plain.toml"
    no_table.write_text(with_table.read_text().split("[logical]")[0])
    assert main([*base, str(no_table)]) == 1
    assert _problem_hints(capsys) == [
        (
            "axis 'heads' (dimension 1) is not in the mesh",
            f"mesh axes are 'data', 'model'; to map the logical name 'heads', add to {no_table} "
            'a [logical] table with the line heads = "<mesh axis>" (a mesh axis, a list of axes, '
            'or "none" to replicate)',
        )
    ]
    typo = tmp_path / "typo.toml"
    typo.write_text(with_table.read_text().replace('vocab = "model"', 'heads = "modle"'))
    assert main([*base, str(typo)]) == 1
    assert _problem_hints(capsys) == [
        (
            "logical name 'heads' (dimension 1) maps to mesh axis 'modle', which is not in the "
            "mesh",
            f"did you mean 'model'? write heads = \"model\" in the [logical] table of {typo} "
            "(mesh axes are 'data', 'model')",
        )
    ]
    # the saved specs (no --rules) name the saving mesh's axis 'data': the fix is an option
    assert main(["plan", str(ckpt), "--mesh", "model=8", "--json"]) == 1
    hints = {h for _, h in _problem_hints(capsys)}
    assert hints == {
        "mesh axes are 'model'; give --mesh an axis 'data', or pass --rules RULES.toml (its "
        "[logical] table can map 'data': data = \"<mesh axis>\")"
    }


def test_rules_file_problems_get_toml_fixes(ckpt, tmp_path, capsys):
    """Leaves no rule covers and a rule that matched nothing, planned from a rules file:
    the hints say what to write in that file, the summary what to run (not Python)."""
    part = tmp_path / "part.toml"
    part.write_text(
        "[[rules]]\npattern = 'kernel$'\nspec = ['none', 'data']\n\n"
        "[[rules]]\npattern = 'nope'\nspec = []\n"
    )
    assert main(["plan", str(ckpt), "--mesh", "data=2", "--rules", str(part)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[:4] == [
        "modelshard plan: error: 13 sharding problems, 2 causes (paths are arg:path; numbered "
        "layers folded as {0..N}):",
        "  [1] no rule matches this leaf: 12 leaves",
        "      e.g. tree:attn/key/bias float32[4, 4], mesh (data=2)",
        f"      hint: add to {part} a [[rules]] table whose pattern matches 'attn/key/bias', a "
        "catch-all last (pattern = '.*', spec = []), or strict = false to replicate unmatched "
        "leaves",
    ]
    assert lines[-5:] == [
        "  [2] rule 1 'nope' matched no leaf: 1 leaf",
        "      e.g. Rules:rule 1, spec [], mesh (data=2)",
        f"      hint: fix its pattern in {part} (strict = false there lets a plan list every "
        "path), remove that [[rules]] table, or set strict = false",
        "      Rules:rule 1",
        "All 13 problems, each in full: the same command with --json.",
    ]


def test_one_cause_of_several_rules_gets_every_rules_fix(tmp_path, capsys):
    """Leaves of several rules failing alike are one cause; its hint names the fix of each
    rule (following the example's rule alone would leave the others failing)."""
    mesh = ms.make_mesh({"data": 8})
    state = {name: jnp.ones((4, 6)) for name in "abcdefghij"}
    ckpt = ms.save(tmp_path / "c", ms.shard(state, P(), mesh))
    rules = tmp_path / "r.toml"
    rules.write_text(
        "".join(f'[[rules]]\npattern = "^{n}$"\nspec = ["model"]\n' for n in "abcdefghij")
    )
    assert main(["plan", str(ckpt), "--mesh", "data=1,model=3", "--rules", str(rules)]) == 1
    [hint] = [x for x in capsys.readouterr().err.splitlines() if x.strip().startswith("hint:")]
    fixes = "; ".join(f'in {rules} set rules[{i}].spec = ["none"]' for i in range(6))
    assert hint == (
        "      hint: shard this dimension over axes whose sizes divide it, pad it, or replicate "
        f'it with "none": {fixes}; and 4 more (each problem has its own)'
    )
