"""What ``shard_jit`` does on a cache miss: plan, trace once, and build the ``jax.jit``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import AbstractMesh, Mesh

from .._base import AdapterError, Problem, SpecError, canonical_dtype, explicit_axes
from .._containers import Adapter, WriteBack
from .._place import NOSPEC, Plan, Slot, recording_constraints
from .._specs import ArgPlan, LeafPlan, expand_args
from .outputs import OutDesc, Part, inferred_shardings, set_by_function, split_output
from .take import Taken


class Stale(Exception):
    """Raised while tracing when ``jax.jit`` retraces for shapes the plan was not made for."""


@dataclasses.dataclass
class Entry:
    """One compiled signature."""

    jitted: Any
    in_shardings: list[Any]
    leaf_plans: list[tuple[str, LeafPlan]]
    plan: Plan
    desc: OutDesc
    updates: tuple[tuple[int, tuple[int, ...]], ...]
    expect: list[tuple[tuple[int, ...], Any]]
    bounds: list[tuple[int, int]]
    positional: bool = False
    abstract: list[jax.ShapeDtypeStruct] = dataclasses.field(default_factory=list)
    compiled: Any = None
    run: Callable[..., Any] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.run = self._compile_and_run

    def _compile_and_run(self, *flat: Any) -> Any:
        """The first call: the executable lowered from the entry's trace, compiled once."""
        if has_tracer(flat):
            return self.jitted(*flat)  # under an outer transformation: no executable
        if self.compiled is None:
            self.compiled = self.run = self.jitted.trace(*self.abstract).lower().compile()
        compiled = self.compiled
        out = compiled(*flat)
        # later calls go straight to the C++ dispatcher ``Compiled.__call__`` builds on its
        # first call (a Python frame and an argument copy fewer), where this JAX has one
        direct = getattr(compiled, "_call", None)
        if callable(direct):
            self.run = direct
        return out

    def fits(self, flat: Sequence[Any]) -> bool:
        """Whether ``flat`` has the shapes and dtypes this entry was planned for."""
        return shapes(flat) == self.expect

    def finish(
        self,
        out: Sequence[Any],
        taken: Sequence[Taken] = (),
        gathered: Sequence[WriteBack | None] = (),
    ) -> Any:
        """Rebuild the output and write state updates into the caller's mutable containers
        (``gathered``: each argument's write-back, for a call ``Route`` gathered)."""
        result = self.desc.build(out)
        at = self.desc.num_arrays
        for k, changed in self.updates:
            if not changed:
                continue
            if taken:
                write_back, index = taken[k].write_back, taken[k].array_index
            else:
                write_back, index = gathered[k], None
            assert write_back is not None  # updates exist only for mutable containers
            positions = changed if index is None else [index[m] for m in changed]
            write_back(positions, out[at : at + len(changed)])
            at += len(changed)
        return result


def shapes(flat: Sequence[Any]) -> list[tuple[tuple[int, ...], Any]]:
    """Each array's shape and the dtype JAX computes it in."""
    return [(tuple(x.shape), canonical_dtype(x.dtype)) for x in flat]


def has_tracer(flat: Sequence[Any]) -> bool:
    """Whether any input is a tracer (the call is inside an outer transformation)."""
    return any(isinstance(x, Tracer) for x in flat)


@dataclasses.dataclass(frozen=True)
class Call:
    """What a cache miss builds from: the function, its mesh and specs, one call's arguments."""

    fn: Callable[..., Any]
    mesh: Mesh | AbstractMesh
    out_specs: Any
    slots: tuple[Slot, ...]
    taken: Sequence[Taken]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


def build_entry(call: Call) -> Entry:
    """Plan the arguments, trace ``call.fn`` once for its output, and build the ``jax.jit``."""
    taken, mesh = call.taken, call.mesh
    problems = []
    plan_args = []
    for t in taken:
        s = t.slot
        if s.spec is not NOSPEC:
            plan_args.append((s.name, t.value, s.spec))
        elif t.arrays:
            what = f"argument {s.name!r} holds {len(t.arrays)} array leaves but in_specs gives it no spec"
            hint = f"add an entry for {s.name!r} to in_specs (P() replicates it), or make it static"
            problems.append(Problem(s.name, "", what, hint=hint))
    if problems:
        raise SpecError(problems)
    # the entry outlives the call: its plan keeps each argument's structure, not its values
    argplans = [_structure(a) for a in expand_args(plan_args, mesh)]
    plan = Plan(argplans, mesh)
    by_name = {a.name: i for i, a in enumerate(argplans)}
    per_arg_sh: list[list[Any]] = []
    in_sh: list[Any] = []
    leaf_plans: list[tuple[str, LeafPlan]] = []
    bounds: list[tuple[int, int]] = []
    for t in taken:
        s = t.slot
        i = by_name.get(s.name)  # None: no spec, no arrays
        sh, lps = ([], []) if i is None else (plan.flat_shardings(i), argplans[i].leaves)
        if len(sh) != len(t.arrays):
            raise AdapterError(
                f"argument {s.name!r}: the plan has {len(sh)} array leaves but flattening gave "
                f"{len(t.arrays)}; the container's adapter is not deterministic."
            )
        bounds.append((len(in_sh), len(in_sh) + len(t.arrays)))
        per_arg_sh.append(sh)
        in_sh.extend(sh)
        leaf_plans.extend((s.name, lp) for lp in lps)
    flat_in = [x for t in taken for x in t.arrays]
    expect = shapes(flat_in)
    traced = _FlatFunction(call, bounds, expect)
    abstract = [
        jax.ShapeDtypeStruct(x.shape, dtype, sharding=s, weak_type=getattr(x, "weak_type", False))
        for x, (_, dtype), s in zip(flat_in, expect, in_sh, strict=True)
    ]
    donate = tuple(
        i for t, (a, b) in zip(taken, bounds, strict=True) if t.slot.donate for i in range(a, b)
    )
    # The one trace: its jaxpr shows the outputs the function constrained, jax.jit's trace
    # cache serves it to the jax.jit below, and its constraints go to plan.activations.
    with recording_constraints() as activations:
        closed = (
            jax.jit(traced, in_shardings=tuple(in_sh), donate_argnums=donate).trace(*abstract).jaxpr
        )
    plan.activations = activations
    desc, updates = traced.desc, traced.updates
    assert desc is not None  # set by the trace
    traced.frozen = updates
    n = desc.num_arrays
    out_avals = closed.out_avals
    if call.out_specs is None:
        out_sh = inferred_shardings(
            desc,
            out_avals[:n],
            set_by_function(closed)[:n],
            lambda j: (per_arg_sh[j], abstract[bounds[j][0] : bounds[j][1]]),
            explicit_axes(mesh),
        )
    else:
        out_sh = _explicit_out(call, desc, out_avals[:n])
    for k, changed in updates:
        out_sh.extend(per_arg_sh[k][m] for m in changed)
    jitted = jax.jit(
        traced, in_shardings=tuple(in_sh), out_shardings=tuple(out_sh), donate_argnums=donate
    )
    # every argument positional and dynamic (else the full path binds them)
    positional = all((s.pos, s.kw, s.static) == (i, None, False) for i, s in enumerate(call.slots))
    return Entry(
        jitted, in_sh, leaf_plans, plan, desc, updates, expect, bounds, positional, abstract
    )


def _structure(arg: ArgPlan) -> ArgPlan:
    """``arg`` with ``ShapeDtypeStruct`` leaves: a cached plan must not keep the call's arrays."""
    flat = arg.flat
    infos = flat.infos  # paths and metadata, read from the real container
    at = set(flat.array_index)
    leaves = [
        jax.ShapeDtypeStruct(x.shape, x.dtype) if i in at else x for i, x in enumerate(flat.leaves)
    ]
    obj = flat.adapter.unflatten(flat.aux, leaves)
    abstract = dataclasses.replace(flat, obj=obj, leaves=leaves, _infos=infos)
    return dataclasses.replace(arg, flat=abstract)


def _explicit_out(call: Call, desc: OutDesc, avals: Sequence[Any]) -> list[Any]:
    """Out shardings from ``out_specs``, expanded by the one pipeline on the abstract output."""
    tree = desc.build([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    (ap,) = expand_args([("out", tree, call.out_specs)], call.mesh)
    mirror = ap.flat.rebuild(Plan([ap], call.mesh).flat_shardings(0))
    subs = [mirror] if desc.outer is None else desc.outer.flatten_up_to(mirror)
    out: list[Any] = []
    for part, sub in zip(desc.parts, subs, strict=True):
        if part.adapter is None:
            out.extend([sub] if part.array_index else [])
        else:
            leaves, _ = part.adapter.flatten(sub)
            out.extend(leaves[i] for i in part.array_index)
    if len(out) != desc.num_arrays:  # pragma: no cover - adapters disagree with themselves
        raise AdapterError(
            f"out_specs gave {len(out)} shardings for {desc.num_arrays} output array leaves"
        )
    return out


class _FlatFunction:
    """The function ``jax.jit`` sees: flat array leaves in, flat array leaves out."""

    def __init__(
        self, call: Call, bounds: list[tuple[int, int]], expect: list[tuple[tuple[int, ...], Any]]
    ):
        self.fn = call.fn
        self.__name__ = getattr(call.fn, "__name__", "shard_jit_function")
        self._bounds = bounds
        self._expect = expect
        self.abstract_mesh = (
            call.mesh if isinstance(call.mesh, AbstractMesh) else call.mesh.abstract_mesh
        )
        # the static arguments, in place; each dynamic one is filled per call
        static = {s.pos for s in call.slots if s.static and s.kw is None}
        self._pos = [call.args[i] if i in static else None for i in range(len(call.args))]
        self._kw = {s.kw: call.kwargs[s.kw] for s in call.slots if s.static and s.kw is not None}
        # each argument's structure, not the Taken, whose arrays the jax.jit would keep alive
        self._dyn: list[tuple[Slot, Adapter, Part]] = []
        for t in call.taken:
            index = tuple(range(len(t.leaves))) if t.array_index is None else t.array_index
            at = set(index)
            template = tuple(None if i in at else x for i, x in enumerate(t.leaves))
            self._dyn.append((t.slot, t.adapter, Part(t.adapter, t.aux, template, index, None)))
        self._sources: list[tuple[Any, Hashable]] = [(t.adapter, t.aux) for t in call.taken]
        self._mutable = [k for k, t in enumerate(call.taken) if t.adapter.mutable]
        self.desc: OutDesc | None = None
        self.updates: tuple[tuple[int, tuple[int, ...]], ...] = ()
        self.frozen: tuple[tuple[int, tuple[int, ...]], ...] | None = None

    def __call__(self, *flat: Any) -> tuple[Any, ...]:
        if shapes(flat) != self._expect:
            raise Stale
        pos = list(self._pos)
        kw = dict(self._kw)
        values = []
        for (slot, _, part), (a, b) in zip(self._dyn, self._bounds, strict=True):
            v = part.build(list(flat[a:b]))
            values.append(v)
            if slot.kw is None:
                pos[slot.pos] = v  # type: ignore[index]
            else:
                kw[slot.kw] = v
        with jax.sharding.use_abstract_mesh(self.abstract_mesh):
            out = self.fn(*pos, **kw)
        arrays, desc = split_output(out, self._sources)
        updates: list[tuple[int, tuple[int, ...]]] = []
        for k in self._mutable:
            slot, adapter, part = self._dyn[k]
            leaves, aux = adapter.flatten(values[k])
            if aux != part.aux:
                raise AdapterError(
                    f"the {adapter.kind} argument {slot.name!r} changed structure inside "
                    f"{self.__name__} (Variables or submodules were added, removed or "
                    "replaced); shard_jit can only write back value updates."
                )
            new = [leaves[i] for i in part.array_index]
            a, _ = self._bounds[k]
            if self.frozen is not None:
                # The first trace decides; a later trace can only differ by ops that
                # return their input unchanged (a no-op constraint).
                changed = self.frozen[len(updates)][1]
            else:
                changed = tuple(m for m, x in enumerate(new) if slot.donate or x is not flat[a + m])
            arrays.extend(new[m] for m in changed)
            updates.append((k, changed))
        self.desc = desc
        self.updates = tuple(updates)
        return tuple(arrays)
