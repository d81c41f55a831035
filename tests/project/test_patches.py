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
    "get_tensorstore_raw_bytes",
    "build_array_write_spec",
    "build_kvstore_tspec",
    "get_barrier_sync_fn",
    "save",
    "async_save",
    "finalize",
    "_make_on_commit_callback",
    "to_json",
    "unbox",
    "_with_sharding_constraint",
}


def _leave(current: Any) -> None:
    assert callable(current)


def _module_level() -> list[Callable[[], Any]]:
    import tensorstore as ts

    return [
        lambda: patches.wrap_build_array_write_spec(_leave),
        lambda: patches.wrap_build_kvstore_tspec(_leave),
        lambda: patches.wrap_barrier_sync_fn(_leave),
        lambda: patches.wrap_to_json(ts.Spec, _leave),
        lambda: patches.wrap_to_json(ts.KvStore.Spec, _leave),
        lambda: patches.wrap_linen_unbox(_leave),
        lambda: patches.wrap_linen_constraint(_leave),
    ]


def test_every_patch_finds_its_target_on_the_installed_versions() -> None:
    import orbax.checkpoint as ocp

    for install in _module_level():
        assert callable(install())  # nothing replaced: wrap returned None
    # the handlers modelshard wraps: its own saves' and a manager step's
    for handler in (ocp.PyTreeCheckpointHandler(), ocp.CompositeCheckpointHandler()):
        assert patches.wrap_handler_save(handler, _leave) is handler
        assert patches.wrap_handler_async_save(handler, _leave) is handler
    handler = ocp.PyTreeCheckpointHandler()
    assert patches.wrap_handler_finalize(handler, lambda h, d: None) is handler
    checkpointer = ocp.AsyncCheckpointer(handler)
    try:
        assert patches.wrap_commit_callback(checkpointer, _leave) is checkpointer
    finally:
        checkpointer.close()
    # the one patch of an Orbax function not every supported Orbax has
    from modelshard._internals import tensorstore_utils

    if hasattr(tensorstore_utils, "get_tensorstore_raw_bytes"):
        patches.target(
            tensorstore_utils,
            "get_tensorstore_raw_bytes",
            distribution="orbax-checkpoint",
            symbol="get_tensorstore_raw_bytes",
            used_for="a test",
        )


def _tail(distribution: str) -> str:
    return (
        f"modelshard supports {supported(distribution)} (README, 'Supported versions'): "
        "install a version in that range, or report the release that moved it."
    )


def test_a_missing_target_fails_naming_the_symbol_version_and_use() -> None:
    stand_in = types.SimpleNamespace()
    with pytest.raises(ImportError) as info:
        patches.wrap_handler_save(stand_in, _leave)
    assert str(info.value) == (
        f"modelshard needs SimpleNamespace.save from orbax-checkpoint "
        f"{installed('orbax-checkpoint')} (a failed write shared with every process before "
        "Orbax's next barrier), and that version does not have it (no callable 'save' "
        f"there). {_tail('orbax-checkpoint')}"
    )
    assert not hasattr(stand_in, "save")


def test_a_target_with_another_signature_fails_naming_the_parameter() -> None:
    def finalize(path: str) -> None:
        del path

    stand_in = types.SimpleNamespace(finalize=finalize)
    with pytest.raises(ImportError) as info:
        patches.wrap_handler_finalize(stand_in, lambda handler, directory: None)
    assert str(info.value) == (
        f"modelshard needs SimpleNamespace.finalize from orbax-checkpoint "
        f"{installed('orbax-checkpoint')} (the merge of every process's OCDBT database, "
        "under any path), and that version does not have it (its signature "
        f"{inspect.signature(finalize)} has no parameter 'directory'). "
        f"{_tail('orbax-checkpoint')}"
    )
    assert stand_in.finalize is finalize


def test_a_wrap_that_returns_a_replacement_installs_it() -> None:
    def finalize(directory: str) -> None:
        del directory

    stand_in = types.SimpleNamespace(finalize=finalize)
    seen = []
    patches.wrap_handler_finalize(stand_in, lambda h, d: seen.append((h, d)))
    stand_in.finalize("dir")
    assert seen == [(stand_in, "dir")]


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
        "from .._internals import multihost\n"
        "def f(handler, checkpointer):\n"
        "    ts.Spec.to_json = None\n"
        "    multihost.get_barrier_sync_fn = None\n"
        "    handler.finalize = None\n"
        "    setattr(checkpointer, '_make_on_commit_callback', None)\n"
        "    self_made.value = 1\n"
    )
    assert sorted(line.split(":")[0] for line in assignments_onto_libraries(source)) == [
        "4",
        "5",
        "6",
        "7",
    ]
