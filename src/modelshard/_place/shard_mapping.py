"""``shard_map``: ``jax.shard_map`` over containers, with one spec-like per argument."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from .._base import SpecError, current_mesh, format_mesh, mesh_sizes
from .._containers import Flat, split
from .._specs import FSDP, ArgPlan, SpecLike, active_logical, expand_args, is_leaf_spec
from .arguments import NOSPEC, ArgumentLayout, invalid
from .constraints import constrain_leaves
from .placement import local_specs

_MAX_ENTRIES = 64


@dataclasses.dataclass
class _Entry:
    """One compiled signature: the mapped function and the output's structure."""

    run: Callable[..., Any]
    out: list[Flat]  # filled by the trace: the output split, to rebuild it


class ShardMap:
    """``fn`` mapped over the shards of container arguments. Built by [`shard_map`][modelshard.shard_map]."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        in_specs: Sequence[SpecLike] | Mapping[str, SpecLike],
        out_specs: SpecLike,
        mesh: Any = None,
        axis_names: frozenset[str] | set[str] = frozenset(),
        check_vma: bool = True,
    ):
        self._layout = ArgumentLayout(fn, in_specs, who="shard_map")
        if mesh is not None:
            mesh_sizes(mesh)  # a typed MeshError for anything that is not a mesh
        self.fn = fn
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.mesh = mesh
        self.axis_names = frozenset(axis_names)
        self.check_vma = check_vma
        self._entries: dict[Hashable, _Entry] = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mesh = self.mesh if self.mesh is not None else current_mesh(concrete=True)
        args, kwargs = self._layout.bind(args, kwargs)
        # (name, value, spec-like or None) of every argument
        bound = [
            (
                s.name,
                args[s.pos] if s.kw is None else kwargs[s.kw],  # type: ignore[index]
                None if s.spec is NOSPEC else s.spec,
            )
            for s in self._layout.slots(len(args), tuple(kwargs))
        ]
        mapped = [(n, v, s) for n, v, s in bound if s is not None]
        plans = expand_args(mapped, mesh)  # every input problem, before any trace
        arrays = [x for a in plans for x in a.flat.arrays]
        key = _signature(mesh, bound, plans, active_logical())
        entry = self._entries.get(key) if key is not None else None
        if entry is None:
            entry = self._build(mesh, args, kwargs, bound, plans, arrays)
            if key is not None:
                if len(self._entries) >= _MAX_ENTRIES:
                    self._entries.pop(next(iter(self._entries)))
                self._entries[key] = entry
        return entry.out[0].rebuild(entry.run(*arrays))

    def _build(
        self,
        mesh: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        bound: list[tuple[str, Any, Any]],
        plans: list[ArgPlan],
        arrays: list[Any],
    ) -> _Entry:
        in_specs = tuple(leaf.spec for a in plans for leaf in a.leaves)
        fn, npos = self.fn, len(args)
        out: list[Flat] = []  # filled by the trace

        def body(*local: Any) -> list[Any]:
            """The per-shard function over flat leaves: rebuild the containers, call, split."""
            values = [v for _, v, _ in bound]
            start = 0
            it = iter(plans)
            for i, (_, _, spec) in enumerate(bound):
                if spec is None:
                    continue
                flat = next(it).flat
                n = len(flat.array_index)
                values[i] = flat.rebuild(local[start : start + n])
                start += n
            result = split(fn(*values[:npos], **dict(zip(kwargs, values[npos:], strict=True))))
            out[:] = [result]
            return list(result.arrays)

        over = functools.partial(
            jax.shard_map, body, mesh=mesh, in_specs=in_specs, axis_names=self.axis_names
        )
        # Shape-only trace: the output's structure and local shapes (replicated out specs
        # make global = local; check_vma off, as those specs are not the real ones).
        shapes = jax.eval_shape(
            lambda *xs: over(out_specs=PartitionSpec(), check_vma=False)(
                *constrain_leaves(xs, in_specs, mesh)
            ),
            *arrays,
        )
        out_specs = _out_specs(out[0], shapes, self.out_specs, mesh)
        mapped = over(out_specs=out_specs, check_vma=self.check_vma)

        def run(*xs: Any) -> Any:
            # Inputs take their planned sharding first: JAX refuses an input on Explicit
            # axes whose sharding differs from its in_spec.
            return mapped(*constrain_leaves(xs, in_specs, mesh))

        return _Entry(jax.jit(run), out)


def _out_specs(flat: Flat, shapes: Sequence[Any], specs: SpecLike, mesh: Any) -> list[Any]:
    """One ``PartitionSpec`` per output leaf: ``specs`` expanded over the output's structure."""
    given = jax.tree_util.tree_leaves(specs, is_leaf=is_leaf_spec)
    if any(isinstance(s, FSDP) for s in given):
        raise invalid(
            "shard_map",
            "out_specs",
            "fsdp(...) chooses a dimension from a leaf's global shape, which an output of "
            "shard_map does not have until its shards are concatenated",
            hint="give out_specs as PartitionSpecs or Rules; to place an output as an input "
            "was placed, pass the input plan's specs: plan = ms.plan(x, spec, mesh); "
            "out_specs=lambda path, leaf: plan[path].spec",
        )
    local = flat.rebuild([jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes])
    try:
        return local_specs("out", local, specs, mesh)
    except SpecError as e:
        problems = [
            dataclasses.replace(p, mesh=None if p.mesh is None else format_mesh(mesh_sizes(mesh)))
            for p in e.problems
        ]
        raise SpecError(problems, header="invalid shard_map out_specs:") from None


def _signature(
    mesh: Any, bound: list[tuple[str, Any, Any]], plans: list[ArgPlan], logical: Any
) -> Hashable | None:
    """What a compiled entry depends on, or None where any of it is unhashable."""
    parts: list[Any] = [mesh, logical]  # the object (not its id): the key keeps it alive
    it = iter(plans)
    for name, value, spec in bound:
        if spec is None:
            parts.append((name, "static", value))
            continue
        flat = next(it).flat
        index = set(flat.array_index)
        statics = tuple(leaf for i, leaf in enumerate(flat.leaves) if i not in index)
        shapes = tuple((tuple(x.shape), str(x.dtype)) for x in flat.arrays)
        parts.append((name, id(spec), type(flat.obj), flat.aux, statics, shapes))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def shard_map(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    in_specs: Sequence[SpecLike] | Mapping[str, SpecLike],
    out_specs: SpecLike,
    mesh: Any = None,
    axis_names: frozenset[str] | set[str] = frozenset(),
    check_vma: bool = True,
) -> Any:
    """``jax.shard_map`` over containers: one spec-like per argument, expanded onto its leaves.

    Each argument's spec-like is expanded onto its leaves as by [`plan`][modelshard.plan],
    every problem listed before ``fn`` is traced. Inside ``fn`` each argument is the same
    container holding its local shards; ``out_specs`` says how each output leaf's shards
    are concatenated, as in ``jax.shard_map``.

    Args:
        fn: the per-shard function. Containers it receives are rebuilt from shards:
            mutating an NNX module inside does not change the caller's; return it.
        in_specs: a tuple (one spec-like per positional argument) or a dict (parameter
            name -> spec-like); ``None`` (or a parameter the dict leaves out) passes that
            argument through unmapped, as a constant.
        out_specs: a spec-like (or prefix tree) for the output.
        mesh: the mesh; default: the one set by ``jax.set_mesh``.
        axis_names: the mesh axes ``fn`` is manual over (default: all), as in JAX.
        check_vma: JAX's replication checks on the outputs.

    Returns:
        The mapped function (or a decorator); each new signature is compiled once.

    Raises:
        SpecError: listing every leaf that cannot take its spec (inputs before tracing,
            ``out_specs`` once the output's structure is known).
        MeshError: no ``mesh`` and no ``jax.set_mesh`` context.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 8})
        >>> @ms.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
        ... def apply(params, x):
        ...     return x @ params["w"] + params["b"]
        >>> params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
        >>> apply(params, jnp.ones((16, 4))).shape
        (16, 2)
    """

    make = functools.partial(
        ShardMap,
        in_specs=in_specs,
        out_specs=out_specs,
        mesh=mesh,
        axis_names=axis_names,
        check_vma=check_vma,
    )
    return make if fn is None else make(fn)
