"""Other libraries' private names that modelshard needs, each imported once, with its reason.

Other areas import these names from this façade (``from .._internals import global_state``).
Each is loaded on first use, from ``orbax.py``, ``orbax_text.py`` (names written as text:
Orbax not imported) or ``jax.py``: naming the package loads neither library, and Orbax is
imported only by the code that checkpoints.
"""

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
    from .orbax import BasePyTreeCheckpointHandler as BasePyTreeCheckpointHandler
    from .orbax import UnlimitedInFlightBytes as UnlimitedInFlightBytes
    from .orbax import multihost as multihost
    from .orbax import tensorstore_utils as tensorstore_utils
    from .orbax_text import STANDARD_HANDLER_NAME as STANDARD_HANDLER_NAME

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
    "BasePyTreeCheckpointHandler": "orbax",
    "UnlimitedInFlightBytes": "orbax",
    "multihost": "orbax",
    "tensorstore_utils": "orbax",
}


def __getattr__(name: str) -> Any:
    owner = _OWNER.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if owner == "orbax":
        from . import orbax as module
    elif owner == "orbax_text":
        from . import orbax_text as module
    else:
        from . import jax as module
    return getattr(module, name)
