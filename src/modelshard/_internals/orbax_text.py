"""Orbax's private names that modelshard writes into a checkpoint as text, without importing Orbax
(a local reshard never does: ``_checkpoint/ocdbt.py``)."""

from __future__ import annotations

STANDARD_HANDLER_NAME = (
    "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
)
"""The dotted name of ``ocp.StandardCheckpointHandler`` (its class lives in a private
module), which Orbax records as an item's handler in ``_CHECKPOINT_METADATA``."""
