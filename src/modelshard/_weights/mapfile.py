"""TOML mapping files (``docs/concepts/mapping.md``): every malformed entry reported at once."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._base import (
    MappingError,
    Problem,
    check_keys,
    close_match,
    flag,
    read_toml,
    tables,
    unknown_key,
)
from .ops import Add, Op, Rearrange, Reshape, Scale, Transpose, is_int
from .rules import Concat, MapRule, Split, Stack, Unstack, WeightMap
from .shipped import is_name, shipped_mappings

_TOP = {"strict", "keep", "optional", "config", "rules"}
_RULE = {f.name for f in dataclasses.fields(MapRule)} | {"skip"}
_OPS = ("rearrange", "transpose", "reshape", "add", "scale")
_JOIN = {"group": (int, str), "axis": int, "order": list}
_STEPS: dict[str, tuple[Any, dict[str, Any], str]] = {  # class, its keys, the one required
    "stack": (Stack, _JOIN, "group"),
    "concat": (Concat, _JOIN, "group"),
    "unstack": (Unstack, {"key": str, "axis": int}, "key"),
    "split": (Split, {"key": str, "names": list, "axis": int, "sizes": list}, "key"),
}


def _is(kind: type) -> Any:
    return lambda v: isinstance(v, kind)


_RULE_FLAGS = (
    ("also", False, _is(bool), "true or false"),
    ("optional", False, _is(bool), "true or false"),
    ("untied", None, _is(str), "a tensor name"),
    ("cast", None, _is(str), "a dtype name"),
)


def _ops(value: Any, where: str, problems: list[Problem], src: str) -> tuple[Op, ...] | None:
    """``ops = [{ rearrange = "(h d) e -> h e d", h = "heads" }, { add = 1.0 }]``."""

    def report(at: str, text: str, hint: str | None = None) -> None:
        problems.append(Problem(src, at, text, hint=hint))

    if not isinstance(value, list):
        report(where, f"{value!r} is not an array of tables", hint=_OPS_HINT)
        return None
    out: list[Op] = []
    for j, item in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(item, Mapping):
            report(at, f"{item!r} is not a table", hint=_OPS_HINT)
            continue
        kinds = [k for k in _OPS if k in item]
        typos = [k for k in item if close_match(k, _OPS)]
        if not kinds and typos:  # { rearange = ... }: name the key, not "no operation"
            for k in typos:
                report(f"{at}.{k}", unknown_key(k, _OPS), hint="operations: " + ", ".join(_OPS))
            continue
        if len(kinds) != 1:
            what = "no operation" if not kinds else f"{len(kinds)} operations ({', '.join(kinds)})"
            report(at, f"{what}: give exactly one of {', '.join(_OPS)}", hint=_OPS_HINT)
            continue
        kind, arg = kinds[0], item[kinds[0]]
        extra = [k for k in item if k != kind]
        if kind != "rearrange" and extra:
            report(f"{at}.{extra[0]}", f"{unknown_key(extra[0], _OPS)} for {kind}")
            continue
        if kind == "rearrange":
            sizes = {k: item[k] for k in extra}
            wrong = [k for k, v in sizes.items() if not (isinstance(v, str) or is_int(v))]
            if not isinstance(arg, str):
                report(f"{at}.rearrange", f"{arg!r} is not a string")
            elif wrong:
                for k in wrong:
                    report(f"{at}.{k}", f"size {sizes[k]!r} is not an integer or a name")
            else:
                out.append(Rearrange(arg, **sizes))
        elif kind in ("transpose", "reshape"):
            got = _ints(arg, f"{at}.{kind}", problems, src, kind == "reshape")
            if got is not None:
                out.append(Transpose(got) if kind == "transpose" else Reshape(got))
        elif isinstance(arg, int | float) and not isinstance(arg, bool):
            out.append(Add(float(arg)) if kind == "add" else Scale(float(arg)))
        else:
            report(f"{at}.{kind}", f"{arg!r} is not a number")
    return tuple(out) if len(out) == len(value) else None


_OPS_HINT = 'e.g. ops = [{ rearrange = "(h d) e -> h e d", h = "heads" }, { add = 1.0 }]'


def _ints(value: Any, where: str, problems: list[Problem], src: str, names: bool) -> Any:
    ok = isinstance(value, list) and all(is_int(v) or (names and isinstance(v, str)) for v in value)
    if not ok:
        what = "integers or config names" if names else "integers"
        problems.append(Problem(src, where, f"{value!r} is not an array of {what}"))
        return None
    return tuple(value)


def _table(
    value: Any, where: str, keys: dict[str, Any], required: str, problems: list[Problem], src: str
) -> dict[str, Any] | None:
    if not isinstance(value, Mapping):
        problems.append(Problem(src, where, f"{value!r} is not a table"))
        return None
    check_keys(value, keys, src, where, problems)
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k not in keys:
            continue
        if not isinstance(v, keys[k]) or isinstance(v, bool):
            problems.append(Problem(src, f"{where}.{k}", f"{v!r} has the wrong type"))
        else:
            out[k] = v
    if required not in value:
        problems.append(Problem(src, where, f"{required} is required"))
        return None
    return out if required in out else None


def parse_weight_map(data: Mapping[str, Any], source: str = "mapping") -> WeightMap:
    """Build a [`WeightMap`][modelshard.WeightMap] from parsed TOML; every problem at once.

    Raises:
        MappingError: unknown keys, missing fields, wrong types, malformed rules.

    Example:
        >>> wm = parse_weight_map({"rules": [{"source": "w", "target": "dense/kernel",
        ...                                   "transpose": [1, 0]}]})
        >>> wm.target_of("w")
        'dense/kernel'
    """
    problems: list[Problem] = []

    def report(at: str, text: str, hint: str | None = None) -> None:
        problems.append(Problem(source, at, text, hint=hint))

    check_keys(data, sorted(_TOP), source, "", problems, "top-level key")
    strict = flag(data, "strict", True, source, problems)

    def field(d: Mapping[str, Any], key: str, at: str, default: Any, ok: Any, what: str) -> Any:
        v = d.get(key, default)
        if v is not default and not ok(v):
            report(at, f"{key} must be {what}, got {v!r}")
            return default
        return v

    def regexes(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(k, str) for k in v)

    keep = field(data, "keep", "keep", [], regexes, "an array of regexes")
    optional = field(data, "optional", "optional", [], regexes, "an array of regexes")

    def sizes(c: Any) -> bool:
        return isinstance(c, Mapping) and all(map(is_int, c.values()))

    config = field(data, "config", "config", {}, sizes, "a table of integers")
    raw = tables(data, "rules", source, problems)
    rules: list[MapRule] = []
    for i, item in enumerate(raw):
        where = f"rules[{i}]"
        if not isinstance(item, Mapping):
            report(where, f"{item!r} is not a table")
            continue
        before = len(problems)  # the rule is built only if none of its fields had a problem
        check_keys(item, sorted(_RULE), source, where, problems)
        src, target, skip = item.get("source"), item.get("target"), item.get("skip", False)
        if not isinstance(src, str):
            report(f"{where}.source", f"source must be a regex string, got {src!r}")
        if skip is not True and not isinstance(target, str):
            report(
                f"{where}.target",
                f"target must be a path template, got {target!r}",
                hint="or write skip = true to ignore the matched tensors",
            )
        if skip is True and target is not None:
            report(where, "a rule cannot have both target and skip = true")
        shorthand: dict[str, Any] = {}
        for kind in ("transpose", "reshape"):
            if item.get(kind) is not None:
                shorthand[kind] = _ints(
                    item[kind], f"{where}.{kind}", problems, source, kind == "reshape"
                )
        steps: dict[str, Any] = {}
        for kind, (cls, keys, required) in _STEPS.items():
            if kind not in item:
                continue
            at = f"{where}.{kind}"
            t = _table(item[kind], at, keys, required, problems, source)
            if t is not None and kind == "split":
                names, n = t.get("names"), len(problems)
                if names is None:
                    report(at, "names is required")
                elif not all(isinstance(x, str) for x in names):
                    report(f"{at}.names", f"{names!r} is not an array of strings")
                if "sizes" in t:
                    t["sizes"] = _ints(t["sizes"], f"{at}.sizes", problems, source, True)
                t = t if len(problems) == n else None
            if t is not None:
                for k in ("order", "names"):
                    if k in t:
                        t[k] = tuple(map(str, t[k]))
                steps[kind] = cls(**t)
        if "ops" in item:
            shorthand["ops"] = _ops(item["ops"], f"{where}.ops", problems, source)
        flags = {
            k: field(item, k, f"{where}.{k}", default, ok, what)
            for k, default, ok, what in _RULE_FLAGS
        }
        if len(problems) == before:
            target = None if skip is True else target
            rules.append(MapRule(src, target, **shorthand, **steps, **flags))  # type: ignore[arg-type]
    header = f"invalid mapping file {source}:"
    if problems:
        raise MappingError(problems, header=header)
    try:
        return WeightMap(rules, keep=keep, config=config, strict=strict, optional=optional)
    except MappingError as e:
        raise MappingError(e.problems, header=header) from e


def load_weight_map(path: str | os.PathLike[str]) -> WeightMap:
    """Read a TOML mapping file, or a shipped mapping by name, into a
    [`WeightMap`][modelshard.WeightMap].

    Args:
        path: a TOML file, or the name of a mapping shipped with modelshard (``"llama"``,
            ``"qwen2"``, ...: [`shipped_mappings`][modelshard.shipped_mappings] lists them).
            A name that is also a file in the working directory reads the file.

    Raises:
        MappingError: the file is missing, not UTF-8 TOML, or does not describe a mapping;
            a name that no shipped mapping has.

    Example:
        >>> import modelshard as ms
        >>> ms.load_weight_map("llama").target_of("model.norm.weight")
        'norm/scale'
    """
    text = os.fspath(path)
    if is_name(text) and not Path(text).exists():
        shipped = shipped_mappings()
        if text not in shipped:
            close = close_match(text, shipped, cutoff=0.6)
            problem = Problem(
                "mapping",
                text,
                f"no shipped mapping is named {text!r}"
                + (f" (did you mean {close!r}?)" if close else ""),
                hint=f"shipped: {', '.join(shipped)}; or give a path to a TOML mapping file",
            )
            raise MappingError([problem], header="unknown mapping:")
        path = shipped[text].path
    p = Path(path)

    def fail(problems: list[Problem]) -> MappingError:
        return MappingError(problems, header=f"invalid mapping file {p}:")

    data = read_toml(p, fail, where="", unreadable="the mapping file")
    return parse_weight_map(data, str(p))


def checkpoint_config(path: str | os.PathLike[str]) -> dict[str, int]:
    """The integer entries of the ``config.json`` beside a checkpoint (its file, index or
    directory) as sizes a mapping may name: a nested table's as ``table.name``, and
    ``text_config``'s also as ``name`` where the top level lacks it (multimodal Gemma 3)."""
    p = Path(path)
    d = p if p.is_dir() else p.parent
    try:
        data = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out = {str(k): v for k, v in data.items() if is_int(v)}
    tables = {str(k): v for k, v in data.items() if isinstance(v, dict)}
    out |= {f"{k}.{k2}": v for k, t in tables.items() for k2, v in t.items() if is_int(v)}
    for k, v in tables.get("text_config", {}).items():
        if is_int(v):
            out.setdefault(str(k), v)
    return out
