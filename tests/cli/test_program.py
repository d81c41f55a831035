"""The modelshard program (``_cli/program.py``): help for every command, the installed script and
``python -m modelshard`` alike, and docs/cli.md true to what the commands print and accept."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard.cli import main


def test_help_on_every_command(capsys):
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
    for cmd in ("inspect", "plan", "reshard"):
        assert main([cmd, "--help"]) == 0
        assert f"usage: modelshard {cmd}" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["plan"]) == 2
    assert "the following arguments are required: --mesh" in capsys.readouterr().err


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
    from modelshard._runtime.processes import _parser as launch_parser

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


def test_ctrl_c_is_one_line_and_status_130_and_nothing_is_published(tmp_path):
    """SIGINT to a ``modelshard reshard`` under way (its staging directory written): exit
    status 130, one line on stderr, nothing published, and the next reshard to the same
    path completes, leaving nothing hidden."""
    mesh = ms.make_mesh({"data": 8})
    state = {f"w{i}": jnp.full((512, 1024), float(i)) for i in range(24)}  # 48 MiB
    src = ms.save(tmp_path / "src", ms.shard(state, ms.fsdp("data"), mesh))
    exe = Path(sys.executable).parent / "modelshard"
    argv = [str(exe), "reshard", str(src), str(tmp_path / "dst"), "--mesh", "data=2,model=4"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # SIGINT caught (not ignored, as it may be under a test runner's workers) in the
    # process that execs the command: exec gives the command the default disposition
    trampoline = "import os, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", trampoline, *argv, "--chunk-mb", "1"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith(".") for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "no staging seen"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines() == [
        "modelshard reshard: error: interrupted (Ctrl-C); nothing half-written was published"
    ]
    assert not (tmp_path / "dst").exists()
    # The staging directory is removed on the way out; a slab write TensorStore started in
    # the instant the interrupt came (before its future was kept) may land after that, as
    # after a kill -9: the next reshard to the same path removes it.
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_dropped_inside_a_garbage_collector_callback_still_ends_the_command(
    tmp_path, monkeypatch, capsys
):
    """Python drops a KeyboardInterrupt raised inside a gc callback (JAX registers one) as
    "ignored", and the command went on and published. The command's next progress report
    raises it again."""
    from modelshard._cli import output
    from modelshard._cli import reshard as reshard_cli

    ticks: list[int] = []

    def ctrl_c_in_gc(_phase: str, _info: dict) -> None:
        gc.callbacks.remove(ctrl_c_in_gc)
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # as the signal would

    def run(args):
        with output.progress_bar(args, "resharding") as progress:
            gc.callbacks.append(ctrl_c_in_gc)
            gc.collect()  # the KeyboardInterrupt is dropped here, "ignored"
            for i in range(3):
                ticks.append(i)
                progress(i, 3)
        return 0

    monkeypatch.setattr(reshard_cli, "run", run)
    argv = ["reshard", str(tmp_path / "a"), str(tmp_path / "b"), "--mesh", "data=2"]
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh process
    try:
        assert main(argv) == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, before)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "modelshard reshard: error: interrupted (Ctrl-C); nothing half-written was published"
    )
    assert ticks == [0]  # the first report after the drop ended it
