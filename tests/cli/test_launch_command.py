"""``modelshard launch`` (``_cli/launch.py``): routed to the launcher, its arguments as given."""

from __future__ import annotations

from modelshard.cli import main


def test_launch_is_routed_to_the_launcher(monkeypatch):
    import modelshard._runtime as runtime  # the command calls the runtime façade's main

    calls = []
    monkeypatch.setattr(runtime, "main", lambda argv: calls.append(argv) or 7)
    assert main(["launch", "-n", "2", "--", "python", "x.py"]) == 7
    assert calls == [["-n", "2", "--", "python", "x.py"]]
