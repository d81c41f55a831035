"""Progress in bytes, the one bar of the library and the CLI.

``progress=True`` (the default of ``load_safetensors`` and ``save_safetensors``) draws a
``rich`` bar on stderr only when stderr is a terminal and the work is at least
``MIN_BYTES`` (256 MiB): nothing in a pipe, a log file or a test. ``False`` draws nothing;
a callable is called as ``progress(bytes_done, bytes_total)`` instead of a bar. The
commands (``reshard``, ``convert``) draw the same bar whatever the size, unless ``--json``
or ``--no-progress``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

MIN_BYTES = 256 << 20
"""The smallest load or export that draws a bar (smaller ones finish before it helps)."""

Progress = bool | Callable[[int, int], None] | None
Report = Callable[[int, int], None]


def terminal() -> Any:
    """A ``rich`` console on stderr if stderr is a terminal, else ``None``.

    Decided by the stream's own ``isatty()``, not by ``FORCE_COLOR`` or ``TTY_COMPATIBLE``
    (which make ``rich`` draw into pipes, and CI logs).
    """
    stream = sys.stderr
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # closed, or not a file
        tty = False
    if not tty:
        return None
    from rich.console import Console

    return Console(file=stream, force_terminal=True)


@contextlib.contextmanager
def reporter(
    progress: Progress, total: int | None, description: str, *, min_bytes: int | None = None
) -> Iterator[Report | None]:
    """What to call after each piece: the user's callable, a bar's update, or ``None``.

    ``total`` may be unknown (None) until the first report; ``min_bytes`` (default
    ``MIN_BYTES``) is the smallest known total that draws a bar."""
    if callable(progress):
        yield progress
        return
    least = MIN_BYTES if min_bytes is None else min_bytes
    console = terminal() if progress and (total is None or total >= least) else None
    if console is None:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    from .text import escape_markup

    with Progress(*columns, console=console) as bar:
        task = bar.add_task(escape_markup(description), total=total)
        yield lambda done, total: bar.update(task, completed=done, total=total)
