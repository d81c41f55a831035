"""Restoring can run no code a checkpoint supplies: nothing in the package unpickles, evals or
execs."""

from __future__ import annotations

from pathlib import Path

import modelshard as ms

UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "joblib",
}


UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _unsafe(path: Path) -> list[str]:
    """Imports of unpickling modules, calls of eval/exec/compile/__import__ (bare or via
    ``builtins``), ``allow_pickle=``, and ``import_module`` of a non-literal name outside
    ``import_optional`` (whose callers must pass literals) and ``function_arg`` (the
    ``module:function`` a user types after ``modelshard plan --step``, as ``python -m``
    takes a module: the user's own code, never a name read from a file)."""
    import ast

    tree = ast.parse(path.read_text())
    exempt = {
        id(n)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name in ("import_optional", "function_arg")
        for n in ast.walk(fn)
    }
    bad = []
    where = path.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            bad += [
                f"{where}:{node.lineno}: import {m}"
                for m in mods
                if m.split(".")[0] in UNSAFE_MODULES
            ]
        if not isinstance(node, ast.Call):
            continue
        f, literal = node.func, all(isinstance(a, ast.Constant) for a in node.args)
        if isinstance(f, ast.Name) and f.id in UNSAFE_BUILTINS:
            bad.append(f"{where}:{node.lineno}: {f.id}()")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if f.value.id == "builtins" and f.attr in UNSAFE_BUILTINS:
                bad.append(f"{where}:{node.lineno}: builtins.{f.attr}()")
            if f.attr == "import_module" and not literal and id(node) not in exempt:
                bad.append(f"{where}:{node.lineno}: import_module of a computed name")
        if isinstance(f, ast.Name) and f.id == "import_optional" and not literal:
            bad.append(f"{where}:{node.lineno}: import_optional of a computed name")
        bad += [
            f"{where}:{node.lineno}: allow_pickle" for k in node.keywords if k.arg == "allow_pickle"
        ]
    return sorted(set(bad))


def test_no_pickle_eval_or_exec_anywhere_in_the_package(tmp_path):
    """Restoring reads JSON and array bytes only: nothing in modelshard can run code that a
    checkpoint carries."""
    files = sorted(Path(ms.__file__).parent.rglob("*.py"))
    assert len(files) > 10
    assert [bad for f in files for bad in _unsafe(f)] == []
    # the scan does find what it looks for
    (tmp_path / "evil.py").write_text(
        "import pickle\nimport builtins\ndef f(x):\n    eval(x)\n    builtins.exec(x)\n"
        "    importlib.import_module(x)\n    np.load(x, allow_pickle=True)\n"
    )
    assert _unsafe(tmp_path / "evil.py") == [
        "evil.py:1: import pickle",
        "evil.py:4: eval()",
        "evil.py:5: builtins.exec()",
        "evil.py:6: import_module of a computed name",
        "evil.py:7: allow_pickle",
    ]
