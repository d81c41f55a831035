"""How a [`CheckpointManager`][modelshard.CheckpointManager] removes what carries a step
number from its root, on process 0, on a local disk or object storage.

A local step is renamed aside into ``storage.ROTATED`` in one step and removed there, so a
crash leaves it whole or gone (the aside copies are purged when a manager opens or waits);
on object storage, where nothing renames, the step is first made incomplete (its commit
file and metadata removed), then removed. What another tool wrote is removed only by
``remove_numbered`` (``CheckpointManager.delete``); ``remove_partial`` keeps it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from .listing import OURS, entry_owner
from .storage import CHECKPOINT_METADATA, COMMIT_FILE, ORBAX_TMP, ROTATED
from .urls import is_remote


def purge_rotated(root: Any) -> None:
    """Delete the steps rotation moved aside in a local ``root`` (never listed)."""
    rotated = root / ROTATED
    if not is_remote(root) and rotated.is_dir():
        for step_dir in rotated.iterdir():
            shutil.rmtree(step_dir, ignore_errors=True)


def delete_step(root: Any, step: int) -> None:
    """Remove the folder ``root/<step>``: renamed aside first on a disk, made incomplete
    first on object storage."""
    step_dir = root / str(step)
    if is_remote(root):
        for marker in (COMMIT_FILE, CHECKPOINT_METADATA):
            with contextlib.suppress(FileNotFoundError):
                (step_dir / marker).unlink()
        step_dir.rmtree(missing_ok=True)
        return
    rotated = root / ROTATED
    rotated.mkdir(exist_ok=True)
    target = rotated / f"{step}.{os.getpid()}"
    os.rename(step_dir, target)
    shutil.rmtree(target, ignore_errors=True)


def _numbered(root: Any, step: int) -> list[Any]:
    """``root/<step>`` and its staging folders ``<step>.orbax-checkpoint-tmp...``."""
    try:
        children = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # object storage: no "directory"
        return []  # before the first object
    return [c for c in children if c.name == str(step) or c.name.startswith(f"{step}{ORBAX_TMP}")]


def remove_partial(root: Any, step: int) -> None:
    """Remove what an interrupted or failed save of ``step`` left behind: entries of that
    number the manager wrote, or holding nothing (``listing.entry_owner``); another tool's
    are never touched."""
    remote = is_remote(root)
    for c in _numbered(root, step):
        if c.name == str(step) or entry_owner(c) not in (OURS, None):
            continue
        if remote:
            c.rmtree(missing_ok=True)
        else:
            shutil.rmtree(c, ignore_errors=True)
    step_dir = root / str(step)
    if not step_dir.exists() or entry_owner(step_dir) not in (OURS, None):
        return
    if remote:
        step_dir.rmtree(missing_ok=True)
    else:
        shutil.rmtree(step_dir)


def remove_numbered(root: Any, step: int) -> str | None:
    """Remove everything numbered ``step``, whoever wrote it (``CheckpointManager.delete``):
    None once removed, or why nothing was."""
    numbered = _numbered(root, step)
    if not numbered:
        return f"no step {step} in {root}: nothing there carries that number."
    for c in sorted(numbered, key=lambda c: c.name != str(step)):
        if is_remote(root) and c.name != str(step):
            c.rmtree(missing_ok=True)
        elif is_remote(root):
            delete_step(root, step)
        elif c.is_symlink() or not c.is_dir():
            c.unlink()  # a link itself, never what it points to
        elif c.name == str(step):
            delete_step(root, step)
        else:
            shutil.rmtree(c)
    return None
