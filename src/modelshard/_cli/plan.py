"""``modelshard plan``: a checkpoint planned onto a mesh; ``--step``: will the step fit?"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._base import ModelshardError, make_mesh, write_durable
from .._checkpoint import locate, planning_tree
from .._fit import fit_advice, step_memory
from .._internals import backends_are_initialized
from .._place import plan
from .args import (
    CKPT_HELP,
    add_json,
    add_max_rows,
    add_target,
    bytes_arg,
    checkpoint_arg,
    mesh_arg,
    regex_arg,
    target_specs,
)
from .output import console, emit, fail, say


def add_parser(sub: Any) -> None:
    """The ``plan`` subcommand."""
    pl = sub.add_parser(
        "plan",
        help="plan a checkpoint onto a mesh; will a training step fit?",
        description="Plan every leaf of a checkpoint onto a target mesh: spec, "
        "matching rule and bytes per device; or list every problem at once "
        "(exit status 1). No devices are needed. With --step, the training step is "
        "compiled for abstract inputs (nothing is allocated) and XLA's memory per device "
        "is shown by part; with --budget too, the smallest change that fits, each checked "
        "by compiling.",
    )
    pl.add_argument(
        "checkpoint",
        metavar="CKPT",
        nargs="?",
        help=CKPT_HELP + " (or give the state with --state)",
    )
    add_target(pl)
    add_json(pl)
    add_max_rows(pl)
    pl.add_argument(
        "--filter",
        type=regex_arg,
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
        metavar="SIZE",
        help="memory per device, e.g. 16GiB or 80GB: exit status 1 if the plan needs more, "
        "naming the largest contributors; with --step, the step's memory is checked and "
        "the smallest change that fits is named",
    )
    st = pl.add_argument_group("a training step (will it fit?)")
    st.add_argument(
        "--step",
        dest="step_fn",
        type=function_arg,
        metavar="MODULE:FUNCTION",
        help="the training step, step(state, batch) -> (state, ...), imported from MODULE "
        "(the current directory is on the path); it is compiled, never run",
    )
    st.add_argument(
        "--state",
        type=function_arg,
        metavar="MODULE:FUNCTION",
        help="a function of no arguments returning the state (called under jax.eval_shape: "
        "nothing is allocated); default: the checkpoint's tree (nested dicts)",
    )
    st.add_argument(
        "--batch",
        type=batch_arg,
        metavar="SHAPE",
        help="the batch as abstract arrays: int32[16,2048] or "
        "tokens=int32[16,2048],mask=bool[16,2048] (global shapes)",
    )
    st.add_argument(
        "--batch-axes",
        metavar="AXES",
        help="mesh axes the batch's first dimension is split over, e.g. data or data,fsdp "
        "(default: the first mesh axis)",
    )
    st.add_argument(
        "--no-donate",
        action="store_true",
        help="do not donate the state to the step (by default its outputs take the inputs' "
        "place, as in a training loop)",
    )
    st.add_argument(
        "--topology",
        metavar="NAME",
        help="compile for a TPU slice this machine does not have, e.g. v5e:4x4 (the "
        "--mesh sizes must multiply to its chips); elsewhere a mesh larger than the "
        "machine compiles on simulated CPU devices (JAX_NUM_CPU_DEVICES)",
    )
    st.add_argument(
        "--write-rules",
        metavar="OUT.toml",
        help="with --budget: write the smallest change that fits as a rules file (when it "
        "changes placement)",
    )
    pl.add_argument(
        "--html",
        metavar="OUT.html",
        help="also write the plan as a self-contained HTML page (memory per device by "
        "module, the grouped table, each leaf's tiles on the mesh); opens offline",
    )
    pl.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.step_fn is not None or args.state is not None:
        return run_step(args)
    if args.checkpoint is None:
        return usage(args, "give a checkpoint (CKPT), or --state and --step")
    source = locate(checkpoint_arg(args, args.checkpoint))
    mesh = make_mesh(args.mesh, axis_types=args.axis_types, abstract=True)
    p = plan(planning_tree(source.record), target_specs(args, source.record), mesh)
    check = None if args.budget is None else lambda: p.check_budget(args.budget)
    return report(args, p, str(source.path), f"plan of {source.path}", check)


def report(
    args: argparse.Namespace,
    p: Any,
    checkpoint: str | None,
    title: str,
    check: Any,
    extra: dict[str, Any] | None = None,
    lines: tuple[str, ...] = (),
    written: str | None = None,
) -> int:
    """Print the plan (table, or JSON with ``extra``'s keys), write its HTML, run ``check``."""
    fold = not args.no_fold
    if args.html is not None:
        p.to_html(args.html, fold=fold, filter=args.filter, title=title)
    if args.json:
        if check is not None:
            check()
        doc = {"checkpoint": checkpoint, "step": getattr(args, "step", None), "mesh": args.mesh}
        doc |= {"bytes_per_device": p.bytes_per_device(), "total_bytes": p.total_bytes}
        doc |= extra or {}
        doc |= {
            "modules": p.modules(filter=args.filter),
            "rows": p.groups(fold=fold, filter=args.filter),
            "leaves": p.rows(filter=args.filter),
        }
        emit(args, **doc)
        return 0
    console().print(p.table(max_rows=args.max_rows, fold=fold, filter=args.filter))
    for line in lines:
        say(line)
    for out in (args.html, written):
        if out is not None:
            say(f"wrote {os.path.abspath(out)}", stderr=True)
    if check is not None:
        check()
    return 0


def simulate_devices(argv: list[str]) -> None:
    """As many simulated CPU devices as ``--mesh`` needs, before ``--step`` imports."""
    text = None
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == "--mesh" and i + 1 < len(argv):
            text = argv[i + 1]
        elif a.startswith("--mesh="):
            text = a.removeprefix("--mesh=")
    if text is None or backends_are_initialized():
        return
    try:
        n = math.prod(mesh_arg(text).values())
    except argparse.ArgumentTypeError:  # argparse reports it
        return
    if n > max(int(jax.config.jax_num_cpu_devices), 1):
        jax.config.update("jax_num_cpu_devices", n)


def usage(args: argparse.Namespace, message: str) -> int:
    """Options that do not go together: a usage error (exit status 2), as argparse's."""
    full = f"{message} (see 'modelshard plan --help')"
    return fail("plan", 2, {"type": "UsageError", "message": full}, args.json)


def function_arg(text: str) -> Any:
    """argparse type: ``module:function``, imported (the current directory on the path)."""
    module, colon, name = text.partition(":")
    if not colon or not module or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not MODULE:FUNCTION, e.g. train:step")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise argparse.ArgumentTypeError(f"cannot import {module!r}: {e}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise argparse.ArgumentTypeError(f"module {module!r} has no {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise argparse.ArgumentTypeError(f"{text} is not callable")
    return obj


_ARRAY = re.compile(r"^\s*(?:([A-Za-z_][\w.]*)\s*=\s*)?([a-z][a-z0-9_]*)\[([\d,\s]*)\]\s*$")
# the commas between arrays: not inside [...] or (...)
_BETWEEN = re.compile(r",(?![^\[(]*[\])])")

# dtypes as jaxprs print them (f32[64,256]), and the name --batch takes
_SHORT_DTYPES = {
    "bf16": "bfloat16",
    **{f"f{n}": f"float{n}" for n in (16, 32, 64)},
    **{f"i{n}": f"int{n}" for n in (8, 16, 32, 64)},
    **{f"u{n}": f"uint{n}" for n in (8, 16, 32, 64)},
}


def batch_arg(text: str) -> Any:
    """argparse type: ``int32[16,2048]`` or ``a=int32[16],b=bool[16]``: abstract arrays."""
    parts = _BETWEEN.split(text)
    out: dict[str, Any] = {}
    for part in parts:
        m = _ARRAY.match(part)
        if m is None:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not an array shape; write int32[16,2048] or "
                "tokens=int32[16,2048],mask=bool[16,2048]"
            )
        name, dtype, dims = m.groups()
        if dtype in _SHORT_DTYPES:
            raise argparse.ArgumentTypeError(
                f"{dtype!r} is not a dtype here; write {_SHORT_DTYPES[dtype]}"
            )
        try:
            dt = np.dtype(dtype) if dtype != "bfloat16" else jax.numpy.bfloat16
        except TypeError:
            raise argparse.ArgumentTypeError(f"{dtype!r} is not a dtype") from None
        shape = tuple(int(d) for d in dims.split(",") if d.strip())
        if name is None and len(parts) > 1:
            raise argparse.ArgumentTypeError(f"name every array of several: {part.strip()!r}")
        out[name or ""] = jax.ShapeDtypeStruct(shape, dt)
    return out[""] if list(out) == [""] else out


def raised(args: argparse.Namespace, what: str, fn: Any, e: Exception) -> int:
    """One error naming the user's function that raised while traced (modelshard's go on)."""
    if isinstance(e, ModelshardError):
        raise e
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    kind = type(e).__name__
    message = f"the {what} {name} raised while being traced: {kind}: {e}"
    return fail("plan", 1, {"type": kind, "message": message, "function": name}, args.json)


def rules_file(advice: Any) -> tuple[str | None, str | None]:
    """``--write-rules``: the best change's rules file and other changes, or why none."""
    if advice is None:
        return None, "--write-rules writes the change that fits a --budget; none was given"
    if advice.fits:
        return None, "the step fits the budget as it is"
    best = advice.best
    if best is None:
        return None, "no change tried fits the budget"
    text = best.toml()
    if text is None:
        return None, f"the smallest change that fits moves nothing: {best.description}"
    if not best.notes:
        return text, None
    head = [
        "# This placement fits the budget only with these changes too (modelshard plan",
        "# --budget, checked by compiling):",
        *(f"#   {note}" for note in best.notes),
    ]
    return "\n".join([*head, "", text]), None


def run_step(args: argparse.Namespace) -> int:
    """``--step``: the step's memory per device (and, with ``--budget``, the advice)."""
    if args.step_fn is None or args.batch is None:
        return usage(args, "--step and --batch go together (and --state or CKPT)")
    sizes = args.mesh
    source = None
    if args.state is not None:
        try:
            state = jax.eval_shape(args.state)
        except Exception as e:
            return raised(args, "state function", args.state, e)
        specs = target_specs(args)
    elif args.checkpoint is not None:
        source = locate(checkpoint_arg(args, args.checkpoint))
        state = planning_tree(source.record)
        specs = target_specs(args, source.record)
    else:
        return usage(args, "--step needs the state: CKPT or --state")
    axes = args.batch_axes.split(",") if args.batch_axes else [next(iter(sizes))]
    batch_spec = PartitionSpec(axes[0] if len(axes) == 1 else tuple(axes))
    kw: dict[str, Any] = dict(
        mesh=make_mesh(sizes, axis_types=args.axis_types, abstract=True),
        in_specs=(specs, batch_spec),
        donate_argnums=() if args.no_donate else (0,),
        topology=args.topology,
    )
    try:
        if args.budget is None:
            m = step_memory(args.step_fn, state, args.batch, **kw)
            advice = None
        else:
            advice = fit_advice(args.step_fn, state, args.batch, budget=args.budget, **kw)
            m = advice.memory
    except Exception as e:
        return raised(args, "step", args.step_fn, e)
    out: str | None = args.write_rules
    rules_text, unwritten = rules_file(advice) if out is not None else (None, None)
    if out is not None and rules_text is not None:
        write_durable(out, rules_text)
    if out is not None and unwritten is not None:
        say(f"nothing written to {os.path.abspath(out)}: {unwritten}", stderr=True)
    extra = {"step_memory": m.to_json(), "advice": None if advice is None else advice.to_json()}
    return report(
        args,
        m.plan,
        None if source is None else str(source.path),
        "plan of the step",
        None if advice is None else advice.check,
        extra,
        () if advice is None else tuple(advice.lines()),
        out if rules_text is not None else None,
    )
