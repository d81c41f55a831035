"""Files made durable: what a writer syncs before it calls a write done (the checkpoint's
record and renames, a safetensors export's renames)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(d: str | os.PathLike[str]) -> None:
    """Make the renames into directory ``d`` durable (sync the directory itself)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durable(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and sync it to the disk before returning."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sync_tree(root: str | os.PathLike[str]) -> None:
    """Sync every file under ``root``, then each directory, deepest first, and ``root``:
    what was written there without syncs is on the disk, and so are its names."""
    for here, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(here)
