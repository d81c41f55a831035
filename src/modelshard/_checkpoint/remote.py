"""``save`` to object storage (``gs://``, ``s3://``): no directory can be renamed there.

On a local disk ``save`` writes into a staging directory and renames it (see
`write.py`). Object stores have no rename, so there the checkpoint is written where it
belongs, in one Orbax save of two items, ``state/`` (the arrays) and
``modelshard/modelshard.json`` (the record), the layout of a manager step that
`locate.locate` reads. Orbax writes its commit file
(``storage.COMMIT_FILE``) last; a checkpoint without it is incomplete and ``locate``
refuses it. ``overwrite`` removes the old checkpoint first (only one modelshard wrote):
there is no atomic swap on object storage, so a crash in between leaves none.
"""

from __future__ import annotations

from typing import Any

from .._base import CheckpointError
from .._runtime import broadcast
from .barriers import sharing_failures
from .record import Record
from .storage import COMMIT_FILE, MARKER, RECORD_FILE, RECORD_ITEM, STATE_ITEM, is_marked
from .urls import atomicity_options, check_bucket, forget_listings, reaching


def prepare_remote(path: Any, *, overwrite: bool) -> None:
    """Make the object-storage ``path`` ready for a new checkpoint: refuse one that is
    there (without ``overwrite``) or that modelshard did not write; remove the old one,
    its commit file first, so that a crash part-way leaves no complete-looking remains.

    Process 0 checks and removes; every process raises the error it found, or none does.

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


def save_remote(
    path: Any, tree: Any, record: Record, *, overwrite: bool, handler: Any, processes: Any
) -> None:
    """Write ``tree`` and ``record`` as a checkpoint at the object-storage ``path``, in
    one Orbax save committed by its commit file (see ``prepare_remote`` for an old one).

    ``handler`` writes the arrays (``write.save_handler``: ``save``'s compression, its
    files), ``processes`` are Orbax's multiprocessing options
    (``write.coordinated_processes``); ``write`` passes both, as it imports this module.
    """
    import orbax.checkpoint as ocp

    prepare_remote(path, overwrite=overwrite)
    record.resolve()  # collectives over arrays spanning processes: every process
    atomicity = atomicity_options(path)
    # a part that fails on one process fails the save on every process at once
    composite = sharing_failures(
        ocp.CompositeCheckpointHandler(
            composite_options=ocp.CompositeOptions(
                atomicity_options=atomicity, multiprocessing_options=processes
            ),
            **{
                STATE_ITEM: handler,
                RECORD_ITEM: ocp.JsonCheckpointHandler(filename=RECORD_FILE),
            },
        ),
        "modelshard:save:arrays",
        f"writing {path}",
    )
    args = ocp.args.Composite(
        **{
            STATE_ITEM: ocp.args.PyTreeSave(tree),
            RECORD_ITEM: ocp.args.JsonSave(record.to_json()),
        }
    )
    with ocp.Checkpointer(
        composite, atomicity_options=atomicity, multiprocessing_options=processes
    ) as ckptr:
        ckptr.save(path, args=args, custom_metadata=MARKER)
