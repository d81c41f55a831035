"""Rules files: [`Rules`][modelshard.Rules] written as TOML, for the CLI and for configs."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from .._base import TOML_NONE as NONE
from .._base import Problem, SpecError, check_keys, flag, quote_pattern, read_toml, tables
from .language import Rules

_TOP = ("strict", "rules", "logical")
_RULE = ("pattern", "spec")


def _entry(value: Any, where: str, problems: list[Problem], arg: str, empty: bool = False) -> Any:
    if isinstance(value, str):
        return None if value == NONE else value
    if isinstance(value, list) and empty and not value:
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) and v != NONE for v in value):
        return tuple(value)
    what = f"{value!r} is not an axis name, a list of axis names, or {NONE!r}"
    hint = f'write "data", ["data", "model"] or "{NONE}" (TOML has no null)'
    problems.append(Problem(arg, where, what, hint=hint))
    return None


def parse_rules(data: Mapping[str, Any], source: str = "rules") -> Rules:
    """Build [`Rules`][modelshard.Rules] from parsed TOML; every problem is reported at once.

    Example:
        >>> parse_rules({"rules": [{"pattern": "kernel$", "spec": ["data", "none"]}]})
        Rules([('kernel$', P('data', None))], strict=True)
    """
    problems: list[Problem] = []
    check_keys(data, _TOP, source, "", problems, "top-level key")
    strict = flag(data, "strict", True, source, problems)
    raw = tables(data, "rules", source, problems)
    rules: list[tuple[str, PartitionSpec]] = []
    for i, item in enumerate(raw):
        where = f"rules[{i}]"
        if not isinstance(item, Mapping):
            problems.append(
                Problem(source, where, f"{item!r} is not a table with pattern and spec")
            )
            continue
        check_keys(item, _RULE, source, where, problems)
        pattern, spec = item.get("pattern"), item.get("spec")
        if not isinstance(pattern, str):
            what = (
                "pattern is missing"
                if pattern is None
                else f"pattern must be a string, got {pattern!r}"
            )
            problems.append(Problem(source, f"{where}.pattern", what))
            continue
        if not isinstance(spec, list):
            what = f"spec must be an array of entries, got {spec!r}"
            hint = 'spec = [] replicates; spec = ["data", "none"] shards dimension 0'
            problems.append(Problem(source, f"{where}.spec", what, hint=hint))
            continue
        try:
            re.compile(pattern)
        except re.error as e:
            what = f"{quote_pattern(pattern)} is not a valid regular expression: {e}"
            hint = (
                "write a Python regular expression, in single quotes (a TOML literal string, "
                r"backslashes kept as written): pattern = 'norm\d?/weight$'"
            )
            problems.append(Problem(source, f"{where}.pattern", what, hint=hint))
        entries = [_entry(e, f"{where}.spec[{j}]", problems, source) for j, e in enumerate(spec)]
        rules.append((pattern, PartitionSpec(*entries)))
    logical: Any = None
    raw_logical = data.get("logical")
    if isinstance(raw_logical, Mapping):
        logical = {
            name: _entry(v, f"logical.{name}", problems, source, empty=True)
            for name, v in raw_logical.items()
        }
    elif isinstance(raw_logical, list):
        logical = []
        for i, pair in enumerate(raw_logical):
            where = f"logical[{i}]"
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                hint = 'write ["embed", ["fsdp", "tensor"]], ["embed", "fsdp"] or ["norm", []]'
                what = f"{pair!r} is not a [logical name, mesh axes] pair"
                problems.append(Problem(source, where, what, hint=hint))
                continue
            logical.append((pair[0], _entry(pair[1], f"{where}[1]", problems, source, True)))
    elif raw_logical is not None:
        what = "logical must be a table of name = axis, or an array of [name, axes] pairs"
        hint = '[logical] embed = "model", or logical = [["embed", "model"]]'
        problems.append(Problem(source, "logical", what, hint=hint))
    if problems:
        raise SpecError(problems, header=f"invalid rules file {source}:")
    try:
        return Rules(rules, logical=logical, strict=strict)
    except SpecError as e:
        raise SpecError(e.problems, header=f"invalid rules file {source}:") from e


def load_rules(path: str | os.PathLike[str]) -> Rules:
    """Read a TOML rules file (format: the Rules files guide) into [`Rules`][modelshard.Rules].

    Args:
        path: the ``.toml`` file.

    Returns:
        The rules it describes; [`Rules.to_toml`][modelshard.Rules.to_toml] writes one back.

    Raises:
        OSError: the file cannot be read.
        SpecError: the file is not UTF-8 TOML describing Rules (every problem listed).

    Example:
        >>> import pathlib, tempfile
        >>> import modelshard as ms
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "rules.toml"
        >>> _ = path.write_text('[[rules]]\\npattern = "kernel$"\\nspec = ["none", "model"]\\n')
        >>> ms.load_rules(path)
        Rules([('kernel$', P(None, 'model'))], strict=True)
    """
    p = Path(path)
    fail = functools.partial(SpecError, header=f"invalid rules file {p}:")
    data = read_toml(p, fail, where=None, unreadable=None)
    return dataclasses.replace(parse_rules(data, str(p)), file=str(p))
