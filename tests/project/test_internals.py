"""Private names of Orbax and JAX live in ``modelshard._internals`` only, and all import.

An Orbax or JAX upgrade that moves one of them fails here, in one place, with a message that
names the symbol, the installed version and what modelshard uses it for.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from modelshard._internals.needs import installed, needed, supported

SRC = Path(__file__).resolve().parents[2] / "src" / "modelshard"
INTERNALS = {
    SRC / "_internals" / "orbax.py",
    SRC / "_internals" / "orbax_text.py",
    SRC / "_internals" / "jax.py",
    SRC / "_internals" / "patches.py",  # names the private symbols it patches
}
PRIVATE = re.compile(r"\b(jax|jaxlib|orbax(\.checkpoint)?)\._src\b")


def _needed_blocks(path: Path) -> list[tuple[str, list[str]]]:
    """``(symbol named in needed(...), names its block imports)`` for every block."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.With):
            call = node.items[0].context_expr
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "needed":
                symbol = ast.literal_eval(call.args[1])
                names = [
                    a.asname or a.name
                    for stmt in node.body
                    if isinstance(stmt, ast.ImportFrom | ast.Import)
                    for a in stmt.names
                ]
                out.append((symbol, names))
    return out


@pytest.mark.parametrize("module", ["orbax", "jax"])
def test_every_private_name_imports(module: str) -> None:
    mod = importlib.import_module(f"modelshard._internals.{module}")
    blocks = _needed_blocks(SRC / "_internals" / f"{module}.py")
    assert blocks, f"no needed(...) blocks found in _internals/{module}.py"
    for symbol, names in blocks:
        assert len(names) == 1, f"{symbol}: one symbol per needed(...) block, got {names}"
        assert hasattr(mod, names[0]), symbol


def test_every_name_written_as_text_is_orbaxs() -> None:
    """``orbax_text`` spells Orbax's private names without importing Orbax: each must still
    name what the installed Orbax has."""
    import orbax.checkpoint as ocp

    from modelshard._internals import orbax_text

    cls = ocp.StandardCheckpointHandler
    assert f"{cls.__module__}.{cls.__qualname__}" == orbax_text.STANDARD_HANDLER_NAME


def test_every_private_import_sits_in_a_needed_block() -> None:
    """A private import outside a ``needed`` block would fail without saying why."""
    loose = []
    for path in sorted(INTERNALS):
        tree = ast.parse(path.read_text())
        inside = {
            id(stmt) for node in ast.walk(tree) if isinstance(node, ast.With) for stmt in node.body
        }
        for node in ast.walk(tree):
            private = isinstance(node, ast.ImportFrom) and PRIVATE.search(node.module or "")
            if private and id(node) not in inside:
                loose.append(f"{path.name}:{node.lineno}")
    assert not loose, f"private imports outside needed(...): {loose}"


def test_no_private_module_named_outside_internals() -> None:
    found = [
        f"{path.relative_to(SRC.parent)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path not in INTERNALS
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert not found, "jax._src / orbax.checkpoint._src named outside _internals:\n" + "\n".join(
        found
    )


def test_a_moved_symbol_fails_with_the_symbol_version_and_use() -> None:
    with (
        pytest.raises(ImportError) as info,
        needed("orbax-checkpoint", "orbax.checkpoint.no_such_name", "a test of the message"),
    ):
        from orbax.checkpoint import no_such_name  # type: ignore[attr-defined]  # noqa: F401
    version = installed("orbax-checkpoint")
    assert str(info.value) == (
        f"modelshard needs orbax.checkpoint.no_such_name from orbax-checkpoint {version} "
        "(a test of the message), and that version does not have it (cannot import name "
        f"'no_such_name' from 'orbax.checkpoint' ({importlib.import_module('orbax.checkpoint').__file__})). "
        f"modelshard supports {supported('orbax-checkpoint')} (README, 'Supported versions'): "
        "install a version in that range, or report the release that moved it."
    )
    assert isinstance(info.value.__cause__, ImportError)


def test_supported_reads_modelshards_requirement() -> None:
    assert re.fullmatch(r"orbax-checkpoint>=[0-9.]+(,<[0-9.]+)?", supported("orbax-checkpoint"))
    assert supported("no-such-distribution") == "no-such-distribution"
    assert installed("no-such-distribution") == "(not installed)"
