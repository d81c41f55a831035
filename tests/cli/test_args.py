"""Argument types (``_cli/args.py``): meshes, rules files, destinations and manager roots as the
user typed them."""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard._cli.args import mesh_arg
from modelshard.cli import main


def test_bad_mesh_text_is_a_usage_error(ckpt, capsys):
    assert main(["plan", str(ckpt), "--mesh", "data:2"]) == 2
    assert capsys.readouterr().err == (
        "modelshard plan: error: argument --mesh: 'data:2' is not name=size with a positive "
        "whole size; write e.g. --mesh data=2,model=4 (see 'modelshard plan --help')\n"
    )
    # str.isdigit() accepts a superscript two; int() does not
    assert main(["plan", str(ckpt), "--mesh", "data=\u00b2"]) == 2
    assert "'data=\u00b2' is not name=size" in capsys.readouterr().err
    assert mesh_arg("data=2, model=4") == {"data": 2, "model": 4}
    with pytest.raises(argparse.ArgumentTypeError, match="gives axis 'a' twice"):
        mesh_arg("a=1,a=2")
    with pytest.raises(argparse.ArgumentTypeError, match=r"'b=0' in 'a=1,b=0' is not name=size"):
        mesh_arg("a=1,b=0")


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
