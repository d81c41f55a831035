"""Every private name of Orbax (``orbax.checkpoint._src``) that modelshard uses, each imported once
with what it is for."""

from __future__ import annotations

from .needs import needed

DIST = "orbax-checkpoint"

with needed(
    DIST,
    "orbax.checkpoint._src.serialization.tensorstore_utils.ArrayReadSpec",
    "the TensorStore spec of one stored array, read box by box without a restore "
    "(reshard, convert, export)",
):
    from orbax.checkpoint._src.serialization.tensorstore_utils import ArrayReadSpec

with needed(
    DIST,
    "orbax.checkpoint._src.serialization.tensorstore_utils.ArrayWriteSpec",
    "the TensorStore spec a streamed checkpoint writes each array to, so that Orbax "
    "reads it as its own (reshard, convert)",
):
    from orbax.checkpoint._src.serialization.tensorstore_utils import ArrayWriteSpec

with needed(
    DIST,
    "orbax.checkpoint._src.serialization.tensorstore_utils",
    "s3:// checkpoints: its build_kvstore_tspec is replaced in that module, where Orbax's "
    "own code looks it up, by one that gives TensorStore's s3 kvstore",
):
    from orbax.checkpoint._src.serialization import tensorstore_utils
