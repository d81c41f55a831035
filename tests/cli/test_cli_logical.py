"""The command line tells a logical name's problem in the rules file's words: the name, the
dimension, the [logical] line that mapped it, and the fix in TOML (never "pass --rules"
when --rules was passed)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import modelshard as ms
from modelshard.cli import main
from tinylm import linen_model

# one worker runs this file (its module fixture trains and saves once)
pytestmark = pytest.mark.xdist_group("cli-logical")

RULES = (
    "strict = false\n\n[logical]\n"
    'batch = "data"\nseq = "none"\nembed = "none"\nheads = "model"\n'
    'kv = "none"\nmlp = "none"\nvocab = "none"\n'
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tinylm's linen parameters, saved once: their logical names are saved with the leaves."""
    params = linen_model.TinyLM().init(jax.random.key(0), jnp.zeros((8, 8), jnp.int32))["params"]
    return ms.save(tmp_path_factory.mktemp("tinylm") / "ckpt", params)


def plan_argv(ckpt: Path, rules: Path, text: str, mesh: str) -> list[str]:
    """``modelshard plan CKPT --mesh MESH --rules RULES``, the rules file written first."""
    rules.write_text(text)
    return ["plan", str(ckpt), "--mesh", mesh, "--rules", str(rules)]


def test_a_non_dividing_logical_axis_in_rules_file_words(ckpt, tmp_path, capsys):
    rules = tmp_path / "tp.toml"
    argv = plan_argv(ckpt, rules, RULES, "data=1,model=8")
    assert main([*argv, "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["error"]["problems"]
    assert len(problems) == 8  # q, k, v and o of two blocks
    first = problems[0]
    entry = f"[logical] heads of {rules}"
    assert {k: first[k] for k in ("path", "what", "hint", "dimension", "logical_name")} == {
        "path": "block_0/k/kernel",
        "what": f"'heads' (dimension 1, size 4) maps to 'model' (8) by {entry}: 4 is not "
        "divisible by 8",
        "hint": f"map heads to an axis whose size divides 4, or replicate it: in {rules}, "
        '[logical] heads = "none"',
        "dimension": 1,
        "logical_name": "heads",
    }
    assert first["logical_rule"] == entry
    assert not any("--rules" in p["hint"] for p in problems)
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    at = err.index("  tree:block_0/k/kernel float32[16, 4, 4]")
    assert err[at : at + 5] == [
        "  tree:block_0/k/kernel float32[16, 4, 4]",
        f"    problem: {first['what']}",
        '    spec: ["none", "model", "none"] (from metadata (LogicallyPartitioned))',
        "    mesh: data=1, model=8",
        f"    hint: {first['hint']}",
    ]


def test_the_plan_table_names_logical_names_and_the_rules_file(ckpt, tmp_path, capsys):
    """modelshard plan --rules: a leaf placed by its saved logical names shows them and the
    rules file's [logical] table that mapped them, not just metadata (LogicallyPartitioned)."""
    rules = tmp_path / "tp.toml"
    argv = plan_argv(ckpt, rules, RULES.replace('mlp = "none"', 'mlp = "model"'), "data=2,model=4")
    assert main(argv) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) > 5:
            rows[cells[0]] = cells
    assert rows["block_{0..1}/k/kernel"] == [
        "block_{0..1}/k/kernel",
        "2",
        "(16, 4, 4)",
        "float32",
        "P(None, 'model', None)",
        "256 B x2",
        "metadata: embed, heads->model, kv ([logical] of tp.toml)",
    ]
    assert (
        rows["block_{0..1}/up/kernel"][-1] == "metadata: embed, mlp->model ([logical] of tp.toml)"
    )
    assert rows["block_{0..1}/norm/scale"][-1] == "unmatched (replicated, strict=False)"
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    k = next(r for r in out["rows"] if r["path"] == "block_{0..1}/k/kernel")
    assert (k["rule"], k["logical"]) == (
        "metadata (LogicallyPartitioned)",
        [
            [{"name": n, "axes": axes, "rule": f"[logical] {n} of {rules}"}]
            for n, axes in (("embed", []), ("heads", ["model"]), ("kv", []))
        ],
    )


def test_a_rules_files_logical_pairs_get_the_pair_to_change(ckpt, tmp_path, capsys):
    """Rules written as Flax-style pairs (logical = [[name, axes], ...]): the problem names
    the pair by its index and the hint gives the pair to write there."""
    rules = tmp_path / "pairs.toml"
    argv = plan_argv(
        ckpt,
        rules,
        'strict = false\nlogical = [["batch", "data"], ["embed", "none"], ["heads", "model"], '
        '["kv", "none"], ["mlp", "none"], ["vocab", "none"]]\n',
        "data=1,model=8",
    )
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    at = err.index("  tree:block_0/o/kernel float32[4, 4, 16]")
    entry = f"logical[2] of {rules}"
    hint = (
        f"map heads to an axis whose size divides 4, or replicate it: in {rules}, set "
        'logical[2] = ["heads", "none"]'
    )
    assert err[at : at + 5] == [
        "  tree:block_0/o/kernel float32[4, 4, 16]",
        f"    problem: 'heads' (dimension 0, size 4) maps to 'model' (8) by {entry}: 4 is not "
        "divisible by 8",
        '    spec: ["model", "none", "none"] (from metadata (LogicallyPartitioned))',
        "    mesh: data=1, model=8",
        f"    hint: {hint}",
    ]
    assert main([*argv, "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["error"]["problems"]
    o = next(p for p in problems if p["path"] == "block_0/o/kernel")
    assert (o["dimension"], o["logical_name"], o["logical_rule"], o["hint"]) == (
        0,
        "heads",
        entry,
        hint,
    )


def test_a_misspelt_logical_name_in_the_rules_file_gets_did_you_mean(ckpt, tmp_path, capsys):
    """``hedas = "none"`` for 'heads': each leaf's hint names the entry and the TOML line
    meant, on the command line as from Python."""
    rules = tmp_path / "tp.toml"
    argv = plan_argv(
        ckpt, rules, RULES.replace('heads = "model"', 'hedas = "none"'), "data=2,model=4"
    )
    assert main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    at = err.index("  tree:block_0/k/kernel float32[16, 4, 4]")
    assert err[at : at + 5] == [
        "  tree:block_0/k/kernel float32[16, 4, 4]",
        "    problem: axis 'heads' (dimension 1) is not in the mesh",
        '    spec: ["none", "heads", "none"] (from metadata (LogicallyPartitioned))',
        "    mesh: data=2, model=4",
        "    hint: mesh axes are 'data', 'model', and 'heads' is not a logical name of the "
        f"[logical] table of {rules} (names: batch, seq, embed, hedas, kv, mlp, vocab); it has "
        'hedas = "none": did you mean heads = "none"? (or add heads = "<mesh axis>" there)',
    ]
    assert sum("did you mean heads" in line for line in err) == 8  # q, k, v, o of 2 blocks
