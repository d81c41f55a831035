"""What a ``CheckpointManager`` root holds, step by step: its steps, its leftovers, and
what another tool wrote there.

A step is complete by ``is_complete_step`` (the one definition). Every other entry that
carries a step number is either a leftover of the manager's own, written by a save that did
not finish (its process or host died, or it failed) or by a removal that did not:

- ``N/`` that is not complete: on object storage, a save writes there directly and
  commits last (``storage.COMMIT_FILE``);
- ``N.orbax-checkpoint-tmp...``: a local save's staging folder, renamed to ``N`` when done;
- ``.modelshard-rotated/N.PID``: a step rotation moved aside and had not yet deleted;

or another tool's (``owner``): Orbax's own ``CheckpointManager`` writes steps into folders
of the same names. Which is whose is read from the entry itself (``entry_owner``): the
manager's committed steps carry ``storage.MARKER`` in ``_CHECKPOINT_METADATA``; its
unfinished ones do not yet (Orbax writes the custom metadata at the commit) but hold the
record item (``modelshard/``, or under Orbax's temporary name), created as the save starts;
an entry with Orbax's metadata and neither is Orbax's (complete by Orbax's rule: its final
name, plus the commit file on object storage), anything else another tool's. An empty
folder, or one holding only the metadata file Orbax writes as any save starts, holds
nothing to lose and is a leftover; so is one holding only items of a step and no metadata
(on object storage, a process's share of the arrays, written before process 0 wrote the
metadata, of a save that died).

Inside a leftover, Orbax writes each item of the step (``state``, ``modelshard``, ``items``,
``metrics``) under a temporary name (``state.orbax-checkpoint-tmp...``) renamed when the
item is written: such an item is listed as unfinished, under the name it has, not as
missing; a name that is no part of a step is listed as other.

The next save of step N removes its leftovers (``CheckpointManager.save``), opening the
manager removes the rotated ones; another tool's entries are never removed or replaced
except by ``CheckpointManager.delete(N)``. Orbax's complete steps that hold an item to
restore as the state (``orbax_state``) are adopted: listed and restored beside the
manager's own (``adopted_steps``, ``restorable_steps``), told apart by their owner.
``modelshard steps`` prints this listing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import warnings
from typing import Any

from .._base import CheckpointError, ForeignStepsWarning
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
    is_marked,
    read_small,
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


_ITEMS = {STATE_ITEM, RECORD_ITEM, ITEMS_ITEM, METRICS_ITEM}
"""The items of a manager's step."""
OURS = "modelshard"
ORBAX = "orbax"
OTHER = "other"
WRITERS = {ORBAX: "Orbax", OTHER: ""}
"""How each other owner is named to people (``""``: a tool that cannot be told)."""


def _step_metadata(path: Any) -> dict[str, Any] | None:
    """Orbax's ``_CHECKPOINT_METADATA`` in ``path`` as a dict, or None (none, unreadable)."""
    try:
        data = json.loads(read_small(path / CHECKPOINT_METADATA))
    except (OSError, ValueError, RecursionError, CheckpointError):
        return None
    return data if isinstance(data, dict) else None


def entry_owner(path: Any, names: list[str] | None = None) -> str | None:
    """Who wrote the numbered entry ``path`` (``N/`` or ``N.orbax-checkpoint-tmp...``):
    ``OURS`` (a manager step, committed or not), ``ORBAX`` (Orbax's own step, committed or
    not), ``OTHER`` (a link, a file, or a folder of anything else), or None when it holds
    nothing to lose (empty, or only the metadata Orbax writes as any save starts).

    ``names``: its entries, when the caller listed them already.
    """
    if (not is_remote(path) and path.is_symlink()) or not path.is_dir():
        return OTHER
    if names is None:
        names = sorted(c.name for c in path.iterdir())
    if not names:
        return None
    if CHECKPOINT_METADATA in names and is_marked(path):
        return OURS
    meta = _step_metadata(path) if CHECKPOINT_METADATA in names else None
    # a commit without the marker is another writer's: the manager marks before it commits
    committed = meta is not None and meta.get("commit_timestamp_nsecs") is not None
    # a save of ours not committed yet: its record or items item made (Orbax makes a save's
    # items in name order, so a kill can leave items/ alone) or announced in the metadata
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
        # only parts of a step, no metadata yet: on object storage another process wrote
        # its share of the arrays before process 0 wrote the metadata, and the save died
        return OURS if all(n.partition(ORBAX_TMP)[0] in _ITEMS for n in names) else OTHER
    return ORBAX


def orbax_complete(path: Any, names: list[str]) -> bool:
    """Whether Orbax counts the entry ``path`` as a finished step: its final name (a local
    save is renamed to it when done), and on object storage its commit file."""
    if not _STEP.fullmatch(path.name):
        return False
    return not is_remote(path) or COMMIT_FILE in names


def orbax_state(path: Any, names: list[str]) -> str | None:
    """The item of Orbax's step ``path`` a restore reads as the state, as
    ``sources.locate`` picks it: ``state`` where it holds Orbax's tree metadata, else the
    one item that does (``default``, the item of a manager saving a single item); None
    where there is no such item or several (the step is listed but not restored)."""
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
    """A numbered entry of a manager's root that another tool wrote.

    Attributes:
        step: the step number it carries.
        name: its name in the root (``20``, ``20.orbax-checkpoint-tmp``).
        owner: ``ORBAX`` or ``OTHER``.
        complete: whether its writer counts it as finished (Orbax's rule; False for
            ``OTHER``).
        state: for a complete step of Orbax's, the item restored as its state
            (``orbax_state``: ``state``, or its one tree item), which makes it a step
            the manager lists and restores; None otherwise.
    """

    step: int
    name: str
    owner: str
    complete: bool
    state: str | None = None

    @property
    def restorable(self) -> bool:
        """Whether the manager lists and restores it (a complete step of Orbax's with a
        state item); it still never removes or replaces it."""
        return self.complete and self.state is not None

    @property
    def writer(self) -> str:
        """``"another tool (Orbax)"`` or ``"another tool"``."""
        who = WRITERS.get(self.owner, "")
        return f"another tool ({who})" if who else "another tool"

    def describe(self, root: Any) -> str:
        """``"<root>/20 is a complete step written by another tool (Orbax)"`` and the like."""
        path = root / self.name
        if self.owner != ORBAX:
            return f"{path} was put there by another tool or by hand (no step of modelshard's or Orbax's)"
        if self.complete:
            return f"{path} is a complete step written by {self.writer}"
        return f"{path} is an unfinished save by {self.writer}"

    @property
    def kind(self) -> str:
        """``"complete, Orbax"``, ``"unfinished, Orbax"`` or ``"another tool"``."""
        if self.owner != ORBAX:
            return "another tool"
        return f"{'complete' if self.complete else 'unfinished'}, {WRITERS[ORBAX]}"

    def to_json(self) -> list[Any]:
        return [self.step, self.name, self.owner, self.complete, self.state]

    @classmethod
    def from_json(cls, doc: list[Any]) -> Foreign:
        state = None if doc[4] is None else str(doc[4])
        return cls(int(doc[0]), str(doc[1]), str(doc[2]), bool(doc[3]), state)


def foreign_steps(root: Any, complete: list[int] | None = None) -> list[Foreign]:
    """Every numbered entry of ``root`` another tool wrote, by step then name.
    ``complete``: the manager's complete steps, when known (they are not looked into).

    Raises:
        CheckpointError: object storage that cannot be reached (``urls.reaching``).
    """
    skip = set(complete or ())
    try:
        with reaching(root):
            children = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: list[Foreign] = []
    with reaching(root):
        for c in children:
            m = _NUMBERED.fullmatch(c.name)
            if m is None or (not m.group(2) and int(m.group(1)) in skip):
                continue
            plain = _plain_dir(c)
            if plain and is_marked(c):
                continue  # committed by the manager: one read tells
            names = sorted(n.name for n in c.iterdir()) if plain else []
            owner = entry_owner(c, names)
            if owner in (ORBAX, OTHER):
                done = owner == ORBAX and orbax_complete(c, names)
                state = orbax_state(c, names) if done else None
                out.append(Foreign(int(m.group(1)), c.name, owner, done, state))
    return sorted(out, key=lambda f: (f.step, f.name))


def refusal(step: int, root: Any, entries: list[Foreign]) -> str:
    """Why ``CheckpointManager.save(step)`` refuses the step number another tool's
    ``entries`` hold, and what to do."""
    held = "; ".join(f.describe(root) for f in entries)
    names = " and ".join(str(root / f.name) for f in entries)
    return (
        f"cannot save step {step}: {held}, and this CheckpointManager never removes or "
        "replaces what it did not write.\n"
        f"Save under another step number, move {names} out of {root}, or, to replace it, "
        f"remove it by name with delete({step}) first."
    )


def foreign_summary(root: Any, entries: list[Foreign], steps: list[int]) -> str:
    """The warning a manager opened on a root holding another tool's ``entries`` it does
    not restore gives (``steps``: those it restores)."""
    groups: dict[str, list[int]] = {}
    for f in entries:
        numbers = groups.setdefault(f.kind, [])
        if f.step not in numbers:
            numbers.append(f.step)
    held = "; ".join(f"{', '.join(map(str, s))} ({kind})" for kind, s in groups.items())
    latest = steps[-1] if steps else None
    return (
        f"{root} holds steps another tool wrote that this CheckpointManager does not "
        f"restore: {held}. It never removes or replaces them, and does not save over their "
        "numbers (should_save is False for them, save raises ForeignStepError); "
        f"latest_step() is {latest}. `modelshard steps {root}` lists them."
    )


def adopted_steps(others: list[Foreign]) -> list[int]:
    """The steps of ``others`` (``foreign_steps``) the manager lists and restores beside
    its own: Orbax's complete steps with a state item."""
    return sorted({f.step for f in others if f.restorable})


def restorable_steps(root: Any) -> list[int]:
    """Every step a manager of ``root`` lists and restores, ascending: its own complete
    steps and Orbax's (``adopted_steps``).

    Raises:
        CheckpointError: object storage that cannot be reached (``urls.reaching``).
    """
    steps = complete_steps(root)
    return sorted({*steps, *adopted_steps(foreign_steps(root, steps))})


def _plain_dir(path: Any) -> bool:
    """A folder, not a link to one."""
    return (is_remote(path) or not path.is_symlink()) and path.is_dir()


def manager_step(directory: str | os.PathLike[str]) -> tuple[Any, int | None]:
    """``(path, None)`` for a checkpoint, or ``(its latest complete step's directory,
    step)`` when ``directory`` is a CheckpointManager's root (numbered steps, no Orbax
    tree of its own), the manager's own or Orbax's (``restorable_steps``). What
    ``modelshard inspect|plan|reshard`` read."""
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
    """One numbered entry of a manager's root.

    Attributes:
        step: the step number.
        complete: whether its writer counts it as finished: for the manager's own, a
            complete step (restorable); for Orbax's, by Orbax's rule.
        path: where it is.
        why: for a leftover, what left it (``"interrupted save"``, ``"staging folder of an
            interrupted save"``, ``"removal by rotation not finished"``); for another
            tool's entry, ``"written by another tool (Orbax)"`` or ``"written by another
            tool"``; ``""`` for a complete step of the manager's.
        has: the parts of a step that are there (see ``PARTS``), and the commit file;
            for another tool's entry, every name in it.
        unfinished: ``(part, name)`` for each part there only under a temporary name (an
            item Orbax had not finished writing).
        lacks: the parts a complete step needs that are missing (neither there nor
            unfinished); none for another tool's entry.
        others: the names in it that are no part of a step.
        files: how many files it holds.
        bytes: their total size.
        owner: who wrote it: ``"modelshard"`` (this package's manager), ``"orbax"``
            (Orbax's own manager), ``"other"`` (another tool), or None (it holds nothing
            to lose: an empty folder, or only the metadata any save starts with).
        state: for a complete step of Orbax's, the item restored as its state
            (``orbax_state``), or None.
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
    owner: str | None = OURS
    state: str | None = None

    @property
    def foreign(self) -> bool:
        """Whether another tool wrote it (a manager never removes or replaces it)."""
        return self.owner in (ORBAX, OTHER)

    @property
    def restorable(self) -> bool:
        """Whether the manager lists and restores it: a complete step of its own, or
        Orbax's complete step with a state item (``owner`` tells them apart)."""
        if self.owner == ORBAX:
            return self.complete and self.state is not None
        return self.complete and self.owner == OURS

    @property
    def status(self) -> str:
        """``"complete"`` (restorable: the manager's or Orbax's, ``owner`` says whose),
        ``"foreign"`` (another tool's, not restorable) or ``"leftover"``."""
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


ROTATED_WHY = "removal by rotation not finished"


def _json_copies(path: Any, names: list[str]) -> list[str]:
    """The JSON items beside a manager step's own that its ``_CHECKPOINT_METADATA`` lists
    (each JSON item of ``save(items=...)`` written as Orbax's ``JsonSave`` writes one)."""
    meta = _step_metadata(path) if CHECKPOINT_METADATA in names else None
    handlers = meta.get("item_handlers") if meta is not None else None
    if not isinstance(handlers, dict):
        return []
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
        done = owner == ORBAX and orbax_complete(path, names)
        return StepEntry(
            step,
            done,
            path,
            f"written by {Foreign(step, path.name, owner, False).writer}",
            tuple(n for n in names if ORBAX_TMP not in n),
            temporary,
            (),
            (),
            files,
            size,
            owner,
            orbax_state(path, names) if done else None,
        )
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
    # the JSON items a step also holds as Orbax's own (``items.orbax_json_items``): copies
    # of what ``items`` holds, so only one not finished is named
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
        owner,
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
    """Every numbered entry of the manager root ``directory``, complete, leftover or another
    tool's, by step (a step's complete entry first), read from storage now.

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
            if m is not None:
                staging = bool(m.group(2))
                why = "staging folder of an interrupted save" if staging else None
                out.append(_entry(int(m.group(1)), child, why))
            elif child.name == ROTATED and not is_remote(root) and child.is_dir():
                for aside in child.iterdir():
                    r = _ROTATED.fullmatch(aside.name)
                    if r is not None:
                        out.append(_entry(int(r.group(1)), aside, ROTATED_WHY))
    return sorted(out, key=lambda e: (e.step, not e.restorable, not e.complete, str(e.path)))


def warn_foreign(root: Any, stacklevel: int) -> None:
    """Warn (``stacklevel`` as ``warnings.warn``'s) about another tool's entries in ``root`` that a manager does not restore (Orbax's
    complete steps it restores: no warning); unreachable storage is left to the listing."""
    try:
        held = [f for f in foreign_steps(root) if not f.restorable]
        steps = restorable_steps(root) if held else []
    except CheckpointError:
        return
    if held:
        warnings.warn(
            foreign_summary(root, held, steps), ForeignStepsWarning, stacklevel=stacklevel
        )
