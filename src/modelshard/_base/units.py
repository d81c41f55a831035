"""Byte sizes as people write them: ``16GiB``, ``80 GB``, ``512 MiB``, ``1.5kb``, ``4096``."""

from __future__ import annotations

import math
import re

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"b": 1} | {
    f"{u}{i}b": (1024 if i else 1000) ** (n + 1) for n, u in enumerate("kmgt") for i in ("i", "")
}


def size_in_bytes(value: object) -> int | None:
    """Bytes from a finite number >= 0, or from a string: a number and an optional unit
    (``KB`` = 1000, ``KiB`` = 1024, any case); None when ``value`` is no size.

    >>> size_in_bytes("16GiB"), size_in_bytes("80 GB"), size_in_bytes(4096), size_in_bytes("lots")
    (17179869184, 80000000000, 4096, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value) if math.isfinite(value) and value >= 0 else None
    if isinstance(value, str) and (m := _SIZE.fullmatch(value)) is not None:
        return int(float(m[1]) * _UNITS[(m[2] or "b").lower()])
    return None
