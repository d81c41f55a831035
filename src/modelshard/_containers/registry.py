"""Container adapters: the registry of model-state types and the built-in adapters.

The registry follows Orbax's type-handler registry: a base class ([`Adapter`][modelshard.adapters.Adapter], which
declares every capability modelshard uses, with defaults), one global default,
``register_container(ty, adapter, override=False)`` and ``get_adapter(obj)``. Lookup is
first match: user registrations (most recent first), then built-ins, then the plain-pytree
adapter that serves every JAX pytree (dicts, lists, tuples, NamedTuples such as optax
states, registered dataclasses such as ``TrainState``, ``None``).

Built-ins for Flax and Equinox are registered lazily: an object can only be an
``nnx.Module`` once Flax has been imported, so modelshard never imports Flax, Equinox or
optax itself. Splitting a container with its adapter is [`modelshard.adapters.split`][modelshard.adapters.split]
(``_flat.py``); naming its leaves is ``_describe.py``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import jax

from .._base import AdapterError
from .describe import LeafInfo, describe_pytree, set_nested_types
from .nnx_route import nnx_call_leaves


class CallLeaves(NamedTuple):
    """One container flattened for one compiled call (``Adapter.flatten_for_call``).

    Attributes:
        leaves: every leaf, in ``flatten`` order.
        aux: the structure key (as from ``flatten``).
        key: a hashable stand-in for ``aux`` in per-call cache keys (``aux`` itself by
            default; an adapter whose ``aux`` is costly to hash may give an interned object).
        write_back: for a mutable container, ``write_back(positions, values)`` sets the
            leaves at those ``flatten`` positions to ``values`` in the caller's object;
            ``None`` for an immutable one.
    """

    leaves: list[Any]
    aux: Hashable
    key: Hashable
    write_back: Callable[[Sequence[int], Sequence[Any]], None] | None


class Adapter:
    """How one container type is split into leaves and rebuilt: the base of every adapter.

    A subclass must give ``kind`` and the three methods ``flatten``, ``unflatten`` and
    ``describe``. Everything else modelshard asks of a container is a *capability* declared
    here with a default that is right for an immutable container whose paths come from
    ``describe``; override the ones your container differs in:

    - ``numbers_are_arrays``: Python numbers among the leaves are rank-0 array leaves.
    - ``follows_pytree``: ``flatten``/``unflatten``/``describe`` are exactly JAX's
      flattening of the object (``aux`` is its ``PyTreeDef``), so descriptions can be cached
      per structure and ``shard_jit`` may gather leaves as JAX does.
    - ``mutable`` with ``update``: the container is changed in place (an NNX
      module): ``shard``, ``constrain`` and ``shard_jit`` write new values into the caller's
      object instead of returning a copy only.
    - ``tree_of``: the pytree whose structure canonical paths follow, for prefix trees.
    - ``mirror``: what a tree of shardings or plans for this container looks like.
    - ``flatten_for_call``: flattening on ``shard_jit``'s per-call path.

    ``flatten`` is on the hot path of every ``shard_jit`` call and must be cheap;
    ``describe`` (paths and metadata) runs only when a plan is made.

    Attributes:
        kind: the container kind recorded in plans and checkpoints (``"nnx.Module"``...).
        numbers_are_arrays: treat Python numbers (``bool``, ``int``, ``float``,
            ``complex``) among the leaves as rank-0 array leaves, as ``jax.jit`` does,
            instead of static leaves (default ``False``, as in Equinox).
        follows_pytree: the adapter is JAX's own flattening of the object (default
            ``False``).
        mutable: ``update`` writes into the object it is given (default ``False``).
    """

    kind: str = "container"
    numbers_are_arrays: bool = False
    follows_pytree: bool = False
    mutable: bool = False

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        """All leaves of ``obj`` (array and static) and a hashable structure key."""
        raise NotImplementedError(f"{type(self).__name__}.flatten")

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """Rebuild an object of the original type from ``flatten``'s output."""
        raise NotImplementedError(f"{type(self).__name__}.unflatten")

    def describe(self, obj: Any) -> list[LeafInfo]:
        """One [`LeafInfo`][modelshard.adapters.LeafInfo] per leaf, in ``flatten`` order."""
        raise NotImplementedError(f"{type(self).__name__}.describe")

    def tree_of(self, obj: Any) -> Any:
        """The pytree whose structure the canonical paths follow (default: ``obj``).

        Prefix trees given for the container (one spec per subtree) are matched against
        this tree's nodes.
        """
        return obj

    def mirror(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """The container's structure holding ``leaves`` as a tree of values such as
        shardings (default: ``unflatten``)."""
        return self.unflatten(aux, leaves)

    def update(self, obj: Any, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """``obj`` with its leaves replaced by ``leaves``: written into ``obj`` itself when
        ``mutable``, otherwise (the default) a new object from ``unflatten``."""
        return self.unflatten(aux, leaves)

    def flatten_for_call(self, obj: Any) -> CallLeaves:
        """Flatten ``obj`` for one ``shard_jit`` call.

        The default is ``flatten``, with a ``write_back`` through ``update`` when
        ``mutable``. An adapter may override it with a faster route that gives the same
        leaves and ``aux``.
        """
        leaves, aux = self.flatten(obj)
        if not self.mutable:
            return CallLeaves(leaves, aux, aux, None)

        def write_back(positions: Sequence[int], values: Sequence[Any]) -> None:
            new = list(leaves)
            for i, v in zip(positions, values, strict=True):
                new[i] = v
            self.update(obj, aux, new)

        return CallLeaves(leaves, aux, aux, write_back)


@dataclasses.dataclass(frozen=True)
class PytreeAdapter(Adapter):
    """The adapter for anything JAX can flatten (the default for unregistered types).

    Its paths follow the pytree (``Adapter.follows_pytree``); a subclass that changes
    ``flatten`` must set ``follows_pytree = False``.

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
    follows_pytree = True

    def flatten(self, obj: Any) -> tuple[list[Any], Hashable]:
        return flatten_pytree(obj)

    def unflatten(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        return unflatten_pytree(aux, leaves)

    def describe(self, obj: Any) -> list[LeafInfo]:
        return describe_pytree(obj)


@dataclasses.dataclass(frozen=True)
class NnxModuleAdapter(Adapter):
    """Flax NNX modules: ``nnx.split`` into graph + state, Variables as leaves.

    Mutable: updates are written into the caller's module (``nnx.update``). Prefix trees
    and mirrors follow the module's ``nnx.State``. On ``shard_jit``'s per-call path a module
    seen before is flattened as a JAX pytree down to its Variables (far cheaper than
    ``nnx.split``: docs/benchmarks/dispatch.md), mapped onto ``nnx.split``'s leaf order by a
    cached route, and written back with ``Variable.set_value`` on the Variables that changed;
    the same module object called again is only checked for changes (``nnx_route.py``).
    """

    kind: str = "nnx.Module"
    mutable = True

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
        """The module's ``nnx.State``."""
        from flax import nnx

        return nnx.state(obj)

    def mirror(self, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """The ``nnx.State`` holding ``leaves`` (what NNX users expect for sharding trees)."""
        _, treedef = aux  # type: ignore[misc]
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def update(self, obj: Any, aux: Hashable, leaves: Sequence[Any]) -> Any:
        """Write ``leaves`` into the caller's module in place (``nnx.update``)."""
        from flax import nnx

        nnx.update(obj, self.mirror(aux, leaves))
        return obj

    def flatten_for_call(self, obj: Any) -> CallLeaves:
        fast = nnx_call_leaves(obj)
        if fast is None:
            return Adapter.flatten_for_call(self, obj)
        return CallLeaves(fast.leaves, fast.aux, fast.key, fast.write_back)


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
# Third-party containers (penzai, qwix) live in modules of their own, which add themselves
# here with ``register_lazy`` when they are imported (the public ``adapters`` module
# imports them): the registry never imports an adapter module.


_DEFAULT = PytreeAdapter()


class _Registry:
    def __init__(self) -> None:
        self.user: list[tuple[type, Adapter]] = []
        self.builtin: list[tuple[type, Adapter]] = []
        self.pending = list(_LAZY_BUILTINS)
        self.cache: dict[type, Adapter] = {}
        self.modules_seen = -1  # len(sys.modules) when pending was last resolved
        self._nested: tuple[type, ...] | None = None
        self.stops: dict[type, bool] = {}  # type -> is a subclass of a nested type

    def changed(self) -> None:
        """Forget what was looked up (a registration came or went)."""
        self.cache.clear()
        self._nested = None
        set_nested_types(())  # until nested() is asked again

    def nested(self) -> tuple[type, ...]:
        """The registered types whose adapter is not JAX's own flattening: wherever one
        appears inside another container it is split by its own adapter."""
        if self.pending and len(sys.modules) != self.modules_seen:
            self.resolve_lazy()
        if self._nested is None:
            self._nested = tuple(
                ty
                for ty, a in [*reversed(self.user), *self.builtin]
                if not a.follows_pytree or a.numbers_are_arrays
            )
            self.stops.clear()
            set_nested_types(self._nested)
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
        # Lazy built-ins can only appear once more modules are imported (every call of
        # shard_jit looks its arguments up here, so this check must be cheap).
        if self.pending and len(sys.modules) != self.modules_seen:
            self.resolve_lazy()
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


REGISTRY = _Registry()


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

    Either pass an [`Adapter`][modelshard.adapters.Adapter], or the two callbacks: ``flatten(obj)`` returns a
    mapping from child name to child (children may be arrays, static values or other
    containers), and ``unflatten(children)`` builds the object back. The callbacks also
    register ``ty`` as a JAX pytree, so ``jax.jit`` and friends accept it too.

    Args:
        ty: the container class (subclasses match too).
        adapter: a full adapter: an [`Adapter`][modelshard.adapters.Adapter] subclass instance.
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
            f"register_container({ty.__name__}): {adapter!r} is not an Adapter; subclass "
            "modelshard.adapters.Adapter (it needs kind, flatten, unflatten and describe, and "
            "gives every other capability a default)."
        )
    existing = [i for i, (t, _) in enumerate(REGISTRY.user) if t is ty]
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
        del REGISTRY.user[i]
    REGISTRY.user.append((ty, adapter))
    REGISTRY.changed()


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
    return REGISTRY.lookup(type(obj))


def registered() -> list[tuple[type, str]]:
    """Registered container types and their kinds, in lookup order."""
    REGISTRY.resolve_lazy()
    entries = [*reversed(REGISTRY.user), *REGISTRY.builtin]
    return [(t, a.kind) for t, a in entries]


def register_lazy(module: str, attr: str, factory: Callable[[], Adapter]) -> None:
    """Register ``factory()`` as the built-in adapter of ``module.attr`` once that module has
    been imported by someone (the class is looked up by name: nothing is imported here).
    For adapter modules of third-party libraries, called when the adapter module loads."""
    entry = (module, attr, factory)
    _LAZY_BUILTINS.append(entry)
    REGISTRY.pending.append(entry)
    REGISTRY.modules_seen = -1


@contextmanager
def registry_snapshot() -> Iterator[None]:
    """Restore the registry's user registrations on exit (used by the test fixture)."""
    saved = list(REGISTRY.user)
    try:
        yield
    finally:
        REGISTRY.user[:] = saved
        REGISTRY.changed()


def nested_types() -> tuple[type, ...]:
    """The registered container types that are split by their own adapter wherever they
    appear inside another container (those whose adapter is not JAX's own flattening)."""
    return REGISTRY.nested()


def nested_leaf(root: Any = None) -> Callable[[Any], bool] | None:
    """An ``is_leaf`` for ``jax.tree_util`` that is true for instances of the nested
    container types (``nested_types``) other than ``root``, or None when there are none.

    The answer is memoised per type: flattening calls it once per node (a 10,000-leaf
    tree has about 17,000), and ``isinstance`` against ABC-based framework classes runs
    Python code each time.
    """
    stop = REGISTRY.nested()
    if not stop:
        return None
    memo = REGISTRY.stops
    get = memo.get

    def is_nested(x: Any) -> bool:
        hit = get(type(x))
        if hit is None:
            hit = memo[type(x)] = isinstance(x, stop)
        return hit and x is not root

    return is_nested


def flatten_pytree(obj: Any) -> tuple[list[Any], Any]:
    """``jax.tree_util.tree_flatten(obj)``, stopping at every nested container type
    (``nested_types``) below the root: such a container is one leaf here, for its own
    adapter to split."""
    return jax.tree_util.tree_flatten(obj, is_leaf=nested_leaf(obj))


def unflatten_pytree(aux: Any, leaves: Sequence[Any]) -> Any:
    """The inverse of ``flatten_pytree``."""
    return jax.tree_util.tree_unflatten(aux, leaves)
