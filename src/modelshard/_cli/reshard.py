"""``modelshard reshard``: a checkpoint rewritten for another mesh, streamed."""

from __future__ import annotations

import argparse
import math
from typing import Any

import jax

from .._base import format_bytes, format_mesh, make_mesh
from .args import (
    CKPT_HELP,
    add_json,
    add_target,
    checkpoint_arg,
    float_dtype,
    positive_float,
    target_specs,
)
from .host import join_launch, one_malloc_arena, use_cpu_devices
from .output import emit, progress_bar, say, writing


def add_parser(sub: Any) -> None:
    """The ``reshard`` subcommand."""
    r = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint for another mesh",
        description="Rewrite checkpoint SRC as DST laid out for a new mesh and "
        "rules, offline on simulated CPU devices, a chunk of leaves at a time so "
        "host memory stays a small fraction of the checkpoint.",
    )
    r.add_argument("source", metavar="SRC", help="source " + CKPT_HELP)
    r.add_argument("destination", metavar="DST", help="new checkpoint directory")
    add_target(r)
    r.add_argument(
        "--dtype", type=float_dtype, help="cast floating-point leaves to this dtype, e.g. bfloat16"
    )
    r.add_argument(
        "--chunk-mb",
        type=positive_float,
        default=64.0,
        metavar="MB",
        help="host memory per chunk of leaves, replicas included (default 64)",
    )
    r.add_argument(
        "--compression",
        choices=["zstd"],
        help="compress DST's chunks with zstd (smaller files, several times the CPU time); "
        "default: each chunk's raw bytes, as modelshard.save writes them",
    )
    r.add_argument(
        "--no-verify",
        action="store_true",
        help="skip verifying the source's checksums; each leaf no --dtype cast changes keeps "
        "the source's checksum unchecked, so a later restore still catches damage copied",
    )
    r.add_argument(
        "--overwrite", action="store_true", help="replace DST if it is a modelshard checkpoint"
    )
    r.add_argument(
        "--drop-items",
        action="store_true",
        help="reshard a CheckpointManager step's arrays without its items and metrics (config, "
        "RNG state, data iterator, losses), which DST cannot hold; without it such a step is "
        "refused (the output names what was dropped)",
    )
    add_json(r)
    r.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sizes = args.mesh
    one_malloc_arena()
    join_launch()  # under `modelshard launch`: each process writes a share of the leaves
    use_cpu_devices(math.prod(sizes.values()))
    from .._checkpoint import locate, reshard, step_extras

    args.source = checkpoint_arg(args, args.source)
    source = locate(args.source)
    dropped = step_extras(source.path)
    specs = target_specs(args, source.record)
    mesh = make_mesh(sizes, axis_types=args.axis_types)
    with progress_bar(args, "resharding") as progress, writing(args.destination):
        written = reshard(
            args.source,
            args.destination,
            specs=specs,
            mesh=mesh,
            dtype=args.dtype,
            chunk_bytes=int(args.chunk_mb * (1 << 20)),
            verify=not args.no_verify,
            overwrite=args.overwrite,
            drop_items=args.drop_items,
            compression=args.compression,
            progress=progress,
        )
    record = locate(written).record
    dest = str(written)
    if jax.process_index() != 0:
        return 0  # process 0 reports for every process
    if args.json:
        emit(
            args,
            source=str(source.path),
            step=args.step,
            destination=dest,
            mesh=sizes,
            leaves=len(record.leaves),
            bytes=record.nbytes,
            dropped=dropped,
        )
    else:
        say(
            f"wrote {dest}: {len(record.leaves)} leaves, "
            f"{format_bytes(record.nbytes)}, mesh {format_mesh(sizes)}"
        )
        if any(dropped.values()):
            held = " and ".join(f"{k} ({', '.join(v)})" for k, v in dropped.items() if v)
            say(f"dropped the step's {held} (--drop-items): {dest} holds the arrays only")
    return 0
