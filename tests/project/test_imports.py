"""The package's import graph: no cycles between modules, and no underscore names borrowed
across modules (a private name another module needs belongs to a public-in-package helper).

The graph is read from the source: every ``import`` and ``from ... import`` anywhere in a
module, at module level, under ``if TYPE_CHECKING:`` and inside function bodies alike. A
type-only import back up the call path, or one deferred into a function, is still a cycle a
reader has to follow: deferring it hides it from the interpreter, not from the reader.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "modelshard"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out: dict[str, Path] = {}
    for f in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module: module level, ``if TYPE_CHECKING:``, ``try``
    blocks, and inside functions and classes."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """``module -> modules it imports`` (inside the package; imports in function bodies
    count), and every ``(importer, module, name)`` where an underscore name is imported
    from another module."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    borrowed: list[tuple[str, str, str]] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(mod, is_pkg, node)
                targets = []
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
                    if (
                        sub not in mods
                        and base.startswith(PACKAGE)
                        and a.name.startswith("_")
                        and not a.name.startswith("__")
                    ):
                        borrowed.append((mod, base, a.name))
            for t in targets:
                # Importing a submodule first initialises its parents: an edge to one's own
                # ancestor package is how packages work, not a cycle.
                if t in mods and t != mod and not mod.startswith(t + "."):
                    graph[mod].add(t)
    return graph, borrowed


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each as a
    sorted list: the modules that import each other round in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_detector_finds_cycles() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_is_read_from_the_package() -> None:
    graph, _ = import_graph()
    assert f"{PACKAGE}._specs" in graph[PACKAGE]  # the façade imports the areas
    assert f"{PACKAGE}._base" in graph[f"{PACKAGE}._specs.expand"]


def test_imports_in_function_bodies_are_edges() -> None:
    """A deferred import is read like any other (``Plan.groups`` in ``_place/planning.py`` imports ``fold``
    inside the method)."""
    tree = ast.parse(
        "def f():\n    from . import b\n\nclass C:\n    def g(self):\n        import c\n"
    )
    assert sorted(ast.unparse(n) for n in _imports(tree)) == ["from . import b", "import c"]
    graph, _ = import_graph()
    assert f"{PACKAGE}._base" in graph[f"{PACKAGE}._place.planning"]


def test_no_import_cycles() -> None:
    graph, _ = import_graph()
    cycles = find_cycles(graph)
    if cycles:
        lines = [
            " -> ".join([*c, c[0]])
            + "\n    edges: "
            + "; ".join(f"{a} imports {b}" for a in c for b in sorted(graph[a]) if b in c)
            for c in cycles
        ]
        pytest.fail("import cycles in src/:\n  " + "\n  ".join(lines))


def test_no_private_names_borrowed_across_modules() -> None:
    _, borrowed = import_graph()
    assert not borrowed, "underscore names imported from another module:\n" + "\n".join(
        f"  {importer}: from {module} import {name}" for importer, module, name in borrowed
    )


def _all_of(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in getattr(node.value, "elts", [])]
    return None


def test_private_modules_have_no_all() -> None:
    """What is public is what a façade re-exports (``from ._x import y as y``); a private
    module's ``__all__`` would be a second list to keep true, and such lists went stale."""
    found = [
        mod
        for mod, path in _modules().items()
        if any(part.startswith("_") for part in mod.split(".")[1:])
        and path.name != "__init__.py"
        and _all_of(ast.parse(path.read_text())) is not None
    ]
    assert not found, f"private modules with __all__: {found}"


def test_public_modules_all_is_true() -> None:
    import importlib

    for mod, path in _modules().items():
        if any(part.startswith("_") for part in mod.split(".")[1:]):
            continue
        names = _all_of(ast.parse(path.read_text())) or []
        module = importlib.import_module(mod)
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, f"{mod}.__all__ names what it lacks: {missing}"


def test_docs_examples_and_readme_import_no_private_module() -> None:
    """Users are shown public names only: no page under docs/, no example and not the
    README imports a ``modelshard._`` module (or an underscore name of modelshard)."""
    root = SRC.parent
    private = re.compile(
        r"(from\s+modelshard\._\w*|import\s+modelshard\._\w*|from\s+modelshard\s+import\s+_\w*"
        r"|import_module\(\s*[\"']modelshard\._)"
    )
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    files += sorted((root / "examples").rglob("*.py"))
    found = [
        f"{f.relative_to(root)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not found, "private modules imported where users read:\n" + "\n".join(found)


def test_area_readmes_name_every_module() -> None:
    """Each private package's README says what each of its modules owns: a module added
    without a line there is a module no reader was told about."""
    missing = []
    for readme in sorted((SRC / PACKAGE).glob("_*/README.md")):
        text = readme.read_text()
        for f in sorted(readme.parent.glob("*.py")):
            if f.name != "__init__.py" and f"`{f.name}`" not in text:
                missing.append(f"{readme.parent.name}/README.md does not name `{f.name}`")
    assert not missing, "\n".join(missing)


def test_area_readmes_are_maps_not_walls() -> None:
    """An area README is read in two minutes: at most 60 lines, no line over 200 characters."""
    long = []
    for readme in sorted((SRC / PACKAGE).glob("_*/README.md")):
        lines = readme.read_text().splitlines()
        if len(lines) > 60:
            long.append(f"{readme.parent.name}/README.md: {len(lines)} lines")
        long += [
            f"{readme.parent.name}/README.md:{n}: {len(line)} characters"
            for n, line in enumerate(lines, 1)
            if len(line) > 200
        ]
    assert not long, "\n".join(long)


def _area(module: str) -> str | None:
    """The area package a module belongs to (``modelshard._checkpoint.read`` ->
    ``modelshard._checkpoint``); None for the top-level modules."""
    parts = module.split(".")
    return (
        ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and _is_area(parts[1])) else None
    )


def _is_area(name: str) -> bool:
    return name.startswith("_") and (SRC / PACKAGE / name / "__init__.py").exists()


def reaches_past_facades(graph: Mapping[str, set[str]]) -> list[tuple[str, str]]:
    """Every ``(importer, module)`` where ``module`` lies inside an area the importer is not
    part of and is not that area's façade (its ``__init__``)."""
    out = []
    for importer, targets in graph.items():
        for t in sorted(targets):
            area = _area(t)
            if area is not None and t != area and _area(importer) != area:
                out.append((importer, t))
    return out


def test_the_facade_check_finds_a_reach() -> None:
    graph = {
        f"{PACKAGE}._cli.args": {f"{PACKAGE}._place.planning", f"{PACKAGE}._place"},
        f"{PACKAGE}._place.planning": {f"{PACKAGE}._place.constraints", f"{PACKAGE}._base"},
        PACKAGE: {f"{PACKAGE}._place", f"{PACKAGE}._checkpoint.read"},
    }
    assert reaches_past_facades(graph) == [
        (f"{PACKAGE}._cli.args", f"{PACKAGE}._place.planning"),
        (PACKAGE, f"{PACKAGE}._checkpoint.read"),
    ]


def test_no_import_reaches_past_an_areas_facade() -> None:
    """From outside an area only its ``__init__`` is imported: what another area needs is
    exported there, so an area's modules can be split or renamed behind it."""
    graph, _ = import_graph()
    found = reaches_past_facades(graph)
    assert not found, "imports past a façade (import the area's __init__ instead):\n" + "\n".join(
        f"  {importer} imports {module}" for importer, module in found
    )


def shadowed_modules(packages: Mapping[str, str], mods: set[str] | Mapping[str, Path]) -> list[str]:
    """Every ``package.name`` where the package's ``__init__`` (``packages``: dotted name ->
    source) binds ``name`` to something other than its submodule of that name (a function
    exported under the module's name hides the module: ``import package.name`` then gives
    the function)."""
    out = []
    for mod, source in packages.items():
        tree = ast.parse(source)
        for node in tree.body:
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = _resolve(mod, True, node)
                names = [
                    a.asname or a.name
                    for a in node.names
                    if f"{base}.{a.name}" not in mods or (a.asname or a.name) != a.name
                ]
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            out += [f"{mod}.{n}" for n in names if f"{mod}.{n}" in mods]
    return sorted(out)


def test_the_shadow_check_finds_a_function_named_like_its_module() -> None:
    mods = {"p", "p.locate", "p.read"}
    init = "from .locate import locate as locate\nfrom .read import restore as restore\n"
    assert shadowed_modules({"p": init}, mods) == ["p.locate"]
    assert shadowed_modules({"p": "from . import read as read\n"}, mods) == []


def test_no_module_is_shadowed_by_a_name_of_its_package() -> None:
    mods = _modules()
    packages = {m: p.read_text() for m, p in mods.items() if p.name == "__init__.py"}
    found = shadowed_modules(packages, mods)
    assert not found, "modules hidden by a name their package's __init__ binds:\n" + "\n".join(
        f"  {m}" for m in found
    )


# A module a reader can hold in mind: one concept per file, split by concept before a file
# grows past this (about 700 lines, with room for a docstring or two).
MAX_LINES = 750


def test_no_module_is_longer_than_a_reader_can_follow() -> None:
    long = {
        m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"
