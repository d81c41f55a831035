"""``modelshard launch``: a command as N local JAX processes (``_runtime.processes``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _runtime


def add_parser(sub: Any) -> None:
    """The ``launch`` subcommand (``main`` hands its arguments to the launcher)."""
    sub.add_parser(
        "launch",
        help="run a command as N local JAX processes",
        description="Run a command as N local processes on JAX's distributed "
        "runtime; see `modelshard launch --help`.",
        add_help=False,
    )


def run(rest: Sequence[str]) -> int:
    """Run the launcher on the arguments after ``launch``; returns its exit status."""
    return int(_runtime.main(list(rest)))
