"""``modelshard.cli.main``: the ``modelshard`` command line (``python -m modelshard`` too)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._base import ModelshardError, speaking
from . import convert, inspect, launch, mappings, plan, reshard, steps
from .output import (
    Parser,
    UsageError,
    fail,
    interruptible,
    os_error_json,
    problem_json,
    tensorstore_os_error,
)


def parser() -> argparse.ArgumentParser:
    """The ``modelshard`` argument parser: one subcommand per command module."""
    from .. import __version__

    p = Parser(
        prog="modelshard",
        description="Inspect, plan and reshard JAX checkpoints; launch local multi-process runs. "
        "Exit status: 0 done, 1 a problem (printed as one line, or a JSON object with --json), "
        "2 a usage error, 130 interrupted.",
    )
    p.add_argument("--version", action="version", version=f"modelshard {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for command in (inspect, plan, reshard, convert, steps, mappings, launch):
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``modelshard`` command line; returns the exit status.

    The same program as the ``modelshard`` script and ``python -m modelshard``. A user
    error never ends in a traceback: it is one line on stderr (with ``--json``, a JSON
    document on stdout, as on success), exit status 1 for a problem and 2 for a usage error;
    Ctrl-C ends it with status 130 and one line.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 done, 1 a problem, 2 a usage error, 130 interrupted.

    Example:
        >>> from modelshard.cli import main
        >>> main(["plan", "ckpt", "--mesh", "data=2,model=x"])
        2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        return launch.run(argv[1:])
    as_json = "--json" in (argv[: argv.index("--")] if "--" in argv else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    if command == "plan":
        plan.simulate_devices(argv)
    p = parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help, --version
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    except UsageError as e:
        cmd = e.prog.removeprefix("modelshard").strip() or command
        message = f"{e} (see 'modelshard {cmd + ' ' if cmd else ''}--help')"
        return fail(cmd, 2, {"type": "UsageError", "message": message}, as_json)
    if getattr(args, "run", None) is None:
        p.print_help(sys.stderr)
        return 2
    try:
        with speaking("cli"), interruptible():  # hints name options, not Python
            return int(args.run(args))
    except ModelshardError as e:
        return fail(args.command, 1, problem_json(e), as_json)
    except KeyboardInterrupt:  # Ctrl-C: what a write had staged is removed on the way out
        message = "interrupted (Ctrl-C); nothing half-written was published"
        return fail(args.command, 130, {"type": "KeyboardInterrupt", "message": message}, as_json)
    except (OSError, ValueError) as e:  # user's paths: missing, unreadable, read-only, full disk
        # TensorStore reports a failed write (full disk) as ValueError
        os_error = e if isinstance(e, OSError) else tensorstore_os_error(e)
        if os_error is None:
            raise
        return fail(args.command, 1, os_error_json(os_error), as_json)
