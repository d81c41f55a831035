"""``modelshard steps``: a CheckpointManager root's steps, complete and leftover."""

from __future__ import annotations

import argparse
from typing import Any

from .args import add_json
from .output import absolute, console, emit, say


def add_parser(sub: Any) -> None:
    """The ``steps`` subcommand."""
    s = sub.add_parser(
        "steps",
        help="list a CheckpointManager root's steps, complete and leftover",
        description="List every step in a CheckpointManager's root (a local path, gs:// or "
        "s3://): the complete ones, which restore, and the leftovers of saves that did not "
        "finish (a process or host died): what is there, what is missing, files and bytes. "
        "The next save of a leftover's step number removes it.",
    )
    s.add_argument("root", metavar="ROOT", help="the manager's root directory or URL")
    add_json(s)
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .._base import CheckpointError, format_bytes, literal
    from .._checkpoint import list_steps, location

    root = location(args.root)
    if not is_root(root):
        raise CheckpointError(f"{args.root} does not exist.")
    entries = list_steps(root)
    complete = [e.step for e in entries if e.complete]
    if args.json:
        emit(
            args,
            {
                "root": absolute(args.root),
                "complete": complete,
                "latest": complete[-1] if complete else None,
                "steps": [e.to_json() | {"path": absolute(e.path)} for e in entries],
            },
        )
        return 0
    if not entries:
        say(f"{args.root}: no steps.")
        return 0
    table = Table(title=literal(str(root)))
    for col, kw in [
        ("step", {"justify": "right"}),
        ("status", {}),
        ("files", {"justify": "right"}),
        ("bytes", {"justify": "right"}),
        ("what is there", {}),
    ]:
        table.add_column(col, **kw)
    for e in entries:
        status = "complete" if e.complete else f"leftover: {e.why}"
        there = ", ".join(e.has) or "nothing"
        if e.lacks:
            there += f"; no {', '.join(e.lacks)}"
        if not e.complete and e.path.name != str(e.step):
            there += f" ({e.path.name})"
        cells = [str(e.step), status, str(e.files), format_bytes(e.bytes), there]
        table.add_row(*map(literal, cells))
    console().print(table)
    leftovers = sorted({e.step for e in entries if not e.complete})
    latest = f"latest complete step: {complete[-1]}" if complete else "no complete step"
    say(latest + (f"; leftovers of step {', '.join(map(str, leftovers))}" if leftovers else ""))
    if leftovers:
        say(
            "A leftover is what a save that did not finish left behind; the next save of "
            "its step number removes it."
        )
    return 0


def is_root(root: Any) -> bool:
    """Whether ``root`` is there: a local directory, or an object-storage folder."""
    from .._checkpoint import is_remote, reaching

    if is_remote(root):
        from .._checkpoint import check_bucket

        check_bucket(root)  # a misspelt bucket is said so
        return True  # an empty prefix is an empty root
    with reaching(root):
        return root.is_dir()
