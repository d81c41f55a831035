"""``modelshard plan`` (``_cli/plan.py``): tables, JSON, folding and budgets, and spec problems
explained in rules-file words."""

from __future__ import annotations

import json

import jax
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


STEP_MODULE = '''
import jax, jax.numpy as jnp, optax

TX = optax.adamw(1e-3)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"mlp": {"up": {"kernel": jax.random.normal(k1, (64, 256))},
                    "down": {"kernel": jax.random.normal(k2, (256, 64))}}}


def state():
    params = init(jax.random.key(0))
    return {"params": params, "opt_state": TX.init(params)}


def loss(params, x):
    h = jax.nn.gelu(x @ params["mlp"]["up"]["kernel"])
    return ((h @ params["mlp"]["down"]["kernel"] - x) ** 2).mean()


def step(state, x):
    value, grads = jax.value_and_grad(loss)(state["params"], x)
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, value


def step_named(state, batch):
    return step(state, batch["x"])


def broken(state, x):
    raise ValueError("x must be tokens,\\nnot floats")


def sgd(state, x):
    """A step over the checkpoint's own tree (nested dicts): plain SGD."""
    grads = jax.grad(loss)(state, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)
'''


@pytest.fixture
def step_module(tmp_path, monkeypatch):
    """A module defining a state, an AdamW step and an SGD step, importable by name."""
    import uuid

    name = f"fit_step_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(STEP_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_step_is_planned_with_its_memory_from_xla(step_module, tmp_path, capsys):
    mod = step_module
    base = ["plan", "--state", f"{mod}:state", "--step", f"{mod}:step", "--mesh", "data=4,model=2"]
    html = tmp_path / "step.html"
    assert main([*base, "--batch", "float32[16,64]", "--json", "--html", str(html)]) == 0
    data = json.loads(capsys.readouterr().out)
    memory = data["step_memory"]
    page = html.read_text()
    assert f'class="ms-step-memory" data-total="{memory["total"]}"' in page
    assert sum(memory["parts"].values()) == memory["total"]
    assert memory["parts"]["parameters"] == 2 * 64 * 256 * 4  # replicated: no --rules
    assert memory["parts"]["optimizer_state"] == 2 * memory["parts"]["parameters"] + 4
    assert memory["parts"]["batch"] == 16 * 64 * 4 // 4  # over the first mesh axis
    assert data["advice"] is None and data["mesh"] == {"data": 4, "model": 2}
    # the same figures as the library's, in-process
    import importlib

    m = importlib.import_module(mod)
    lib = ms.step_memory(
        m.step,
        jax.eval_shape(m.state),
        jax.ShapeDtypeStruct((16, 64), jnp.float32),
        mesh={"data": 4, "model": 2},
        in_specs=(P(), P("data")),
        donate_argnums=0,
    )
    assert memory["total"] == lib.total
    named = ["plan", "--state", f"{mod}:state", "--step", f"{mod}:step_named"]
    assert main([*named, "--mesh", "data=4,model=2", "--batch", "x=float32[16,64]"]) == 0
    out = capsys.readouterr().out
    assert "step memory per device (XLA)" in out and "gradients (estimated)" in out


def test_a_step_over_budget_names_the_smallest_change_and_writes_its_rules(
    step_module, tmp_path, capsys
):
    mod = step_module
    argv = ["plan", "--state", f"{mod}:state", "--step", f"{mod}:step", "--mesh", "data=8"]
    argv += ["--batch", "float32[16,64]"]
    assert main([*argv, "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["step_memory"]["total"]
    budget = str(total - 1)
    out_rules = tmp_path / "fits.toml"
    assert main([*argv, "--budget", budget, "--write-rules", str(out_rules)]) == 1
    captured = capsys.readouterr()
    assert "smallest change that fits: shard the optimizer state over 'data' (ZeRO-1)" in (
        captured.out
    )
    assert "# rules file for state" in captured.out  # the command line pastes TOML
    err = captured.err.splitlines()
    assert err[0] == f"wrote {out_rules}"
    assert err[1] == "modelshard plan: error: the step does not fit the memory budget:"
    assert err[3].startswith(f"    problem: the step needs {ms._base.format_bytes(total)}")
    assert err[-1].startswith("    hint: the smallest change that fits (")
    assert err[-1].endswith("checked by compiling): shard the optimizer state over 'data' (ZeRO-1)")
    # the rules file written, given back as --rules, fits
    assert main([*argv, "--rules", str(out_rules), "--budget", budget]) == 0
    capsys.readouterr()
    assert main([*argv, "--budget", budget, "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "FitError"
    advice = error["advice"]
    assert (advice["fits"], advice["best"]["kind"]) == (False, "shard_optimizer")
    assert (
        advice["best"]["total"] <= total - 1
        and advice["compiles"] == len(advice["suggestions"]) + 1
    )


def test_a_checkpoints_tree_goes_to_the_step(step_module, tmp_path, capsys):
    import importlib

    m = importlib.import_module(step_module)
    ms.save(tmp_path / "ckpt", m.init(jax.random.key(0)))
    argv = ["plan", str(tmp_path / "ckpt"), "--step", f"{step_module}:sgd", "--mesh", "data=8"]
    assert main([*argv, "--batch", "float32[16,64]", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["step_memory"]
    assert memory["parts"]["parameters"] == 2 * 64 * 256 * 4  # replicated, as it was saved
    assert (
        memory["parts"]["optimizer_state"] == 0
        and sum(memory["parts"].values()) == (memory["total"])
    )


def test_step_arguments_are_checked(step_module, capsys):
    base = ["plan", "--state", f"{step_module}:state", "--mesh", "data=8"]
    for flag, value, said in (
        ("--step", "nomodule", "'nomodule' is not MODULE:FUNCTION, e.g. train:step"),
        ("--step", "no_such_module_xyz:step", "cannot import 'no_such_module_xyz'"),
        ("--step", f"{step_module}:nothing", f"module '{step_module}' has no 'nothing'"),
        ("--batch", "int32(16)", "'int32(16)' is not an array shape"),
        ("--batch", "a=int32[2],int32[2]", "name every array of several: 'int32[2]'"),
    ):
        assert main([*base, flag, value]) == 2
        assert said in one_line(capsys.readouterr().err, "plan")
    for value, said in (
        (
            "float32(64,256)",
            "argument --batch: 'float32(64,256)' is not an array shape; write int32[16,2048] "
            "or tokens=int32[16,2048],mask=bool[16,2048]",
        ),
        ("f32[64,256]", "argument --batch: 'f32' is not a dtype here; write float32"),
        ("x=bf16[2],y=i32[2]", "argument --batch: 'bf16' is not a dtype here; write bfloat16"),
    ):
        assert main([*base, "--batch", value]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"modelshard plan: error: {said} (see 'modelshard plan --help')"
        ]
    assert main([*base, "--step", f"{step_module}:step"]) == 2
    assert "--step and --batch go together" in capsys.readouterr().err


def test_the_command_simulates_the_cpu_devices_its_mesh_needs(step_module):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    argv = ["plan", "--state", f"{step_module}:state", "--step", f"{step_module}:step"]
    argv += ["--batch", "float32[16,64]", "--mesh", "data=8", "--json"]
    code = "import sys; from modelshard.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["mesh"] == {"data": 8}
    assert data["step_memory"]["parts"]["batch"] == 16 * 64 * 4 // 8


def test_a_mesh_larger_than_a_started_jax_is_explained_in_command_line_words(step_module, capsys):
    # JAX started with 8 CPU devices, as when a module sets its count or uses JAX on import
    assert jax.device_count() == 8
    argv = ["plan", "--state", f"{step_module}:state", "--step", f"{step_module}:step"]
    argv += ["--batch", "float32[64,64]"]
    assert main([*argv, "--mesh", "data=64"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "modelshard plan: error: mesh (data=64) needs 64 devices to compile for, this machine "
        "has 8: the --step or --state module fixed JAX's device count when imported (its own "
        "jax_num_cpu_devices, or a JAX computation); pass --topology v5e:8x8 to compile for a "
        "TPU slice, or have that module call jax.config.update('jax_num_cpu_devices', 64) "
        "before it uses JAX"
    ]
    assert main([*argv, "--mesh", "data=4,model=3"]) == 1  # no v5e slice has 12 chips
    assert capsys.readouterr().err.splitlines() == [
        "modelshard plan: error: mesh (data=4, model=3) needs 12 devices to compile for, this "
        "machine has 8: the --step or --state module fixed JAX's device count when imported "
        "(its own jax_num_cpu_devices, or a JAX computation); have that module call "
        "jax.config.update('jax_num_cpu_devices', 12) before it uses JAX"
    ]


def test_a_step_that_raises_is_one_error_naming_it(step_module, capsys):
    mod = step_module
    argv = ["plan", "--state", f"{mod}:state", "--mesh", "data=8"]
    assert main([*argv, "--step", f"{mod}:broken", "--batch", "float32[16,64]"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"modelshard plan: error: the step {mod}:broken raised while being traced: "
        "ValueError: x must be tokens,",
        "not floats",
    ]
    # a batch of the wrong shape, with --json: the one document on stdout
    assert main([*argv, "--step", f"{mod}:step", "--batch", "float32[16,63]", "--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert (data["ok"], data["exit_status"]) == (False, 1)
    error = data["error"]
    assert error["type"] == "TypeError" and error["function"] == f"{mod}:step"
    assert error["message"].startswith(
        f"the step {mod}:step raised while being traced: TypeError: dot_general requires "
    )
    assert captured.err == (
        "modelshard plan: error: TypeError, exit status 1 (the JSON on stdout says what and "
        "where)\n"
    )


def test_write_rules_names_the_other_changes_and_says_when_nothing_is_written(
    step_module, tmp_path, capsys
):
    mod = step_module
    argv = ["plan", "--state", f"{mod}:state", "--step", f"{mod}:step", "--mesh", "data=8"]
    argv += ["--batch", "float32[1024,64]"]
    out_rules = tmp_path / "fits.toml"
    # FSDP and narrower moments with a quarter of the batch: the file says the rest
    assert main([*argv, "--budget", "400000", "--write-rules", str(out_rules)]) == 1
    capsys.readouterr()
    lines = out_rules.read_text().splitlines()
    assert lines[:6] == [
        "# This placement fits the budget only with these changes too (modelshard plan",
        "# --budget, checked by compiling):",
        "#   optax.adamw(learning_rate, mu_dtype=jnp.bfloat16)",
        "#   a global batch of 256 (32 per device)",
        "",
        "strict = true",
    ]
    assert ms.load_rules(out_rules)  # still a rules file
    for extra, why in (
        ([], "--write-rules writes the change that fits a --budget; none was given"),
        (["--budget", "1GiB"], "the step fits the budget as it is"),
        (["--budget", "1KiB"], "no change tried fits the budget"),
    ):
        target = tmp_path / "none.toml"
        main([*argv, *extra, "--write-rules", str(target)])
        err = capsys.readouterr().err.splitlines()
        assert err[0] == f"nothing written to {target}: {why}"
        assert not target.exists()
