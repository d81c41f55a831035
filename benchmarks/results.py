"""Where every benchmark's numbers go: ``docs/benchmarks/results/<name>.json``.

The docs quote figures only from these files (rendered at docs build time), so a number on a
page is always one a benchmark wrote, with the run that produced it::

    from results import write_results
    write_results("checkpoint", {"save_vs_np_save": 0.73, "restore_vs_floor": [0.61, 0.64]},
                  argv=sys.argv)

A value is a number, a string, or a list of numbers (one per run or repeat). Each file also
records the date, the commit, the versions of the stack, the machine's cores and load, and
the command line, so that a reader can tell which code and which machine a figure is from.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "results"
PACKAGES = ("jax", "jaxlib", "flax", "equinox", "optax", "orbax-checkpoint", "numpy", "modelshard")


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=RESULTS.parents[2],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def _check(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float | str | list | tuple):
        raise TypeError(
            f"result {name!r}: {value!r} is not a number, a string or a list of numbers"
        )
    if isinstance(value, list | tuple):
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            raise TypeError(f"result {name!r}: a list must hold numbers only, got {value!r}")
        return list(value)
    return value


def write_results(
    name: str,
    results: Mapping[str, Any],
    *,
    argv: Sequence[str] | None = None,
    notes: str = "",
) -> Path:
    """Write ``results`` (figure name -> value) as ``docs/benchmarks/results/<name>.json``,
    replacing the file a previous run of the same benchmark wrote, and return its path."""
    body = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _commit(),
        "versions": _versions(),
        "machine": {"cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2)},
        "command": " ".join(argv if argv is not None else sys.argv),
        "notes": notes,
        "results": {k: _check(k, v) for k, v in results.items()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)
    return path
