"""What a ``CheckpointManager`` root holds: its steps, its leftovers, another tool's entries.

A step is complete by ``is_complete_step``. Any other numbered entry (``N/``, a staging
``N.orbax-checkpoint-tmp...``, a rotated ``.modelshard-rotated/N.PID``) is a leftover of
ours or another tool's (``entry_owner``). Leftovers go with the next save of their step,
another tool's entries only by ``delete(N)``; Orbax's complete steps are adopted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from typing import Any

from .._base import CheckpointError, ForeignStepsWarning
from .storage import (
    CHECKPOINT_METADATA,
    COMMIT_FILE,
    ITEMS_FILE,
    ITEMS_ITEM,
    METRICS_ITEM,
    ORBAX_TMP,
    RECORD_FILE,
    RECORD_ITEM,
    ROTATED,
    STATE_ITEM,
    TREE_METADATA,
    is_marked,
    read_json,
    step_metadata,
)
from .urls import forget_listings, is_remote, location, reaching

_NUMBERED = re.compile(rf"(0|[1-9][0-9]*)((?:{re.escape(ORBAX_TMP)}.*)?)")
_STEP = re.compile(r"0|[1-9][0-9]*")
_ROTATED = re.compile(r"(0|[1-9][0-9]*)\.[0-9]+")
PARTS = (CHECKPOINT_METADATA, STATE_ITEM, f"{RECORD_ITEM}/{RECORD_FILE}", ITEMS_ITEM, METRICS_ITEM)
"""What a step may hold, in the order listed (``items`` and ``metrics`` are optional)."""
_ITEMS = {STATE_ITEM, RECORD_ITEM, ITEMS_ITEM, METRICS_ITEM}
OURS, ORBAX, OTHER = "modelshard", "orbax", "other"
ROTATED_WHY = "removal by rotation not finished"


def children(root: Any) -> list[Any]:
    """The entries of ``root``, none where it does not exist; CheckpointError if unreachable."""
    try:
        with reaching(root):  # TensorFlow's NotFoundError comes out as FileNotFoundError
            return list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_complete_step(step_dir: Any) -> bool:
    """Whether ``step_dir`` is a finished manager step: a real directory with Orbax's
    metadata and modelshard's record (and the commit file on object storage)."""
    try:
        if not _plain_dir(step_dir):
            return False
        needed = [step_dir / CHECKPOINT_METADATA, step_dir / RECORD_ITEM / RECORD_FILE]
        if is_remote(step_dir):
            needed.append(step_dir / COMMIT_FILE)
        return all(p.is_file() for p in needed)
    except OSError:
        return False


def complete_steps(root: Any) -> list[int]:
    """Every complete step under a manager's ``root``, ascending (``children`` raises)."""
    forget_listings(root)  # another process may have written or removed steps since
    found = children(root)
    with reaching(root):
        return sorted(int(c.name) for c in found if _STEP.fullmatch(c.name) and is_complete_step(c))


def entry_owner(path: Any, names: list[str] | None = None) -> str | None:
    """Who wrote the numbered entry ``path``: ``OURS`` or ``ORBAX`` (a step, committed or
    not), ``OTHER`` (a link, a file, anything else), or None when it holds nothing to lose
    (empty, or only the metadata any save starts with). ``names``: its entries, if listed."""
    if not _plain_dir(path):
        return OTHER
    if names is None:
        names = sorted(c.name for c in path.iterdir())
    if not names:
        return None
    if CHECKPOINT_METADATA in names and is_marked(path):
        return OURS
    meta = step_metadata(path) if CHECKPOINT_METADATA in names else None
    # a commit without the marker is another writer's: the manager marks before it commits
    committed = meta is not None and meta.get("commit_timestamp_nsecs") is not None
    # ours uncommitted: its record or items item made (in name order) or announced
    ours = (RECORD_ITEM, ITEMS_ITEM)
    record = any(n.partition(ORBAX_TMP)[0] in ours for n in names)
    handlers = meta.get("item_handlers") if meta is not None else None
    if not committed and (record or (isinstance(handlers, dict) and RECORD_ITEM in handlers)):
        return OURS
    if names == [CHECKPOINT_METADATA] and (
        meta is None or not (committed or meta.get("item_handlers"))
    ):
        return None  # only the metadata a save starts with (cut short by a kill, or empty)
    if meta is None:
        # parts of a step before any metadata: another process's share on object storage
        return OURS if all(n.partition(ORBAX_TMP)[0] in _ITEMS for n in names) else OTHER
    return ORBAX


def _orbax_done(path: Any, owner: str, names: list[str]) -> tuple[bool, str | None]:
    """Whether another tool's entry is Orbax's finished step, and its state item."""
    final = _STEP.fullmatch(path.name) and (not is_remote(path) or COMMIT_FILE in names)
    done = owner == ORBAX and bool(final)
    return done, orbax_state(path, names) if done else None


def orbax_state(path: Any, names: list[str]) -> str | None:
    """The item of Orbax's step restored as the state: ``state``, else its one tree item."""
    trees = [
        n
        for n in names
        if ORBAX_TMP not in n and not n.startswith(".") and (path / n / TREE_METADATA).is_file()
    ]
    if STATE_ITEM in trees:
        return STATE_ITEM
    return trees[0] if len(trees) == 1 else None


@dataclasses.dataclass(frozen=True)
class Foreign:
    """A numbered entry of a manager's root another tool wrote (``state``: its state item)."""

    step: int
    name: str
    owner: str
    complete: bool
    state: str | None = None

    @property
    def restorable(self) -> bool:
        """Whether the manager lists and restores it (it still never removes or replaces it)."""
        return self.complete and self.state is not None

    def describe(self, root: Any) -> str:
        path = root / self.name
        if self.owner != ORBAX:
            return f"{path} was put there by another tool or by hand (no step of modelshard's or Orbax's)"
        done = "a complete step written" if self.complete else "an unfinished save"
        return f"{path} is {done} by another tool (Orbax)"

    @property
    def kind(self) -> str:
        """``"complete, Orbax"``, ``"unfinished, Orbax"`` or ``"another tool"``."""
        if self.owner != ORBAX:
            return "another tool"
        return f"{'complete' if self.complete else 'unfinished'}, Orbax"

    def to_json(self) -> list[Any]:
        return list(dataclasses.astuple(self))

    @classmethod
    def from_json(cls, doc: list[Any]) -> Foreign:
        return cls(*doc)


def foreign_steps(root: Any, complete: list[int] | None = None) -> list[Foreign]:
    """Every numbered entry of ``root`` another tool wrote (not looking into ``complete``)."""
    skip = set(complete or ())
    out: list[Foreign] = []
    found = children(root)
    with reaching(root):
        for c in found:
            m = _NUMBERED.fullmatch(c.name)
            if m is None or (not m.group(2) and int(m.group(1)) in skip):
                continue
            plain = _plain_dir(c)
            if plain and is_marked(c):
                continue  # committed by the manager: one read tells
            try:
                names = sorted(n.name for n in c.iterdir()) if plain else []
                owner = entry_owner(c, names)
                if owner in (ORBAX, OTHER):
                    done = _orbax_done(c, owner, names)
                    out.append(Foreign(int(m.group(1)), c.name, owner, *done))
            except FileNotFoundError:  # renamed or removed since the listing: a save, a rotation
                continue
    return sorted(out, key=lambda f: (f.step, f.name))


def refusal(step: int, root: Any, entries: list[Foreign]) -> str:
    """Why ``save(step)`` refuses a step number another tool's ``entries`` hold."""
    held = "; ".join(f.describe(root) for f in entries)
    names = " and ".join(str(root / f.name) for f in entries)
    return (
        f"cannot save step {step}: {held}, and this CheckpointManager never removes or "
        "replaces what it did not write.\n"
        f"Save under another step number, move {names} out of {root}, or, to replace it, "
        f"remove it by name with delete({step}) first."
    )


def adopted_steps(others: list[Foreign]) -> list[int]:
    """The steps of ``others`` the manager lists and restores beside its own."""
    return sorted({f.step for f in others if f.restorable})


def restorable_steps(root: Any) -> list[int]:
    """Every step a manager of ``root`` lists and restores, its own and Orbax's, ascending."""
    steps = complete_steps(root)
    return sorted({*steps, *adopted_steps(foreign_steps(root, steps))})


def _plain_dir(path: Any) -> bool:
    """A folder, not a link to one."""
    return (is_remote(path) or not path.is_symlink()) and path.is_dir()


def manager_step(directory: str | os.PathLike[str]) -> tuple[Any, int | None]:
    """``(path, None)`` for a checkpoint, ``(latest step's directory, step)`` for a root."""
    root = location(directory)
    try:
        if not root.is_dir() or (root / TREE_METADATA).exists() or (root / STATE_ITEM).exists():
            return root, None
    except OSError:
        return root, None
    steps = restorable_steps(root)
    if not steps:
        return root, None
    return root / str(steps[-1]), steps[-1]


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """One numbered entry of a manager's root: whether its writer counts it finished, what
    left it or who wrote it (``why``), the ``PARTS`` it has (another tool's: every name), lacks
    or holds unfinished as ``(part, temporary name)``, other names, files and bytes, its
    ``owner`` (None: nothing to lose) and, for Orbax's finished step, its state item."""

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
    owner: str | None = OURS
    state: str | None = None

    @property
    def foreign(self) -> bool:
        """Whether another tool wrote it (a manager never removes or replaces it)."""
        return self.owner in (ORBAX, OTHER)

    @property
    def restorable(self) -> bool:
        """Whether the manager lists and restores it (its own, or Orbax's with a state)."""
        if self.owner == ORBAX:
            return self.complete and self.state is not None
        return self.complete and self.owner == OURS

    @property
    def status(self) -> str:
        """``"complete"`` (restorable), ``"foreign"`` (another tool's) or ``"leftover"``."""
        return "complete" if self.restorable else "foreign" if self.foreign else "leftover"

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "status": self.status,
            "owner": self.owner,
            "complete": self.complete,
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
    files = size = 0
    if not is_remote(path):
        for folder, _, names in os.walk(path):
            for name in names:
                files += 1
                with contextlib.suppress(OSError):  # removed while we count
                    size += os.lstat(os.path.join(folder, name)).st_size
        return files, size
    for child in path.iterdir():
        if child.is_dir():
            f, b = _tally(child)
            files, size = files + f, size + b
        else:
            files, size = files + 1, size + int(child.stat().length)
    return files, size


def _temporary(path: Any, part: str, names: list[str]) -> str | None:
    """The temporary name of ``part`` in ``path`` (``state.orbax-checkpoint-tmp...``), or None."""
    item, _, inner = part.partition("/")
    for name in names:
        if name.startswith(f"{item}{ORBAX_TMP}") and (not inner or (path / name / inner).exists()):
            return name
    return None


def _json_copies(path: Any, names: list[str]) -> list[str]:
    """The JSON items (Orbax's copies of ``save(items=...)``) a step's metadata lists, or,
    in a step not committed (no metadata yet), the ``items`` item names."""
    meta = step_metadata(path) if CHECKPOINT_METADATA in names else None
    handlers = meta.get("item_handlers") if meta is not None else None
    if not isinstance(handlers, dict):
        try:
            items = read_json(path / ITEMS_ITEM / ITEMS_FILE)
        except (OSError, ValueError):
            return []
        return sorted(n for n in items if n in names) if isinstance(items, dict) else []
    return sorted(
        n
        for n, h in handlers.items()
        if n not in _ITEMS and str(h).endswith("JsonCheckpointHandler")
    )


def _entry(step: int, path: Any, why: str | None) -> StepEntry:
    is_dir = _plain_dir(path)
    names = sorted(c.name for c in path.iterdir()) if is_dir else []
    owner = OURS if why == ROTATED_WHY else entry_owner(path, names)
    files, size = _tally(path) if is_dir else (1, 0)
    if owner in (ORBAX, OTHER):
        temporary = tuple((n.partition(ORBAX_TMP)[0], n) for n in names if ORBAX_TMP in n)
        kept = tuple(n for n in names if ORBAX_TMP not in n)
        done, state = _orbax_done(path, owner, names)
        why = "written by another tool (Orbax)" if owner == ORBAX else "written by another tool"
        return StepEntry(step, done, path, why, kept, temporary, (), (), files, size, owner, state)
    complete = why is None and is_complete_step(path)
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
    # Orbax's copies of what ``items`` holds: named only when not finished
    copies = _json_copies(path, names)
    for name in copies:
        if not (path / name).exists() and (tmp := _temporary(path, name, names)) is not None:
            unfinished.append((name, tmp))
    known = (
        {p.partition("/")[0] for p in (*PARTS, COMMIT_FILE)}
        | {n for _, n in unfinished}
        | set(copies)
    )
    others = tuple(n for n in names if n not in known)
    why = "" if complete else why or "interrupted save"
    parts = tuple(has), tuple(unfinished), tuple(lacks)
    return StepEntry(step, complete, path, why, *parts, others, files, size, owner)


def checkpoint_kind(root: Any) -> str | None:
    """``"step"`` (a numbered folder with ``state``), ``"checkpoint"`` or None (not one)."""
    with reaching(root):
        if not any((root / name).exists() for name in (CHECKPOINT_METADATA, TREE_METADATA)):
            return None
        if _STEP.fullmatch(root.name) and (root / STATE_ITEM).is_dir():
            return "step"
    return "checkpoint"


def list_steps(directory: str | os.PathLike[str]) -> list[StepEntry]:
    """Every numbered entry of the manager root ``directory`` by step, complete ones first."""
    root = location(directory)
    forget_listings(root)
    out: list[StepEntry] = []
    found = sorted(children(root), key=lambda c: c.name)
    with reaching(root):
        for child in found:
            m = _NUMBERED.fullmatch(child.name)
            if m is not None:
                why = "staging folder of an interrupted save" if m.group(2) else None
                out.append(_entry(int(m.group(1)), child, why))
            elif child.name == ROTATED and not is_remote(root) and child.is_dir():
                for aside in child.iterdir():
                    r = _ROTATED.fullmatch(aside.name)
                    if r is not None:
                        out.append(_entry(int(r.group(1)), aside, ROTATED_WHY))
    return sorted(out, key=lambda e: (e.step, not e.restorable, not e.complete, str(e.path)))


def warn_foreign(root: Any, stacklevel: int) -> None:
    """Warn about another tool's entries in ``root`` a manager does not restore."""
    try:
        entries = [f for f in foreign_steps(root) if not f.restorable]
        steps = restorable_steps(root) if entries else []
    except CheckpointError:
        return
    if not entries:
        return
    groups: dict[str, dict[int, None]] = {}
    for f in entries:
        groups.setdefault(f.kind, {})[f.step] = None
    held = "; ".join(f"{', '.join(map(str, s))} ({kind})" for kind, s in groups.items())
    text = (
        f"{root} holds steps another tool wrote that this CheckpointManager does not "
        f"restore: {held}. It never removes or replaces them, and does not save over their "
        "numbers (should_save is False for them, save raises ForeignStepError); "
        f"latest_step() is {steps[-1] if steps else None}. `modelshard steps {root}` lists them."
    )
    warnings.warn(text, ForeignStepsWarning, stacklevel=stacklevel)
