"""The ``modelshard`` command: inspect, plan and reshard checkpoints; launch local processes.

Every command has ``--help``; commands whose output is data take ``--json``. Errors are
printed as modelshard formats them (every offending leaf at once) with exit status 1;
usage errors exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "parse_mesh"]


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``.

    Raises:
        MeshError: the text is not ``name=size`` pairs with positive sizes.
    """
    from ._errors import MeshError

    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise MeshError(
                f"--mesh {text!r}: {part.strip()!r} is not name=size with a positive size; "
                "write e.g. --mesh data=2,model=4."
            )
        if name.strip() in out:
            raise MeshError(f"--mesh {text!r}: axis {name.strip()!r} is given twice.")
        out[name.strip()] = int(size)
    return out


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=1) + "\n")


def _fmt_spec(spec: Any) -> str:
    from ._specs import format_spec

    return "-" if spec is None else format_spec(spec)


# ---- inspect -----------------------------------------------------------------------------


def _cmd_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ._checkpoint import locate
    from ._plan import format_bytes

    source = locate(args.checkpoint)
    rec = source.record
    if args.json:
        data = rec.to_json()
        data["path"] = str(source.path)
        data["source"] = rec.source
        data["total_bytes"] = rec.nbytes
        for leaf_json, leaf in zip(data["leaves"], rec.leaves, strict=True):
            leaf_json["bytes"] = leaf.nbytes
        _print_json(data)
        return 0
    mesh = rec.mesh_sizes()
    mesh_text = ", ".join(f"{k}={v}" for k, v in mesh.items()) if mesh else "-"
    table = Table(
        title=f"{source.path}",
        caption=f"{len(rec.leaves)} array leaves, {format_bytes(rec.nbytes)}; kind {rec.kind}; "
        f"saved on mesh ({mesh_text}); written by {rec.source}",
    )
    for col, kw in [
        ("path", {}),
        ("shape", {}),
        ("dtype", {}),
        ("bytes", {"justify": "right"}),
        ("saved spec", {}),
        ("names", {}),
    ]:
        table.add_column(col, **kw)
    shown = rec.leaves if args.max_rows is None else rec.leaves[: args.max_rows]
    for leaf in shown:
        names = "-" if leaf.names is None else str(tuple(leaf.names))
        table.add_row(
            leaf.path or "<root>",
            str(leaf.shape),
            leaf.dtype,
            format_bytes(leaf.nbytes),
            _fmt_spec(leaf.spec),
            names,
        )
    if len(shown) < len(rec.leaves):
        table.add_row(f"... {len(rec.leaves) - len(shown)} more leaves", "", "", "", "", "")
    console = _console()
    console.print(table)
    if rec.versions:
        console.print("versions: " + ", ".join(f"{k} {v}" for k, v in rec.versions.items()))
    return 0


# ---- plan --------------------------------------------------------------------------------


def _specs(args: argparse.Namespace, record: Any) -> Any:
    from ._checkpoint import _saved_specs
    from ._rulesfile import load_rules

    return load_rules(args.rules) if args.rules else _saved_specs(record)


def _cmd_plan(args: argparse.Namespace) -> int:
    from ._checkpoint import locate, planning_tree
    from ._mesh import make_mesh
    from ._plan import plan

    sizes = parse_mesh(args.mesh)
    source = locate(args.checkpoint)
    specs = _specs(args, source.record)
    mesh = make_mesh(sizes, axis_types=args.axis_types, abstract=True)
    p = plan(planning_tree(source.record), specs, mesh)
    if args.json:
        _print_json(
            {
                "checkpoint": str(source.path),
                "mesh": sizes,
                "bytes_per_device": p.bytes_per_device(),
                "total_bytes": p.total_bytes,
                "leaves": p.rows(),
            }
        )
        return 0
    _console().print(p.table(max_rows=args.max_rows))
    return 0


# ---- reshard -----------------------------------------------------------------------------


def _use_cpu_devices(n: int) -> None:
    """Simulate ``n`` CPU devices if JAX has not started yet; else check there are enough."""
    import jax
    from jax._src import xla_bridge

    from ._errors import MeshError

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    if jax.device_count() < n:
        raise MeshError(
            f"the target mesh needs {n} devices but JAX already started with "
            f"{jax.device_count()}; run modelshard reshard in a fresh process."
        )


def _return_freed_memory() -> None:
    """glibc: give every block of 128 KiB or more its own mapping, unmapped when freed, and
    keep one malloc arena.

    By default glibc raises that threshold to the largest block freed so far (up to 32
    MiB), so the chunk-sized buffers resharding frees and allocates again, chunk after
    chunk and on many reader threads, would stay resident as fragmented heap (about 40 MiB
    more peak for a 1 GiB checkpoint). This process exists only to reshard, so the
    allocator's settings are ours to choose. Elsewhere (no glibc) nothing changes.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold, m_arena_max = -3, -8
    mallopt(m_mmap_threshold, 128 << 10)
    mallopt(m_arena_max, 1)


def _cmd_reshard(args: argparse.Namespace) -> int:
    sizes = parse_mesh(args.mesh)
    _return_freed_memory()
    _use_cpu_devices(math.prod(sizes.values()))
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from ._checkpoint import locate
    from ._mesh import make_mesh
    from ._plan import format_bytes
    from ._checkpoint.reshard import reshard

    source = locate(args.source)
    specs = _specs(args, source.record)
    mesh = make_mesh(sizes, axis_types=args.axis_types)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=_console(stderr=True),
        disable=args.json or not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task("resharding", total=source.record.nbytes)
        record = reshard(
            args.source,
            args.destination,
            specs=specs,
            mesh=mesh,
            dtype=args.dtype,
            chunk_bytes=int(args.chunk_mb * (1 << 20)),
            verify=not args.no_verify,
            overwrite=args.overwrite,
            progress=lambda done, total: progress.update(task, completed=done),
        )
    dest = os.path.abspath(args.destination)
    if args.json:
        _print_json(
            {
                "source": str(source.path),
                "destination": dest,
                "mesh": sizes,
                "leaves": len(record.leaves),
                "bytes": record.nbytes,
            }
        )
    else:
        _console().print(
            f"wrote {dest}: {len(record.leaves)} leaves, "
            f"{format_bytes(record.nbytes)}, mesh "
            + ", ".join(f"{k}={v}" for k, v in sizes.items())
        )
    return 0


# ---- launch ------------------------------------------------------------------------------


def _launch(rest: Sequence[str]) -> int:
    import importlib

    try:
        _launch = importlib.import_module("modelshard._launch")
    except ImportError as e:
        sys.stderr.write(f"modelshard launch is not available in this installation ({e}).\n")
        return 1
    return int(_launch.main(list(rest)))


# ---- parser ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="modelshard",
        description="Inspect, plan and reshard JAX checkpoints; launch local multi-process runs.",
    )
    p.add_argument("--version", action="version", version=f"modelshard {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    i = sub.add_parser(
        "inspect",
        help="list the leaves of a checkpoint",
        description="Show every leaf of a checkpoint (modelshard or plain Orbax): "
        "path, shape, dtype, bytes, the spec it was saved with, and totals.",
    )
    i.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    i.add_argument("--json", action="store_true", help="print the record as JSON")
    i.add_argument("--max-rows", type=int, default=None, metavar="N", help="show at most N leaves")
    i.set_defaults(run=_cmd_inspect)

    def target(p: argparse.ArgumentParser) -> None:
        """The options naming the target layout: --mesh, --rules, --axis-types."""
        p.add_argument(
            "--mesh", required=True, help="target mesh as name=size pairs, e.g. data=2,model=4"
        )
        p.add_argument(
            "--rules",
            metavar="RULES.toml",
            help="TOML rules file (see docs/guides/rules-file.md); default: the saved specs",
        )
        p.add_argument(
            "--axis-types",
            choices=["auto", "explicit"],
            default="auto",
            help="mesh axis types (default auto)",
        )

    pl = sub.add_parser(
        "plan",
        help="plan a checkpoint onto a mesh",
        description="Plan every leaf of a checkpoint onto a target mesh: spec, "
        "matching rule and bytes per device; or list every problem at once "
        "(exit status 1). No devices are needed.",
    )
    pl.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    target(pl)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--max-rows", type=int, default=None, metavar="N", help="show at most N leaves")
    pl.set_defaults(run=_cmd_plan)

    r = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint for another mesh",
        description="Rewrite checkpoint SRC as DST laid out for a new mesh and "
        "rules, offline on simulated CPU devices, a chunk of leaves at a time so "
        "host memory stays a small fraction of the checkpoint.",
    )
    r.add_argument("source", metavar="SRC", help="source checkpoint directory")
    r.add_argument("destination", metavar="DST", help="new checkpoint directory")
    target(r)
    r.add_argument("--dtype", default=None, help="cast floating-point leaves, e.g. bfloat16")
    r.add_argument(
        "--chunk-mb",
        type=float,
        default=64.0,
        metavar="MB",
        help="host memory per chunk of leaves, replicas included (default 64)",
    )
    r.add_argument("--no-verify", action="store_true", help="skip source checksum verification")
    r.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    r.add_argument("--json", action="store_true", help="print a JSON summary")
    r.set_defaults(run=_cmd_reshard)

    sub.add_parser(
        "launch",
        help="run a command as N local JAX processes",
        description="Run a command as N local processes on JAX's distributed "
        "runtime; see `modelshard launch --help`.",
        add_help=False,
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``modelshard`` command line; returns the exit status.

    Example:
        >>> main(["--help"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        return _launch(argv[1:])
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    from ._errors import ModelshardError

    try:
        return int(args.run(args))
    except ModelshardError as e:
        sys.stderr.write(f"modelshard {args.command}: error: {e}\n")
        return 1
