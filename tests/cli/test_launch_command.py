"""``modelshard launch`` (``_cli/launch.py``): routed to the launcher, imported only when used."""

from __future__ import annotations

import sys

from modelshard.cli import main


def test_launch_is_routed_lazily(monkeypatch, capsys):
    import modelshard._runtime as runtime  # the command calls the runtime façade's main

    calls = []
    monkeypatch.setattr(runtime, "main", lambda argv: calls.append(argv) or 7)
    assert main(["launch", "-n", "2", "--", "python", "x.py"]) == 7
    assert calls == [["-n", "2", "--", "python", "x.py"]]
    monkeypatch.setitem(sys.modules, "modelshard._runtime", None)
    assert main(["launch", "-n", "2"]) == 1
    assert capsys.readouterr().err.startswith("modelshard launch is not available")
