"""Every patch modelshard installs on another library (Orbax, TensorStore, Flax), in one place."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

from .needs import moved

ORBAX = "orbax-checkpoint"
TENSORSTORE = "tensorstore"
FLAX = "flax"

Wrap = Callable[[Any], Any]
"""Given what is installed now, the replacement to install, or None to leave it."""


def _symbol(owner: Any, name: str) -> str:
    """``owner.name`` as an error names it: a module's or class's dotted name, an object's type."""
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{type(owner).__qualname__}.{name}"


def target(
    owner: Any, name: str, *, distribution: str, used_for: str, params: Iterable[str] = ()
) -> Any:
    """``owner.name``, checked: a callable whose signature has each of ``params`` (a signature
    Python cannot read is not checked); an ImportError saying what moved otherwise."""
    symbol = _symbol(owner, name)
    current = getattr(owner, name, None)
    if current is None or not callable(current):
        raise ImportError(moved(distribution, symbol, used_for, f"no callable {name!r} there"))
    try:
        signature = inspect.signature(current)
    except (TypeError, ValueError):  # a compiled function (TensorStore's to_json)
        return current
    lacking = ", ".join(repr(p) for p in params if p not in signature.parameters)
    if lacking:
        detail = f"its signature {signature} has no parameter {lacking}"
        raise ImportError(moved(distribution, symbol, used_for, detail))
    return current


def _install(
    owner: Any, name: str, wrap: Wrap, distribution: str, used_for: str, *params: str
) -> Any:
    """``wrap(target(owner, name, ...))`` set on ``owner`` unless it is None; returns what
    ``owner.name`` is afterwards."""
    replacement = wrap(
        target(owner, name, distribution=distribution, used_for=used_for, params=params)
    )
    if replacement is not None:
        setattr(owner, name, replacement)
    return getattr(owner, name)


# -- Orbax, module level (Orbax's own code looks each up in its module when it calls it)


def wrap_build_kvstore_tspec(wrap: Wrap) -> Any:
    """Wrap Orbax's ``tensorstore_utils.build_kvstore_tspec``: Orbax (0.12.8) gives no ``s3``
    kvstore for an ``s3://`` directory, which TensorStore supports (``_checkpoint/s3.py``)."""
    from . import orbax

    used_for = "s3:// checkpoints through TensorStore's s3 kvstore"
    params = ("directory", "use_ocdbt")
    return _install(orbax.tensorstore_utils, "build_kvstore_tspec", wrap, ORBAX, used_for, *params)


# -- TensorStore


def wrap_to_json(cls: Any, wrap: Wrap) -> Any:
    """Wrap ``cls.to_json`` (``tensorstore.Spec``, ``KvStore.Spec``): TensorStore (0.1.86) keeps
    a reference too many to every key and value it converts, and Orbax converts a spec per
    array of every save and restore (``_checkpoint/leaks.py`` probes for it first)."""
    used_for = "the references its conversion keeps given back: no leak on every save"
    return _install(cls, "to_json", wrap, TENSORSTORE, used_for)


# -- Flax linen (installed the first time a linen model is traced under modelshard's rules)


def wrap_linen_unbox(wrap: Wrap) -> Any:
    """Wrap ``flax.linen.spmd.LogicallyPartitioned.unbox``: Flax constrains a box whose value an
    initializer made flat by its full-rank names, and fails (flax#3676) (``_specs/logical.py``)."""
    import flax.linen.spmd as linen_spmd

    used_for = "a flat param's box left unconstrained under modelshard's logical rules"
    owner = linen_spmd.LogicallyPartitioned
    return _install(owner, "unbox", wrap, FLAX, used_for, "apply_constraint")


def wrap_linen_constraint(wrap: Wrap) -> Any:
    """Wrap ``flax.linen.spmd._with_sharding_constraint``: it only asserts on an Explicit mesh
    axis; under modelshard's rules it reshards as ``constrain`` does (``_specs/logical.py``)."""
    import flax.linen.spmd as linen_spmd

    used_for = "linen's logical constraints resharded on Explicit mesh axes"
    params = ("x", "axis_resources", "mesh")
    return _install(linen_spmd, "_with_sharding_constraint", wrap, FLAX, used_for, *params)
