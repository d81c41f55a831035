"""Other libraries' private names that modelshard needs, each imported once, with its reason."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jax import ArrayImpl as ArrayImpl
    from .jax import backends_are_initialized as backends_are_initialized
    from .jax import cloud_tpu_init as cloud_tpu_init
    from .jax import global_state as global_state
    from .orbax import ArrayMetadataStore as ArrayMetadataStore
    from .orbax import ArrayReadSpec as ArrayReadSpec
    from .orbax import ArrayWriteSpec as ArrayWriteSpec
    from .orbax import multihost as multihost
    from .orbax import tensorstore_utils as tensorstore_utils
    from .orbax_text import STANDARD_HANDLER_NAME as STANDARD_HANDLER_NAME
    from .patches import replace_raw_bytes as replace_raw_bytes
    from .patches import wrap_barrier_sync_fn as wrap_barrier_sync_fn
    from .patches import wrap_build_array_write_spec as wrap_build_array_write_spec
    from .patches import wrap_build_kvstore_tspec as wrap_build_kvstore_tspec
    from .patches import wrap_commit_callback as wrap_commit_callback
    from .patches import wrap_handler_async_save as wrap_handler_async_save
    from .patches import wrap_handler_finalize as wrap_handler_finalize
    from .patches import wrap_handler_save as wrap_handler_save
    from .patches import wrap_linen_constraint as wrap_linen_constraint
    from .patches import wrap_linen_unbox as wrap_linen_unbox
    from .patches import wrap_to_json as wrap_to_json

# which module owns each name: importing it loads that module's library (and only then)
_OWNER = {
    "ArrayImpl": "jax",
    "backends_are_initialized": "jax",
    "cloud_tpu_init": "jax",
    "global_state": "jax",
    "STANDARD_HANDLER_NAME": "orbax_text",
    "ArrayMetadataStore": "orbax",
    "ArrayReadSpec": "orbax",
    "ArrayWriteSpec": "orbax",
    "multihost": "orbax",
    "tensorstore_utils": "orbax",
    "replace_raw_bytes": "patches",
    "wrap_build_array_write_spec": "patches",
    "wrap_build_kvstore_tspec": "patches",
    "wrap_barrier_sync_fn": "patches",
    "wrap_handler_save": "patches",
    "wrap_handler_async_save": "patches",
    "wrap_handler_finalize": "patches",
    "wrap_commit_callback": "patches",
    "wrap_to_json": "patches",
    "wrap_linen_unbox": "patches",
    "wrap_linen_constraint": "patches",
}


def __getattr__(name: str) -> Any:
    owner = _OWNER.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if owner == "orbax":
        from . import orbax as module
    elif owner == "orbax_text":
        from . import orbax_text as module
    elif owner == "patches":  # imports each library only when a patch is installed
        from . import patches as module
    else:
        from . import jax as module
    return getattr(module, name)
