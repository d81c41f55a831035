"""One clear failure when another library's private name moves: ``needed``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata


def installed(distribution: str) -> str:
    """The installed version of ``distribution``, or ``"(not installed)"``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def supported(distribution: str) -> str:
    """modelshard's requirement on ``distribution`` as installed (``"jax>=0.8.1"``), or the
    bare name where modelshard's metadata is not installed."""
    wanted = re.sub(r"[-_.]+", "-", distribution).lower()
    try:
        requires = metadata.requires("modelshard") or []
    except metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        spec = req.split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9_.-]+", spec)
        if name and re.sub(r"[-_.]+", "-", name.group()).lower() == wanted:
            spec = re.sub(r"\[[^]]*\]", "", spec).replace(" ", "")
            # the floor first (metadata may list "<0.13,>=0.12.3")
            parts = sorted(spec[name.end() :].split(","), key=lambda c: not c.startswith(">"))
            return spec[: name.end()] + ",".join(parts)
    return distribution


@contextmanager
def needed(distribution: str, symbol: str, used_for: str) -> Iterator[None]:
    """Turn an ImportError inside the block into one that says what moved and why we care."""
    try:
        yield
    except ImportError as e:
        raise ImportError(moved(distribution, symbol, used_for, str(e))) from e


def moved(distribution: str, symbol: str, used_for: str, detail: str) -> str:
    """The message of an ImportError for ``symbol`` of ``distribution`` missing from the
    installed version (``needed``, and ``patches`` for what it patches): the symbol, the
    version, what modelshard uses it for, ``detail`` and the versions supported."""
    return (
        f"modelshard needs {symbol} from {distribution} {installed(distribution)} "
        f"({used_for}), and that version does not have it ({detail}). modelshard supports "
        f"{supported(distribution)} (README, 'Supported versions'): install a version "
        "in that range, or report the release that moved it."
    )
