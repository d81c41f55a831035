"""Progress in bytes, the one bar of the library and the CLI."""

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
    """A ``rich`` console on stderr if stderr is a terminal, else ``None``."""
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
    """What to call after each piece: the user's callable, a bar's update, or ``None``."""
    if callable(progress):
        yield progress
        return
    least = MIN_BYTES if min_bytes is None else min_bytes
    console = terminal() if progress and (total is None or total >= least) else None
    if console is None:
        yield None
        return
    import rich.progress as rp
    from rich.markup import escape

    columns = (
        rp.TextColumn("{task.description}"),
        rp.BarColumn(),
        rp.DownloadColumn(binary_units=True),
    )
    columns += (rp.TransferSpeedColumn(), rp.TimeRemainingColumn())
    with rp.Progress(*columns, console=console) as bar:
        task = bar.add_task(escape(description), total=total)  # shown literally
        yield lambda done, total: bar.update(task, completed=done, total=total)
