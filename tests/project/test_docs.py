"""The docs cannot rot: every public name is documented, docstring examples and the code
blocks shown in the docs and the README run, and the site's navigation points at pages that exist."""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import modelshard as ms

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
API = DOCS / "api"


def _public(module: types.ModuleType) -> dict[str, object]:
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    return {n: getattr(module, n) for n in names}


def _documented() -> set[str]:
    """Every ``::: dotted.name`` directive in the API reference pages."""
    found: set[str] = set()
    for page in API.glob("*.md"):
        found.update(re.findall(r"^::: *([\w.]+)", page.read_text(), flags=re.MULTILINE))
    return found


def _documentable(obj: object) -> bool:
    """Classes and functions carry docstrings; constants (strings, numbers) cannot."""
    return inspect.isclass(obj) or inspect.isroutine(obj)


def _public_objects() -> list[tuple[str, object]]:
    """``(dotted name, object)`` for every public class and function of modelshard and of its
    public modules (``modelshard.adapters``, ...)."""
    out: list[tuple[str, object]] = []
    for name, obj in _public(ms).items():
        if isinstance(obj, types.ModuleType):
            out.extend(
                (f"modelshard.{name}.{n}", o) for n, o in _public(obj).items() if _documentable(o)
            )
        elif _documentable(obj):
            out.append((f"modelshard.{name}", obj))
    return out


def test_public_modules_have_docstrings() -> None:
    for name, obj in _public(ms).items():
        if isinstance(obj, types.ModuleType):
            assert (obj.__doc__ or "").strip(), f"modelshard.{name} has no module docstring"


def _same_object_documented(obj: object, documented: set[str]) -> bool:
    """A re-export (``modelshard.adapters.register_container``) documented under another name."""
    for dotted in documented:
        mod, _, attr = dotted.rpartition(".")
        try:
            if getattr(importlib.import_module(mod), attr) is obj:
                return True
        except (ImportError, AttributeError):
            continue
    return False


@pytest.mark.parametrize(
    "dotted,obj", _public_objects(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_public_name_has_docstring_and_api_entry(dotted: str, obj: object) -> None:
    doc = inspect.getdoc(obj)
    assert doc and len(doc.split()) >= 3, f"{dotted} has no real docstring"
    documented = _documented()
    assert dotted in documented or _same_object_documented(obj, documented), (
        f"{dotted} is public but appears in no `::: {dotted}` directive under docs/api/"
    )


def test_api_directives_name_real_objects() -> None:
    for dotted in sorted(_documented()):
        mod, _, attr = dotted.rpartition(".")
        assert hasattr(importlib.import_module(mod), attr), f"docs/api names missing {dotted}"


def _modules() -> list[str]:
    """Every module of the package, the area packages' modules included."""
    return sorted(m.name for m in pkgutil.walk_packages(ms.__path__, "modelshard."))


@pytest.mark.parametrize("module", _modules())
def test_docstring_examples_run(module: str) -> None:
    """``>>>`` examples in every module's docstrings (8 simulated devices from conftest)."""
    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(mod, module) if t.examples]
    for t in tests:
        with ms.adapters.registry_snapshot():
            runner.run(t, clear_globs=True)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module}"


# ---- the code shown in the docs ----------------------------------------------------------

# Every ```python block of these pages runs, in order, in one namespace per page.
# (``py`` blocks are shown but not run: schematic fragments.)
RUNNABLE = [
    ROOT / "README.md",
    *sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text()),
]

_RUNNER = r"""
import os, re, runpy, sys, traceback
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_num_cpu_devices", 8)
cache = os.environ.get("MODELSHARD_TESTS_COMPILATION_CACHE")
if cache:  # the run's, as the tests compile
    runpy.run_path("tests/compile_cache.py")["use"](cache)
failed = []
for path in sys.argv[1:]:
    text = open(path).read()
    code = "\n".join(re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL))
    try:
        exec(compile(code, path, "exec"), {"__name__": "__main__"})
    except Exception:
        failed.append(path)
        traceback.print_exc()
print("FAILED:" + ",".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.parametrize("half", [0, 1])
def test_docs_code_blocks_run(half: int) -> None:
    # Two halves of the pages, each in one process: two test workers share the work.
    assert RUNNABLE, "no runnable code blocks found under docs/"
    # Tiny arrays: compile time dominates, so XLA's backend optimisations are turned down.
    xla = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *map(str, RUNNABLE[half::2])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_nav_pages_exist() -> None:
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    pages = re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.MULTILINE)
    assert pages
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml nav names pages that do not exist: {missing}"


def test_cli_page_matches_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """Every command and option the CLI page shows exists in that command's --help."""
    from modelshard.cli import main

    text = (DOCS / "cli.md").read_text()
    shown = re.findall(r"`modelshard (\w+)([^`]*)`", text)
    assert {c for c, _ in shown} >= {"inspect", "plan", "reshard", "launch"}
    for command, rest in shown:
        capsys.readouterr()
        try:
            status = main([command, "--help"])
        except SystemExit as e:  # `launch` hands its arguments to argparse directly
            status = e.code or 0
        assert status == 0
        helptext = capsys.readouterr().out
        for option in re.findall(r"--[a-z][\w-]*", rest):
            assert option in helptext, f"modelshard {command} has no {option}"


def test_readme_commands_exist() -> None:
    """The README's two commands are Makefile targets, and `make demo` runs the demo."""
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, flags=re.MULTILINE), target
    demo_recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "examples/demo.py" in demo_recipe
    assert "bootstrap" in makefile and (ROOT / "scripts" / "bootstrap.sh").is_file()


_ROLE = re.compile(r":(func|class|mod|meth|attr|exc|data|obj):`")


def test_no_sphinx_roles_in_sources() -> None:
    """Cross-references are mkdocstrings autorefs ([`plan`][modelshard.plan]); a Sphinx role
    (:func:`plan`) would render as literal text in the API reference."""
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted([*(ROOT / "src").rglob("*.py"), *DOCS.rglob("*.md")])
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _ROLE.search(line)
    ]
    assert not found, "\n".join(found)


def _built_site(tmp_path: Path) -> Path:
    """The strict build ``make docs`` wrote if it is newer than every page and source
    file; else a strict build of our own (the one ``make test`` runs)."""
    made = ROOT / ".venv" / "site" / "index.html"
    sources = [*(ROOT / "src").rglob("*.py"), *DOCS.rglob("*"), ROOT / "mkdocs.yml"]
    if made.is_file() and made.stat().st_mtime > max(p.stat().st_mtime for p in sources):
        return made.parent
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "--site-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp_path


def test_built_api_reference_has_no_sphinx_roles(tmp_path: Path) -> None:
    """The strict docs build, then its HTML: no role text survives, cross-refs are links."""
    site = _built_site(tmp_path)
    pages = list((site / "api").rglob("*.html"))
    assert pages
    for page in pages:
        text = page.read_text()
        assert not _ROLE.search(text), page
    core = (site / "api" / "core" / "index.html").read_text()
    assert 'href="#modelshard.LeafPlan"' in core  # ArgPlan's docstring links LeafPlan
