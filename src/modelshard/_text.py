"""How the package writes quantities for people (bytes as ``1.50 MiB``)."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``1.50 MiB``-style text for a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover
