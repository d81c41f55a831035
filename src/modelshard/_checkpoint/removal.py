"""How a manager's process 0 removes what carries a step number: a local step renamed aside
(``storage.ROTATED``) then removed, so a crash leaves it whole or gone; on object storage
made incomplete first. Only ``remove_numbered`` (``delete``) removes another tool's."""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from .listing import OURS, children, entry_owner
from .storage import CHECKPOINT_METADATA, COMMIT_FILE, ORBAX_TMP, ROTATED
from .urls import is_remote


def purge_rotated(root: Any) -> None:
    """Delete the steps rotation moved aside in a local ``root`` (never listed)."""
    rotated = root / ROTATED
    if not is_remote(root) and rotated.is_dir():
        for step_dir in rotated.iterdir():
            shutil.rmtree(step_dir, ignore_errors=True)


def delete_step(root: Any, step: int) -> None:
    """Remove the folder ``root/<step>``: renamed aside or made incomplete first."""
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


def _rmtree(path: Any, strict: bool = False) -> None:
    if is_remote(path):
        path.rmtree(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=not strict)


def _numbered(root: Any, step: int) -> list[Any]:
    """``root/<step>`` and its staging folders ``<step>.orbax-checkpoint-tmp...``."""
    prefix = f"{step}{ORBAX_TMP}"
    return [c for c in children(root) if c.name == str(step) or c.name.startswith(prefix)]


def remove_partial(root: Any, step: int) -> None:
    """Remove what a failed save of ``step`` left: entries of ours or holding nothing."""
    for c in sorted(_numbered(root, step), key=lambda c: c.name == str(step)):
        if entry_owner(c) in (OURS, None):
            _rmtree(c, strict=c.name == str(step))


def remove_numbered(root: Any, step: int) -> str | None:
    """Remove everything numbered ``step``, whoever wrote it: None, or why nothing was."""
    numbered = _numbered(root, step)
    if not numbered:
        return f"no step {step} in {root}: nothing there carries that number."
    for c in sorted(numbered, key=lambda c: c.name != str(step)):
        if not is_remote(root) and (c.is_symlink() or not c.is_dir()):
            c.unlink()  # a link itself, never what it points to
        elif c.name == str(step):
            delete_step(root, step)
        else:
            _rmtree(c, strict=True)
    return None
