"""MkDocs hook: the benchmark figures on the pages are read from the results files at build
time, so a page can only show a number a benchmark wrote.

``benchmarks/results.py`` writes ``docs/benchmarks/results/<name>.json``. A page writes

- ``{{ bench("expand", "cold_vs_baseline", "×") }}``: one figure (a list of runs shows as
  its range, ``min–max``), with an optional unit appended;
- ``{{ bench_run("expand") }}``: which run the figures are from (date, commit, versions,
  machine and load, command, notes).

An unknown file or figure stops the build (``mkdocs build --strict``), naming both.
``tests/project/test_benchmark_figures.py`` checks that no page quotes a figure by hand.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
PLACEHOLDER = re.compile(r"\{\{\s*(bench|bench_run)\(([^)]*)\)\s*\}\}")
_ARG = re.compile(r"\s*\"([^\"]*)\"\s*(?:,|$)")


class BenchmarkFigureError(ValueError):
    """A placeholder names a results file or a figure that does not exist."""


@functools.cache
def load(name: str) -> dict[str, Any]:
    """The results file ``docs/benchmarks/results/<name>.json``."""
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in RESULTS.glob("*.json"))) or "none"
        raise BenchmarkFigureError(
            f"no results file {path.name} under docs/benchmarks/results/ (have: {have}); "
            f"run benchmarks/{name}.py, which writes it"
        )
    return json.loads(path.read_text())


def _number(v: float | int) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def figure(name: str, key: str, unit: str = "") -> str:
    """One figure of a results file as a page shows it."""
    results = load(name)["results"]
    if key not in results:
        raise BenchmarkFigureError(
            f"results file {name}.json has no figure {key!r} (it has: {', '.join(results)})"
        )
    v = results[key]
    if isinstance(v, list):
        lo, hi = min(v), max(v)
        text = _number(lo) if lo == hi else f"{_number(lo)}–{_number(hi)}"
    elif isinstance(v, int | float):
        text = _number(v)
    else:
        text = str(v)
    if unit:
        text += unit if unit in ("×", "%") else f" {unit}"
    return text


def run_line(name: str) -> str:
    """Where the figures of a results file come from, in one line."""
    r = load(name)
    versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
    machine = r["machine"]
    notes = f" {r['notes'].rstrip('.')}." if r.get("notes") else ""
    return (
        f"*Figures from `{r['command']}`, run {r['date']} at commit `{r['commit']}` on "
        f"{machine['cpus']} CPU cores (load average {machine['load_1min']}); {versions}.{notes}*"
    )


def render(markdown: str) -> str:
    """``markdown`` with every placeholder replaced by its figure."""

    def one(m: re.Match[str]) -> str:
        args = _ARG.findall(m.group(2))
        if m.group(1) == "bench_run":
            return run_line(*args)
        return figure(*args)

    return PLACEHOLDER.sub(one, markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown)
    except (BenchmarkFigureError, TypeError) as e:
        raise PluginError(f"{page.file.src_path}: {e}") from e
