"""What the commands print (``_cli/output.py``): JSON on failure, one spec and mesh schema, row
limits that say what is left out."""

from __future__ import annotations

import argparse
import json
import re
import signal

import numpy as np
import pytest

from helpers import CONVERT_MAP
from modelshard.cli import main


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


def test_every_command_takes_json(capsys):
    for cmd in ("inspect", "plan", "reshard"):
        assert main([cmd, "--help"]) == 0
        assert "--json" in capsys.readouterr().out


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


def test_first_ctrl_c_under_a_progress_bar_waits_for_its_tick_the_second_does_not():
    """Raised anywhere, the first Ctrl-C could land inside a thread pool's ``submit`` and
    leave a worker that the interpreter's exit waits on forever."""

    from modelshard._cli import output

    args = argparse.Namespace(json=False, no_progress=True)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with output.interruptible(), output.progress_bar(args, "copying") as tick:
            handler = signal.getsignal(signal.SIGINT)
            handler(signal.SIGINT, None)  # first press: marked, not raised
            with pytest.raises(KeyboardInterrupt):
                tick(1, 2)
            with pytest.raises(KeyboardInterrupt):
                handler(signal.SIGINT, None)  # second press: at once
        with output.interruptible(), pytest.raises(KeyboardInterrupt):  # no bar: at once
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, previous)
