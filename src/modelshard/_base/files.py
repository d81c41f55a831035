"""Files made durable: what a writer syncs before it calls a write done."""

from __future__ import annotations

import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


def _sync(path: str | os.PathLike[str], data_only: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    finally:
        os.close(fd)


def fsync_dir(d: str | os.PathLike[str]) -> None:
    """Make the renames into directory ``d`` durable (sync the directory itself)."""
    _sync(d)


def write_durable(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) all at once, durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sync_tree(root: str | os.PathLike[str]) -> None:
    """Sync every file under ``root``, then each directory, deepest first."""
    for here, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            _sync(os.path.join(here, name))
        _sync(here)


class EarlySync:
    """Files under ``root`` synced on a thread while a writer writes more (``kick``)."""

    def __init__(self, root: str | os.PathLike[str] | None) -> None:
        self.root = root
        self._synced: dict[str, int] = {}  # path -> size when synced
        self._pool: ThreadPoolExecutor | None = None
        self._running: Future[None] | None = None

    def __enter__(self) -> EarlySync:
        if self.root is not None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="modelshard-sync")
        return self

    def kick(self) -> None:
        """Sync what was written since the last pass, unless a pass is still running."""
        if self._pool is None or (self._running is not None and not self._running.done()):
            return
        self._running = self._pool.submit(self._pass)

    def _pass(self) -> None:
        if self.root is None:
            return
        for here, _dirs, files in os.walk(self.root):
            for name in files:
                path = os.path.join(here, name)
                try:
                    size = os.stat(path).st_size
                    if self._synced.get(path) != size:
                        _sync(path, data_only=True)
                        self._synced[path] = size
                except OSError:
                    continue  # replaced or removed meanwhile (a manifest): sync_tree's

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
