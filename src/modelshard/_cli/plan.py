"""``modelshard plan``: a checkpoint planned onto a mesh, no devices needed."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .args import (
    CKPT_HELP,
    add_json,
    add_max_rows,
    add_target,
    bytes_arg,
    checkpoint_arg,
    regex_arg,
    target_specs,
)
from .output import console, emit, say


def add_parser(sub: Any) -> None:
    """The ``plan`` subcommand."""
    pl = sub.add_parser(
        "plan",
        help="plan a checkpoint onto a mesh",
        description="Plan every leaf of a checkpoint onto a target mesh: spec, "
        "matching rule and bytes per device; or list every problem at once "
        "(exit status 1). No devices are needed.",
    )
    pl.add_argument("checkpoint", metavar="CKPT", help=CKPT_HELP)
    add_target(pl)
    add_json(pl)
    add_max_rows(pl)
    pl.add_argument(
        "--filter",
        type=regex_arg,
        default=None,
        metavar="REGEX",
        help="show only leaves whose path this regular expression is found in, e.g. 'attn'",
    )
    pl.add_argument(
        "--no-fold",
        action="store_true",
        help="one row per leaf (by default leaves that differ only in layer numbers and are "
        "planned alike share a row: layers_{0..61}/mlp/kernel)",
    )
    pl.add_argument(
        "--budget",
        type=bytes_arg,
        default=None,
        metavar="SIZE",
        help="memory per device, e.g. 16GiB or 80GB: exit status 1 if the plan needs more, "
        "naming the largest contributors",
    )
    pl.add_argument(
        "--html",
        metavar="OUT.html",
        default=None,
        help="also write the plan as a self-contained HTML page (memory per device by "
        "module, the grouped table, each leaf's tiles on the mesh); opens offline",
    )
    pl.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._base import make_mesh
    from .._checkpoint import locate, planning_tree
    from .._place import plan

    sizes = args.mesh
    source = locate(checkpoint_arg(args, args.checkpoint))
    specs = target_specs(args, source.record)
    mesh = make_mesh(sizes, axis_types=args.axis_types, abstract=True)
    p = plan(planning_tree(source.record), specs, mesh)
    if args.json:
        if args.html is not None:
            p.to_html(args.html, fold=not args.no_fold, filter=args.filter)
        if args.budget is not None:
            p.check_budget(args.budget)
        emit(
            args,
            {
                "checkpoint": str(source.path),
                "step": args.step,
                "mesh": sizes,
                "bytes_per_device": p.bytes_per_device(),
                "total_bytes": p.total_bytes,
                "modules": p.modules(filter=args.filter),
                "rows": p.groups(fold=not args.no_fold, filter=args.filter),
                "leaves": p.rows(filter=args.filter),
            },
        )
        return 0
    if args.html is not None:
        p.to_html(
            args.html, fold=not args.no_fold, filter=args.filter, title=f"plan of {source.path}"
        )
    console().print(p.table(max_rows=args.max_rows, fold=not args.no_fold, filter=args.filter))
    if args.html is not None:
        say(f"wrote {os.path.abspath(args.html)}", stderr=True)
    if args.budget is not None:
        p.check_budget(args.budget)
    return 0
