"""``modelshard inspect``: every leaf of a checkpoint, or every tensor of a safetensors file."""

from __future__ import annotations

import argparse
from typing import Any

from .args import CKPT_HELP, add_json, checkpoint_arg, positive_int
from .output import console, emit, fmt_spec, say


def add_parser(sub: Any) -> None:
    """The ``inspect`` subcommand."""
    i = sub.add_parser(
        "inspect",
        help="list the leaves of a checkpoint or safetensors file",
        description="Show every leaf of a checkpoint (modelshard or plain Orbax) or every "
        "tensor of a safetensors file, index or directory: "
        "path, shape, dtype, bytes, the spec it was saved with, and totals.",
    )
    i.add_argument("checkpoint", metavar="CKPT", help=CKPT_HELP)
    add_json(i)
    i.add_argument(
        "--max-rows", type=positive_int, default=None, metavar="N", help="show at most N leaves"
    )
    i.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .._checkpoint import locate
    from .._text import format_bytes, literal
    from .._weights import is_safetensors

    if is_safetensors(args.checkpoint):
        return _inspect_safetensors(args)
    source = locate(checkpoint_arg(args, args.checkpoint))
    rec = source.record
    if args.json:
        from .._checkpoint import extras_json

        data = rec.to_json()
        # one mesh spelling in every output: {"axis": size} (the record keeps its types apart)
        saved = data.pop("mesh", None) or {}
        data["mesh"] = rec.mesh_sizes()
        data["axis_types"] = saved.get("axis_types")
        data["path"] = str(source.path)
        data["step"] = args.step
        data.update(extras_json(source.path))
        data["source"] = rec.source
        data["total_bytes"] = rec.nbytes
        for leaf_json, leaf in zip(data["leaves"], rec.leaves, strict=True):
            leaf_json["bytes"] = leaf.nbytes
        emit(args, data)
        return 0
    mesh = rec.mesh_sizes()
    mesh_text = ", ".join(f"{k}={v}" for k, v in mesh.items()) if mesh else "-"
    table = Table(
        title=literal(source.path),
        caption=literal(
            f"{len(rec.leaves)} array leaves, {format_bytes(rec.nbytes)}; kind {rec.kind}; "
            f"saved on mesh ({mesh_text}); written by {rec.source}"
        ),
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
            *map(
                literal,
                (
                    leaf.path or "<root>",
                    str(leaf.shape),
                    leaf.dtype,
                    format_bytes(leaf.nbytes),
                    fmt_spec(leaf.spec),
                    names,
                ),
            )
        )
    if len(shown) < len(rec.leaves):
        table.add_row(f"... {len(rec.leaves) - len(shown)} more leaves", "", "", "", "", "")
    console().print(table)
    if rec.versions:
        say("versions: " + ", ".join(f"{k} {v}" for k, v in rec.versions.items()))
    return 0


def _inspect_safetensors(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .._text import format_bytes, literal
    from .._weights import open_safetensors

    with open_safetensors(args.checkpoint) as st:
        tensors = list(st.tensors.values())
        files = st.files
        if args.json:
            emit(
                args,
                {
                    "path": str(st.path),
                    "format": "safetensors",
                    "files": [str(f) for f in files],
                    "metadata": st.metadata,
                    "total_bytes": st.nbytes,
                    "tensors": [
                        {
                            "name": t.name,
                            "shape": list(t.shape),
                            "dtype": t.code,
                            "bytes": t.nbytes,
                            "file": t.file.name,
                        }
                        for t in tensors
                    ],
                },
            )
            return 0
        table = Table(
            title=literal(st.path),
            caption=literal(
                f"{len(tensors)} tensors, {format_bytes(st.nbytes)} in {len(files)} "
                f"safetensors file{'s' if len(files) != 1 else ''}"
            ),
        )
        for col, kw in [
            ("name", {}),
            ("shape", {}),
            ("dtype", {}),
            ("bytes", {"justify": "right"}),
        ]:
            table.add_column(col, **kw)
        if len(files) > 1:
            table.add_column("file")
        shown = tensors if args.max_rows is None else tensors[: args.max_rows]
        for t in shown:
            row = [t.name, str(t.shape), t.code, format_bytes(t.nbytes)]
            table.add_row(*map(literal, [*row, *([t.file.name] if len(files) > 1 else [])]))
        if len(shown) < len(tensors):
            table.add_row(f"... {len(tensors) - len(shown)} more tensors", "", "", "")
        console().print(table)
        if st.metadata:
            say("metadata: " + ", ".join(f"{k}={v}" for k, v in st.metadata.items()))
    return 0
