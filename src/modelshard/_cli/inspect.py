"""``modelshard inspect``: every leaf of a checkpoint, or every tensor of a safetensors file."""

from __future__ import annotations

import argparse
from typing import Any

from .._base import fold as fold_paths
from .._base import format_bytes, format_mesh, format_spec, literal, spec_json
from .._checkpoint import extras_json, locate
from .._weights import is_safetensors, open_safetensors
from .args import CKPT_HELP, add_json, add_max_rows, checkpoint_arg
from .output import SHOW_ALL, absolute, console, emit, new_table, say


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
    add_max_rows(i)
    i.add_argument(
        "--no-fold",
        action="store_true",
        help="one row per leaf (by default leaves that differ only in layer numbers and are "
        "stored alike share a row: layers_{0..61}/mlp/kernel), as for plan",
    )
    i.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if is_safetensors(args.checkpoint):
        return _inspect_safetensors(args)
    source = locate(checkpoint_arg(args, args.checkpoint))
    rec = source.record
    rows = _rows(rec.leaves, fold=not args.no_fold)
    extras = extras_json(source.path)  # a manager step's items and metrics, beside the arrays
    if args.json:
        data = rec.to_json()
        # one mesh spelling in every output: {"axis": size} (the record keeps its types apart)
        saved = data.pop("mesh", None) or {}
        data["mesh"] = rec.mesh_sizes()
        data["axis_types"] = saved.get("axis_types")
        data["path"] = absolute(source.path)
        # a step directory given itself is that step, as its root would say
        named = source.path.name
        step_dir = source.tree_dir != source.path and named.isdigit() and named == str(int(named))
        data["step"] = args.step if args.step is not None else int(named) if step_dir else None
        data.update(extras)
        data["source"] = rec.source
        data["total_bytes"] = rec.nbytes
        for leaf_json, leaf in zip(data["leaves"], rec.leaves, strict=True):
            leaf_json["bytes"] = leaf.nbytes
        data["rows"] = [
            {
                "path": g.path,
                "count": g.count,
                "shape": list(leaf.shape),
                "dtype": leaf.dtype,
                "spec": spec_json(leaf.spec) if leaf.spec is not None else None,
                "names": None if leaf.names is None else list(leaf.names),
                "bytes": leaf.nbytes,
                "paths": g.paths,
            }
            for g in rows
            for leaf in [g.items[0]]
        ]
        emit(args, **data)
        return 0
    mesh = rec.mesh_sizes()
    mesh_text = format_mesh(mesh) if mesh else "-"
    folded = any(g.count > 1 for g in rows)
    columns = ["path", *(["leaves"] if folded else []), "shape", "dtype", "bytes"]
    table = new_table(
        source.path,
        f"{len(rec.leaves)} array leaves, {format_bytes(rec.nbytes)}; kind {rec.kind}; "
        f"saved on mesh ({mesh_text}); written by {rec.source}",
        [*columns, "saved spec", "names"],
        right=("leaves", "bytes"),
    )
    shown = rows[: args.max_rows]
    for g in shown:
        leaf = g.items[0]
        cells = [
            g.path,
            *([str(g.count)] if folded else []),
            str(leaf.shape),
            leaf.dtype,
            format_bytes(leaf.nbytes) + (f" x{g.count}" if g.count > 1 else ""),
            "-" if leaf.spec is None else format_spec(leaf.spec),
            "-" if leaf.names is None else str(tuple(leaf.names)),
        ]
        table.add_row(*map(literal, cells))
    console().print(table)
    if len(shown) < len(rows):  # below the table, as plan says it
        rest = rows[len(shown) :]
        say(f"... {len(rest)} more rows ({sum(g.count for g in rest)} leaves); {SHOW_ALL}")
    if rec.values:  # the state's Python values (an epoch, a name), held in the record
        cut = [(v.path or "<root>", repr(v.value)) for v in rec.values[:24]]
        shown_values = [f"{p}={r if len(r) <= 60 else r[:59] + '…'}" for p, r in cut]
        more = len(rec.values) - len(shown_values)
        tail = f" and {more} more (--json lists them)" if more else ""
        say(literal("values: " + ", ".join(shown_values) + tail))
    if rec.versions:
        say("versions: " + ", ".join(f"{k} {v}" for k, v in rec.versions.items()))
    if extras.get("items"):
        say(f"items: {', '.join(extras['items'])} (CheckpointManager.items; --json shows them)")
    if extras.get("metrics"):
        say("metrics: " + ", ".join(f"{k}={v}" for k, v in extras["metrics"].items()))
    return 0


def _rows(leaves: Any, fold: bool) -> list[Any]:
    """The table's rows in record order (``fold``: leaves stored alike folded, as ``plan`` does)."""

    def stored_alike(leaf: Any) -> Any:
        return (
            tuple(leaf.shape),
            leaf.dtype,
            str(leaf.spec),
            None if leaf.names is None else tuple(map(str, leaf.names)),
        )

    # without ``fold`` every leaf is a key of its own: one row each
    return fold_paths(leaves, lambda leaf: leaf.path or "<root>", stored_alike if fold else id)


def _inspect_safetensors(args: argparse.Namespace) -> int:
    with open_safetensors(args.checkpoint) as st:
        tensors = list(st.tensors.values())
        files = st.files
        if args.json:
            emit(
                args,
                path=absolute(st.path),
                format="safetensors",
                files=[absolute(f) for f in files],
                metadata=st.metadata,
                total_bytes=st.nbytes,
                tensors=[
                    {
                        "name": t.name,
                        "shape": list(t.shape),
                        "dtype": t.code,
                        "bytes": t.nbytes,
                        "file": t.file.name,
                    }
                    for t in tensors
                ],
            )
            return 0
        table = new_table(
            st.path,
            f"{len(tensors)} tensors, {format_bytes(st.nbytes)} in {len(files)} "
            f"safetensors file{'s' if len(files) != 1 else ''}",
            ["name", "shape", "dtype", "bytes", *(["file"] if len(files) > 1 else [])],
            right=("bytes",),
        )
        shown = tensors[: args.max_rows]
        for t in shown:
            row = [t.name, str(t.shape), t.code, format_bytes(t.nbytes)]
            table.add_row(*map(literal, [*row, *([t.file.name] if len(files) > 1 else [])]))
        console().print(table)
        if len(shown) < len(tensors):
            say(f"... {len(tensors) - len(shown)} more tensors; {SHOW_ALL}")
        if st.metadata:
            say("metadata: " + ", ".join(f"{k}={v}" for k, v in st.metadata.items()))
    return 0
