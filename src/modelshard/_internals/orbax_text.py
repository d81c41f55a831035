"""Orbax's private names that modelshard writes into a checkpoint as text, without importing Orbax
(a local reshard never does: ``_checkpoint/ocdbt.py``)."""

from __future__ import annotations

STANDARD_HANDLER_NAME = (
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
)
"""The dotted name of ``ocp.StandardCheckpointHandler`` (its class lives in a private
module), which Orbax records as an item's handler in ``_CHECKPOINT_METADATA``."""

PYTREE_HANDLER_NAME = (
    "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
)
"""The dotted name of ``ocp.PyTreeCheckpointHandler``: a manager step's ``state`` item's
handler in its ``_CHECKPOINT_METADATA``, so that Orbax's own manager reads the step."""

JSON_HANDLER_NAME = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
"""The dotted name of ``ocp.JsonCheckpointHandler``: each JSON item's handler in a manager
step's ``_CHECKPOINT_METADATA``."""
