"""Progress of a load or an export, in bytes.

``progress=True`` (the default of ``load_safetensors``, ``save_safetensors`` and the CLI)
draws a ``rich`` bar on stderr only when stderr is a terminal and the work is at least
``MIN_BYTES`` (256 MiB): nothing in a pipe, a log file or a test. ``False`` draws nothing;
a callable is called as ``progress(bytes_done, bytes_total)`` instead of a bar.
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
def reporter(progress: Progress, total: int, description: str) -> Iterator[Report | None]:
    """What to call after each piece: the user's callable, a bar's update, or ``None``."""
    if callable(progress):
        yield progress
        return
    console = terminal() if progress and total >= MIN_BYTES else None
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
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done, _total: bar.update(task, completed=done)
