"""The Orbax checkpointer a [`CheckpointManager`][modelshard.CheckpointManager] writes each
step with, and the check of what a step's JSON parts hold before a byte is written.

A step is one Orbax composite of items: ``state`` (the arrays, through
``write.save_handler``), ``modelshard`` (the record), ``items`` and ``metrics`` (small
JSON), and each JSON item again as Orbax's own manager reads it (``step_args``),
committed together. Under several processes a part failing on one process fails the step
on every process at once (``barriers``), as ``ms.save`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .._base import CheckpointError
from .barriers import carrying_commit, carrying_failures, sharing_failures
from .items import orbax_json_items
from .storage import (
    ITEMS_FILE,
    ITEMS_ITEM,
    METRICS_FILE,
    METRICS_ITEM,
    RECORD_FILE,
    RECORD_ITEM,
    STATE_ITEM,
)
from .urls import atomicity_options
from .write import coordinated_processes, save_handler


def step_checkpointer(directory: Any, compression: str | None, async_save: bool) -> Any:
    """Orbax's ``AsyncCheckpointer`` (``async_save``) or ``Checkpointer`` of a manager's
    steps under ``directory``, its arrays stored with ``compression``."""
    import orbax.checkpoint as ocp

    atomicity = atomicity_options(directory)
    processes = coordinated_processes()
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add(STATE_ITEM, ocp.args.PyTreeSave, save_handler(compression))
    for item, filename in (
        (RECORD_ITEM, RECORD_FILE),
        (ITEMS_ITEM, ITEMS_FILE),
        (METRICS_ITEM, METRICS_FILE),
    ):
        registry.add(item, ocp.args.JsonSave, ocp.JsonCheckpointHandler(filename=filename))
    # a registry, not fixed items: each JSON item a step mirrors (``orbax_json_items``)
    # gets Orbax's default JSON handler under its own name as the step is saved
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(
            atomicity_options=atomicity, multiprocessing_options=processes
        ),
        handler_registry=registry,
    )
    # as ms.save's: a part failing on one process fails the step on every process at once,
    # so they stay in step; in the background, through the barrier Orbax waits at before
    # its commit (carrying_failures)
    if async_save:
        handler = carrying_failures(handler, "modelshard:manager:started", "writing")
    else:
        handler = sharing_failures(handler, "modelshard:manager:written", "writing")
    kind = ocp.AsyncCheckpointer if async_save else ocp.Checkpointer
    ckptr = kind(handler, atomicity_options=atomicity, multiprocessing_options=processes)
    if async_save:  # and a commit failing on process 0, through the next one
        carrying_commit(ckptr)
    return ckptr


def step_args(
    tree: Any,
    record: dict[str, Any],
    items: Mapping[str, Any] | None,
    encoded: dict[str, Any],
    metrics: Mapping[str, Any] | None,
) -> Any:
    """The ``args.Composite`` of one step: the stored ``tree``, the ``record`` (JSON),
    the ``encoded`` items (``encode_items(items)``), the ``metrics`` where given, and each
    JSON item again under its own name, where Orbax's own manager reads it with
    ``ocp.args.JsonRestore()`` (``orbax_json_items``)."""
    import orbax.checkpoint as ocp

    args = {
        STATE_ITEM: ocp.args.PyTreeSave(tree),
        RECORD_ITEM: ocp.args.JsonSave(record),
        ITEMS_ITEM: ocp.args.JsonSave(encoded),
    }
    for name, value in orbax_json_items(items, encoded).items():
        args[name] = ocp.args.JsonSave(value)
    if metrics is not None:
        args[METRICS_ITEM] = ocp.args.JsonSave(dict(metrics))
    return ocp.args.Composite(**args)


def json_or_error(what: str, value: Any) -> None:
    """Raise a CheckpointError naming ``what`` where ``value`` is not JSON."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{what} must be JSON (nothing was written): {type(e).__name__}: {e}. "
            "Convert NumPy/JAX scalars with float(...) or int(...)."
        ) from e
