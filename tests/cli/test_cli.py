"""The modelshard command: inspect, plan, reshard, launch routing, and the installed script."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS
from modelshard._cli.args import parse_mesh
from modelshard.cli import main

RULES = """
[[rules]]
pattern = 'embedding$'
spec = ["vocab", "none"]

[[rules]]
pattern = 'kernel$'
spec = ["none", "model"]

[[rules]]
pattern = ".*"
spec = []

[logical]
vocab = "model"
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    mesh = ms.make_mesh({"data": 8})
    model = ms.shard(MAKERS["nnx"](), ms.fsdp("data", min_size=0), mesh)
    path = ms.save(root / "ckpt", model)
    (root / "rules.toml").write_text(RULES)
    return path


def test_help_on_every_command(capsys):
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
    for cmd in ("inspect", "plan", "reshard"):
        assert main([cmd, "--help"]) == 0
        assert f"usage: modelshard {cmd}" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["plan"]) == 2
    assert "the following arguments are required: CKPT, --mesh" in capsys.readouterr().err


def test_inspect_table_and_json(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "embed/embedding" in out and "P(None, 'data')" in out
    assert "19 array leaves, 11.01 KiB; kind nnx.Module; saved on mesh (data=8)" in out
    assert main(["inspect", str(ckpt), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "nnx.Module" and data["total_bytes"] == 11276
    leaf = next(x for x in data["leaves"] if x["path"] == "mlp/kernel")
    assert (leaf["shape"], leaf["spec"], leaf["bytes"]) == ([16, 32], [None, "data"], 2048)


def test_inspect_plain_orbax_and_missing(tmp_path, capsys):
    with ocp.StandardCheckpointer() as c:
        c.save(str(tmp_path / "plain"), {"a": {"b": jnp.ones((4, 2))}})
    assert main(["inspect", str(tmp_path / "plain"), "--max-rows", "1"]) == 0
    assert "written by orbax" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err == (
        f"modelshard inspect: error: no checkpoint at {tmp_path / 'nope'}: the directory does not "
        "exist.\n"
    )


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


def test_bad_mesh_text_is_a_usage_error(ckpt, capsys):
    assert main(["plan", str(ckpt), "--mesh", "data:2"]) == 2
    assert capsys.readouterr().err == (
        "modelshard plan: error: argument --mesh: 'data:2' is not name=size with a positive "
        "whole size; write e.g. --mesh data=2,model=4 (see 'modelshard plan --help')\n"
    )
    # str.isdigit() accepts a superscript two; int() does not
    assert main(["plan", str(ckpt), "--mesh", "data=\u00b2"]) == 2
    assert "'data=\u00b2' is not name=size" in capsys.readouterr().err
    assert parse_mesh("data=2, model=4") == {"data": 2, "model": 4}
    with pytest.raises(ms.MeshError, match="gives axis 'a' twice"):
        parse_mesh("a=1,a=2")
    with pytest.raises(ms.MeshError, match=r"'b=0' in 'a=1,b=0' is not name=size"):
        parse_mesh("a=1,b=0")


def test_reshard_in_process(ckpt, tmp_path, capsys):
    dst = tmp_path / "out"
    rules = str(ckpt.parent / "rules.toml")
    argv = [
        "reshard",
        str(ckpt),
        str(dst),
        "--mesh",
        "data=2,model=4",
        "--rules",
        rules,
        "--dtype",
        "bfloat16",
        "--chunk-mb",
        "0.001",
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {
        "schema": 1,
        "command": "reshard",
        "ok": True,
        "source": str(ckpt),
        "step": None,
        "destination": str(dst),
        "mesh": {"data": 2, "model": 4},
        "leaves": 19,
        "bytes": 5644,
        "dropped": {"items": [], "metrics": []},
    }
    out = ms.restore(dst)
    assert out["mlp"]["kernel"].dtype == jnp.bfloat16
    assert out["mlp"]["kernel"].sharding.spec == P(None, "model")
    original = ms.restore(ckpt)
    # streamed into one OCDBT store (this process's), merged by Orbax's finalize
    assert sorted(p.name for p in dst.glob("ocdbt.process_*")) == ["ocdbt.process_0"]
    plain = ocp.StandardCheckpointer().restore(str(dst))
    np.testing.assert_array_equal(plain["mlp"]["kernel"], out["mlp"]["kernel"])
    np.testing.assert_array_equal(
        out["embed"]["embedding"], original["embed"]["embedding"].astype(jnp.bfloat16)
    )
    assert main(argv[:-1]) == 1
    err = capsys.readouterr().err
    assert err.startswith("modelshard reshard: error: ") and err.count("\n") == 1
    assert "already exists; pass --overwrite to replace it" in err
    assert main(["reshard", str(ckpt), str(tmp_path / "x"), "--mesh", "data=16"]) == 1
    assert capsys.readouterr().err == (
        "modelshard reshard: error: the target mesh needs 16 devices but JAX already started "
        "with 8; run modelshard reshard in a fresh process.\n"
    )


def test_launch_is_routed_lazily(monkeypatch, capsys):
    import modelshard._runtime.launch as launch

    calls = []
    monkeypatch.setattr(launch, "main", lambda argv: calls.append(argv) or 7)
    assert main(["launch", "-n", "2", "--", "python", "x.py"]) == 7
    assert calls == [["-n", "2", "--", "python", "x.py"]]
    monkeypatch.setitem(sys.modules, "modelshard._runtime.launch", None)
    assert main(["launch", "-n", "2"]) == 1
    assert capsys.readouterr().err.startswith("modelshard launch is not available")


def test_installed_command_end_to_end(ckpt, tmp_path):
    exe = Path(sys.executable).parent / "modelshard"
    assert exe.exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    dst = tmp_path / "four"
    run = subprocess.run(
        [str(exe), "reshard", str(ckpt), str(dst), "--mesh", "data=4", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["mesh"] == {"data": 4}
    record = json.loads((dst / "modelshard.json").read_text())
    assert record["mesh"]["axes"] == {"data": 4}
    spec = {leaf["path"]: leaf["spec"] for leaf in record["leaves"]}
    assert spec["mlp/kernel"] == [None, "data"]
    out = ms.restore(dst, mesh=ms.make_mesh({"data": 4}))
    assert out["mlp"]["kernel"].sharding.spec == P(None, "data")
    assert jax.dtypes.issubdtype(out["drop"]["rngs"]["key"].dtype, jax.dtypes.prng_key)


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


# ---- user errors: one line (or one JSON object), exit 1 for problems, 2 for usage --------------


def _one_line(err: str, command: str) -> str:
    assert err.startswith(f"modelshard {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--dtype", "bogus", "argument --dtype: 'bogus' is not a floating-point dtype"),
        ("--dtype", "int8", "argument --dtype: 'int8' is not a floating-point dtype"),
        ("--chunk-mb", "nan", "argument --chunk-mb: 'nan' is not a finite number above 0"),
        ("--chunk-mb", "-1", "argument --chunk-mb: '-1' is not a finite number above 0"),
        ("--mesh", "data=0", "argument --mesh: 'data=0' is not name=size"),
    ],
)
def test_bad_reshard_values_are_usage_errors(ckpt, tmp_path, capsys, flag, value, says):
    argv = ["reshard", str(ckpt), str(tmp_path / "out"), "--mesh", "data=2", flag, value]
    assert main(argv) == 2
    err = _one_line(capsys.readouterr().err, "reshard")
    assert says in err and err.endswith("(see 'modelshard reshard --help')\n")
    assert not (tmp_path / "out").exists()


def test_usage_error_as_json(ckpt, capsys):
    """--json: the one JSON document goes to stdout on failure too; stderr one human line."""
    assert main(["plan", str(ckpt), "--mesh", "data=\u00b2", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "modelshard plan: error: UsageError, exit status 2 (the JSON on stdout says what "
        "and where)\n"
    )
    err = json.loads(captured.out)
    assert err == {
        "schema": 1,
        "command": "plan",
        "ok": False,
        "exit_status": 2,
        "error": {
            "type": "UsageError",
            "message": "argument --mesh: 'data=\u00b2' is not name=size with a positive whole "
            "size; write e.g. --mesh data=2,model=4 (see 'modelshard plan --help')",
        },
    }


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
    assert capsys.readouterr().err.splitlines()[-1] == (
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


def test_destination_below_a_regular_file(ckpt, tmp_path, capsys):
    (tmp_path / "afile").write_text("not a directory")
    for dst in (tmp_path / "afile" / "sub", tmp_path / "afile" / "a" / "b"):
        assert main(["reshard", str(ckpt), str(dst), "--mesh", "data=2"]) == 1
        err = _one_line(capsys.readouterr().err, "reshard")
        assert f"{tmp_path / 'afile'} is a regular file, not a directory" in err
    assert (tmp_path / "afile").read_text() == "not a directory"


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.EROFS, "Read-only file system (the file system is read-only; choose a writable"),
        (errno.ENOSPC, "No space left on device (the disk is full; free space or choose"),
        (errno.EACCES, "Permission denied"),
    ],
)
def test_destination_os_errors(ckpt, tmp_path, capsys, monkeypatch, code, says):
    """A read-only mount or a full disk (simulated: the writer fails as the OS would)."""
    import modelshard._checkpoint as reshard_module  # the CLI calls the façade's reshard

    dst = tmp_path / "out"

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(dst))

    monkeypatch.setattr(reshard_module, "reshard", fail)
    for extra in ([], ["--json"]):
        assert main(["reshard", str(ckpt), str(dst), "--mesh", "data=2", *extra]) == 1
        captured = capsys.readouterr()
        err = captured.err
        if extra:
            error = json.loads(captured.out)["error"]
            assert err.endswith(", exit status 1 (the JSON on stdout says what and where)\n")
            assert (error["type"], error["errno"]) == (type(OSError(code, "")).__name__, code)
            assert says in error["message"]
        else:
            assert says in _one_line(err, "reshard") and str(dst) in err


def test_rules_file_that_is_not_utf8(ckpt, tmp_path, capsys):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[[rules]]\npattern = "caf\xe9"\nspec = []\n')
    assert main(["plan", str(ckpt), "--mesh", "data=2", "--rules", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not UTF-8 text (byte 24)" in err
    missing = tmp_path / "missing.toml"
    assert main(["plan", str(ckpt), "--mesh", "data=2", "--rules", str(missing)]) == 1
    assert capsys.readouterr().err == (
        f"modelshard plan: error: {missing}: No such file or directory\n"
    )


def test_a_missing_rules_file_is_the_os_error_kind_with_errno(ckpt, tmp_path, capsys):
    """A file the user named that is not there: FileNotFoundError with errno 2, as every
    file-system error on the user's paths, with and without --json."""
    for cmd in (
        ["plan", str(ckpt), "--mesh", "data=2"],
        ["reshard", str(ckpt), str(tmp_path / "r"), "--mesh", "data=2"],
        ["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "c"), "--mesh", "data=2"],
    ):
        if cmd[0] == "convert":
            from safetensors.numpy import save_file

            save_file({"w": np.ones(4, np.float32)}, cmd[1])
        assert main([*cmd, "--rules", "nofile.toml", "--json"]) == 1
        error = json.loads(capsys.readouterr().out)["error"]
        assert error == {
            "type": "FileNotFoundError",
            "message": "nofile.toml: No such file or directory",
            "errno": 2,
        }
        assert main([*cmd, "--rules", "nofile.toml"]) == 1
        assert capsys.readouterr().err == (
            f"modelshard {cmd[0]}: error: nofile.toml: No such file or directory\n"
        )
    assert not (tmp_path / "r").exists() and not (tmp_path / "c").exists()


def test_convert_input_files_missing_are_file_not_found(ckpt, tmp_path, capsys, monkeypatch):
    """convert's input paths (SRC, --mapping, --reference) that are not there: the
    FileNotFoundError itself with errno 2, like --rules, nothing written."""
    from safetensors.numpy import save_file

    monkeypatch.chdir(tmp_path)
    save_file({"w": np.ones(4, np.float32)}, "m.safetensors")
    for argv, missing in (
        (["convert", "nope.safetensors", "c"], "nope.safetensors"),
        (["convert", "m.safetensors", "c", "--mapping", "nomap.toml"], "nomap.toml"),
        (
            ["convert", str(ckpt), "o.safetensors", "--to", "safetensors", "--mapping", "m.toml"],
            "m.toml",
        ),
        (
            [
                "convert",
                str(ckpt),
                "o.safetensors",
                "--to",
                "safetensors",
                "--reference",
                "ref.safetensors",
            ],
            "ref.safetensors",
        ),
    ):
        assert main([*argv, "--json"]) == 1, argv
        assert json.loads(capsys.readouterr().out)["error"] == {
            "type": "FileNotFoundError",
            "message": f"{missing}: No such file or directory",
            "errno": 2,
        }
        assert main(argv) == 1
        assert capsys.readouterr().err == (
            f"modelshard convert: error: {missing}: No such file or directory\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    # and inspect's JSON gives the file's paths absolute, as every command does
    assert main(["inspect", "m.safetensors", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["path"], doc["files"]) == (
        str(tmp_path / "m.safetensors"),
        [str(tmp_path / "m.safetensors")],
    )


def test_an_unwritable_destination_names_what_the_user_typed(ckpt, tmp_path, capsys):
    """A destination whose parent takes no new files (/proc): the error names DST as typed
    (never the writer's temporary file beside it), says why, and hints what to do."""
    from safetensors.numpy import save_file

    st = tmp_path / "m.safetensors"
    save_file({"w": np.ones(4, np.float32)}, str(st))
    for cmd, dest in (
        (["reshard", str(ckpt), "/proc/x", "--mesh", "data=2"], "/proc/x"),
        (["convert", str(st), "/proc/y", "--mesh", "data=2"], "/proc/y"),
        (
            ["convert", str(ckpt), "/proc/z.safetensors", "--to", "safetensors"],
            "/proc/z.safetensors",
        ),
    ):
        says = (
            f"{dest}: cannot be written: its parent directory /proc does not take new files: "
            "No such file or directory (choose a destination in a directory you can write)"
        )
        assert main(cmd) == 1
        assert capsys.readouterr().err == f"modelshard {cmd[0]}: error: {says}\n"
        assert main([*cmd, "--json"]) == 1
        error = json.loads(capsys.readouterr().out)["error"]
        assert error == {"type": "FileNotFoundError", "message": says, "errno": 2}


def test_convert_to_safetensors_refuses_to_replace_without_overwrite(
    ckpt, tmp_path, capsys, monkeypatch
):
    """convert --to safetensors replaces an existing file (or sharded layout) only with
    --overwrite, as reshard and the other direction do; its JSON says what it wrote, with
    absolute paths."""
    monkeypatch.chdir(tmp_path)
    argv = ["convert", str(ckpt), "out.safetensors", "--to", "safetensors"]
    assert main([*argv, "--json"]) == 0
    out = tmp_path / "out.safetensors"
    from safetensors import safe_open

    with safe_open(str(out), "np") as f:
        written = len(list(f.keys()))  # the tensors in the file (not the RNG key leaf)
    assert written == 18
    assert json.loads(capsys.readouterr().out) == {
        "schema": 1,
        "command": "convert",
        "ok": True,
        "source": str(ckpt),
        "step": None,
        "destination": str(out),
        "leaves": written,
        "files": [str(out)],
        "bytes": out.stat().st_size,
    }
    before = out.read_bytes()
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        "modelshard convert: error: out.safetensors already exists; pass --overwrite to replace "
        "it\n"
    )
    assert main([*argv, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"] == {
        "type": "CheckpointError",
        "message": "out.safetensors already exists; pass --overwrite to replace it",
    }
    assert out.read_bytes() == before
    assert main([*argv, "--overwrite"]) == 0
    assert (
        capsys.readouterr().out
        == f"wrote out.safetensors: 18 tensors, {out.stat().st_size / 1024:.2f} KiB\n"
    )
    # the sharded layout: an index or shards of that name in DST are refused too
    sharded = ["convert", str(ckpt), "hf", "--to", "safetensors", "--max-shard-size", "4KB"]
    assert main([*sharded, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1 and doc["files"] == [str(f) for f in shards]
    assert doc["destination"] == str(tmp_path / "hf" / "model.safetensors.index.json")
    assert doc["bytes"] == sum(f.stat().st_size for f in shards) and doc["leaves"] == written
    assert main(sharded) == 1
    assert capsys.readouterr().err == (
        "modelshard convert: error: hf (model-00001-of-00003.safetensors) already exists; pass "
        "--overwrite to replace it\n"
    )
    assert main([*sharded, "--overwrite"]) == 0
    size = sum(f.stat().st_size for f in shards) / 1024
    assert capsys.readouterr().out == (
        f"wrote hf/model.safetensors.index.json: {written} tensors, {size:.2f} KiB in 3 files\n"
    )
    # a directory DST for one file: the writer's own error, --overwrite would not help
    assert main(["convert", str(ckpt), "hf", "--to", "safetensors"]) == 1
    assert capsys.readouterr().err == (
        "modelshard convert: error: hf: a directory; pass a .safetensors file name in it\n"
    )


def test_convert_json_paths_are_absolute_and_dry_run_transforms_null(tmp_path, capsys, monkeypatch):
    from safetensors.numpy import save_file

    monkeypatch.chdir(tmp_path)
    save_file(
        {"norm.weight": np.ones(16, np.float32), "l.0.up.weight": np.ones((24, 16), np.float32)},
        "model.safetensors",
    )
    Path("map.toml").write_text(CONVERT_MAP)
    argv = ["convert", "model.safetensors", "ck", "--mapping", "map.toml", "--json"]
    assert main([*argv, "--dry-run"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == str(tmp_path / "model.safetensors")
    assert [(r["target"], r["transforms"]) for r in doc["rows"]] == [
        ("layers/0/up/kernel", "transpose(1, 0)"),
        ("norm/scale", None),
    ]
    # the table's footer in the command's words: no Python argument (like=) named
    assert main([*argv[:-1], "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "like" not in out
    assert "2 leaves mapped from 2 stored tensors, 0 kept, 0 stored tensors skipped" in " ".join(
        out.split()
    )
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["source"], doc["destination"]) == (
        str(tmp_path / "model.safetensors"),
        str(tmp_path / "ck"),
    )
    assert (doc["mesh"], doc["leaves"], doc["bytes"]) == ({"data": 1}, 2, 24 * 16 * 4 + 64)


def test_a_manager_root_is_said_on_stderr_with_json_too(tmp_path, capsys):
    """stderr carries the human line on a manager's root in both modes; stdout with
    --json is the JSON alone, whose step says the same."""
    root = tmp_path / "run"
    with ms.CheckpointManager(root) as mngr:
        mngr.save(3, {"w": jnp.ones((8, 2))})
    line = f"{root} is a CheckpointManager directory: using its latest complete step 3 ({root / '3'})\n"
    for cmd in (["inspect", str(root)], ["plan", str(root), "--mesh", "data=2"]):
        assert main(cmd) == 0
        assert capsys.readouterr().err == line
        assert main([*cmd, "--json"]) == 0
        captured = capsys.readouterr()
        assert captured.err == line and json.loads(captured.out)["step"] == 3


def test_inspect_a_regular_file(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    assert main(["inspect", str(tmp_path / "weights.bin")]) == 1
    err = _one_line(capsys.readouterr().err, "inspect")
    assert "is a file, not a checkpoint directory" in err and "does not exist" not in err


def test_every_command_takes_json(capsys):
    for cmd in ("inspect", "plan", "reshard"):
        assert main([cmd, "--help"]) == 0
        assert "--json" in capsys.readouterr().out


def test_help_explains_rules_inline(capsys):
    assert main(["plan", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "[[rules]] tables" in out and "[logical]" in out
    assert "docs/" not in out and ".md" not in out


def test_full_disk_reported_by_tensorstore(ckpt, tmp_path, capsys, monkeypatch):
    """TensorStore reports a failed write as ValueError with the OS error code inside (the
    text below is what a real 64 KiB tmpfs produced)."""
    import modelshard._checkpoint as reshard_module  # the CLI calls the façade's reshard

    target = tmp_path / "..out.modelshard-tmp.pieces/merged/manifest.ocdbt"

    def fail(*args, **kwargs):
        raise ValueError(
            f'RESOURCE_EXHAUSTED: Error writing local file "{target}": Failed writing: '
            f'"{target}.__lock": Failed to write 113 bytes to file 8: No space left on device '
            "[os_error_code='28']"
        )

    monkeypatch.setattr(reshard_module, "reshard", fail)
    assert main(["reshard", str(ckpt), str(tmp_path / "out"), "--mesh", "data=2"]) == 1
    assert capsys.readouterr().err == (
        f"modelshard reshard: error: {target}: No space left on device (the disk is full; "
        "free space or choose another destination)\n"
    )
    # any other ValueError from the library is a bug: it is not disguised as a user error
    monkeypatch.setattr(reshard_module, "reshard", lambda *a, **k: int("x"))
    with pytest.raises(ValueError, match="invalid literal"):
        main(["reshard", str(ckpt), str(tmp_path / "out"), "--mesh", "data=2"])


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
        assert f"argument {flag}: '{value}' is not" in _one_line(capsys.readouterr().err, "plan")


def test_python_m_modelshard_is_the_modelshard_script(capsys):
    """``python -m modelshard``, the installed ``modelshard`` script and
    ``modelshard.cli.main`` are one program: the same help, the same exit statuses."""
    script = Path(sys.executable).with_name("modelshard")
    assert script.exists(), "the modelshard script is installed with the package"
    runs = {
        name: subprocess.run(
            [*cmd, *argv], capture_output=True, text=True, timeout=120, check=False
        )
        for name, cmd in {
            "-m": [sys.executable, "-m", "modelshard"],
            "script": [str(script)],
        }.items()
        for argv in [["--help"]]
    }
    assert runs["-m"].returncode == runs["script"].returncode == 0
    assert runs["-m"].stdout == runs["script"].stdout
    assert runs["-m"].stdout.startswith("usage: modelshard [-h] [--version] COMMAND ...")
    for command in ("inspect", "plan", "reshard", "convert", "launch"):
        assert command in runs["-m"].stdout
    assert main(["--help"]) == 0
    assert capsys.readouterr().out == runs["-m"].stdout
    bad = subprocess.run(
        [sys.executable, "-m", "modelshard", "plan", "ckpt", "--mesh", "data=x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2
    assert "modelshard plan: error: argument --mesh" in bad.stderr


MARKUP_RULES = r"""
[[rules]]
pattern = 'attn/w[qkv]$'
spec = ["none", "model"]

[[rules]]
pattern = 'norm\d?/weight$'
spec = []

[[rules]]
pattern = '\[bold\]'
spec = ["model"]
"""


def test_tables_show_user_text_literally(tmp_path, capsys):
    """Rule patterns, paths and names reach rich tables as written: ``[qkv]`` and ``[bold]``
    are not markup, ``\\d`` is not doubled (plan and inspect tables)."""
    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = {
        "attn": {"wq": jnp.ones((8, 8)), "wk": jnp.ones((8, 8))},
        "norm1": {"weight": jnp.ones((8,))},
        "[bold]emb[/bold]": jnp.ones((16, 8)),
    }
    path = ms.save(tmp_path / "ck[red]pt", ms.shard(state, P(), mesh))
    (tmp_path / "tp.toml").write_text(MARKUP_RULES)
    argv = ["plan", str(path), "--mesh", "data=2,model=4", "--rules", str(tmp_path / "tp.toml")]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4:8] == [
        r"│ [bold]emb[/bold] │ (16, 8) │ float32 │ P('model')       │      128 B │ rule 2 '\[bold\]'        │",
        "│ attn/wk          │ (8, 8)  │ float32 │ P(None, 'model') │       64 B │ rule 0 'attn/w[qkv]$'    │",
        "│ attn/wq          │ (8, 8)  │ float32 │ P(None, 'model') │       64 B │ rule 0 'attn/w[qkv]$'    │",
        r"│ norm1/weight     │ (8,)    │ float32 │ P()              │       32 B │ rule 1 'norm\d?/weight$' │",
    ]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    title = "".join(line.strip() for line in out.split("┏")[0].splitlines())
    assert title == str(path)  # the title wraps to the table's width; "[red]" stays
    assert "│ [bold]emb[/bold] │ (16, 8) │ float32 │" in out


CONVERT_MAP = r"""
[[rules]]
source = 'l\.(\d+)\.up\.weight'
target = "layers/{1}/up/kernel"
transpose = [1, 0]

[[rules]]
source = 'norm\.weight'
target = "norm/scale"
"""

# the JSON spelling of a spec entry and of a mesh, in every output
_PROSE = {"message", "what", "hint", "header", "help"}


def _check_schema(doc, where="$"):
    """Every ``spec`` is a list of null / axis name / list of names; every ``mesh`` is an
    object of axis sizes; no other value spells a spec (``P(...)``) or a mesh (``a=3``)
    outside prose fields. Returns how many spec and mesh fields were checked."""
    n = 0
    if isinstance(doc, dict):
        for k, v in doc.items():
            at = f"{where}.{k}"
            if k == "spec" and v is not None:
                assert isinstance(v, list), (at, v)
                for e in v:
                    ok = e is None or isinstance(e, str)
                    ok = ok or (isinstance(e, list) and all(isinstance(a, str) for a in e))
                    assert ok, (at, v)
                n += 1
            elif k == "mesh" and v is not None:
                assert isinstance(v, dict) and v, (at, v)
                assert all(isinstance(a, str) and type(s) is int for a, s in v.items()), (at, v)
                n += 1
            elif k not in _PROSE:
                n += _check_schema(v, at)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            n += _check_schema(v, f"{where}[{i}]")
    elif isinstance(doc, str):
        assert not doc.startswith("P(") and not re.fullmatch(r"(\w+=\d+)(, \w+=\d+)*", doc), (
            where,
            doc,
        )
    return n


def test_every_json_output_has_one_spec_and_mesh_schema(ckpt, tmp_path, capsys):
    """inspect, plan, reshard and convert, on success and on failure: specs are lists with
    nulls and meshes are objects, in results and in problems alike."""
    from safetensors.numpy import save_file

    rules = str(ckpt.parent / "rules.toml")
    st = tmp_path / "model.safetensors"
    save_file(
        {
            "norm.weight": np.ones(16, np.float32),
            **{f"l.{i}.up.weight": np.ones((24, 16), np.float32) for i in range(2)},
        },
        str(st),
    )
    (tmp_path / "map.toml").write_text(CONVERT_MAP)
    (tmp_path / "conv.toml").write_text(
        '[[rules]]\npattern = "kernel$"\nspec = ["data"]\n\n[[rules]]\npattern = ".*"\nspec = []\n'
    )
    conv = ["--mapping", str(tmp_path / "map.toml"), "--rules", str(tmp_path / "conv.toml")]
    runs = {
        "inspect": (["inspect", str(ckpt)], 0),
        "inspect missing": (["inspect", str(tmp_path / "nope")], 1),
        "plan": (["plan", str(ckpt), "--mesh", "data=2,model=4", "--rules", rules], 0),
        "plan problems": (["plan", str(ckpt), "--mesh", "data=2,model=3", "--rules", rules], 1),
        "plan budget": (["plan", str(ckpt), "--mesh", "data=8", "--budget", "1KiB"], 1),
        "plan usage": (["plan", str(ckpt), "--mesh", "data=0"], 2),
        "reshard": (
            [
                "reshard",
                str(ckpt),
                str(tmp_path / "r"),
                "--mesh",
                "data=2,model=4",
                "--rules",
                rules,
            ],
            0,
        ),
        "reshard problems": (
            ["reshard", str(ckpt), str(tmp_path / "r3"), "--mesh", "model=3", "--rules", rules],
            1,
        ),
        "convert": (["convert", str(st), str(tmp_path / "c"), "--mesh", "data=8", *conv], 0),
        "convert dry run": (
            ["convert", str(st), str(tmp_path / "c"), "--mesh", "data=8", *conv, "--dry-run"],
            0,
        ),
        "convert problems": (
            ["convert", str(st), str(tmp_path / "c3"), "--mesh", "data=3", *conv],
            1,
        ),
    }
    checked = {}
    for name, (argv, status) in runs.items():
        assert main([*argv, "--json"]) == status, name
        doc = json.loads(capsys.readouterr().out)
        assert doc["ok"] is (status == 0), name
        checked[name] = _check_schema(doc)
    # the failures carry the fields they are about: every offending leaf's spec and mesh
    assert checked["plan problems"] >= 12 and checked["reshard problems"] >= 12
    assert checked["plan budget"] >= 1 and checked["convert problems"] >= 2
    assert checked["plan"] >= 1 + 19 * 2 and checked["inspect"] >= 19


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


def test_reshard_of_a_manager_step_never_drops_items_silently(tmp_path, capsys):
    """A CheckpointManager step's items and metrics cannot ride along in a resharded
    checkpoint: the reshard is refused, naming them, unless told to drop them (then the
    output says what was dropped)."""
    root = tmp_path / "run"
    with ms.CheckpointManager(root) as mngr:
        mngr.save(
            3,
            {"w": jnp.ones((8, 2))},
            items={"config": {"lr": 0.1}, "rng": jax.random.key(0)},
            metrics={"loss": 0.5},
        )
    step = root / "3"
    refused = (
        f"{step} is step 3 of a CheckpointManager and holds items (config, rng) and metrics "
        "(loss) beside its arrays; a resharded checkpoint holds arrays only, so they would be "
        f"lost. Keep them: read CheckpointManager({str(root)!r}).items(3) and .metrics(3) and "
        "save them with the resharded state; or pass {} to reshard the arrays without them."
    )
    mesh = ms.make_mesh({"data": 8})
    with pytest.raises(ms.CheckpointError) as e:
        ms.reshard(step, tmp_path / "py", specs=P("data"), mesh=mesh)
    assert str(e.value) == refused.format("drop_items=True")
    assert not (tmp_path / "py").exists()
    # the command line: the root means its latest step; the flag is named as typed
    argv = ["reshard", str(root), str(tmp_path / "cli"), "--mesh", "data=8"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.endswith(f"modelshard reshard: error: {refused.format('--drop-items')}\n")
    assert not (tmp_path / "cli").exists()
    assert main([*argv, "--drop-items"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        f"dropped the step's items (config, rng) and metrics (loss) (--drop-items): "
        f"{tmp_path / 'cli'} holds the arrays only"
    )
    assert main([*argv[:2], str(tmp_path / "cli2"), *argv[3:], "--drop-items", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dropped"] == {"items": ["config", "rng"], "metrics": ["loss"]}
    # a plain checkpoint has nothing to drop
    assert (
        main(["reshard", str(tmp_path / "cli"), str(tmp_path / "p"), "--mesh", "data=8", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["dropped"] == {"items": [], "metrics": []}


def test_inspect_folds_like_plan_in_record_order(tmp_path, capsys):
    """Leaves that differ only in layer numbers share a row, in the order the state
    flattens (the record's order; ``layers/10`` after ``layers/9``); --no-fold lists each."""
    state = {
        "layers": [{"w": jnp.ones((8, 4)), "b": jnp.ones(4)} for _ in range(12)],
        "head": jnp.ones((4, 2)),
    }
    mesh = ms.make_mesh({"data": 8})
    path = ms.save(
        tmp_path / "ck", ms.shard(state, ms.Rules([("w$", P("data")), (".*", P())]), mesh)
    )
    assert main(["inspect", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[1:8] == [
        "┏━━━━━━━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━┓",
        "┃ path             ┃ leaves ┃ shape  ┃ dtype   ┃     bytes ┃ saved spec ┃ names ┃",
        "┡━━━━━━━━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━┩",
        "│ head             │      1 │ (4, 2) │ float32 │      32 B │ P()        │ -     │",
        "│ layers/{0..11}/b │     12 │ (4,)   │ float32 │  16 B x12 │ P()        │ -     │",
        "│ layers/{0..11}/w │     12 │ (8, 4) │ float32 │ 128 B x12 │ P('data')  │ -     │",
        "└──────────────────┴────────┴────────┴─────────┴───────────┴────────────┴───────┘",
    ]
    assert main(["inspect", str(path), "--no-fold", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    order = [r["path"] for r in doc["rows"]]
    assert (
        order
        == [leaf["path"] for leaf in doc["leaves"]]
        == [
            "head",
            *[f"layers/{i}/{n}" for i in range(12) for n in ("b", "w")],
        ]
    )
    assert main(["inspect", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[2] == {
        "path": "layers/{0..11}/w",
        "count": 12,
        "shape": [8, 4],
        "dtype": "float32",
        "spec": ["data"],
        "names": None,
        "bytes": 128,
        "paths": [f"layers/{i}/w" for i in range(12)],
    }
    assert main(["plan", str(path), "--mesh", "data=8", "--no-fold", "--max-rows", "2"]) == 0
    assert "... 23 more rows (23 leaves); run without --max-rows to show all" in (
        capsys.readouterr().out.splitlines()
    )


def test_cli_page_json_is_what_the_commands_print(tmp_path, monkeypatch, capsys):
    """docs/cli.md shows a success's and a failure's JSON side by side: both are exactly
    what ``modelshard plan`` prints today (the directory aside)."""
    page = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    shown = re.findall(
        r"^```text\n\$ modelshard (plan ckpt [^\n]*--json)\n(\{.*?^\})\n```$",
        page,
        flags=re.MULTILINE | re.DOTALL,
    )
    assert [cmd.split()[3] for cmd, _ in shown] == ["model=4", "model=3"]
    monkeypatch.chdir(tmp_path)
    mesh = ms.make_mesh({"data": 8})
    ms.save("ckpt", ms.shard({"head": {"kernel": jnp.zeros((8, 32))}}, P(), mesh))
    Path("tp.toml").write_text('[[rules]]\npattern = "kernel$"\nspec = ["none", "model"]\n')
    for (cmd, doc), status in zip(shown, (0, 1), strict=True):
        assert main(cmd.split()) == status
        out = capsys.readouterr().out.replace(f"{tmp_path}/", "/home/me/")
        assert json.loads(out) == json.loads(doc)


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


def test_printed_lines_show_paths_literally(ckpt, tmp_path, capsys):
    """'wrote ...' lines of reshard and convert print the path as it is, ``[red]`` included,
    on one line."""
    from safetensors.numpy import save_file

    dst = tmp_path / "[red]out[/red]"
    assert main(["reshard", str(ckpt), str(dst), "--mesh", "data=8"]) == 0
    assert capsys.readouterr().out == f"wrote {dst}: 19 leaves, 11.01 KiB, mesh data=8\n"
    st = tmp_path / "model.safetensors"
    save_file({"norm.weight": np.ones(16, np.float32), "l.0.up.weight": np.ones((24, 16))}, str(st))
    (tmp_path / "map.toml").write_text(CONVERT_MAP)
    conv = tmp_path / "[bold]conv"
    argv = ["convert", str(st), str(conv), "--mapping", str(tmp_path / "map.toml")]
    assert main([*argv, "--mesh", "data=8"]) == 0
    assert capsys.readouterr().out == f"wrote {conv}: 2 leaves, 3.06 KiB, mesh data=8\n"


def test_inspect_of_a_manager_step_names_its_items_and_metrics(tmp_path, capsys):
    with ms.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(2, {"w": jnp.ones((8, 2))}, items={"data": {"pos": 2}}, metrics={"loss": 0.5})
    assert main(["inspect", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "items: data (CheckpointManager.items; --json shows them)",
        "metrics: loss=0.5",
    ]


def test_max_rows_says_what_is_left_out_below_every_table(ckpt, tmp_path, capsys):
    """inspect (checkpoint and safetensors), plan and convert --dry-run cut by --max-rows
    all count the rest on one line below the table, never as a row inside it."""
    from safetensors.numpy import save_file

    def below(argv):
        assert main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        (more,) = [i for i, line in enumerate(lines) if "more " in line]
        # the table (its bottom border) is above the line; no table row holds it
        assert any(line.startswith("└") for line in lines[:more]), lines
        assert not any(line.startswith("│ ...") for line in lines)
        return lines[more]

    show = "run without --max-rows to show all"
    assert below(["inspect", str(ckpt), "--no-fold", "--max-rows", "2"]) == (
        f"... 17 more rows (17 leaves); {show}"
    )
    assert below(["plan", str(ckpt), "--mesh", "data=8", "--no-fold", "--max-rows", "2"]) == (
        f"... 17 more rows (17 leaves); {show}"
    )
    st = tmp_path / "model.safetensors"
    tensors = {f"l.{i}.up.weight": np.ones((24, 16), np.float32) for i in range(4)}
    save_file({**tensors, "norm.weight": np.ones(16, np.float32)}, str(st))
    assert below(["inspect", str(st), "--max-rows", "1"]) == f"... 4 more tensors; {show}"
    (tmp_path / "map.toml").write_text(CONVERT_MAP)
    argv = ["convert", str(st), str(tmp_path / "c"), "--mapping", str(tmp_path / "map.toml")]
    assert below([*argv, "--dry-run", "--max-rows", "1"]) == f"... 4 more leaves; {show}"


def _page_commands() -> dict[str, list[tuple[set[str], set[str]]]]:
    """docs/cli.md's command table: command -> per row (options shown required, i.e.
    outside [...], and every option shown), from the backticked command cell."""
    page = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    out: dict[str, list[tuple[set[str], set[str]]]] = {}
    for cell in re.findall(r"^\| `modelshard ([^`]+)` \|", page, flags=re.MULTILINE):
        text = cell.split(" -- ")[0]
        required, shown, depth = set(), set(), 0
        for m in re.finditer(r"\[|\]|(?<![\w-])(--?[a-z][\w-]*)", text):
            if m.group(0) == "[":
                depth += 1
            elif m.group(0) == "]":
                depth -= 1
            else:
                shown.add(m.group(1))
                if depth == 0:
                    required.add(m.group(1))
        out.setdefault(cell.split()[0], []).append((required, shown))
    return out


def test_cli_page_lists_every_option_as_help_does():
    """docs/cli.md's table shows each command's options as its --help does: every option
    (a command's rows together), and required exactly when argparse requires it (an option
    required in every row of a command: --to safetensors picks a row, it is not required)."""
    import argparse

    from modelshard._cli import parser
    from modelshard._runtime.launch import _parser as launch_parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {**sub.choices, "launch": launch_parser()}
    page = _page_commands()
    assert sorted(page) == sorted(parsers)
    for name, p in parsers.items():
        options = [a for a in p._actions if a.option_strings and a.dest != "help"]
        canonical = {s: a.option_strings[-1] for a in options for s in a.option_strings}
        rows = page[name]
        shown = {canonical.get(o, o) for _, every in rows for o in every}
        assert shown == {a.option_strings[-1] for a in options}, name
        required = set.intersection(*({canonical.get(o, o) for o in r} for r, _ in rows))
        assert required == {a.option_strings[-1] for a in options if a.required}, name
