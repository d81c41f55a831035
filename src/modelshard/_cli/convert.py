"""``modelshard convert``: safetensors weights to a sharded checkpoint, or back, streamed."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

import jax

from .._base import CheckpointError, format_bytes, format_mesh, make_mesh
from .._checkpoint import StreamLeaf, host_leaves, locate, write_stream
from .._weights import (
    Exporter,
    as_mapping,
    check_destination,
    finish_model_directory,
    is_model_directory,
    is_safetensors,
    load_safetensors,
    mapped_leaves,
    open_safetensors,
    parse_size,
    reference_table,
    shard_size_for,
    shipped_mappings,
    write_export,
)
from .args import (
    RULES_HELP,
    add_json,
    add_max_rows,
    add_target,
    checkpoint_arg,
    float_dtype,
    positive_float,
    readable,
    target_specs,
)
from .host import join_launch, return_freed_memory, use_cpu_devices
from .output import SHOW_ALL, absolute, console, emit, progress_bar, say, writing


def add_parser(sub: Any) -> None:
    """The ``convert`` subcommand."""
    c = sub.add_parser(
        "convert",
        help="safetensors weights to a sharded checkpoint, or back",
        description="Read a safetensors checkpoint SRC (a file, a model.safetensors.index.json, "
        "a directory with either, or a Hugging Face Hub repository hf://org/name[@revision], "
        "from the local cache first) through a mapping file and write DST, a sharded "
        "modelshard checkpoint laid out for --mesh and --rules, streamed (each leaf computed a "
        "slab of rows at a time through the mapping and written as it comes; nothing is "
        "placed on the devices); with --to safetensors, write the checkpoint SRC back as "
        "safetensors (the mapping backwards; --reference names the checkpoint it was "
        "imported from; without it every leaf under its path, '/' written as '.'): DST "
        "ending .safetensors is one file; any other DST is a model directory, what "
        "transformers' from_pretrained loads (model.safetensors, or shards of at most "
        "--max-shard-size, default 5GB, and model.safetensors.index.json, as "
        "save_pretrained writes; config.json, the generation config and the tokenizer "
        "files from --reference's directory). --dry-run prints the mapping table without "
        "reading a tensor.",
    )
    c.add_argument(
        "source",
        metavar="SRC",
        help="safetensors file/index/directory or hf://org/name[@revision] (or checkpoint)",
    )
    c.add_argument(
        "destination",
        metavar="DST",
        help="checkpoint directory (with --to safetensors: a .safetensors file or a model "
        "directory)",
    )
    c.add_argument(
        "--mapping",
        metavar="MAP.toml",
        help="TOML mapping file: [[rules]] with source (a regex over stored names), target "
        "(a path template, {1} inserts a group) and transforms (transpose, reshape, stack, "
        "unstack, cast; skip = true ignores tensors); or a shipped mapping's name (llama, "
        "qwen2, ...: see 'modelshard mappings'). Default: every tensor under its own name, "
        "'.' read as '/'",
    )
    replicated = RULES_HELP.replace(
        "Default: the specs the checkpoint was saved with.", "Default: replicated."
    )
    add_target(c, "target mesh, e.g. data=8 (default data=1)", replicated)
    c.add_argument("--dtype", type=float_dtype, help="cast floating-point tensors, e.g. float32")
    c.add_argument(
        "--to",
        choices=["checkpoint", "safetensors"],
        default="checkpoint",
        help="what DST is (default: a modelshard checkpoint)",
    )
    c.add_argument(
        "--chunk-mb",
        type=positive_float,
        default=64.0,
        metavar="MB",
        help="host memory in flight while writing a checkpoint: slabs of a quarter of it are "
        "read ahead while others are written (default 64; smaller: less memory, slower)",
    )
    c.add_argument(
        "--reference",
        metavar="REF",
        help="with --to safetensors: the safetensors checkpoint the mapping imports (a "
        "file, index, directory or hf://org/name[@revision])",
    )
    c.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        type=_size,
        help="with --to safetensors: Hugging Face's sharded layout, "
        "model-0000k-of-0000n.safetensors files of at most SIZE (bytes, or 5GB, 500MB, 2GiB) "
        "and model.safetensors.index.json, in the directory DST (or beside DST when it names "
        "a .safetensors file, its stem for 'model'); default for a directory DST: 5GB",
    )
    c.add_argument(
        "--no-progress", action="store_true", help="no progress bar (drawn only on a terminal)"
    )
    c.add_argument("--dry-run", action="store_true", help="print the mapping table only")
    add_max_rows(c)
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it is a modelshard checkpoint (with --to safetensors: the "
        "safetensors file, or the index and shards of that name)",
    )
    add_json(c)
    c.set_defaults(run=run)


def _size(text: str) -> int | str:
    size = int(text) if text.isdigit() else text
    try:
        parse_size(size)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return size


def run(args: argparse.Namespace) -> int:
    """safetensors -> a sharded modelshard checkpoint, or (``--to safetensors``) back."""
    return_freed_memory()  # streams tensor-sized buffers
    # the user's input files: missing or unreadable is the OSError itself (with its errno)
    if not (args.mapping in shipped_mappings() and not os.path.exists(args.mapping)):
        readable(args.mapping)
    readable(args.reference, file=False)
    if args.to == "safetensors":
        return _convert_to_safetensors(args)
    if args.max_shard_size is not None:
        raise CheckpointError("--max-shard-size writes safetensors: pass --to safetensors")
    readable(args.source, file=False)
    if not is_safetensors(args.source):
        raise CheckpointError(
            f"{args.source} is not a safetensors file, index, directory or hf:// repository; "
            "to write safetensors from a checkpoint pass --to safetensors"
        )
    sizes = args.mesh or {"data": 1}
    join_launch()  # under `modelshard launch`, every process writes its share of DST
    if args.mesh is not None:  # without a mesh: whatever devices JAX has, the first used
        use_cpu_devices(math.prod(sizes.values()))
    mesh = make_mesh(sizes, axis_types=args.axis_types)
    common = dict(mapping=args.mapping, specs=target_specs(args), mesh=mesh, dtype=args.dtype)
    if args.dry_run:
        table = load_safetensors(args.source, dry_run=True, **common)
        if args.json:
            # the table's "-" means "no transform": JSON says null, else the text as printed
            rows = [
                {
                    "target": r.target,
                    "sources": list(r.sources),
                    "transforms": None if r.how == "-" else r.how,
                    "shape": None if r.shape is None else list(r.shape),
                    "dtype": r.dtype,
                }
                for r in table.rows
            ]
            emit(args, source=absolute(args.source), rows=rows)
        else:
            # the rows --max-rows leaves out: counted below the table, as plan and inspect do
            console().print(table.table(max_rows=args.max_rows))
            if args.max_rows is not None and len(table.rows) > args.max_rows:
                rest = len(table.rows) - args.max_rows
                say(f"... {rest} more lea{'ves' if rest != 1 else 'f'}; {SHOW_ALL}")
        return 0
    # streamed a slab of rows at a time: host memory stays near a few slabs, no device used
    with open_safetensors(args.source) as files:
        _, leaves = mapped_leaves(files, **common)
        with progress_bar(args, "converting") as progress, writing(args.destination):
            write_stream(
                args.destination,
                [StreamLeaf(x.path, x.shape, x.dtype, x.read, spec=x.spec) for x in leaves],
                mesh=mesh,
                overwrite=args.overwrite,
                slab_bytes=int(args.chunk_mb * (1 << 20)) // 4,
                progress=progress,
            )
    dest = args.destination
    nbytes = sum(x.nbytes for x in leaves)
    if args.json:
        emit(
            args,
            source=absolute(args.source),
            destination=absolute(dest),
            mesh=sizes,
            leaves=len(leaves),
            bytes=nbytes,
        )
    else:
        say(
            f"wrote {dest}: {len(leaves)} leaves, {format_bytes(nbytes)}, mesh {format_mesh(sizes)}"
        )
    return 0


def _convert_to_safetensors(args: argparse.Namespace) -> int:
    """A checkpoint written back as safetensors, one leaf on the host at a time."""
    if args.reference is None and args.mapping is not None:
        raise CheckpointError(
            "--to safetensors with --mapping needs --reference SRC.safetensors: the "
            "checkpoint the mapping imports, whose names, shapes and dtypes are written"
        )
    max_shard_size = shard_size_for(args.destination, args.max_shard_size)
    # what is at DST is replaced only with --overwrite, checked before the source is read
    check_destination(
        args.destination, max_shard_size, overwrite=args.overwrite, flag="--overwrite"
    )
    source = locate(checkpoint_arg(args, args.source))
    targets, load = host_leaves(source)
    reference: Any = args.reference
    if reference is None:  # every leaf under its path, '/' written as '.'
        reference = {
            p.replace("/", "."): jax.ShapeDtypeStruct(shape, dt)
            for p, (shape, dt) in targets.items()
        }
    table, meta, sizes = reference_table(reference)
    if args.reference is None:
        meta = {"format": "pt"}  # what transformers expects of a file it did not write
    wm = as_mapping(args.mapping, split_dots=True).with_config(sizes)
    ex = Exporter(targets, load, table, wm, args.dtype)
    ex.check_also()  # a tied leaf changed since it was loaded: refused, nothing written
    items = ex.items()
    with progress_bar(args, "writing") as progress, writing(args.destination):
        dest = write_export(
            args.destination,
            items,
            ex.compute,
            meta,
            max_shard_size=max_shard_size,
            progress=progress,
            overwrite=args.overwrite,
            flag="--overwrite",
        )
        if is_model_directory(args.destination):
            finish_model_directory(dest, args.reference, items)
    if dest.suffix == ".safetensors":
        files = [dest]
    else:  # an index: the shards it names
        files = sorted(
            {dest.parent / f for f in json.loads(dest.read_text())["weight_map"].values()}
        )
    nbytes = sum(f.stat().st_size for f in files)
    if args.json:
        emit(
            args,
            source=absolute(source.path),
            step=args.step,
            destination=absolute(dest),
            leaves=len(items),
            files=[absolute(f) for f in files],
            bytes=nbytes,
        )
    else:
        many = f" in {len(files)} files" if len(files) > 1 else ""
        say(f"wrote {dest}: {len(items)} tensors, {format_bytes(nbytes)}{many}")
    return 0
