"""How a restore's target differs from its checkpoint, said to the user: a path-first diff,
the error with the hint that fits, and the warning of a partial restore."""

from __future__ import annotations

import collections
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .._base import PartialRestoreWarning, caller_stacklevel, dtype_name
from .codec import logical_dtype
from .record import LeafRecord, some
from .sources import Source
from .values import Diff


def diff(
    paths: Sequence[str], arrays: Sequence[Any], stored: Mapping[str, LeafRecord], dtype: Any
) -> tuple[Diff, Diff, Diff]:
    """Missing, extra and changed leaves between a target and a checkpoint, path first."""
    missing: Diff = []
    changed: Diff = []
    seen = set()
    for path, x in zip(paths, arrays, strict=True):
        rec = stored.get(path)
        here = f"{dtype_name(x.dtype)}{list(x.shape)}"
        if rec is None:
            missing.append(("missing", path, f"{here} (in the target, not in the checkpoint)"))
            continue
        seen.add(path)
        want_name = dtype_name(logical_dtype(rec, dtype))
        if tuple(x.shape) != rec.shape or dtype_name(x.dtype) != want_name:
            cast = f" (restored as {want_name} by dtype=)" if want_name != rec.dtype else ""
            was = f"checkpoint {rec.dtype}{list(rec.shape)}{cast}"
            changed.append(("changed", path, f"{was} -> target {here}"))
    extra: Diff = [
        ("extra", p, f"{r.dtype}{list(r.shape)} (in the checkpoint, not in the target)")
        for p, r in stored.items()
        if p not in seen
    ]
    return missing, extra, changed


def format_diff(rows: Diff, limit: int = 24) -> list[str]:
    """The rows, those differing only in layer numbers folded into one; at most ``limit``."""
    from .._base import fold

    groups = fold(rows, lambda r: r[1] or "<root>", key=lambda r: (r[0], r[2]))
    width = max(len(g.path) for g in groups[:limit])
    out = []
    for g in groups[:limit]:
        what, _, detail = g.items[0]  # type: ignore[misc]
        n = f"  ({g.count} leaves)" if g.count > 1 else ""
        out.append(f"  {what:<7}  {g.path:<{width}}  {detail}{n}")
    rest = groups[limit:]
    if rest:
        out.append(f"  ... {len(rest)} more rows ({sum(g.count for g in rest)} leaves)")
    return out


def _subtree(paths: Sequence[str], stored: Mapping[str, LeafRecord]) -> str | None:
    """``"model"`` if every target path is stored under ``model/``."""
    tops = sorted({p.split("/", 1)[0] for p in stored if "/" in p})
    for top in tops:
        if paths and all(f"{top}/{p}" in stored for p in paths):
            return top
    return None


def _size_changes(
    paths: Sequence[str], arrays: Sequence[Any], stored: Mapping[str, LeafRecord]
) -> tuple[list[str], bool]:
    """The sizes that changed (``"64 -> 128 (12 leaves)"``), and whether some dtypes did."""
    counts: collections.Counter[tuple[int, int]] = collections.Counter()
    dtype_only = False
    for p, x in zip(paths, arrays, strict=True):
        rec = stored.get(p)
        if rec is None:
            continue
        shape = tuple(x.shape)
        if shape == rec.shape:
            dtype_only = dtype_only or dtype_name(x.dtype) != rec.dtype
            continue
        if len(shape) == len(rec.shape):
            counts.update((a, b) for a, b in zip(rec.shape, shape, strict=True) if a != b)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return [f"{a} -> {b} ({n} leaves)" for (a, b), n in ranked[:3]], dtype_only


_KINDS = ("changed", "missing", "extra")


def mismatch_message(
    source: Source,
    like: Any,
    paths: Sequence[str],
    arrays: Sequence[Any],
    stored: Mapping[str, LeafRecord],
    rows: Diff,
    partial: bool = False,
) -> str:
    """Why ``like`` does not match the checkpoint: counts by kind, the folded ``rows``, and
    the hint that fits (never ``partial=True`` where the caller passed it)."""
    changed, missing, extra = ([r for r in rows if r[0] == k] for k in _KINDS)
    n = len(rows)
    kinds = [f"{len(r)} {k}" for k, r in zip(_KINDS, (changed, missing, extra), strict=True) if r]
    shared = sum(p in stored for p in paths)
    target = type(like).__name__
    if partial and not shared:
        head = (
            f"restore(partial=True) would restore nothing from checkpoint {source.path}: "
            f"none of the target {target}'s {len(paths)} leaves is in it"
        )
    else:
        head = f"checkpoint {source.path} does not match the target {target}"
    head += f" ({n} difference{'s' if n != 1 else ''}: {', '.join(kinds)}; paths first):\n"
    hints = []
    top = _subtree(paths, stored)
    if top is not None:
        hints.append(
            f"every leaf of the target is in the checkpoint under {top + '/'!r}: restore that "
            f"part with like={{{top!r}: like}}, partial=True (and take [{top!r}] of the result)"
        )
    elif changed and not missing and not extra:
        sizes, dtype_only = _size_changes(paths, arrays, stored)
        if sizes:
            hints.append(
                "the checkpoint's shapes differ from the target's (sizes "
                + "; ".join(sizes)
                + "): build the target with the configuration the checkpoint was saved with "
                "(partial=True cannot help: these leaves exist on both sides)"
            )
        if dtype_only:
            hints.append("shapes must match; pass dtype=... to cast floating leaves")
    else:
        if (missing or extra) and not shared:
            renamed = rename_mapping(paths, arrays, stored, missing, extra)
            hints.append(
                "the target and the checkpoint share no leaf path, so partial=True would "
                "restore nothing: "
                + (
                    renamed
                    if renamed is not None
                    else "compare the paths (modelshard inspect shows the checkpoint's) and "
                    "restore with mapping=ms.WeightMap([...]): a rule per renamed path, then "
                    'ms.MapRule(r"(.*)", "{1}") to keep the other paths'
                )
            )
        elif missing and partial:
            hints.append(
                "partial=True keeps like's values for the missing leaves, but like is "
                "abstract there: pass a concrete like (a freshly initialised model)"
            )
        elif missing or extra:
            renamed = rename_mapping(paths, arrays, stored, missing, extra)
            if renamed is not None:
                hints.append(renamed)
            hints.append(
                "pass partial=True to restore only the leaves both have (missing leaves then "
                "keep like's values, so like must be concrete for them; a warning names them)"
            )
        if changed:
            hints.append("shapes must match; pass dtype=... to cast floating leaves")
    if any(p not in stored for _, p, _ in changed):  # a Python value of another type
        hints.append(
            "a Python value must keep its type: build like with the saved value's type "
            "(ms.restore without like shows them)"
        )
    return head + "\n".join(format_diff(rows)) + "\nhint: " + "; ".join(hints)


def rename_mapping(
    paths: Sequence[str],
    arrays: Sequence[Any],
    stored: Mapping[str, LeafRecord],
    missing: Diff,
    extra: Diff,
) -> str | None:
    """The ``mapping=`` to paste where missing and extra leaves pair up (shape, dtype, last
    name) as renamed parents (``up/kernel`` saved, ``up_proj/kernel`` wanted), else None."""
    target = {p: x for p, x in zip(paths, arrays, strict=True)}
    pool: dict[tuple[Any, ...], list[str]] = {}
    for _, p, _ in extra:
        r = stored.get(p)
        if r is not None:
            pool.setdefault((r.shape, r.dtype, p.rsplit("/", 1)[-1]), []).append(p)
    renames: dict[str, str] = {}
    unpaired = []
    paired = 0
    for _, p, _ in missing:
        x = target.get(p)
        key = None if x is None else (tuple(x.shape), dtype_name(x.dtype), p.rsplit("/", 1)[-1])
        cands = pool.get(key) if key is not None else None
        if not cands:
            unpaired.append(p)
            continue
        saved = cands.pop(0)
        paired += 1
        a, b = saved.split("/"), p.split("/")
        while len(a) > 1 and len(b) > 1 and a[-1] == b[-1]:
            a, b = a[:-1], b[:-1]
        renames.setdefault("/".join(a), "/".join(b))
    if not renames or len(renames) > 4:
        return None
    dropped = sorted(p for ps in pool.values() for p in ps)
    rules = [f'ms.MapRule(r"{re.escape(a)}/(.*)", "{b}/{{1}}")' for a, b in renames.items()]
    rules += [f'ms.MapRule(r"{re.escape(p)}", None)' for p in dropped[:4]]
    kept = len(stored) > paired + len(dropped)  # paths both sides have: kept as they are
    if kept:
        rules.append('ms.MapRule(r"(.*)", "{1}")')
    keep = f", keep={[re.escape(p) for p in unpaired[:4]]!r}" if unpaired else ""
    return (
        "leaves that match in shape look renamed ("
        + ", ".join(f"{a}/ -> {b}/" for a, b in renames.items())
        + "): restore them with mapping=ms.WeightMap(["
        + ", ".join(rules)
        + f"]{keep})"
        + (" (the last rule keeps every other path as it is)" if kept else "")
    )


def warn_partial(
    source: Source, n: int, restored: Sequence[str], missing: Diff, extra: Diff
) -> None:
    """A ``PartialRestoreWarning`` naming the leaves a partial restore did not restore (``n``:
    the target's array leaves; ``restored``: those read from the checkpoint)."""
    kept = [p for _, p, _ in missing]
    skipped = [p for _, p, _ in extra]

    parts = [f"restored {len(restored)} of the target's {n} leaves from {source.path}"]
    if kept:
        parts.append(f"{len(kept)} kept like's values (not in the checkpoint): {some(kept, 5)}")
    if skipped:
        parts.append(f"{len(skipped)} checkpoint leaves not restored: {some(skipped, 5)}")
    warnings.warn(
        PartialRestoreWarning(
            "; ".join(parts) + " (partial=True)", restored=restored, kept=kept, skipped=skipped
        ),
        stacklevel=caller_stacklevel(),
    )
