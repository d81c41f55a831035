"""Container adapters: the registry of model-state types and the built-in adapters.

The registry follows Orbax's type-handler registry: a protocol, one global default,
``register_container(ty, adapter, override=False)`` and ``get_adapter(obj)``. Lookup is
first match: user registrations (most recent first), then built-ins, then the plain-pytree
adapter that serves every JAX pytree (dicts, lists, tuples, NamedTuples such as optax
states, registered dataclasses such as ``TrainState``, ``None``).

Built-ins for Flax and Equinox are registered lazily: an object can only be an
``nnx.Module`` once Flax has been imported, so modelshard never imports Flax, Equinox or
optax itself. Splitting a container with its adapter is :func:`modelshard.adapters.split`
(``_flat.py``); naming its leaves is ``_describe.py``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import jax

from ._describe import LeafInfo, describe_pytree
from ._errors import AdapterError

__all__ = [
    "Adapter",
    "NnxModuleAdapter",
    "PytreeAdapter",
    "get_adapter",
    "register_container",
    "registered",
    "registry_snapshot",
]


@runtime_checkable
class Adapter(Protocol):
    """How one container type is split into leaves and rebuilt.

    ``flatten`` is on the hot path of every ``shard_jit`` call and must be cheap;
    ``describe`` (paths and metadata) runs only when a plan is made.
    """

    @property
    def kind(self) -> str:
        """The container kind recorded in plans and checkpoints (``"nnx.Module"``...)."""
        ...

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        """All leaves of ``obj`` (array and static) and a hashable structure key."""
        ...

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """Rebuild an object of the original type from ``flatten``'s output."""
        ...

    def describe(self, obj: Any) -> list[LeafInfo]:
        """One :class:`LeafInfo` per leaf, in ``flatten`` order."""
        ...


@dataclasses.dataclass(frozen=True)
class PytreeAdapter:
    """The adapter for anything JAX can flatten (the default for unregistered types).

    Attributes:
        kind: the name recorded for this container kind (``"pytree"``, ``"optax"``, ...).
        numbers_are_arrays: treat Python numbers (``bool``, ``int``, ``float``,
            ``complex``) among the leaves as rank-0 array leaves, as ``jax.jit`` does,
            instead of static leaves. On for Flax's ``TrainState``, whose ``step`` starts
            as the Python int 0 and is state like any other: it is traced, sharded
            (replicated) and saved. Off elsewhere, as in Equinox: a Python number in a
            container is configuration, part of the compilation key.
    """

    kind: str = "pytree"
    numbers_are_arrays: bool = False

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        leaves, treedef = jax.tree_util.tree_flatten(obj)
        return leaves, treedef

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(aux, leaves)  # type: ignore[arg-type]

    def describe(self, obj: Any) -> list[LeafInfo]:
        return describe_pytree(obj)


@dataclasses.dataclass(frozen=True)
class NnxModuleAdapter:
    """Flax NNX modules: ``nnx.split`` into graph + state, Variables as leaves."""

    kind: str = "nnx.Module"

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        from flax import nnx

        graphdef, state = nnx.split(obj)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        return leaves, (graphdef, treedef)

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        from flax import nnx

        graphdef, treedef = aux  # type: ignore[misc]
        return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))

    def describe(self, obj: Any) -> list[LeafInfo]:
        from flax import nnx

        return describe_pytree(nnx.state(obj))

    def tree_of(self, obj: Any) -> Any:
        """The pytree whose structure the canonical paths follow (the module's state)."""
        from flax import nnx

        return nnx.state(obj)

    def state_of(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """The ``nnx.State`` holding ``leaves`` (what NNX users expect for mirrors)."""
        _, treedef = aux  # type: ignore[misc]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def update(self, obj: Any, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """Write ``leaves`` into the caller's module in place (``nnx.update``)."""
        from flax import nnx

        nnx.update(obj, self.state_of(aux, leaves))
        return obj


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
]

_DEFAULT = PytreeAdapter()


class _Registry:
    def __init__(self) -> None:
        self.user: list[tuple[type, Adapter]] = []
        self.builtin: list[tuple[type, Adapter]] = []
        self.pending = list(_LAZY_BUILTINS)
        self.cache: dict[type, Adapter] = {}
        self.modules_seen = -1  # len(sys.modules) when pending was last resolved

    def _resolve_lazy(self) -> None:
        self.modules_seen = len(sys.modules)
        still = []
        for module, attr, factory in self.pending:
            mod = sys.modules.get(module)
            ty = getattr(mod, attr, None) if mod is not None else None
            if not isinstance(ty, type):  # not imported yet, or still being imported
                still.append((module, attr, factory))
                continue
            self.builtin.append((ty, factory()))
            self.cache.clear()
        self.pending = still

    def lookup(self, ty: type) -> Adapter:
        # Lazy built-ins can only appear once more modules are imported (every call of
        # shard_jit looks its arguments up here, so this check must be cheap).
        if self.pending and len(sys.modules) != self.modules_seen:
            self._resolve_lazy()
        hit = self.cache.get(ty)
        if hit is not None:
            return hit
        adapter: Adapter = _DEFAULT
        for reg_ty, reg_adapter in [*reversed(self.user), *self.builtin]:
            if issubclass(ty, reg_ty):
                adapter = reg_adapter
                break
        if optax_kind(ty) and adapter is _DEFAULT:
            adapter = _OPTAX
        self.cache[ty] = adapter
        return adapter


_OPTAX = PytreeAdapter("optax")


def optax_kind(ty: type) -> bool:
    return getattr(ty, "__module__", "").startswith("optax")


_REGISTRY = _Registry()


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

    Either pass an :class:`Adapter`, or the two callbacks: ``flatten(obj)`` returns a
    mapping from child name to child (children may be arrays, static values or other
    containers), and ``unflatten(children)`` builds the object back. The callbacks also
    register ``ty`` as a JAX pytree, so ``jax.jit`` and friends accept it too.

    Args:
        ty: the container class (subclasses match too).
        adapter: a full adapter (``flatten``/``unflatten``/``describe``/``kind``).
        flatten: child-name -> child mapping for an instance.
        unflatten: rebuild an instance from that mapping.
        kind: the container kind recorded in plans and checkpoints (default: class name).
        override: replace an existing registration instead of raising.

    Raises:
        AdapterError: ``ty`` is not a class, it is already registered (and not
            ``override``), or neither/both of ``adapter`` and the callbacks were given.

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
            f"register_container({ty.__name__}): {adapter!r} is not an Adapter (it needs "
            "kind, flatten, unflatten and describe)."
        )
    existing = [i for i, (t, _) in enumerate(_REGISTRY.user) if t is ty]
    if existing and not override:
        raise AdapterError(
            f"{ty.__module__}.{ty.__qualname__} is already registered as a container; pass "
            "override=True to replace its adapter."
        )
    if callbacks:
        assert flatten is not None and unflatten is not None
        adapter = _register_pytree(ty, flatten, unflatten, kind or ty.__name__)
    assert adapter is not None
    for i in reversed(existing):
        del _REGISTRY.user[i]
    _REGISTRY.user.append((ty, adapter))
    _REGISTRY.cache.clear()


# Callbacks per user type; the JAX pytree registration (made once) dispatches through this,
# so ``override=True`` can replace them.
_CALLBACKS: dict[
    type, tuple[Callable[[Any], Mapping[str, Any]], Callable[[Mapping[str, Any]], Any]]
] = {}


def _register_pytree(
    ty: type,
    flatten: Callable[[Any], Mapping[str, Any]],
    unflatten: Callable[[Mapping[str, Any]], Any],
    kind: str,
) -> Adapter:
    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
        children = _CALLBACKS[ty][0](obj)
        if not isinstance(children, Mapping):
            raise AdapterError(
                f"flatten for {ty.__name__} must return a mapping of child name -> child, "
                f"got {type(children).__name__}."
            )
        names = tuple(str(k) for k in children)
        return [(jax.tree_util.GetAttrKey(n), children[n]) for n in names], names

    def unflatten_pytree(names: tuple[str, ...], children: Any) -> Any:
        return _CALLBACKS[ty][1](dict(zip(names, children, strict=True)))

    if ty not in _CALLBACKS and issubclass(ty, dict | list | tuple):
        raise AdapterError(
            f"{ty.__name__} is a {ty.__mro__[1].__name__} subclass, which JAX already "
            f"flattens; register it with an adapter instead: register_container("
            f"{ty.__name__}, modelshard.adapters.PytreeAdapter({kind!r}))."
        )
    if ty not in _CALLBACKS:
        try:
            jax.tree_util.register_pytree_with_keys(ty, flatten_with_keys, unflatten_pytree)
        except ValueError as e:
            raise AdapterError(
                f"{ty.__name__} is already a JAX pytree, so JAX owns its flattening; register "
                f"it with an adapter instead: register_container({ty.__name__}, "
                f"modelshard.adapters.PytreeAdapter({kind!r}))."
            ) from e
    _CALLBACKS[ty] = (flatten, unflatten)
    return PytreeAdapter(kind)


def get_adapter(obj: Any) -> Adapter:
    """The adapter that handles ``obj`` (first match; plain pytrees by default)."""
    return _REGISTRY.lookup(type(obj))


def registered() -> list[tuple[type, str]]:
    """Registered container types and their kinds, in lookup order."""
    _REGISTRY._resolve_lazy()
    entries = [*reversed(_REGISTRY.user), *_REGISTRY.builtin]
    return [(t, a.kind) for t, a in entries]


@contextmanager
def registry_snapshot() -> Iterator[None]:
    """Restore the registry's user registrations on exit (used by the test fixture)."""
    saved = list(_REGISTRY.user)
    try:
        yield
    finally:
        _REGISTRY.user[:] = saved
        _REGISTRY.cache.clear()
