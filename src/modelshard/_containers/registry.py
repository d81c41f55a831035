"""The registry of model-state types: which adapter splits which container."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .._base import AdapterError
from . import describe
from .adapter_base import Adapter
from .nnx import NnxModuleAdapter
from .penzai import NamedArrayAdapter, PenzaiVariableAdapter
from .pytree import PytreeAdapter, callbacks_adapter
from .qwix import QwixWithAuxAdapter

# (module, attribute, adapter factory): resolved once the module has been imported.
_LAZY_BUILTINS: list[tuple[str, str, Callable[[], Adapter]]] = [
    ("flax.nnx", "Module", NnxModuleAdapter),
    ("flax.nnx", "State", lambda: PytreeAdapter("nnx.State")),
    (
        "flax.training.train_state",
        "TrainState",
        lambda: PytreeAdapter("flax.TrainState", numbers_are_arrays=True),
    ),
    ("flax.core.frozen_dict", "FrozenDict", lambda: PytreeAdapter("flax.FrozenDict")),
    ("equinox", "Module", lambda: PytreeAdapter("equinox.Module")),
    # Other NNX graph objects (nnx.Optimizer, ...) are mutable too: split and update them
    # like modules, so state changed inside shard_jit reaches the caller's object.
    ("flax.nnx", "Pytree", lambda: NnxModuleAdapter("nnx.Pytree")),
    ("penzai.core.variables", "LabeledVariable", PenzaiVariableAdapter),
    ("penzai.core.named_axes", "NamedArrayBase", NamedArrayAdapter),
    ("qwix._src.providers.ptq", "WithAux", QwixWithAuxAdapter),
]


_DEFAULT = PytreeAdapter()


class _Registry:
    def __init__(self) -> None:
        self.user: list[tuple[type, Adapter]] = []
        self.builtin: list[tuple[type, Adapter]] = []
        self.pending = list(_LAZY_BUILTINS)
        self.cache: dict[type, Adapter] = {}
        self.modules_seen = -1  # len(sys.modules) when pending was last resolved
        self._nested: tuple[type, ...] | None = None

    def changed(self) -> None:
        """Forget what was looked up (a registration came or went)."""
        self.cache.clear()
        self._nested = None

    def fresh(self) -> None:
        # Lazy built-ins appear only once more modules are imported (every shard_jit call
        # looks its arguments up: this check must stay cheap).
        if self.pending and len(sys.modules) != self.modules_seen:
            self.resolve_lazy()

    def entries(self) -> list[tuple[type, Adapter]]:
        """Every registration in lookup order: the user's, newest first, then the built-ins."""
        self.fresh()
        return [*reversed(self.user), *self.builtin]

    def nested(self) -> tuple[type, ...]:
        """The registered types split by their own adapter wherever they appear."""
        self.fresh()
        if self._nested is None:
            self._nested = tuple(
                ty for ty, a in self.entries() if not a.follows_pytree or a.numbers_are_arrays
            )
        return self._nested

    def resolve_lazy(self) -> None:
        self.modules_seen = len(sys.modules)
        still = []
        for module, attr, factory in self.pending:
            mod = sys.modules.get(module)
            ty = getattr(mod, attr, None) if mod is not None else None
            if not isinstance(ty, type):  # not imported yet, or still being imported
                still.append((module, attr, factory))
                continue
            self.builtin.append((ty, factory()))
            self.changed()
        self.pending = still

    def lookup(self, ty: type) -> Adapter:
        self.fresh()
        hit = self.cache.get(ty)
        if hit is None:
            default = _OPTAX if optax_kind(ty) else _DEFAULT
            hit = next((a for t, a in self.entries() if issubclass(ty, t)), default)
            self.cache[ty] = hit
        return hit


_OPTAX = PytreeAdapter("optax")


def optax_kind(ty: type) -> bool:
    """Whether ``ty`` is one of optax's (an optimizer state)."""
    return getattr(ty, "__module__", "").split(".", 1)[0] == "optax"


REGISTRY = _Registry()
describe.install(REGISTRY.nested)


def register_container(
    ty: type,
    adapter: Adapter | None = None,
    *,
    flatten: Callable[[Any], Mapping[str, Any]] | None = None,
    unflatten: Callable[[Mapping[str, Any]], Any] | None = None,
    kind: str | None = None,
    override: bool = False,
) -> None:
    """Register a container type so modelshard can split it into named leaves.

    Either pass an [`Adapter`][modelshard.adapters.Adapter], or ``flatten(obj)`` (child name
    -> child) and ``unflatten(children)``, which also register ``ty`` as a JAX pytree.

    Args:
        ty: the container class (subclasses match too).
        adapter: a full adapter: an [`Adapter`][modelshard.adapters.Adapter] subclass instance.
        flatten: child-name -> child mapping for an instance.
        unflatten: rebuild an instance from that mapping.
        kind: the container kind recorded in plans and checkpoints (default: class name).
        override: replace an existing registration instead of raising.

    Raises:
        AdapterError: not a class, already registered, or not exactly one of ``adapter``
            and the callbacks.

    Example:
        >>> import jax.numpy as jnp
        >>> import modelshard as ms
        >>> class Pair:
        ...     def __init__(self, w, b):
        ...         self.w, self.b = w, b
        >>> ms.register_container(Pair, flatten=lambda p: {"w": p.w, "b": p.b},
        ...                       unflatten=lambda d: Pair(d["w"], d["b"]))
        >>> [info.path for info in ms.adapters.split(Pair(jnp.ones(2), jnp.zeros(2))).infos]
        ['w', 'b']
    """
    if not isinstance(ty, type):
        raise AdapterError(f"register_container needs a class, got {ty!r} ({type(ty).__name__}).")
    callbacks = flatten is not None or unflatten is not None
    if (adapter is None) == (not callbacks):
        raise AdapterError(
            f"register_container({ty.__name__}): pass either an adapter or both flatten= and "
            "unflatten=, not both and not neither."
        )
    if callbacks and (flatten is None or unflatten is None):
        raise AdapterError(
            f"register_container({ty.__name__}): flatten= and unflatten= go together; "
            f"got only {'flatten' if flatten else 'unflatten'}=."
        )
    if adapter is not None and not isinstance(adapter, Adapter):
        raise AdapterError(
            f"register_container({ty.__name__}): {adapter!r} is not an Adapter; subclass "
            "modelshard.adapters.Adapter (it needs kind, flatten, unflatten and describe, and "
            "gives every other capability a default)."
        )
    if not override and any(t is ty for t, _ in REGISTRY.user):
        raise AdapterError(
            f"{ty.__module__}.{ty.__qualname__} is already registered as a container; pass "
            "override=True to replace its adapter."
        )
    if flatten is not None and unflatten is not None:
        adapter = callbacks_adapter(ty, flatten, unflatten, kind or ty.__name__)
    assert adapter is not None
    REGISTRY.user[:] = [(t, a) for t, a in REGISTRY.user if t is not ty] + [(ty, adapter)]
    REGISTRY.changed()


def get_adapter(obj: Any) -> Adapter:
    """The adapter that handles ``obj`` (first match; plain pytrees by default)."""
    return REGISTRY.lookup(type(obj))


def registered() -> list[tuple[type, str]]:
    """Registered container types and their kinds, in lookup order."""
    REGISTRY.resolve_lazy()
    return [(t, a.kind) for t, a in REGISTRY.entries()]


@contextmanager
def registry_snapshot() -> Iterator[None]:
    """Restore the registry's user registrations on exit (used by the test fixture)."""
    saved = list(REGISTRY.user)
    try:
        yield
    finally:
        REGISTRY.user[:] = saved
        REGISTRY.changed()
