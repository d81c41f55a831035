"""One step of a [`CheckpointManager`][modelshard.CheckpointManager], written by every
process: the arrays through ``shards``, then the record, the JSON items and the step's
metadata, committed last (``shards.write_and_commit``).

A step holds the items ``state`` (the arrays), ``modelshard`` (the record), ``items`` and
``metrics`` (small JSON), and each JSON item again as Orbax's own manager reads it; its
``_CHECKPOINT_METADATA`` names each item's Orbax handler, so Orbax's ``CheckpointManager``
reads the step as one of its own. Locally the step is written into
``<step>.orbax-checkpoint-tmp`` and renamed; on object storage in place, committed by its
commit file, written last.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .._base import CheckpointError, fsync_dir, sync_tree
from .._internals import JSON_HANDLER_NAME, PYTREE_HANDLER_NAME
from .items import ORBAX_JSON_FILE, orbax_json_items
from .ocdbt import checkpoint_metadata
from .record import Record
from .shards import Held, write_and_commit, write_held
from .storage import (
    CHECKPOINT_METADATA,
    COMMIT_FILE,
    ITEMS_FILE,
    ITEMS_ITEM,
    MARKER,
    METRICS_FILE,
    METRICS_ITEM,
    ORBAX_TMP,
    RECORD_FILE,
    RECORD_ITEM,
    STATE_ITEM,
)
from .urls import is_remote, reaching


def json_parts(
    items: Mapping[str, Any] | None, encoded: dict[str, Any], metrics: Mapping[str, Any] | None
) -> dict[str, tuple[str, Any]]:
    """A step's JSON items but the record, ``{item: (file, value)}``: the ``encoded`` items
    (``encode_items(items)``), the ``metrics`` where given, and each JSON item again under
    its own name, where Orbax's own manager reads it with ``ocp.args.JsonRestore()``."""
    parts = {ITEMS_ITEM: (ITEMS_FILE, encoded)}
    for name, value in orbax_json_items(items, encoded).items():
        parts[name] = (ORBAX_JSON_FILE, value)
    if metrics is not None:
        parts[METRICS_ITEM] = (METRICS_FILE, dict(metrics))
    return parts


def write_step(
    root: Any,
    step: int,
    held: Sequence[Held],
    record: Record,
    parts: Mapping[str, tuple[str, Any]],
    *,
    compress: bool,
    name: str,
) -> None:
    """Write step ``step`` under ``root`` (every process, ``held`` its own blocks), then
    process 0 the ``record``, the JSON ``parts`` (``json_parts``), the metadata and the
    commit. Every wait for the other processes is named after ``name``.

    Raises:
        CheckpointError: a part failed, on this process or another (every process raises).
    """
    start_ns = time.time_ns()
    final = root / str(step)
    where = final if is_remote(root) else root / f"{step}{ORBAX_TMP}"
    write_and_commit(
        lambda: write_held(where / STATE_ITEM, held, compress=compress, name=name),
        record,
        lambda: commit_items(where, final, record, parts, start_ns),
        name=name,
        writing=f"writing step {step}",
        committing=f"committing step {step}",
    )


def commit_items(
    where: Any, final: Any, record: Record, parts: Mapping[str, tuple[str, Any]], start_ns: int
) -> None:
    """Process 0: the record and JSON items, each item's commit file, the step's metadata
    and commit file, then (locally) the rename of ``where`` to ``final``; ``save`` to object
    storage too (``final`` is ``where``, no ``parts``)."""
    with reaching(where):
        done = f"Checkpoint commit was successful to {where}"
        files = {RECORD_ITEM: (RECORD_FILE, record.dumps())}
        files.update({item: (file, json.dumps(value)) for item, (file, value) in parts.items()})
        (where / STATE_ITEM / COMMIT_FILE).write_text(done)
        for item, (file, text) in files.items():
            (where / item).mkdir(parents=True, exist_ok=True)
            (where / item / file).write_text(text)
            (where / item / COMMIT_FILE).write_text(done)
        handlers = {
            item: PYTREE_HANDLER_NAME if item == STATE_ITEM else JSON_HANDLER_NAME
            for item in sorted([STATE_ITEM, *files])
        }
        (where / CHECKPOINT_METADATA).write_text(
            json.dumps(checkpoint_metadata(handlers, start_ns, MARKER))
        )
        (where / COMMIT_FILE).write_text(done)
        if is_remote(where):
            return
        sync_tree(where)
        os.rename(where, final)
        fsync_dir(final.parent)


def json_or_error(what: str, value: Any) -> None:
    """Raise a CheckpointError naming ``what`` where ``value`` is not JSON."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{what} must be JSON (nothing was written): {type(e).__name__}: {e}. "
            "Convert NumPy/JAX scalars with float(...) or int(...)."
        ) from e
