"""``shard_jit``: ``jax.jit`` over containers, with one spec-like per argument."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .._base import (
    AdapterError,
    Problem,
    ShardingMismatchError,
    caller_stacklevel,
    current_mesh,
    dtype_name,
    format_bytes,
    format_mesh,
    format_spec,
    mesh_sizes,
)
from .._containers import split
from .._place import ArgumentLayout, Slot, invalid, place
from .._specs import active_logical, check_mesh_axes
from .build import Call, Entry, Stale, build_entry, has_tracer, shapes
from .route import Route, routable
from .take import Taken, static_part, take, take_plainly

_MAX_BY_STRUCTURE = 512
_MAX_ROUTE_MISSES = 16

_Bound = tuple[tuple[Any, ...], dict[str, Any], tuple[Slot, ...], list[Taken], Hashable]
"""A call as ``_take`` binds it: args, kwargs, slots, dynamic arguments, structure key."""


class ShardJit:
    """A function compiled per abstract signature, with container arguments placed by plan.

    Built by [`shard_jit`][modelshard.shard_jit]; call it like the wrapped function.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        mesh: Mesh | AbstractMesh | None = None,
        in_specs: Sequence[Any] | Mapping[str, Any],
        out_specs: Any = None,
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        on_mismatch: Literal["move", "raise"] = "move",
    ):
        self._layout = ArgumentLayout(
            fn,
            in_specs,
            who="shard_jit",
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
        )
        if mesh is not None:
            mesh_sizes(mesh)  # a typed MeshError for anything that is not a mesh
        if on_mismatch not in ("move", "raise"):
            raise invalid(
                "shard_jit", "on_mismatch", f"on_mismatch={on_mismatch!r} is not 'move' or 'raise'"
            )
        self.fn = fn
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.on_mismatch = on_mismatch
        # Compiled entries by full abstract signature (shapes and dtypes included), and the
        # same entries by structure and static values only (what each call looks up).
        self._by_signature: dict[Hashable, Entry] = {}
        self._by_structure: dict[Hashable, Entry] = {}
        self._route: Route | None = None  # the layout of the last routable call
        self._route_misses = 0
        self._moved: dict[int, int] = {}  # entry id -> calls that moved its inputs
        self._route_env: tuple[Any, Any] | None = None  # the _env() the route was built in
        functools.update_wrapper(self, fn)

    def _take(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Bound:
        """Bind and flatten a call: its slots, dynamic arguments and structure key."""
        if kwargs or len(args) != self._layout.plain_arity:
            args, kwargs = self._layout.bind(args, kwargs)
        slots = self._layout.slots(len(args), tuple(kwargs))
        statics, taken, keys = [], [], []
        for s in slots:
            v = kwargs[s.kw] if s.pos is None else args[s.pos]  # type: ignore[index]
            if s.static:
                statics.append(v)
                continue
            t, key = take(s, v)
            taken.append(t)
            keys.append(key)
        return args, kwargs, slots, taken, (slots, tuple(statics), tuple(keys), self._env())

    def _env(self) -> tuple[Any, Any]:
        """What a plan depends on besides the arguments: the mesh and the logical rules."""
        mesh = self.mesh if self.mesh is not None else current_mesh(concrete=True)
        return mesh, active_logical()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        route = self._route
        if route is not None and not kwargs and self._env() == self._route_env:
            got = route.gather(args)
            if got is not None:
                entry = route.entry
                try:
                    out = entry.run(*got[0])
                except (TypeError, ValueError):
                    pass  # new shapes or misplaced inputs: the full path decides
                else:
                    return entry.finish(out, gathered=got[1])
            # A ShardJit whose calls keep changing layout stops trying this route.
            self._route = None
            self._route_misses += 1
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = self._take(args, kwargs)
        args, _, _, taken, key = bound
        try:
            entry = self._by_structure.get(key)
        except TypeError:
            entry = None
        flat = taken[0].arrays if len(taken) == 1 else [x for t in taken for x in t.arrays]
        if entry is None:
            entry = self._miss(bound)
            flat = _place(entry, taken, flat, False)
        try:
            out = entry.run(*flat)
        except (TypeError, Stale, ValueError) as e:
            if entry.fits(flat):
                out = self._rescue(entry, flat, taken, e)
            else:
                # Same structure, new shapes or dtypes (or shardings jit refused for them):
                # plan afresh; the executable checks shapes on its fast path, so this costs
                # nothing until they change.
                entry = self._miss(bound, stale=True)
                flat = _place(entry, taken, flat, False)
                try:
                    out = entry.run(*flat)
                except (TypeError, ValueError) as err:
                    out = self._rescue(entry, flat, taken, err)
        if self._route_misses < _MAX_ROUTE_MISSES and routable(entry, taken):
            self._route = Route(entry, args, taken)
            self._route_env = key[-1]  # type: ignore[index]  # _take's key: env last
        return entry.finish(out, taken)

    def _rescue(
        self, entry: Entry, flat: Sequence[Any], taken: list[Taken], error: Exception
    ) -> Any:
        """After ``entry.run`` refused ``flat``: tracers through its ``jax.jit``, inputs placed
        otherwise moved (``_recover``); else ``error`` is raised."""
        if isinstance(error, ValueError):
            out = self._recover(entry, flat, taken)
        else:
            out = entry.jitted(*flat) if has_tracer(flat) else None  # an outer transformation
        if out is None:
            raise error
        return out

    def _miss(self, bound: _Bound, stale: bool = False) -> Entry:
        """Find or build the entry for a signature the structure table has not seen."""
        args, kwargs, slots, taken, structure_key = bound
        # Arguments are flattened again by their adapter's own flatten here (not a per-call
        # route), so planning and tracing see exactly what the adapter makes of them.
        taken = [take_plainly(t) for t in taken]
        statics = tuple(args[s.pos] if s.kw is None else kwargs[s.kw] for s in slots if s.static)  # type: ignore[index]
        self._check_hashable(slots, statics, taken)
        env = self._env()
        check_mesh_axes(env[1], env[0])  # before Flax meets a misspelt axis while tracing
        parts = [(t.adapter, t.aux, static_part(t.leaves, t.array_index), t.arrays) for t in taken]
        signature = (env, slots, statics, tuple((*p[:3], tuple(shapes(p[3]))) for p in parts))
        entry = self._by_signature.get(signature)
        if entry is None:
            call = Call(self.fn, env[0], self.out_specs, slots, taken, args, kwargs)
            entry = self._by_signature[signature] = build_entry(call)
        if len(self._by_structure) >= _MAX_BY_STRUCTURE and not stale:
            self._by_structure.clear()
        self._by_structure[structure_key] = entry
        return entry

    def _check_hashable(
        self, slots: tuple[Slot, ...], statics: tuple[Any, ...], taken: list[Taken]
    ) -> None:
        for s, v in zip([s for s in slots if s.static], statics, strict=True):
            try:
                hash(v)
            except TypeError:
                raise invalid(
                    "shard_jit",
                    s.name,
                    f"static argument {s.name!r} is a {type(v).__name__}, which is not hashable",
                    hint="static arguments are part of the compilation cache key; "
                    "pass a hashable value (tuple, not list)",
                ) from None
        for t in taken:
            for i, leaf in static_part(t.leaves, t.array_index) or ():
                try:
                    hash(leaf)
                except TypeError:
                    path = split(t.value).adapter.describe(t.value)[i].path
                    raise AdapterError(
                        f"{t.slot.name}:{path} is a {type(leaf).__name__}, which is neither an "
                        "array nor hashable; shard_jit carries non-array leaves statically (they "
                        "are part of the compilation cache key). Make it an array or a hashable "
                        "value, or mark the field static in its container."
                    ) from None

    def _recover(self, entry: Entry, flat: Sequence[Any], taken: list[Taken]) -> Any:
        """After jit refused the inputs: move those committed elsewhere, or raise."""
        bad = [
            i
            for i, (x, s) in enumerate(zip(flat, entry.in_shardings, strict=True))
            if isinstance(x, jax.Array)
            and x.committed
            and not x.sharding.is_equivalent_to(s, x.ndim)
        ]
        if not bad:
            if jax.process_count() > 1 and not all(isinstance(x, jax.Array) for x in flat):
                # Multi-process jit refuses host values for shardings spanning other
                # processes; place them as shard does (each process holds the full value).
                return _execute(entry, place(flat, entry.in_shardings))
            return None
        if self.on_mismatch == "raise":
            raise self._mismatch(entry, flat, bad)
        self._warn_moves(entry, flat, bad)
        return _execute(entry, _place(entry, taken, flat, True))

    def _warn_moves(self, entry: Entry, flat: Sequence[Any], bad: list[int]) -> None:
        """Warn once per entry when a second call moves the same inputs again."""
        n = self._moved[id(entry)] = self._moved.get(id(entry), 0) + 1
        if n != 2:
            return
        nbytes = sum(int(flat[i].nbytes) for i in bad)
        names = ", ".join(
            f"{entry.leaf_plans[i][0]}:{entry.leaf_plans[i][1].path or '<root>'}" for i in bad[:5]
        )
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        warnings.warn(
            f"{getattr(self, '__name__', 'shard_jit')}: moved {names}{more} ({format_bytes(nbytes)}) to the planned "
            "sharding again on this call; every call copies them. Place them once with "
            "modelshard.shard(...) (or feed back the step's outputs), or pass "
            "on_mismatch='raise' to be told instead.",
            stacklevel=caller_stacklevel(),
        )

    def _mismatch(self, entry: Entry, flat: Sequence[Any], bad: list[int]) -> ShardingMismatchError:
        hint = "place inputs first with modelshard.shard(...), or pass on_mismatch='move' to let "
        hint += "shard_jit move them"
        problems = []
        for i in bad:
            (arg, leaf), x = entry.leaf_plans[i], flat[i]
            what = f"is {_format_sharding(x.sharding)}, but the plan places it "
            what += _format_sharding(entry.in_shardings[i])
            shape, dtype = tuple(x.shape), dtype_name(x.dtype)
            problems.append(
                Problem(arg, leaf.path, what, shape, dtype, leaf.spec, leaf.rule, hint=hint)
            )
        n = len(problems)
        header = f"{n} input {'leaves are' if n != 1 else 'leaf is'} not in the planned sharding "
        return ShardingMismatchError(problems, header=header + "(on_mismatch='raise'):")

    def _entry_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Entry, list[Any]]:
        bound = self._take(args, kwargs)
        entry = self._miss(bound)
        flat = [x for t in bound[3] for x in t.arrays]  # bound[3]: the dynamic arguments
        return entry, place(flat, entry.in_shardings)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.stages.Lowered`` for these arguments (``ShapeDtypeStruct`` leaves work too).

        ``.lower(...).compile().input_shardings[0]`` lists the flat array leaves' shardings.
        """
        entry, flat = self._entry_for(args, kwargs)
        return entry.jitted.lower(*flat)

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        """The [`Plan`][modelshard.Plan] of the dynamic arguments for these arguments."""
        return self._entry_for(args, kwargs)[0].plan

    def clear_cache(self) -> None:
        """Forget every compiled signature."""
        self._by_signature.clear()
        self._by_structure.clear()
        self._route = None

    @property
    def cache_size(self) -> int:
        """How many signatures have been compiled: one XLA compilation each.

        A signature is the arguments' structure, shapes, dtypes and static values, the mesh
        and the active logical rules, not how the arrays are placed. Signatures only planned
        or lowered are not counted; ``clear_cache`` resets the count. The cache keeps no
        arrays or modules of the calls that made it.
        """
        return sum(1 for e in self._by_signature.values() if e.compiled is not None)


def _execute(entry: Entry, flat: Sequence[Any]) -> Any:
    """Run ``entry`` on ``flat``; tracers go through its ``jax.jit`` (no executable)."""
    try:
        return entry.run(*flat)
    except TypeError:
        if not has_tracer(flat):
            raise
        return entry.jitted(*flat)


def _place(
    entry: Entry, taken: Sequence[Taken], flat: Sequence[Any], move_committed: bool
) -> list[Any]:
    """``flat`` placed as planned before an entry's first call (or after ``jax.jit`` refused it);
    mutable containers (NNX modules) get their placed arrays written back, so later calls find
    them in place."""
    todo = [
        i
        for i, x in enumerate(flat)
        if move_committed or not (isinstance(x, jax.Array) and x.committed)
    ]
    out = list(flat)
    placed = place([flat[i] for i in todo], [entry.in_shardings[i] for i in todo])
    for i, y in zip(todo, placed, strict=True):
        out[i] = y
    for t, (a, b) in zip(taken, entry.bounds, strict=True):
        if t.write_back is None:
            continue
        moved = [m for m in range(b - a) if out[a + m] is not flat[a + m]]
        if moved:
            ix = t.array_index
            t.write_back([m if ix is None else ix[m] for m in moved], [out[a + m] for m in moved])
    return out


def _format_sharding(s: Any) -> str:
    """How mismatch errors name a sharding."""
    if isinstance(s, NamedSharding):
        return f"{format_spec(s.spec)} on mesh ({format_mesh(dict(s.mesh.shape))})"
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        (d,) = s.device_set
        return f"on device {d.id} ({d.platform}, SingleDeviceSharding)"
    return repr(s)


def shard_jit(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    in_specs: Sequence[Any] | Mapping[str, Any],
    out_specs: Any = None,
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    on_mismatch: Literal["move", "raise"] = "move",
) -> Any:
    """Compile ``fn`` for ``mesh`` with one spec-like per argument; usable as a decorator.

    Arguments may be containers of every registered kind; each argument's spec-like is
    expanded onto every array leaf inside it, and non-array leaves are static (part of the
    cache key). NNX modules behave as with ``nnx.jit``: state updated inside the function is
    written back into the caller's module.

    Inputs are placed before the call whatever they are (NumPy, uncommitted, or sharded
    another way); with ``on_mismatch="raise"`` a committed array placed otherwise raises
    [`ShardingMismatchError`][modelshard.ShardingMismatchError] instead.

    Each signature (structure, shapes, dtypes, static values, mesh, logical rules, NNX
    ``Variable`` metadata) is compiled once, whatever its inputs' placement
    ([`cache_size`][modelshard.ShardJit.cache_size] counts them).

    Args:
        fn: the function.
        mesh: the ``jax.sharding.Mesh`` to compile for; default: the mesh set by
            ``jax.set_mesh`` at the call (each mesh is planned and compiled once).
        in_specs: a tuple with one spec-like per positional argument (``None`` for one
            holding no arrays), or a dict from parameter name to spec-like.
        out_specs: ``None`` (default): shardings the function set itself are kept, an input's
            state coming back keeps that input's shardings, and the compiler decides the
            rest; otherwise one spec-like (or prefix tree of them) for the output.
        donate_argnums: positional arguments whose array leaves are donated.
        donate_argnames: the same, by parameter name.
        static_argnums: positional arguments passed as compile-time constants (hashable).
        static_argnames: the same, by parameter name.
        on_mismatch: ``"move"`` (default) or ``"raise"``.

    Returns:
        A [`ShardJit`][modelshard.ShardJit] (or a decorator making one when ``fn`` is omitted), with
        ``.lower(*args)`` and ``.plan(*args)``.

    Raises:
        SpecError: at the first call with a new signature, listing every leaf of every
            argument that cannot be placed.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 8})
        >>> @ms.shard_jit(mesh=mesh, in_specs=(ms.fsdp("data", min_size=0), P("data")))
        ... def step(params, x):
        ...     return {"w": params["w"] + x.sum()}
        >>> out = step({"w": jnp.zeros((16, 4))}, jnp.ones((8, 2)))
        >>> out["w"].sharding.spec
        P('data',)
    """
    make = functools.partial(
        ShardJit,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        on_mismatch=on_mismatch,
    )
    return make if fn is None else make(fn)
