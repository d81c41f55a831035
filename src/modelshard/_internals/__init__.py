"""Other libraries' private names that modelshard needs, each imported once, with its reason."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jax import ArrayImpl as ArrayImpl
    from .jax import backends_are_initialized as backends_are_initialized
    from .jax import cloud_tpu_init as cloud_tpu_init
    from .jax import global_state as global_state
    from .orbax import ArrayReadSpec as ArrayReadSpec
    from .orbax import ArrayWriteSpec as ArrayWriteSpec
    from .orbax import tensorstore_utils as tensorstore_utils
    from .orbax_text import JSON_HANDLER_NAME as JSON_HANDLER_NAME
    from .orbax_text import PYTREE_HANDLER_NAME as PYTREE_HANDLER_NAME
    from .orbax_text import STANDARD_HANDLER_NAME as STANDARD_HANDLER_NAME
    from .patches import wrap_build_kvstore_tspec as wrap_build_kvstore_tspec
    from .patches import wrap_linen_constraint as wrap_linen_constraint
    from .patches import wrap_linen_unbox as wrap_linen_unbox
    from .patches import wrap_to_json as wrap_to_json

# which module owns each name: importing it loads that module's library (and only then)
_OWNER = {
    **dict.fromkeys(
        ("ArrayImpl", "backends_are_initialized", "cloud_tpu_init", "global_state"), "jax"
    ),
    **dict.fromkeys(("ArrayReadSpec", "ArrayWriteSpec", "tensorstore_utils"), "orbax"),
    **dict.fromkeys(
        ("JSON_HANDLER_NAME", "PYTREE_HANDLER_NAME", "STANDARD_HANDLER_NAME"), "orbax_text"
    ),
}


def __getattr__(name: str) -> Any:
    owner = _OWNER.get(name) or ("patches" if name.startswith("wrap_") else None)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_module(owner), name)


def _module(owner: str) -> Any:
    """The module ``owner`` of this package, imported by a literal name."""
    if owner == "jax":
        from . import jax as module
    elif owner == "orbax":
        from . import orbax as module
    elif owner == "orbax_text":
        from . import orbax_text as module
    else:
        from . import patches as module
    return module
