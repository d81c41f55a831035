"""The on-disk vocabulary of a checkpoint: every name modelshard writes or looks for, the
rule from a leaf's canonical path to its stored key, the tree Orbax stores, and small files
read as untrusted input. ``docs/concepts/checkpoint-format.md`` describes the format.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .._base import CheckpointError
from .._base import split as split_path
from .urls import reaching

FORMAT = "modelshard.checkpoint/1"
"""The record's ``format``; also the value of the marker."""

STATE_ITEM = "state"
"""The Orbax item holding the arrays in a manager step (``<step>/state/``)."""
RECORD_ITEM = "modelshard"
"""The Orbax item holding the record in a manager step (``<step>/modelshard/``)."""
RECORD_FILE = "modelshard.json"
"""The record's file name (in a ``save`` checkpoint's root, or in ``RECORD_ITEM``)."""
TREE_METADATA = "_METADATA"
"""Orbax's tree metadata file: where it is, there is an Orbax PyTree checkpoint."""
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
"""Orbax's checkpoint metadata file, whose ``custom_metadata`` carries the marker."""

MARKER = {"modelshard": FORMAT}
"""Written into Orbax's own ``_CHECKPOINT_METADATA``: says a record must be there (typed
PRNG keys, paths and checksums are only in the record; without it a checkpoint reads as
plain Orbax), and that ``overwrite`` may replace the directory."""

ROOT_KEY = "value"
"""The storage key of a container that is a single array (canonical path ``""``)."""

ORBAX_TMP = ".orbax-checkpoint-tmp"
"""What Orbax appends to a directory's name while it writes it."""
STAGING_SUFFIX = ".modelshard-tmp"
ASIDE_SUFFIX = ".modelshard-old"
PIECES_SUFFIX = ".pieces"
ROTATED = ".modelshard-rotated"
"""Manager: where Orbax renames rotated-out steps (one atomic rename), deleted afterwards."""
LOCK = ".modelshard-lock"
"""Manager: flocked by the one manager that saves into a directory."""
ITEMS_ITEM = "items"
"""Manager: the Orbax item holding a step's named items (``<step>/items/items.json``)."""
ITEMS_FILE = "items.json"
METRICS_ITEM = "metrics"
"""Manager: the Orbax item holding a step's metrics (``<step>/metrics/metrics``, where
Orbax's own CheckpointManager keeps them)."""
METRICS_FILE = "metrics"
COMMIT_FILE = "commit_success.txt"
"""Orbax's mark of a finished checkpoint where renames are not atomic (object storage)."""

MAX_METADATA_BYTES = 256 << 20
"""A record or Orbax metadata file larger than this is refused unread."""

MAX_NAME_CHARS = 4096
"""The longest dotted storage name a leaf may have (TensorStore's keys are bounded)."""


def storage_key(path: str) -> tuple[str, ...]:
    """The key in the stored Orbax tree of the leaf at canonical ``path``: its components
    (``"layers/0/kernel"`` -> ``("layers", "0", "kernel")``); a bare array's is ``("value",)``."""
    return split_path(path) or (ROOT_KEY,)


def orbax_name(key: Sequence[str]) -> str:
    """The name Orbax and TensorStore give the array at ``key``: its components joined
    with ``.``. Distinct keys can share one (``("a.b",)`` and ``("a", "b")``)."""
    return ".".join(key)


def name_collisions(
    keys: Iterable[tuple[str, tuple[str, ...]]], max_chars: int | None = MAX_NAME_CHARS
) -> list[str]:
    """For ``(canonical path, storage key)`` pairs, one line per group of distinct leaves
    that Orbax would store under one dotted name (the later one would overwrite the
    earlier on disk), and per name longer than ``max_chars``."""
    seen: dict[str, list[str]] = {}
    long: list[str] = []
    for path, key in keys:
        name = orbax_name(key)
        if max_chars is not None and len(name) > max_chars:
            long.append(
                f"  {(path or '<root>')[:80]}...: its storage name has {len(name)} "
                f"characters, more than {max_chars}"
            )
        seen.setdefault(name, []).append(path or "<root>")
    clashes = [
        f"  {', '.join(repr(p) for p in paths)} are all stored as {name!r}"
        for name, paths in seen.items()
        if len(paths) > 1
    ]
    return clashes + long


def check_names(keys: Sequence[tuple[str, tuple[str, ...]]], what: str) -> None:
    """Raise CheckpointError listing every leaf ``name_collisions`` finds."""
    problems = name_collisions(keys)
    if problems:
        raise CheckpointError(
            f"{what}: {len(problems)} leaf name problem{'s' if len(problems) != 1 else ''} "
            "(Orbax stores each array under its path joined with '.'):\n"
            + "\n".join(problems)
            + "\nhint: rename the leaves so that their paths differ in more than where a "
            "'.' or '/' falls, and keep names short."
        )


def nest(items: Sequence[tuple[tuple[str, ...], Any]], what: str) -> dict[str, Any]:
    """Nested dicts from ``(storage key, value)`` pairs: the tree Orbax stores.

    Raises:
        CheckpointError: a key is both a leaf and a parent, or two leaves share a key.
    """
    root: dict[str, Any] = {}
    for key, value in items:
        node = root
        for i, k in enumerate(key[:-1]):
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise CheckpointError(
                    f"{what}: leaf {'/'.join(key[: i + 1])!r} is also a parent "
                    f"of {'/'.join(key)!r}; canonical paths must form a tree."
                )
            node = child
        if key[-1] in node:
            raise CheckpointError(
                f"{what}: two leaves have the canonical path {'/'.join(key)!r}; rename one of them."
            )
        node[key[-1]] = value
    return root


def staging_dir(path: Path) -> Path:
    """Where a save of ``path`` is written before it is renamed into place."""
    return path.parent / f".{path.name}{STAGING_SUFFIX}"


def aside_dir(path: Path) -> Path:
    """Where an overwrite moves the old checkpoint at ``path`` while it renames the new
    one in (only where the atomic exchange is unavailable), removed right after."""
    return path.parent / f".{path.name}{ASIDE_SUFFIX}"


def pieces_dir(staging: Path) -> Path:
    """Where reshard of older versions wrote the pieces of ``staging`` (still removed)."""
    return staging.parent / f".{staging.name}{PIECES_SUFFIX}"


def orbax_tmp_dirs(path: Path) -> list[Path]:
    """Orbax's own temporary directories for ``path`` (left by a save that failed or was
    killed while Orbax wrote it)."""
    try:
        return sorted(p for p in path.parent.iterdir() if p.name.startswith(path.name + ORBAX_TMP))
    except OSError:
        return []


def kind_of(mode: int) -> str:
    """``"regular file"``, ``"directory"``, ``"named pipe"``... for an ``st_mode``."""
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "named pipe"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISLNK, "symbolic link"),
    ):
        if test(mode):
            return name
    return "special file"


def read_json(path: Any) -> Any:
    """The JSON document at ``path`` (``read_small``), or None where there is no such file;
    CheckpointError where it cannot be read or is not JSON."""
    try:
        with reaching(path):
            raw = read_small(path)
    except FileNotFoundError:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def step_metadata(directory: Path) -> dict[str, Any] | None:
    """Orbax's ``_CHECKPOINT_METADATA`` in ``directory`` as a dict, or None (none, not JSON,
    unreadable, oversized or not a regular file)."""
    try:
        data = read_json(directory / CHECKPOINT_METADATA)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_marked(directory: Path) -> bool:
    """Whether ``directory`` is a checkpoint modelshard wrote: Orbax's
    ``_CHECKPOINT_METADATA`` there carries ``MARKER``."""
    custom = (step_metadata(directory) or {}).get("custom_metadata")
    return isinstance(custom, dict) and all(k in custom for k in MARKER)


def _too_big(path: Any, size: int, limit: int) -> CheckpointError:
    return CheckpointError(
        f"{path} is {size} bytes, more than the {limit} that checkpoint "
        "metadata may have; refusing to read it."
    )


def _read_small_remote(path: Any, limit: int) -> bytes:
    try:
        size = path.stat().length
        if size <= limit:
            return path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from e
    raise _too_big(path, size, limit)


def read_small(path: Path, limit: int = MAX_METADATA_BYTES) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes (checked on
    the descriptor opened without blocking: a named pipe is refused, never waited on).

    Raises:
        FileNotFoundError: there is no ``path`` (the caller says what that means).
        CheckpointError: it is not a regular file, is too large, or cannot be read.
    """
    if not isinstance(path, Path):  # object storage (etils.epath): objects, no pipes
        return _read_small_remote(path, limit)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}.") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{path} is a {kind_of(st.st_mode)}, not a regular file; a checkpoint's "
                "files are regular files, refusing to read it."
            )
        if st.st_size > limit:
            raise _too_big(path, st.st_size, limit)
        chunks, left = [], limit + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > limit:
            raise CheckpointError(f"{path} grew past {limit} bytes while it was read.")
        return data
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}.") from e
    finally:
        os.close(fd)
