"""``modelshard steps``: a manager root's complete steps and the leftovers of a save that
did not finish (a real one: a process that died mid-save), on a local disk and on s3://."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

import modelshard as ms
from modelshard._checkpoint import list_steps
from modelshard._checkpoint.storage import ORBAX_TMP
from modelshard._cli.steps import what_is_there
from modelshard.cli import main

SCRIPT = Path(__file__).parent / "scripts" / "die_mid_save.py"
PARTS = ["_CHECKPOINT_METADATA", "state", "modelshard/modelshard.json", "items"]


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "s3":
        return request.getfixturevalue("s3_root")
    return str(tmp_path / "run")


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    capsys.readouterr()
    status = main(["steps", *argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def listing(path: str) -> list[str]:
    """The names in a folder, listed without modelshard."""
    if path.startswith("s3://"):
        import s3fs

        return [p.rsplit("/", 1)[1] for p in s3fs.S3FileSystem().ls(path, refresh=True)]
    return os.listdir(path)


def tally(path: str) -> tuple[int, int]:
    """(files, bytes) under a step, counted without modelshard."""
    if path.startswith("s3://"):
        import s3fs

        fs = s3fs.S3FileSystem()
        found = fs.find(path, detail=True)
        assert isinstance(found, dict)
        sizes = [info["size"] for info in found.values()]
        return len(sizes), sum(sizes)
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs]
    return len(sizes), sum(sizes)


def test_steps_lists_complete_steps_and_the_leftovers_of_a_dead_save(root, capsys):
    died = subprocess.run(
        [sys.executable, str(SCRIPT), root], capture_output=True, text=True, timeout=400
    )
    assert died.returncode == 0, died.stderr[-3000:]
    status, doc = run_json(capsys, root)
    assert status == 0, doc
    remote = root.startswith("s3://")
    leftover = doc["steps"][-1]
    name = leftover["path"].rsplit("/", 1)[1]
    inside = sorted(listing(leftover["path"]))
    # arrays, record and items written; the step's metadata and commit not
    done = [p for p in PARTS if p.split("/")[0] in inside]
    assert done == ["state", "modelshard/modelshard.json", "items"]
    assert "data" in inside  # the JSON item, as Orbax's JsonSave writes it: not "others"
    unfinished: list = []
    if remote:  # written in place, committed last
        assert name == "2"
        why = "interrupted save"
        lacks = ["_CHECKPOINT_METADATA", "commit_success.txt"]
        there = f"{', '.join(done)}; no _CHECKPOINT_METADATA, commit_success.txt"
    else:  # a staging folder, renamed when done
        assert name == f"2{ORBAX_TMP}"
        why, lacks = "staging folder of an interrupted save", ["_CHECKPOINT_METADATA"]
        there = f"in {name}: {', '.join(done)}; no _CHECKPOINT_METADATA"
    base = root if remote else os.path.abspath(root)
    complete = [
        {
            "step": s,
            "status": "complete",
            "owner": "modelshard",
            "complete": True,
            "path": f"{base}/{s}",
            "why": None,
            "has": [*PARTS, "commit_success.txt"],
            "unfinished": [],
            "lacks": [],
            "others": [],
            "files": tally(f"{base}/{s}")[0],
            "bytes": tally(f"{base}/{s}")[1],
        }
        for s in (0, 1)
    ]
    files, size = tally(leftover["path"])
    assert doc == {
        "schema": 1,
        "command": "steps",
        "ok": True,
        "root": base,
        "complete": [0, 1],
        "latest": 1,
        "steps": [
            *complete,
            {
                "step": 2,
                "status": "leftover",
                "owner": "modelshard",
                "complete": False,
                "path": f"{base}/{name}",
                "why": why,
                "has": done,
                "unfinished": unfinished,
                "lacks": lacks,
                "others": [],
                "files": files,
                "bytes": size,
            },
        ],
    }
    assert files > 0
    capsys.readouterr()
    assert main(["steps", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"leftover: {why}" in "\n".join(lines)
    entry = [e for e in list_steps(root) if not e.complete]
    assert [what_is_there(e) for e in entry] == [there]
    assert lines[-2:] == [
        "latest complete step: 1; leftovers of step 2",
        "A leftover is what a save that did not finish left behind; the next save of its step "
        "number removes it.",
    ]
    # the next save of step 2 removes them
    with ms.CheckpointManager(root, handle_signals=False) as mngr:
        assert mngr.save(2, {"w": jnp.arange(4096.0) + 2}, items={"data": {"pos": 2}})
    status, doc = run_json(capsys, root)
    assert [(e["step"], e["status"]) for e in doc["steps"]] == [
        (0, "complete"),
        (1, "complete"),
        (2, "complete"),
    ]
    assert doc["latest"] == 2


def test_steps_of_an_empty_or_missing_root(tmp_path, capsys):
    status, doc = run_json(capsys, str(tmp_path))
    assert (status, doc["steps"], doc["complete"], doc["latest"]) == (0, [], [], None)
    capsys.readouterr()
    assert main(["steps", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path}: no steps.\n"
    missing = tmp_path / "nope"
    assert main(["steps", str(missing)]) == 1
    assert capsys.readouterr().err == f"modelshard steps: error: {missing} does not exist.\n"


def test_steps_of_a_checkpoint_says_it_is_no_manager_root(tmp_path, capsys):
    """A checkpoint (``ms.save``'s, or one step of a manager) is not a root: it has no
    steps, and the error says what it is and which command to run instead."""
    saved = tmp_path / "ck"
    ms.save(saved, {"w": jnp.arange(8.0)})
    with ms.CheckpointManager(tmp_path / "run", handle_signals=False) as mngr:
        mngr.save(3, {"w": jnp.arange(8.0)})
    step = tmp_path / "run" / "3"
    cases = {
        str(saved): f"{saved} is a checkpoint, not a CheckpointManager root (a folder of "
        f"numbered steps), so it has no steps; `modelshard inspect {saved}` shows what it "
        "holds.",
        str(step): f"{step} is step 3 of a CheckpointManager root, not a CheckpointManager "
        "root (a folder of numbered steps), so it has no steps; "
        f"`modelshard steps {tmp_path / 'run'}` lists that root's steps.",
    }
    for given, message in cases.items():
        capsys.readouterr()
        assert main(["steps", given]) == 1
        out = capsys.readouterr()
        assert (out.out, out.err) == ("", f"modelshard steps: error: {message}\n")
        status, doc = run_json(capsys, given)
        assert status == 1
        assert doc["error"] == {"type": "CheckpointError", "message": message}
    # the root itself is listed
    assert main(["steps", str(tmp_path / "run")]) == 0


def test_steps_tells_another_tools_complete_steps_from_an_interrupted_save(tmp_path, capsys):
    """Orbax's own CheckpointManager saved steps 10, 15, 20 into the root; modelshard's
    manager saved 5 and was interrupted saving 25. Orbax's are complete steps of another
    tool, which the manager restores and will not touch; 25 is a leftover of ours."""
    import shutil

    import orbax.checkpoint as ocp

    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as orbax_mngr:
        for s in (10, 15, 20):
            args = ocp.args.Composite(
                state=ocp.args.StandardSave({"w": jnp.full((4,), float(s))}),
                metadata=ocp.args.JsonSave({"step": s}),
            )
            orbax_mngr.save(s, args=args)
    with ms.CheckpointManager(root, handle_signals=False) as mngr:
        mngr.save(5, {"w": jnp.arange(8.0)})
    # step 25 as a save of ours leaves it when it dies before the commit: items under
    # Orbax's temporary names, the metadata Orbax writes as it starts (no marker yet)
    staging = root / f"25{ORBAX_TMP}"
    shutil.copytree(root / "5", staging)
    for item in [p for p in staging.iterdir() if p.is_dir()]:
        item.rename(staging / f"{item.name}{ORBAX_TMP}-1")
    (staging / "commit_success.txt").unlink()
    (staging / "_CHECKPOINT_METADATA").write_text('{"init_timestamp_nsecs": 1}')
    status, doc = run_json(capsys, str(root))
    assert status == 0
    assert (doc["complete"], doc["latest"]) == ([5, 10, 15, 20], 20)
    orbax_parts = ["_CHECKPOINT_METADATA", "commit_success.txt", "metadata", "state"]
    assert [
        (e["step"], e["status"], e["owner"], e["complete"], e["why"], e["has"], e["lacks"])
        for e in doc["steps"]
    ] == [
        (5, "complete", "modelshard", True, None, [*PARTS, "commit_success.txt"], []),
        *[
            (s, "complete", "orbax", True, "written by another tool (Orbax)", orbax_parts, [])
            for s in (10, 15, 20)
        ],
        (25, "leftover", "modelshard", False, "staging folder of an interrupted save",
         ["_CHECKPOINT_METADATA"], []),
    ]  # fmt: skip
    capsys.readouterr()
    assert main(["steps", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    cells = [[c.strip() for c in line.split("│")[1:3]] for line in lines if "│" in line]
    rows = {step: status for step, status in cells if step}  # a long cell wraps its row
    assert rows == {
        "5": "complete",
        "10": "complete, written by another tool (Orbax)",
        "15": "complete, written by another tool (Orbax)",
        "20": "complete, written by another tool (Orbax)",
        "25": "leftover: staging folder of an interrupted save",
    }
    assert lines[-3:] == [
        "latest complete step: 20; Orbax's: step 10, 15, 20; leftovers of step 25",
        "A leftover is what a save that did not finish left behind; the next save of its step "
        "number removes it.",
        "A CheckpointManager lists and restores the complete steps of Orbax's own "
        "CheckpointManager as its own, but never removes or replaces them (its rotation leaves "
        "them) and refuses to save over their numbers; CheckpointManager.delete(step) removes "
        "one by name.",
    ]
    # an unfinished save of Orbax's is neither listed nor restored
    shutil.copytree(root / "10", root / f"30{ORBAX_TMP}")
    capsys.readouterr()
    assert main(["steps", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "written by another tool (Orbax), unfinished" in "".join(lines)
    assert lines[-4] == (
        "latest complete step: 20; Orbax's: step 10, 15, 20; leftovers of step 25; written by "
        "another tool: step 30"
    )
    assert lines[-1] == (
        "A CheckpointManager never removes or replaces a step another tool wrote: it neither "
        "lists nor restores it, and refuses to save over its number. Save under other step "
        "numbers, move it away, or remove it by name with CheckpointManager.delete(step)."
    )
