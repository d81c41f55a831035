"""The benchmark pages and the comparison show only figures a benchmark wrote.

Figures reach a page through ``{{ bench(...) }}`` placeholders, rendered at build time from
``docs/benchmarks/results/*.json`` (``docs/_ext/bench.py``). A ratio (``1.2x``, with
the multiplication sign or an x) or a time (``31 ms``, ``4.2 s``) typed into a page by hand must be one some results file holds,
to the precision shown; targets (after a comparison sign) are not figures.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "benchmarks" / "results"
PAGES = [*sorted((DOCS / "benchmarks").glob("*.md")), DOCS / "comparison.md"]

_spec = importlib.util.spec_from_file_location("bench_hook", DOCS / "_ext" / "bench.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TIMES, DASH, LE, GE = "\u00d7", "\u2013", "\u2264", "\u2265"
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?P<pre>[{LE}{GE}<>]\s*|~)?(?P<lo>{NUMBER})(?:\s*[{DASH}-]\s*(?P<hi>{NUMBER}))?"
    rf"(?:(?P<ratio>{TIMES}|x\b)|\s?(?P<time>ms|s)\b)"
)


def _prose(markdown: str) -> str:
    """The page without placeholders, fenced code and inline code."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    text = bench.PLACEHOLDER.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def quoted_figures(markdown: str) -> list[str]:
    """Every ratio or time typed into ``markdown``'s prose (targets after ≤/≥ excluded)."""
    out = []
    for m in FIGURE.finditer(_prose(markdown)):
        if m.group("pre") and m.group("pre").strip() in (LE, GE, "<", ">"):
            continue
        out += [n for n in (m.group("lo"), m.group("hi")) if n]
    return out


def held_values() -> list[float]:
    values: list[float] = []
    for f in RESULTS.glob("*.json"):
        for v in json.loads(f.read_text())["results"].values():
            if isinstance(v, list):
                values += v
            elif isinstance(v, int | float):
                values.append(v)
    return values


def _held(text: str, values: list[float]) -> bool:
    shown = text.replace(",", "")
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    q = float(shown)
    return any(abs(q - v) <= 0.5 * 10**-decimals + 1e-12 for v in values)


def _id(page: Path) -> str:
    return str(page.relative_to(DOCS))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_a_page_quotes_only_figures_a_results_file_holds(page: Path) -> None:
    values = held_values()
    stray = [q for q in quoted_figures(page.read_text()) if not _held(q, values)]
    assert not stray, f"{_id(page)} quotes figures no results file holds: {stray}"


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_placeholder_names_a_figure_that_exists(page: Path) -> None:
    bench.render(page.read_text())


def test_every_benchmark_page_is_checked() -> None:
    assert {_id(p) for p in PAGES} >= {
        "benchmarks/index.md",
        "benchmarks/dispatch.md",
        "benchmarks/checkpoint.md",
        "benchmarks/weights.md",
        "comparison.md",
    }


def test_results_files_record_their_run() -> None:
    files = sorted(RESULTS.glob("*.json"))
    assert files, "no results files under docs/benchmarks/results/"
    for f in files:
        body: dict[str, Any] = json.loads(f.read_text())
        assert body["benchmark"] == f.stem
        assert {"date", "commit", "versions", "machine", "command", "results"} <= set(body)
        assert body["versions"].get("jax") and body["commit"] != "unknown", f.name


def test_the_checker_finds_hand_typed_figures() -> None:
    page = (
        f"costs 3.61{TIMES}{DASH}4.94x `jax.jit` (target {LE} 1.5{TIMES}), 31 ms cold, "
        f'{{{{ bench("expand", "cold_ms", "ms") }}}}, shape 4096 {TIMES} 1024\n```\n9.9x\n```\n'
    )
    assert quoted_figures(page) == ["3.61", "4.94", "31"]


def test_an_unknown_figure_or_file_names_both() -> None:
    with pytest.raises(bench.BenchmarkFigureError, match="no figure 'nope'"):
        bench.render('{{ bench("' + sorted(RESULTS.glob("*.json"))[0].stem + '", "nope") }}')
    with pytest.raises(bench.BenchmarkFigureError, match=r"no results file nope\.json"):
        bench.render('{{ bench("nope", "x") }}')


def test_a_list_of_runs_renders_as_its_range() -> None:
    assert bench._number(0.5) == "0.5"
    assert bench._number(10207) == "10,207"
