"""What a ``CheckpointManager`` root holds, step by step: complete steps and leftovers.

A step is complete by ``is_complete_step`` (the one definition). Everything else
that carries a step number is a leftover, written by a save that did not finish (its
process or host died, or it failed) or by a removal that did not:

- ``N/`` that is not complete: on object storage, a save writes there directly and
  commits last (``storage.COMMIT_FILE``); on a local disk, a folder someone else put there;
- ``N.orbax-checkpoint-tmp...``: a local save's staging folder, renamed to ``N`` when done;
- ``.modelshard-rotated/N.PID``: a step rotation moved aside and had not yet deleted.

Inside a leftover, Orbax writes each item of the step (``state``, ``modelshard``, ``items``,
``metrics``) under a temporary name (``state.orbax-checkpoint-tmp...``) renamed when the
item is written: such an item is listed as unfinished, under the name it has, not as
missing; a name that is no part of a step is listed as other.

The next save of step N removes the first two (``CheckpointManager.save``), opening the
manager removes the third. ``modelshard steps`` prints this listing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any

from .storage import (
    CHECKPOINT_METADATA,
    COMMIT_FILE,
    ITEMS_ITEM,
    METRICS_ITEM,
    ORBAX_TMP,
    RECORD_FILE,
    RECORD_ITEM,
    ROTATED,
    STATE_ITEM,
    TREE_METADATA,
)
from .urls import forget_listings, is_remote, location, reaching

_NUMBERED = re.compile(rf"(0|[1-9][0-9]*)((?:{re.escape(ORBAX_TMP)}.*)?)")
_STEP = re.compile(r"0|[1-9][0-9]*")
_ROTATED = re.compile(r"(0|[1-9][0-9]*)\.[0-9]+")
PARTS = (CHECKPOINT_METADATA, STATE_ITEM, f"{RECORD_ITEM}/{RECORD_FILE}", ITEMS_ITEM, METRICS_ITEM)
"""What a step may hold, in the order listed (``items`` and ``metrics`` are optional)."""


def is_complete_step(step_dir: Any) -> bool:
    """Whether ``step_dir`` holds a finished manager step: a real directory with Orbax's
    checkpoint metadata and modelshard's record, plus the commit file on object storage."""
    try:
        if not is_remote(step_dir) and step_dir.is_symlink():
            return False
        if not step_dir.is_dir():
            return False
        needed = [step_dir / CHECKPOINT_METADATA, step_dir / RECORD_ITEM / RECORD_FILE]
        if is_remote(step_dir):
            needed.append(step_dir / COMMIT_FILE)
        return all(p.is_file() for p in needed)
    except OSError:
        return False


def complete_steps(root: Any) -> list[int]:
    """Every complete step under a manager's ``root``, ascending (the one definition).

    Raises:
        CheckpointError: object storage that cannot be reached (``urls.reaching``).
    """
    forget_listings(root)  # another process may have written or removed steps since
    try:
        with reaching(root):  # TensorFlow's NotFoundError comes out as FileNotFoundError
            children = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    with reaching(root):
        return sorted(
            int(c.name) for c in children if _STEP.fullmatch(c.name) and is_complete_step(c)
        )


def manager_step(directory: str | os.PathLike[str]) -> tuple[Any, int | None]:
    """``(path, None)`` for a checkpoint, or ``(its latest complete step's directory,
    step)`` when ``directory`` is a CheckpointManager's root (numbered steps, no Orbax
    tree of its own). What ``modelshard inspect|plan|reshard`` read."""
    from .storage import TREE_METADATA

    root = location(directory)
    try:
        if not root.is_dir() or (root / TREE_METADATA).exists() or (root / STATE_ITEM).exists():
            return root, None
    except OSError:
        return root, None
    steps = complete_steps(root)
    if not steps:
        return root, None
    return root / str(steps[-1]), steps[-1]


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """One numbered entry of a manager's root.

    Attributes:
        step: the step number.
        complete: whether it is a complete step (restorable).
        path: where it is.
        why: for a leftover, what left it (``"interrupted save"``, ``"staging folder of an
            interrupted save"``, ``"removal by rotation not finished"``); ``""`` when complete.
        has: the parts of a step that are there (see ``PARTS``), and the commit file.
        unfinished: ``(part, name)`` for each part there only under a temporary name (an
            item Orbax had not finished writing).
        lacks: the parts a complete step needs that are missing (neither there nor
            unfinished).
        others: the names in it that are no part of a step.
        files: how many files it holds.
        bytes: their total size.
    """

    step: int
    complete: bool
    path: Any
    why: str
    has: tuple[str, ...]
    unfinished: tuple[tuple[str, str], ...]
    lacks: tuple[str, ...]
    others: tuple[str, ...]
    files: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "status": "complete" if self.complete else "leftover",
            "path": str(self.path),
            "why": self.why or None,
            "has": list(self.has),
            "unfinished": [{"part": p, "name": n} for p, n in self.unfinished],
            "lacks": list(self.lacks),
            "others": list(self.others),
            "files": self.files,
            "bytes": self.bytes,
        }


def _tally(path: Any) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    if not is_remote(path):
        files = size = 0
        for folder, _, names in os.walk(path):
            for name in names:
                files += 1
                with contextlib.suppress(OSError):  # removed while we count
                    size += os.lstat(os.path.join(folder, name)).st_size
        return files, size
    files = size = 0
    for child in path.iterdir():
        if child.is_dir():
            f, b = _tally(child)
            files, size = files + f, size + b
        else:
            files, size = files + 1, size + int(child.stat().length)
    return files, size


def _temporary(path: Any, part: str, names: list[str]) -> str | None:
    """The temporary name under which ``part`` is in ``path`` (an item Orbax had not
    finished: ``state.orbax-checkpoint-tmp...``), or None."""
    item, _, inner = part.partition("/")
    for name in names:
        if name.startswith(f"{item}{ORBAX_TMP}") and (not inner or (path / name / inner).exists()):
            return name
    return None


def _entry(step: int, path: Any, why: str | None) -> StepEntry:
    complete = why is None and is_complete_step(path)
    is_dir = path.is_dir()
    names = sorted(c.name for c in path.iterdir()) if is_dir else []
    has: list[str] = []
    unfinished: list[tuple[str, str]] = []
    lacks: list[str] = []
    needed = [CHECKPOINT_METADATA, STATE_ITEM, f"{RECORD_ITEM}/{RECORD_FILE}"]
    if is_remote(path):
        needed.append(COMMIT_FILE)
    for part in (*PARTS, COMMIT_FILE):
        if (path / part).exists():
            has.append(part)
        elif (name := _temporary(path, part, names)) is not None:
            unfinished.append((part, name))
        elif part in needed:
            lacks.append(part)
    known = {p.partition("/")[0] for p in (*PARTS, COMMIT_FILE)} | {n for _, n in unfinished}
    others = tuple(n for n in names if n not in known)
    files, size = _tally(path) if is_dir else (1, 0)
    reason = "" if complete else why or "interrupted save"
    return StepEntry(
        step,
        complete,
        path,
        reason,
        tuple(has),
        tuple(unfinished),
        tuple(lacks),
        others,
        files,
        size,
    )


def checkpoint_kind(root: Any) -> str | None:
    """What ``root`` is when it is a checkpoint rather than a manager's root: ``"step"``
    (a manager's step: its ``state`` item in a folder named by a number), ``"checkpoint"``
    (any other, ``modelshard.save``'s or Orbax's), or None (not a checkpoint).

    Raises:
        CheckpointError: object storage that cannot be reached.
    """
    with reaching(root):
        if not any((root / name).exists() for name in (CHECKPOINT_METADATA, TREE_METADATA)):
            return None
        if _STEP.fullmatch(root.name) and (root / STATE_ITEM).is_dir():
            return "step"
    return "checkpoint"


def list_steps(directory: str | os.PathLike[str]) -> list[StepEntry]:
    """Every numbered entry of the manager root ``directory``, complete or leftover, by
    step (a step's leftovers after it), read from storage now.

    Raises:
        CheckpointError: object storage that cannot be reached.
    """
    root = location(directory)
    forget_listings(root)
    out: list[StepEntry] = []
    with reaching(root):
        try:
            children = sorted(root.iterdir(), key=lambda c: c.name)
        except (FileNotFoundError, NotADirectoryError):
            return []
        for child in children:
            m = _NUMBERED.fullmatch(child.name)
            if m is not None and child.is_dir():
                staging = bool(m.group(2))
                why = "staging folder of an interrupted save" if staging else None
                out.append(_entry(int(m.group(1)), child, why))
            elif child.name == ROTATED and not is_remote(root) and child.is_dir():
                for aside in child.iterdir():
                    r = _ROTATED.fullmatch(aside.name)
                    if r is not None:
                        why = "removal by rotation not finished"
                        out.append(_entry(int(r.group(1)), aside, why))
    return sorted(out, key=lambda e: (e.step, not e.complete, str(e.path)))
