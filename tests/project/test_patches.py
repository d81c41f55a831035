"""Every patch of another library lives in ``modelshard._internals.patches``, and each finds
what it patches on the installed versions, or fails there, saying what moved.
"""

from __future__ import annotations

import ast
import inspect
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from modelshard._internals import patches
from modelshard._internals.needs import installed, supported

SRC = Path(__file__).resolve().parents[2] / "src" / "modelshard"
PATCHES = SRC / "_internals" / "patches.py"
LIBRARIES = {"jax", "jaxlib", "orbax", "tensorstore", "flax", "optax", "equinox", "penzai"}
# what patches.py sets on other libraries' modules, classes and objects
PATCHED = {
    "build_kvstore_tspec",
    "to_json",
    "unbox",
    "_with_sharding_constraint",
}


def _leave(current: Any) -> None:
    assert callable(current)


def _module_level() -> list[Callable[[], Any]]:
    import tensorstore as ts

    return [
        lambda: patches.wrap_build_kvstore_tspec(_leave),
        lambda: patches.wrap_to_json(ts.Spec, _leave),
        lambda: patches.wrap_to_json(ts.KvStore.Spec, _leave),
        lambda: patches.wrap_linen_unbox(_leave),
        lambda: patches.wrap_linen_constraint(_leave),
    ]


def test_every_patch_finds_its_target_on_the_installed_versions() -> None:
    for install in _module_level():
        assert callable(install())  # nothing replaced: wrap returned None


def _tail(distribution: str) -> str:
    return (
        f"modelshard supports {supported(distribution)} (README, 'Supported versions'): "
        "install a version in that range, or report the release that moved it."
    )


def test_a_missing_target_fails_naming_the_symbol_version_and_use() -> None:
    stand_in = types.SimpleNamespace()
    with pytest.raises(ImportError) as info:
        patches.wrap_to_json(stand_in, _leave)
    assert str(info.value) == (
        f"modelshard needs SimpleNamespace.to_json from tensorstore "
        f"{installed('tensorstore')} (the references its conversion keeps given back: no "
        "leak on every save), and that version does not have it (no callable 'to_json' "
        f"there). {_tail('tensorstore')}"
    )
    assert not hasattr(stand_in, "to_json")


def test_a_target_with_another_signature_fails_naming_the_parameter() -> None:
    def build_kvstore_tspec(path: str) -> None:
        del path

    stand_in = types.SimpleNamespace(build_kvstore_tspec=build_kvstore_tspec)
    with pytest.raises(ImportError) as info:
        patches.target(
            stand_in,
            "build_kvstore_tspec",
            distribution="orbax-checkpoint",
            used_for="a test",
            params=("directory",),
        )
    assert str(info.value) == (
        f"modelshard needs SimpleNamespace.build_kvstore_tspec from orbax-checkpoint "
        f"{installed('orbax-checkpoint')} (a test), and that version does not have it (its "
        f"signature {inspect.signature(build_kvstore_tspec)} has no parameter 'directory'). "
        f"{_tail('orbax-checkpoint')}"
    )
    assert stand_in.build_kvstore_tspec is build_kvstore_tspec


def test_a_wrap_that_returns_a_replacement_installs_it() -> None:
    def to_json() -> dict[str, str]:
        return {"driver": "file"}

    stand_in = types.SimpleNamespace(to_json=to_json)
    seen = []

    def wrap(current: Any) -> Any:
        def wrapper() -> Any:
            seen.append("called")
            return current()

        return wrapper

    patches.wrap_to_json(stand_in, wrap)
    assert stand_in.to_json() == {"driver": "file"}
    assert seen == ["called"]


def assignments_onto_libraries(source: str) -> list[str]:
    """``line: text`` of every assignment (``a.b = ``, ``setattr(a, "b", ...)``) in
    ``source`` onto an attribute of a name imported from another library or from
    ``_internals``, or of an attribute ``patches.py`` patches."""
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    imported.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            top = (node.module or "").split(".")[0]
            if (not node.level and top in LIBRARIES) or (
                node.level and (node.module or "").split(".")[0] == "_internals"
            ):
                imported.update(a.asname or a.name for a in node.names)
    found = []
    for node in ast.walk(tree):
        targets: list[tuple[ast.expr, str]] = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute):
                    targets.append((t.value, t.attr))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "setattr"
            and len(node.args) == 3
            and isinstance(node.args[1], ast.Constant)
        ):
            targets.append((node.args[0], str(node.args[1].value)))
        for owner, attr in targets:
            base = owner
            while isinstance(base, ast.Attribute):
                base = base.value
            name = getattr(base, "id", "")
            if name in imported or (attr in PATCHED and name != "self"):
                found.append(f"{getattr(node, 'lineno', 0)}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_no_module_but_patches_assigns_onto_another_library() -> None:
    found = [
        f"{path.relative_to(SRC.parent)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if path != PATCHES
        for line in assignments_onto_libraries(path.read_text())
    ]
    assert not found, "patches of other libraries outside _internals/patches.py:\n" + "\n".join(
        found
    )


def test_the_check_sees_each_way_of_patching() -> None:
    source = (
        "import tensorstore as ts\n"
        "from .._internals import tensorstore_utils\n"
        "def f(spec, store):\n"
        "    ts.Spec.to_json = None\n"
        "    tensorstore_utils.build_kvstore_tspec = None\n"
        "    spec.to_json = None\n"
        "    setattr(store, 'build_kvstore_tspec', None)\n"
        "    self_made.value = 1\n"
    )
    assert sorted(line.split(":")[0] for line in assignments_onto_libraries(source)) == [
        "4",
        "5",
        "6",
        "7",
    ]
