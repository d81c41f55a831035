"""``rules_for``: short, pasteable [`Rules`][modelshard.Rules] giving each leaf its spec."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from .._specs import Rules


def norm_spec(spec: PartitionSpec) -> tuple[Any, ...]:
    """The entries without trailing ``None``s: specs that place a leaf alike compare equal."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _candidates(path: str) -> list[str]:
    """Patterns matching ``path``, shortest first: a suffix, or a first component and a suffix."""
    # each component as a regex, layer numbers matching any number
    comps = [re.sub(r"\d+", r"\\d+", re.escape(c)) for c in path.split("/")]
    n = len(comps)
    out = []
    for k in range(1, n + 1):
        suffix = "/".join(comps[n - k :])
        out.append(f"^{suffix}$" if k == n else f"(^|/){suffix}$")
        for j in range(1, n - k):
            out.append(f"^{'/'.join(comps[:j])}/(.*/)?{suffix}$")
    return sorted(out, key=len)


def rules_for(
    paths: Sequence[str], specs: Sequence[PartitionSpec], shapes: Sequence[tuple[int, ...]]
) -> Rules:
    """Rules giving each leaf ``specs[i]``: one per group of leaves alike, then a catch-all."""
    want = {p: norm_spec(s) for p, s, shape in zip(paths, specs, shapes, strict=True) if shape}
    if not want:
        return Rules([(".*", PartitionSpec())])
    # the catch-all replicates where any leaf replicates: leaves added later stay whole
    default = () if () in want.values() else Counter(want.values()).most_common(1)[0][0]
    pure: dict[str, int] = {}  # pattern -> leaves it matches if all want one spec, else 0
    rules: list[tuple[str, PartitionSpec]] = []
    covered: set[str] = set()
    for path, spec in want.items():
        if spec == default or path in covered:
            continue
        # of the patterns that match no leaf wanting another spec, the one covering most
        # leaves (then the shortest): one rule per group, not per leaf
        best: tuple[int, int, str] | None = None
        for pat in _candidates(path):
            if pat not in pure:
                rx = re.compile(pat)
                hits = [q for q in want if rx.search(q)]
                pure[pat] = len(hits) if all(want[q] == spec for q in hits) else 0
            if pure[pat] and (best is None or (-pure[pat], len(pat)) < best[:2]):
                best = (-pure[pat], len(pat), pat)
        # the whole anchored path always qualifies: it matches this leaf alone
        pat = best[2] if best is not None else "^" + re.escape(path) + "$"
        rx = re.compile(pat)
        covered |= {q for q in want if rx.search(q)}
        rules.append((pat, PartitionSpec(*spec)))
    rules.append((".*", PartitionSpec(*default)))
    return Rules(rules)
