"""What the commands print: tables, the ``--json`` envelope, errors as one line each."""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import json
import os
import re
import signal
import sys
import types
from collections.abc import Iterator
from typing import Any, NoReturn

# what every table cut by --max-rows says below it (``Plan.table`` under the CLI too)
from .._base import SHOW_ALL as SHOW_ALL
from .._base import ModelshardError, literal, reporter

SCHEMA = 1
"""Version of the ``--json`` envelope (``"schema"`` in every object)."""


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    tty = sys.stdout.isatty() or "COLUMNS" in os.environ
    return Console(stderr=stderr, soft_wrap=False, width=None if tty else 160)


def say(text: str, stderr: bool = False) -> None:
    """Print one line of text for people, shown literally (paths with ``[...]`` included)."""
    console(stderr=stderr).print(literal(text), highlight=False, soft_wrap=True)


def new_table(
    title: Any, caption: str | None, columns: list[str], right: tuple[str, ...] = ()
) -> Any:
    """A ``rich`` table with a literal title and caption; the ``right`` columns right-justified."""
    from rich.table import Table

    table = Table(title=literal(title), caption=None if caption is None else literal(caption))
    for c in columns:
        table.add_column(c, justify="right" if c in right else "left")
    return table


def absolute(path: Any) -> str:
    """A local path made absolute, as ``--json`` gives paths; a URL as given."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return text if re.match(r"^[a-z][a-z0-9+.-]*://", text) else os.path.abspath(text)


def emit(args: argparse.Namespace, ok: bool = True, /, **data: Any) -> None:
    """Print a command's JSON result: ``data`` inside the envelope, on stdout."""
    envelope = {"schema": SCHEMA, "command": args.command, "ok": ok, **data}
    sys.stdout.write(json.dumps(envelope, indent=1) + "\n")


# Python keyword arguments that error messages name, as this command's flags.
FLAGS = [
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\bdrop_items=True\b"), "--drop-items"),
    (re.compile(r"\bverify=False\b"), "--no-verify"),
    (re.compile(r"\bdtype=(\.\.\.)?"), "--dtype "),
    (re.compile(r"\bmesh=(\.\.\.)?"), "--mesh "),
    (re.compile(r"\brules=(\.\.\.)?"), "--rules "),
]


def in_flags(text: str) -> str:
    """``text`` with the Python keywords of FLAGS written as this command's flags."""

    def put(m: re.Match[str], name: str) -> str:
        after = m.string[m.end() : m.end() + 1]
        # a flag that takes a value keeps one space before what follows it
        value = after != "" and not after.isspace() and after not in ")]},;:."
        return name if value else name.rstrip()

    for pattern, name in FLAGS:
        text = pattern.sub(functools.partial(put, name=name), text)
    return text


OS_HINTS = {
    errno.ENOSPC: "the disk is full; free space or choose another destination",
    errno.EROFS: "the file system is read-only; choose a writable destination",
    errno.ENOTDIR: "a component of the path is a regular file, not a directory",
    errno.EACCES: "permission denied; choose a path you can write, or fix its permissions",
    errno.EPERM: "operation not permitted on this path",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "the path already exists",
    errno.EISDIR: "the path is a directory where a file is expected",
}


def file_ancestor(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` (itself included) if it is not a directory."""
    p = os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p if os.path.lexists(p) and not os.path.isdir(p) else None


TS_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
TS_FILE = re.compile(r'(?:writing|reading|opening)[^"]*"([^"]+)"', re.IGNORECASE)


def tensorstore_os_error(e: BaseException) -> OSError | None:
    """The ``OSError`` inside a TensorStore error (``... [os_error_code='28']``), if any."""
    text = str(e)
    code = TS_OS_ERROR.search(text)
    if code is None:
        return None
    n = int(code.group(1))
    file = TS_FILE.search(text)
    return OSError(n, os.strerror(n), file.group(1) if file else None)


@contextlib.contextmanager
def writing(destination: str | os.PathLike[str]) -> Iterator[None]:
    """Within the block, an ``OSError`` beside ``destination`` names ``destination`` itself."""
    try:
        yield
    except OSError as e:
        dest = os.fsdecode(destination)
        if e.filename is None or not isinstance(e.filename, str | bytes | os.PathLike):
            raise
        file = os.path.abspath(os.fsdecode(e.filename))
        parent = os.path.dirname(os.path.abspath(dest))
        if file == os.path.abspath(dest) or os.path.dirname(file) != parent:
            raise
        out = type(e)(
            e.errno,
            f"cannot be written: its parent directory {parent} does not take new files: "
            f"{e.strerror or e}",
            dest,
        )
        out.hint = "choose a destination in a directory you can write"  # type: ignore[attr-defined]
        raise out from e


def os_message(e: OSError) -> str:
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = e.strerror or str(e)
    hint = getattr(e, "hint", None) or OS_HINTS.get(e.errno or -1)
    if e.errno in (errno.EEXIST, errno.ENOTDIR) and e.filename is not None:
        blocker = file_ancestor(os.fsdecode(e.filename))
        if blocker is not None:
            return f"{e.filename}: {blocker} is a regular file, not a directory"
    text = f"{where}: {what}" if where else what
    return text + (f" ({hint})" if hint and hint.lower() != what.lower() else "")


def os_error_json(e: OSError) -> dict[str, Any]:
    """An ``OSError`` as the error of a failed command: its type, ``os_message``, errno."""
    return {"type": type(e).__name__, "message": os_message(e), "errno": e.errno}


def problem_json(e: ModelshardError) -> dict[str, Any]:
    """``e`` as the error of a failed command, Python keywords written as flags."""
    out = e.to_json()
    out["message"] = in_flags(str(out["message"]))
    for p in out.get("problems", ()):
        if p.get("hint"):
            p["hint"] = in_flags(p["hint"])
    return out


def fail(command: str, status: int, error: dict[str, Any], as_json: bool) -> int:
    """Report a failed command; returns ``status``."""
    prog = f"modelshard{' ' + command if command else ''}"
    if as_json:
        emit(argparse.Namespace(command=command), False, exit_status=status, error=error)
        sys.stderr.write(
            f"{prog}: error: {error['type']}, exit status {status} (the JSON on stdout says "
            "what and where)\n"
        )
    else:
        sys.stderr.write(f"{prog}: error: {error['message']}\n")
    return status


class UsageError(Exception):
    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse, with its usage errors raised (so ``main`` formats them) not printed."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UsageError(self.prog, message)


@contextlib.contextmanager
def progress_bar(args: argparse.Namespace, what: str) -> Iterator[Any]:
    """The progress bar for a command (none with ``--json`` or ``--no-progress``)."""
    show = not args.json and not getattr(args, "no_progress", False)
    with reporter(show, None, what, min_bytes=0) as report:

        def tick(done: int, total: int) -> None:
            if _interrupt.seen:
                raise KeyboardInterrupt
            if report is not None:
                report(done, total)

        _interrupt.at_ticks = True
        try:
            yield tick
        finally:
            _interrupt.at_ticks = False


# whether Ctrl-C was pressed during the command, and whether ticks raise it
_interrupt = types.SimpleNamespace(seen=False, at_ticks=False)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While a command runs, Ctrl-C also leaves a mark."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        # Under a progress bar the first Ctrl-C is raised at the next tick: raised anywhere,
        # it can land in a thread pool's submit and leave a worker the exit waits on forever.
        first = not _interrupt.seen
        _interrupt.seen = True
        if not (first and _interrupt.at_ticks):
            raise KeyboardInterrupt

    unraisable = sys.unraisablehook

    def quiet(report: Any) -> None:  # the dropped interrupt is raised again: not "ignored"
        if not isinstance(report.exc_value, KeyboardInterrupt):
            unraisable(report)

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    sys.unraisablehook = quiet
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = unraisable
        _interrupt.seen = False
