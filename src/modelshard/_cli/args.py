"""The commands' argument types and shared options: a bad value is a usage error (exit 2)."""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._base import close_match, dtype_name, size_in_bytes
from .._checkpoint import manager_step
from .._specs import load_rules
from .output import say


def mesh_arg(text: str) -> dict[str, int]:
    """argparse type of ``--mesh``: ``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = (x.strip() for x in part.partition("="))
        # isdigit() alone accepts '²'; int() does not
        if not eq or not name or not (size.isascii() and size.isdigit()) or int(size) < 1:
            where = f"{text!r}" if part.strip() == text.strip() else f"{part.strip()!r} in {text!r}"
            raise argparse.ArgumentTypeError(
                f"{where} is not name=size with a positive whole size; "
                "write e.g. --mesh data=2,model=4"
            )
        if name in out:
            raise argparse.ArgumentTypeError(f"{text!r} gives axis {name!r} twice")
        out[name] = int(size)
    return out


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (``nan``, ``inf``, ``0`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number above 0")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def float_dtype(text: str) -> str:
    """argparse type of ``--dtype``: the name of a floating-point dtype (``bfloat16``, ...)."""
    try:
        dt = jnp.dtype(text)
    except (TypeError, ValueError):
        guess = _FLOAT_ALIASES.get(text.strip().lower()) or close_match(text, _FLOAT_NAMES, 0.6)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype name; "
            + (f"did you mean {guess}?" if guess else "choose e.g. bfloat16, float16 or float32")
        ) from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a floating-point dtype; choose e.g. bfloat16, float16 or float32"
        )
    return dtype_name(dt)


_FLOAT_NAMES = ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]
# the short names other tools use for them
_FLOAT_ALIASES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"} | {
    f"{p}{n}": f"float{n}" for n in (16, 32, 64) for p in ("f", "fp")
}


def regex_arg(text: str) -> re.Pattern[str]:
    """argparse type: a regular expression (``--filter``)."""
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {e}") from None


def bytes_arg(text: str) -> int:
    """argparse type: a size such as ``16GiB``, ``80GB``, ``512MiB`` or plain bytes."""
    n = size_in_bytes(text)
    if n is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 16GiB, 80GB or 512MiB"
        )
    return n


def add_json(parser: argparse.ArgumentParser) -> None:
    """Give a command the ``--json`` flag (results and problems as JSON objects)."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document on stdout, on success and on failure alike (the "
        "exit status tells which; stderr only carries a short line for people); schema on "
        "the CLI docs page",
    )


CKPT_HELP = (
    "checkpoint directory, or a CheckpointManager's root directory (then its latest complete step)"
)


def checkpoint_arg(args: argparse.Namespace, text: str) -> str:
    """A checkpoint directory as given, or a manager root's latest complete step (``args.step``)."""
    path, step = manager_step(text)
    args.step = step
    if step is None:
        return text
    # stderr carries human text with --json too (the JSON on stdout has "step")
    say(
        f"{text} is a CheckpointManager directory: using its latest complete step {step} ({path})",
        stderr=True,
    )
    return str(path)


def readable(path: str | None, file: bool = True) -> None:
    """Raise the user's input path's own ``OSError`` if it is missing or unreadable."""
    if path is None or path.startswith("hf://"):
        return
    if file:
        open(path, "rb").close()
    else:
        os.stat(path)


RULES_HELP = (
    "TOML rules file: [[rules]] tables, each with pattern (a regular expression searched in "
    "every leaf path, e.g. 'kernel$') and spec (one entry per dimension: a mesh axis, a "
    'list of axes, or "none"; [] replicates); the first matching rule wins. An optional '
    '[logical] table maps logical axis names to mesh axes (vocab = "model"). '
    "Default: the specs the checkpoint was saved with."
)


def target_specs(args: argparse.Namespace, record: Any = None) -> Any:
    """``--rules`` read, else the specs ``record`` was saved with (no record: replicated)."""
    if args.rules:
        return load_rules(args.rules)
    return PartitionSpec() if record is None else record.saved_specs()


def add_max_rows(p: argparse.ArgumentParser) -> None:
    """``--max-rows N``: a table shows at most N rows and counts the rest below it."""
    p.add_argument("--max-rows", type=positive_int, metavar="N", help="show at most N rows")


def add_target(
    p: argparse.ArgumentParser, mesh_help: str | None = None, rules_help: str = RULES_HELP
) -> None:
    """The options naming the target layout: ``--mesh``, ``--rules``, ``--axis-types``."""
    p.add_argument(
        "--mesh",
        required=mesh_help is None,
        type=mesh_arg,
        help=mesh_help or "target mesh as name=size pairs, e.g. data=2,model=4",
    )
    p.add_argument("--rules", metavar="RULES.toml", help=rules_help)
    p.add_argument(
        "--axis-types",
        choices=["auto", "explicit"],
        default="auto",
        help="mesh axis types (default auto)",
    )
