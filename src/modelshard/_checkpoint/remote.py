"""``save`` to object storage (``gs://``, ``s3://``), where no directory can be renamed.

The checkpoint is written where it belongs, as a manager step with no JSON items (``state/``
and ``modelshard/modelshard.json``, as ``sources.locate`` reads it), its commit file
(``storage.COMMIT_FILE``) last: ``locate`` refuses one without it. ``overwrite`` removes the
old checkpoint first (only one modelshard wrote): with no atomic swap, a crash in between
leaves none.
"""

from __future__ import annotations

from typing import Any

from .._base import CheckpointError
from .._runtime import broadcast
from .record import Record
from .shards import write_and_commit
from .step_writer import commit_items
from .storage import COMMIT_FILE, STATE_ITEM, is_marked
from .urls import check_bucket, forget_listings, reaching


def prepare_remote(path: Any, *, overwrite: bool) -> None:
    """Make the object-storage ``path`` ready for a new checkpoint (process 0 decides, every
    process raises): refuse one that is there (without ``overwrite``) or that modelshard did
    not write; remove the old one, its commit file first.

    Raises:
        CheckpointError: the bucket does not exist, ``path`` holds objects and
            ``overwrite`` is False, or they are not a checkpoint modelshard wrote.
    """
    import jax

    error = None
    if jax.process_index() == 0:  # decides for every process (they would list at other moments)
        try:
            _make_room(path, overwrite=overwrite)
        except CheckpointError as e:
            error = e
    refused = broadcast(None if error is None else str(error), "modelshard:save_remote:prepared")
    forget_listings(path)  # Orbax checks on every process that path is free: ask the server
    if error is not None:
        raise error  # process 0: the error itself, with its cause
    if refused is not None:
        raise CheckpointError(refused)


def _make_room(path: Any, *, overwrite: bool) -> None:
    check_bucket(path)
    forget_listings(path)
    with reaching(path):
        taken = path.exists() and any(True for _ in path.iterdir())
    if taken:
        if not overwrite:
            raise CheckpointError(
                f"{path} already exists; pass overwrite=True to replace it (on object "
                "storage the old checkpoint is removed before the new one is written)."
            )
        if not is_marked(path):
            raise CheckpointError(
                f"{path} is not a checkpoint modelshard wrote; overwrite=True replaces only "
                "those. Choose another path or remove it yourself."
            )
        with reaching(path):
            (path / COMMIT_FILE).unlink(missing_ok=True)
            path.rmtree()


def write_remote(path: Any, write: Any, record: Record, *, overwrite: bool) -> None:
    """Write a checkpoint at the object-storage ``path`` in place, as a manager step with no
    JSON items: ``write(path / "state")`` writes the arrays (every process), then process 0
    the record, the metadata and the commit files, last (``step_writer.commit_items``)."""
    import time

    start_ns = time.time_ns()
    prepare_remote(path, overwrite=overwrite)
    write_and_commit(
        lambda: write(path / STATE_ITEM),
        record,
        lambda: commit_items(path, path, record, {}, start_ns),
        name="modelshard:save",
        writing=f"writing {path}",
        committing=f"committing {path}",
    )
