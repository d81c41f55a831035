"""The README's support table, pyproject's floors and the floor lock say the same versions."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Extras tested on the newest stack only (the README says so): their floors are not pinned.
LOCK_ONLY = {"penzai", "qwix", "gcsfs", "s3fs", "huggingface-hub"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject_floors() -> dict[str, str]:
    """Package -> the ``>=`` floor of every runtime requirement and extra of pyproject."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        if extra != "dev":
            reqs += items
    out: dict[str, str] = {}
    for req in reqs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?>=([0-9.]+)(?:,<[0-9.]+)?", req)
        assert m, f"pyproject requirement {req!r} has no >= floor"
        name, floor = _norm(m.group(1)), m.group(2)
        assert out.get(name, floor) == floor, f"{name}: two floors in pyproject"
        out[name] = floor
    out["python"] = project["requires-python"].removeprefix(">=")
    return out


def floor_pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements" / "floor.in").read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([0-9.]+)", line.strip())
        if m:
            out[_norm(m.group(1))] = m.group(2)
    return out


def readme_table() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"[0-9.]+", cells[1]):
            for name in cells[0].split("(")[0].split(","):
                out[_norm(name.strip())] = cells[1]
    return out


def _same(a: str, b: str) -> bool:
    pad = lambda v: [int(x) for x in v.split(".")] + [0] * (4 - v.count("."))  # noqa: E731
    return pad(a) == pad(b)


def test_the_readme_lists_every_floor_of_pyproject() -> None:
    floors, table = pyproject_floors(), readme_table()
    core = {n: v for n, v in floors.items() if n not in LOCK_ONLY}
    wrong = {n: (v, table.get(n)) for n, v in core.items() if not _same(v, table.get(n, "-1"))}
    assert not wrong, f"pyproject floor vs README support table: {wrong}"


def test_the_floor_lock_pins_pyprojects_floors() -> None:
    floors, pins = pyproject_floors(), floor_pins()
    assert pins, "requirements/floor.in pins nothing"
    assert _same(pins.pop("jaxlib"), pins["jax"]), "floor.in: jaxlib and jax differ"
    wrong = {n: (floors.get(n), v) for n, v in pins.items() if not _same(floors.get(n, "-1"), v)}
    assert not wrong, f"pyproject floor vs requirements/floor.in pin: {wrong}"
    missing = set(floors) - set(pins) - LOCK_ONLY - {"python"}
    assert not missing, f"pyproject floors requirements/floor.in does not pin: {missing}"


def test_the_readme_table_lists_only_pinned_floors() -> None:
    pins, table = floor_pins(), readme_table()
    unpinned = set(table) - set(pins) - {"python", "jaxlib"}
    assert not unpinned, f"README lists versions requirements/floor.in does not test: {unpinned}"


def test_the_floor_lock_is_compiled_from_floor_in() -> None:
    lock = (ROOT / "requirements" / "floor.txt").read_text()
    for name, version in floor_pins().items():
        assert re.search(rf"^{re.escape(name)}=={re.escape(version)}$", lock, re.M | re.I), (
            f"requirements/floor.txt does not pin {name}=={version}: recompile it"
        )
