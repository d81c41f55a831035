"""``modelshard steps``: a CheckpointManager root's steps, complete and leftover."""

from __future__ import annotations

import argparse
from typing import Any

from .._base import CheckpointError, format_bytes, literal
from .._checkpoint import check_bucket, checkpoint_kind, is_remote, list_steps, location, reaching
from .args import add_json
from .output import absolute, console, emit, new_table, say


def add_parser(sub: Any) -> None:
    """The ``steps`` subcommand."""
    s = sub.add_parser(
        "steps",
        help="list a CheckpointManager root's steps, complete and leftover",
        description="List every step in a CheckpointManager's root (a local path, gs:// or "
        "s3://): the complete ones, which restore, the leftovers of saves that did not "
        "finish (a process or host died), and steps another tool wrote there (Orbax's own "
        "CheckpointManager's complete steps restore as the manager's do): what is there, what "
        "is missing, files and bytes. The next save of a leftover's step number removes it; "
        "another tool's steps are never removed or replaced by the manager.",
    )
    s.add_argument("root", metavar="ROOT", help="the manager's root directory or URL")
    add_json(s)
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    root = location(args.root)
    if not is_root(root):
        raise CheckpointError(f"{args.root} does not exist.")
    not_a_root(root, args.root)
    entries = list_steps(root)
    complete = [e.step for e in entries if e.restorable]
    if args.json:
        emit(
            args,
            root=absolute(args.root),
            complete=complete,
            latest=complete[-1] if complete else None,
            steps=[e.to_json() | {"path": absolute(e.path)} for e in entries],
        )
        return 0
    if not entries:
        say(f"{args.root}: no steps.")
        return 0
    columns = ["step", "status", "files", "bytes", "what is there"]
    table = new_table(str(root), None, columns, right=("step", "files", "bytes"))
    for e in entries:
        status = "complete" if e.restorable else f"leftover: {e.why}"
        if e.foreign:
            status = f"{e.why}, {'complete' if e.complete else 'unfinished'}"
        if e.foreign and e.restorable:
            status = f"complete, {e.why}"
        cells = [str(e.step), status, str(e.files), format_bytes(e.bytes), what_is_there(e)]
        table.add_row(*map(literal, cells))
    console().print(table)
    leftovers = sorted({e.step for e in entries if e.status == "leftover"})
    foreign = sorted({e.step for e in entries if e.status == "foreign"})
    orbax = sorted({e.step for e in entries if e.foreign and e.restorable})
    said = [f"latest complete step: {complete[-1]}" if complete else "no complete step"]
    if orbax:
        said.append(f"Orbax's: step {', '.join(map(str, orbax))}")
    if leftovers:
        said.append(f"leftovers of step {', '.join(map(str, leftovers))}")
    if foreign:
        said.append(f"written by another tool: step {', '.join(map(str, foreign))}")
    say("; ".join(said))
    if leftovers:
        say(
            "A leftover is what a save that did not finish left behind; the next save of "
            "its step number removes it."
        )
    if orbax:
        say(
            "A CheckpointManager lists and restores the complete steps of Orbax's own "
            "CheckpointManager as its own, but never removes or replaces them (its rotation "
            "leaves them) and refuses to save over their numbers; "
            "CheckpointManager.delete(step) removes one by name."
        )
    if foreign:
        say(
            "A CheckpointManager never removes or replaces a step another tool wrote: it "
            "neither lists nor restores it, and refuses to save over its number. Save under "
            "other step numbers, move it away, or remove it by name with "
            "CheckpointManager.delete(step)."
        )
    return 0


def what_is_there(e: Any) -> str:
    """The table's "what is there" of one ``StepEntry``: its parts, unfinished, missing, other."""
    said = [", ".join(e.has) or "nothing"]
    if e.unfinished:
        said.append(f"unfinished: {', '.join(f'{p} (as {n})' for p, n in e.unfinished)}")
    if e.lacks:
        said.append(f"no {', '.join(e.lacks)}")
    if e.others:
        said.append(f"other: {', '.join(e.others)}")
    there = "; ".join(said)
    if not e.restorable and e.path.name != str(e.step):
        there = f"in {e.path.name}: {there}"
    return there


def not_a_root(root: Any, given: str) -> None:
    """Refuse a checkpoint given as a manager root (an empty listing would not say why)."""
    kind = checkpoint_kind(root)
    if kind is None:
        return
    if kind == "step":
        what = f"step {root.name} of a CheckpointManager root"
        fix = f"`modelshard steps {parent_of(given)}` lists that root's steps"
    else:
        what = "a checkpoint"
        fix = f"`modelshard inspect {given}` shows what it holds"
    raise CheckpointError(
        f"{given} is {what}, not a CheckpointManager root (a folder of numbered steps), so "
        f"it has no steps; {fix}."
    )


def parent_of(given: str) -> str:
    """The folder above ``given`` as the user wrote it (a path or a URL)."""
    head, sep, _ = given.rstrip("/").rpartition("/")
    return (head or "/") if sep else "."


def is_root(root: Any) -> bool:
    """Whether ``root`` is there: a local directory, or an object-storage folder."""
    if is_remote(root):
        check_bucket(root)  # a misspelt bucket is said so
        return True  # an empty prefix is an empty root
    with reaching(root):
        return root.is_dir()
