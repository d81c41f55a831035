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
    "own code looks it up, by one that gives TensorStore's s3 kvstore; and its "
    "get_tensorstore_raw_bytes, whose metrics conversion leaks memory on every save "
    "(leaks.stop_leaks); and its build_array_write_spec, wrapped so that "
    "modelshard's own writes are stored in chunks aligned for other splits (chunks.py)",
):
    from orbax.checkpoint._src.serialization import tensorstore_utils

with needed(
    DIST,
    "orbax.checkpoint._src.metadata.array_metadata_store.Store",
    "the array metadata store Orbax's default jax.Array handler is built with (it wraps "
    "PRNG key data); our save and restore handlers are built the same way",
):
    from orbax.checkpoint._src.metadata.array_metadata_store import (
        Store as ArrayMetadataStore,
    )

with needed(
    DIST,
    "orbax.checkpoint._src.multihost.multihost",
    "every barrier Orbax runs for a save of ours is bounded by MODELSHARD_BARRIER_TIMEOUT: "
    "its get_barrier_sync_fn is wrapped in that module, where Orbax's own code looks it up "
    "(_checkpoint/barriers.py)",
):
    from orbax.checkpoint._src.multihost import multihost
