"""``modelshard mappings``: the weight mappings shipped with modelshard, by name."""

from __future__ import annotations

import argparse
from typing import Any

from .._base import literal
from .._weights import shipped_mappings
from .args import add_json
from .output import console, emit, new_table


def add_parser(sub: Any) -> None:
    """The ``mappings`` subcommand."""
    mp = sub.add_parser(
        "mappings",
        help="list the weight mappings shipped with modelshard",
        description="List the weight mappings shipped with modelshard: the name that "
        "--mapping (and mapping= in Python) takes, the checkpoints each reads and the "
        "parameter tree it maps them onto.",
    )
    add_json(mp)
    mp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    shipped = shipped_mappings()
    if args.json:
        emit(
            args,
            mappings=[
                {"name": m.name, "source": m.source, "target": m.target, "path": str(m.path)}
                for m in shipped.values()
            ],
        )
        return 0
    t = new_table("shipped weight mappings (--mapping NAME)", None, ["name", "reads", "maps onto"])
    for m in shipped.values():
        t.add_row(m.name, literal(m.source), literal(m.target))
    console().print(t)
    return 0
