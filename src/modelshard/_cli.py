"""The ``modelshard`` command: inspect, plan and reshard checkpoints; launch local processes.

Every command has ``--help`` and ``--json``. One place, ``main``, turns every user
error into one line on stderr (``modelshard CMD: error: ...``) or, with ``--json``, one
JSON object on stderr; exit status 1 for a problem (modelshard's errors, unreadable or
unwritable paths), 2 for a usage error (argparse's convention). No traceback is printed
for a user error.

Adding a command: build its parser in ``_parser`` with ``add_json(parser)``, give it
``set_defaults(run=fn)``; ``fn(args)`` returns an exit status and prints its result with
``emit`` (a dict; the JSON envelope or the text rendering is chosen here). Raise a
``ModelshardError`` (or let an ``OSError`` on the user's paths escape) for problems, and use
argument types ``mesh_arg``, ``positive_float``, ``positive_int``,
``float_dtype`` so bad values are usage errors.

The JSON schema (documented in docs/cli.md): every object has ``"schema": 1``,
``"command"`` and ``"ok"``. Success (stdout): the command's fields beside those. Failure
(stderr): ``"exit_status"`` and ``"error"``: ``{"type", "message"}``, plus ``"problems"``
(one object per offending leaf) and ``"causes"`` for errors that list leaves.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

SCHEMA = 1
"""Version of the ``--json`` envelope (``"schema"`` in every object)."""


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``.

    Raises:
        MeshError: the text is not ``name=size`` pairs with positive sizes.
    """
    from ._errors import MeshError

    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = (x.strip() for x in part.partition("="))
        # isdigit() alone accepts '²'; int() does not
        if not eq or not name or not (size.isascii() and size.isdigit()) or int(size) < 1:
            where = f"{text!r}" if part.strip() == text.strip() else f"{part.strip()!r} in {text!r}"
            raise MeshError(
                f"{where} is not name=size with a positive whole size; "
                "write e.g. --mesh data=2,model=4"
            )
        if name in out:
            raise MeshError(f"{text!r} gives axis {name!r} twice")
        out[name] = int(size)
    return out


# ---- argument types: a bad value is a usage error (exit 2) ---------------------------------


def mesh_arg(text: str) -> dict[str, int]:
    """argparse type of ``--mesh``: ``parse_mesh``, its error a usage error."""
    from ._errors import MeshError

    try:
        return parse_mesh(text)
    except MeshError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    import jax.numpy as jnp

    from ._dtypes import dtype_name

    try:
        dt = jnp.dtype(text)
    except (TypeError, ValueError):
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a floating-point dtype; choose e.g. bfloat16, float16 or float32"
        )
    return dtype_name(dt)


def regex_arg(text: str) -> re.Pattern[str]:
    """argparse type: a regular expression (``--filter``)."""
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {e}") from None


def bytes_arg(text: str) -> int:
    """argparse type: a size such as ``16GiB``, ``80GB``, ``512MiB`` or plain bytes."""
    from ._errors import SpecError
    from ._plan import parse_bytes

    try:
        return parse_bytes(text)
    except SpecError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 16GiB, 80GB or 512MiB"
        ) from None


def add_json(parser: argparse.ArgumentParser) -> None:
    """Give a command the ``--json`` flag (results and problems as JSON objects)."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object on stdout; problems as one JSON "
        "object on stderr (schema in the module docs and the CLI docs page)",
    )


# ---- output --------------------------------------------------------------------------------


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    tty = sys.stdout.isatty() or "COLUMNS" in os.environ
    return Console(stderr=stderr, soft_wrap=False, width=None if tty else 160)


def _write_json(stream: Any, data: Any) -> None:
    stream.write(json.dumps(data, indent=1) + "\n")


def emit(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Print a command's JSON result: ``data`` inside the envelope, on stdout."""
    _write_json(sys.stdout, {"schema": SCHEMA, "command": args.command, "ok": True, **data})


def _fmt_spec(spec: Any) -> str:
    from ._specs import format_spec

    return "-" if spec is None else format_spec(spec)


# Python keyword arguments that error messages name, as this command's flags.
_FLAGS = [
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\bverify=False\b"), "--no-verify"),
    (re.compile(r"\bdtype=(\.\.\.)?"), "--dtype "),
    (re.compile(r"\bmesh=(\.\.\.)?"), "--mesh "),
    (re.compile(r"\brules=(\.\.\.)?"), "--rules "),
]


def _in_flags(text: str) -> str:
    for pattern, flag in _FLAGS:
        text = pattern.sub(flag, text)
    return text.replace(" \n", "\n").replace("  ", " ")


_OS_HINTS = {
    errno.ENOSPC: "the disk is full; free space or choose another destination",
    errno.EROFS: "the file system is read-only; choose a writable destination",
    errno.ENOTDIR: "a component of the path is a regular file, not a directory",
    errno.EACCES: "permission denied; choose a path you can write, or fix its permissions",
    errno.EPERM: "operation not permitted on this path",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "the path already exists",
    errno.EISDIR: "the path is a directory where a file is expected",
}


def _file_ancestor(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` (itself included) if it is not a directory."""
    p = os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p if os.path.lexists(p) and not os.path.isdir(p) else None


_TS_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
_TS_FILE = re.compile(r'(?:writing|reading|opening)[^"]*"([^"]+)"', re.IGNORECASE)


def tensorstore_os_error(e: BaseException) -> OSError | None:
    """The ``OSError`` inside a TensorStore error (``... [os_error_code='28']``), if any."""
    text = str(e)
    code = _TS_OS_ERROR.search(text)
    if code is None:
        return None
    n = int(code.group(1))
    file = _TS_FILE.search(text)
    return OSError(n, os.strerror(n), file.group(1) if file else None)


def _os_message(e: OSError) -> str:
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = e.strerror or str(e)
    hint = _OS_HINTS.get(e.errno or -1)
    if e.errno in (errno.EEXIST, errno.ENOTDIR) and e.filename is not None:
        blocker = _file_ancestor(os.fsdecode(e.filename))
        if blocker is not None:
            return f"{e.filename}: {blocker} is a regular file, not a directory"
    text = f"{where}: {what}" if where else what
    return text + (f" ({hint})" if hint and hint.lower() != what.lower() else "")


def _problem_json(e: Exception) -> dict[str, Any]:
    from ._errors import ModelshardError

    out: dict[str, Any] = (
        e.to_json()
        if isinstance(e, ModelshardError)
        else {"type": type(e).__name__, "message": str(e)}
    )
    out["message"] = _in_flags(str(out["message"]))
    for p in out.get("problems", ()):
        if p.get("hint"):
            p["hint"] = _in_flags(p["hint"])
    return out


def _fail(command: str, status: int, error: dict[str, Any], as_json: bool) -> int:
    if as_json:
        envelope = {"schema": SCHEMA, "command": command, "ok": False, "exit_status": status}
        _write_json(sys.stderr, {**envelope, "error": error})
    else:
        sys.stderr.write(
            f"modelshard{' ' + command if command else ''}: error: {error['message']}\n"
        )
    return status


class _UsageError(Exception):
    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors raised (so ``main`` formats them) not printed."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise _UsageError(self.prog, message)


# ---- inspect -----------------------------------------------------------------------------


_CKPT_HELP = (
    "checkpoint directory, or a CheckpointManager's root directory (then its latest complete step)"
)


def checkpoint_arg(args: argparse.Namespace, text: str) -> str:
    """A checkpoint directory as given, or, for a CheckpointManager's root, its latest
    complete step's directory (said on stderr; ``args.step`` records it for --json)."""
    from ._checkpoint import manager_step

    path, step = manager_step(text)
    args.step = step
    if step is None:
        return text
    if not args.json:
        _console(stderr=True).print(
            f"{text} is a CheckpointManager directory: using its latest complete step "
            f"{step} ({path})",
            highlight=False,
        )
    return str(path)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ._checkpoint import locate
    from ._plan import format_bytes
    from ._weights import is_safetensors

    if is_safetensors(args.checkpoint):
        return _inspect_safetensors(args)
    source = locate(checkpoint_arg(args, args.checkpoint))
    rec = source.record
    if args.json:
        from ._checkpoint import extras_json

        data = rec.to_json()
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


def _inspect_safetensors(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ._plan import format_bytes
    from ._weights import open_safetensors

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
            title=str(st.path),
            caption=f"{len(tensors)} tensors, {format_bytes(st.nbytes)} in {len(files)} "
            f"safetensors file{'s' if len(files) != 1 else ''}",
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
            table.add_row(*row, *([t.file.name] if len(files) > 1 else []))
        if len(shown) < len(tensors):
            table.add_row(f"... {len(tensors) - len(shown)} more tensors", "", "", "")
        console = _console()
        console.print(table)
        if st.metadata:
            console.print("metadata: " + ", ".join(f"{k}={v}" for k, v in st.metadata.items()))
    return 0


# ---- convert -----------------------------------------------------------------------------


def _progress(args: argparse.Namespace, what: str) -> Any:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    return Progress(
        f"[progress.description]{what}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=_console(stderr=True),
        disable=args.json or not sys.stderr.isatty(),
    )


def _cmd_convert(args: argparse.Namespace) -> int:
    """safetensors -> a sharded modelshard checkpoint, or (``--to safetensors``) back."""
    from ._plan import format_bytes
    from ._weights import is_safetensors

    _return_freed_memory()  # streams tensor-sized buffers, as reshard does
    if args.to == "safetensors":
        return _convert_to_safetensors(args)
    if not is_safetensors(args.source):
        from ._errors import CheckpointError

        raise CheckpointError(
            f"{args.source} is not a safetensors file, index or directory; "
            "to write safetensors from a checkpoint pass --to safetensors"
        )
    sizes = args.mesh or {"data": 1}
    if args.mesh is not None:  # without a mesh: whatever devices JAX has, the first used
        _use_cpu_devices(math.prod(sizes.values()))
    import importlib

    from jax.sharding import PartitionSpec

    from ._mesh import make_mesh
    from ._rulesfile import load_rules
    from ._weights import load_safetensors, mapped_leaves, open_safetensors

    specs = load_rules(args.rules) if args.rules else PartitionSpec()
    mesh = make_mesh(sizes, axis_types=args.axis_types)
    common = dict(mapping=args.mapping, specs=specs, mesh=mesh, dtype=args.dtype)
    if args.dry_run:
        table = load_safetensors(args.source, dry_run=True, **common)
        if args.json:
            emit(args, {"source": args.source, "rows": [_row_json(r) for r in table.rows]})
        else:
            _console().print(table.table(max_rows=args.max_rows))
        return 0
    # streamed: each target leaf computed a slab of rows at a time through its recipe and
    # written by the streaming checkpoint writer; nothing is placed on the devices and
    # host memory stays near a few slabs plus one stored tensor's map
    stream = importlib.import_module("modelshard._checkpoint.stream")
    with open_safetensors(args.source) as files:
        _, leaves = mapped_leaves(files, **common)
        with _progress(args, "converting") as progress:
            task = progress.add_task("converting", total=None)
            stream.write_stream(
                args.destination,
                [stream.StreamLeaf(x.path, x.shape, x.dtype, x.read, spec=x.spec) for x in leaves],
                mesh=mesh,
                overwrite=args.overwrite,
                slab_bytes=int(args.chunk_mb * (1 << 20)) // 4,
                progress=lambda done, total: progress.update(task, completed=done, total=total),
            )
    dest = args.destination
    nbytes = sum(x.nbytes for x in leaves)
    if args.json:
        emit(
            args,
            {
                "source": args.source,
                "destination": str(dest),
                "mesh": sizes,
                "leaves": len(leaves),
                "bytes": nbytes,
            },
        )
    else:
        _console().print(
            f"wrote {dest}: {len(leaves)} leaves, {format_bytes(nbytes)}, mesh "
            + ", ".join(f"{k}={v}" for k, v in sizes.items())
        )
    return 0


def _row_json(r: Any) -> dict[str, Any]:
    return {
        "target": r.target,
        "sources": list(r.sources),
        "transforms": r.how,
        "shape": None if r.shape is None else list(r.shape),
        "dtype": r.dtype,
    }


def _convert_to_safetensors(args: argparse.Namespace) -> int:
    """A checkpoint written back as one safetensors file, one checkpoint leaf on the host
    at a time (``Exporter`` over ``mapped.host_leaves``), never the whole state."""
    import importlib

    from ._checkpoint import locate
    from ._plan import format_bytes
    from ._weights import Exporter, as_mapping
    from ._weights.load import reference_table

    if args.reference is None and args.mapping is not None:
        from ._errors import CheckpointError

        raise CheckpointError(
            "--to safetensors with --mapping needs --reference SRC.safetensors: the "
            "checkpoint the mapping imports, whose names, shapes and dtypes are written"
        )
    mapped = importlib.import_module("modelshard._checkpoint.mapped")
    targets, load = mapped.host_leaves(locate(checkpoint_arg(args, args.source)))
    if args.reference is None:  # every leaf under its path, '/' written as '.'
        import jax

        reference: Any = {
            p.replace("/", "."): jax.ShapeDtypeStruct(shape, dt)
            for p, (shape, dt) in targets.items()
        }
    else:
        reference = args.reference
    table, meta = reference_table(reference)
    ex = Exporter(targets, load, table, as_mapping(args.mapping, split_dots=True), args.dtype)
    with _progress(args, "writing") as progress:
        task = progress.add_task("writing", total=None)
        dest = ex.write(
            args.destination,
            meta,
            lambda done, total: progress.update(task, completed=done, total=total),
        )
    nbytes = dest.stat().st_size
    if args.json:
        emit(args, {"source": args.source, "destination": str(dest), "bytes": nbytes})
    else:
        _console().print(f"wrote {dest}: {format_bytes(nbytes)}")
    return 0


# ---- plan --------------------------------------------------------------------------------


def _specs(args: argparse.Namespace, record: Any) -> Any:
    from ._rulesfile import load_rules

    return load_rules(args.rules) if args.rules else record.saved_specs()


def _cmd_plan(args: argparse.Namespace) -> int:
    from ._checkpoint import locate, planning_tree
    from ._mesh import make_mesh
    from ._plan import plan

    sizes = args.mesh
    source = locate(checkpoint_arg(args, args.checkpoint))
    specs = _specs(args, source.record)
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
    _console().print(p.table(max_rows=args.max_rows, fold=not args.no_fold, filter=args.filter))
    if args.html is not None:
        _console(stderr=True).print(f"wrote {os.path.abspath(args.html)}", highlight=False)
    if args.budget is not None:
        p.check_budget(args.budget)
    return 0


# ---- reshard -----------------------------------------------------------------------------


# Simulating 4096 CPU devices takes ~25 s and ~1.4 GB; 100,000 took minutes (issue 17).
MAX_CPU_DEVICES = 4096


def _use_cpu_devices(n: int) -> None:
    """Simulate ``n`` CPU devices if JAX has not started yet; else check there are enough."""
    import jax
    from jax._src import xla_bridge

    from ._errors import MeshError

    if n > MAX_CPU_DEVICES:
        raise MeshError(
            f"the target mesh has {n} devices; reshard on this host simulates at most "
            f"{MAX_CPU_DEVICES} CPU devices (more takes minutes and gigabytes). Reshard for "
            "a larger mesh on the target cluster itself (modelshard.reshard with its mesh)."
        )
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
    more peak for a 1 GiB checkpoint). ``modelshard reshard`` and ``modelshard convert``
    exist only to stream a checkpoint, so the allocator's settings are theirs to choose.
    Elsewhere (no glibc) nothing changes.
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
    sizes = args.mesh
    _return_freed_memory()
    from ._launch import ENV_COORDINATOR

    if os.environ.get(ENV_COORDINATOR):
        # under `modelshard launch`: join the run; each process writes a share of the leaves
        from . import distributed

        distributed.initialize()
    _use_cpu_devices(math.prod(sizes.values()))
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from ._checkpoint import locate
    from ._checkpoint.reshard import reshard
    from ._mesh import make_mesh
    from ._plan import format_bytes

    args.source = checkpoint_arg(args, args.source)
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
        written = reshard(
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
    record = locate(written).record
    dest = str(written)
    import jax

    if jax.process_index() != 0:
        return 0  # process 0 reports for every process
    if args.json:
        emit(
            args,
            {
                "source": str(source.path),
                "step": args.step,
                "destination": dest,
                "mesh": sizes,
                "leaves": len(record.leaves),
                "bytes": record.nbytes,
            },
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

_RULES_HELP = (
    "TOML rules file: [[rules]] tables, each with pattern (a regular expression searched in "
    "every leaf path, e.g. 'kernel$') and spec (one entry per dimension: a mesh axis, a "
    'list of axes, or "none"; [] replicates); the first matching rule wins. An optional '
    '[logical] table maps logical axis names to mesh axes (vocab = "model"). '
    "Default: the specs the checkpoint was saved with."
)


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(
        prog="modelshard",
        description="Inspect, plan and reshard JAX checkpoints; launch local multi-process runs. "
        "Exit status: 0 done, 1 a problem (printed as one line, or a JSON object with --json), "
        "2 a usage error.",
    )
    p.add_argument("--version", action="version", version=f"modelshard {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    i = sub.add_parser(
        "inspect",
        help="list the leaves of a checkpoint or safetensors file",
        description="Show every leaf of a checkpoint (modelshard or plain Orbax) or every "
        "tensor of a safetensors file, index or directory: "
        "path, shape, dtype, bytes, the spec it was saved with, and totals.",
    )
    i.add_argument("checkpoint", metavar="CKPT", help=_CKPT_HELP)
    add_json(i)
    i.add_argument(
        "--max-rows", type=positive_int, default=None, metavar="N", help="show at most N leaves"
    )
    i.set_defaults(run=_cmd_inspect)

    def target(p: argparse.ArgumentParser) -> None:
        """The options naming the target layout: --mesh, --rules, --axis-types."""
        p.add_argument(
            "--mesh",
            required=True,
            type=mesh_arg,
            help="target mesh as name=size pairs, e.g. data=2,model=4",
        )
        p.add_argument("--rules", metavar="RULES.toml", help=_RULES_HELP)
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
    pl.add_argument("checkpoint", metavar="CKPT", help=_CKPT_HELP)
    target(pl)
    add_json(pl)
    pl.add_argument(
        "--max-rows", type=positive_int, default=None, metavar="N", help="show at most N rows"
    )
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
    pl.set_defaults(run=_cmd_plan)

    r = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint for another mesh",
        description="Rewrite checkpoint SRC as DST laid out for a new mesh and "
        "rules, offline on simulated CPU devices, a chunk of leaves at a time so "
        "host memory stays a small fraction of the checkpoint.",
    )
    r.add_argument("source", metavar="SRC", help="source " + _CKPT_HELP)
    r.add_argument("destination", metavar="DST", help="new checkpoint directory")
    target(r)
    r.add_argument(
        "--dtype",
        default=None,
        type=float_dtype,
        help="cast floating-point leaves to this dtype, e.g. bfloat16",
    )
    r.add_argument(
        "--chunk-mb",
        type=positive_float,
        default=64.0,
        metavar="MB",
        help="host memory per chunk of leaves, replicas included (default 64)",
    )
    r.add_argument("--no-verify", action="store_true", help="skip source checksum verification")
    r.add_argument(
        "--overwrite", action="store_true", help="replace DST if it is a modelshard checkpoint"
    )
    add_json(r)
    r.set_defaults(run=_cmd_reshard)

    c = sub.add_parser(
        "convert",
        help="safetensors weights to a sharded checkpoint, or back",
        description="Read a safetensors checkpoint SRC (a file, a model.safetensors.index.json "
        "or a directory with either) through a mapping file and write DST, a sharded "
        "modelshard checkpoint laid out for --mesh and --rules, streamed (each leaf computed a "
        "slab of rows at a time through the mapping and written as it comes; nothing is "
        "placed on the devices); with --to safetensors, write the checkpoint SRC back as the "
        "safetensors file DST (the mapping backwards; --reference names the file it was "
        "imported from). --dry-run prints the mapping table without reading a tensor.",
    )
    c.add_argument("source", metavar="SRC", help="safetensors file/index/directory (or checkpoint)")
    c.add_argument("destination", metavar="DST", help="checkpoint directory (or .safetensors file)")
    c.add_argument(
        "--mapping",
        metavar="MAP.toml",
        help="TOML mapping file: [[rules]] with source (a regex over stored names), target "
        "(a path template, {1} inserts a group) and transforms (transpose, reshape, stack, "
        "unstack, cast; skip = true ignores tensors). Default: every tensor under its own name, "
        "'.' read as '/'",
    )
    c.add_argument(
        "--mesh", type=mesh_arg, default=None, help="target mesh, e.g. data=8 (default data=1)"
    )
    c.add_argument(
        "--rules",
        metavar="RULES.toml",
        help=_RULES_HELP.replace(
            "Default: the specs the checkpoint was saved with.", "Default: replicated."
        ),
    )
    c.add_argument(
        "--axis-types", choices=["auto", "explicit"], default="auto", help="mesh axis types"
    )
    c.add_argument(
        "--dtype", default=None, type=float_dtype, help="cast floating-point tensors, e.g. float32"
    )
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
        default=None,
        help="with --to safetensors: the safetensors checkpoint the mapping imports",
    )
    c.add_argument("--dry-run", action="store_true", help="print the mapping table only")
    c.add_argument(
        "--max-rows", type=positive_int, default=None, metavar="N", help="show at most N rows"
    )
    c.add_argument(
        "--overwrite", action="store_true", help="replace DST if it is a modelshard checkpoint"
    )
    add_json(c)
    c.set_defaults(run=_cmd_convert)

    sub.add_parser(
        "launch",
        help="run a command as N local JAX processes",
        description="Run a command as N local processes on JAX's distributed "
        "runtime; see `modelshard launch --help`.",
        add_help=False,
    )
    return p


def _wants_json(argv: Sequence[str]) -> bool:
    args = list(argv)
    return "--json" in (args[: args.index("--")] if "--" in args else args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``modelshard`` command line; returns the exit status.

    A user error never ends in a traceback: it is one line on stderr (a JSON object with
    ``--json``), exit status 1 for a problem and 2 for a usage error.

    Example:
        >>> main(["plan", "ckpt", "--mesh", "data=2,model=x"])  # doctest: +SKIP
        2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        return _launch(argv[1:])
    as_json = _wants_json(argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    except _UsageError as e:
        cmd = e.prog.removeprefix("modelshard").strip() or command
        message = f"{e} (see 'modelshard {cmd + ' ' if cmd else ''}--help')"
        return _fail(cmd, 2, {"type": "UsageError", "message": message}, as_json)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    from ._errors import ModelshardError

    try:
        return int(args.run(args))
    except ModelshardError as e:
        return _fail(args.command, 1, _problem_json(e), as_json)
    except OSError as e:  # the user's paths: missing, unreadable, read-only, full disk
        error = {"type": type(e).__name__, "message": _os_message(e), "errno": e.errno}
        return _fail(args.command, 1, error, as_json)
    except ValueError as e:  # TensorStore reports a failed write (full disk) as ValueError
        os_error = tensorstore_os_error(e)
        if os_error is None:
            raise
        message = _os_message(os_error)
        error = {"type": type(os_error).__name__, "message": message, "errno": os_error.errno}
        return _fail(args.command, 1, error, as_json)
