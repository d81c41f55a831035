"""What ``shard_jit`` does on a cache miss: plan, trace once, and build the ``jax.jit``."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding

from .._adapters import NnxModuleAdapter, PytreeAdapter
from .._errors import AdapterError, Problem, SpecError
from .._expand import LeafPlan, expand_args
from .._plan import Plan
from .._specs import format_spec
from .outputs import OutDesc, leaf_shardings, split_output

if TYPE_CHECKING:
    from .wrapper import ShardJit

__all__ = ["NOSPEC", "Entry", "Stale", "Slot", "build_entry", "canonical_dtype", "fmt_sharding"]


class Stale(Exception):
    """Raised while tracing when ``jax.jit`` retraces for shapes the plan was not made for."""


class _NoSpec:
    def __repr__(self) -> str:
        return "<no spec>"


NOSPEC: Any = _NoSpec()


@dataclasses.dataclass(frozen=True, eq=False)
class Slot:
    """One argument of a call: where it comes from and how it is treated.

    Slots are made once per call layout and compared by identity (cheap cache keys).

    Attributes:
        name: parameter name (``args[2]`` for extra positional arguments).
        pos: positional index, or ``None`` for a keyword argument.
        kw: keyword name, or ``None`` for a positional argument.
        static: passed as a compile-time constant.
        spec: the spec-like from ``in_specs`` (``NOSPEC`` when none was given).
        donate: its array leaves are donated.
    """

    name: str
    pos: int | None
    kw: str | None
    static: bool
    spec: Any
    donate: bool


def fmt_sharding(s: Any) -> str:
    """How mismatch errors name a sharding."""
    if isinstance(s, NamedSharding):
        mesh = ", ".join(f"{k}={v}" for k, v in dict(s.mesh.shape).items())
        return f"{format_spec(s.spec)} on mesh ({mesh})"
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        (d,) = s.device_set
        return f"on device {d.id} ({d.platform}, SingleDeviceSharding)"
    return repr(s)


@dataclasses.dataclass
class Entry:
    """One compiled signature.

    Attributes:
        jitted: the ``jax.jit`` over the flat array leaves.
        in_shardings: the planned sharding of every flat input leaf.
        leaf_plans: ``(argument name, LeafPlan)`` of every flat input leaf.
        plan: the :class:`Plan` of every argument that has a spec.
        desc: the output's recorded structure.
        updates: per NNX-module argument ``(index among dynamic args, changed leaves)``.
        plain: its arguments are positional plain pytrees of arrays, so calls may gather
            their leaves by a remembered layout (``route.Route``).
    """

    jitted: Any
    in_shardings: list[Any]
    leaf_plans: list[tuple[str, LeafPlan]]
    plan: Plan
    desc: OutDesc
    updates: tuple[tuple[int, tuple[int, ...]], ...]
    expect: list[tuple[tuple[int, ...], Any]]
    plain: bool = False

    def fits(self, flat: Sequence[Any]) -> bool:
        """Whether ``flat`` has the shapes and dtypes this entry was planned for."""
        return len(flat) == len(self.expect) and all(
            tuple(x.shape) == shape and canonical_dtype(x.dtype) == dtype
            for x, (shape, dtype) in zip(flat, self.expect, strict=True)
        )

    def finish(self, out: Sequence[Any], taken: Sequence[Any]) -> Any:
        """Rebuild the output and write NNX state updates into the caller's modules."""
        n = self.desc.num_arrays
        result = self.desc.build(out if not self.updates else out[:n])
        at = n
        for k, changed in self.updates:
            if not changed:
                continue
            _, value, adapter, leaves, aux, index, _ = taken[k]
            setter = getattr(adapter, "set_changed", None)
            if setter is not None:  # the fast NNX route: set the changed Variables
                setter(changed, out[at : at + len(changed)])
                at += len(changed)
                continue
            new = list(leaves)
            positions = index if index is not None else range(len(leaves))
            for m in changed:
                new[positions[m]] = out[at]
                at += 1
            adapter.update(value, aux, new)
        return result


def _plain(slots: tuple[Slot, ...], taken: list[Any]) -> bool:
    """Whether an entry's calls may take :class:`~modelshard._jit.route.Route`: every
    argument positional and dynamic, a plain pytree of arrays only (no static leaves, no
    NNX modules)."""
    if [(s.pos, s.kw, s.static) for s in slots] != [(i, None, False) for i in range(len(slots))]:
        return False  # keyword or static arguments: the full path binds them
    return all(type(t[2]) is PytreeAdapter and t[5] is None for t in taken)


def canonical_dtype(dtype: Any) -> Any:
    """The dtype JAX computes in (``float64`` is ``float32`` unless x64 is enabled)."""
    try:
        return jax.dtypes.canonicalize_dtype(dtype)
    except Exception:  # extended dtypes (PRNG keys) are canonical already
        return dtype


def _abstract(x: Any, s: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        x.shape,
        canonical_dtype(x.dtype),
        sharding=s,
        weak_type=bool(getattr(x, "weak_type", False)),
    )


def build_entry(
    sj: ShardJit,
    slots: tuple[Slot, ...],
    taken: list[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Entry:
    """Plan the arguments, trace ``sj.fn`` once for its output, and build the ``jax.jit``."""
    problems = []
    plan_args = []
    for s, v, _, _, _, _, arrays in taken:
        if s.spec is NOSPEC:
            if arrays:
                problems.append(
                    Problem(
                        s.name,
                        "",
                        f"argument {s.name!r} holds {len(arrays)} array leaves but "
                        "in_specs gives it no spec",
                        hint=f"add an entry for {s.name!r} to in_specs (P() replicates it), or "
                        "make it static",
                    )
                )
            continue
        plan_args.append((s.name, v, s.spec))
    if problems:
        raise SpecError(problems)
    argplans = expand_args(plan_args, sj.mesh)
    plan = Plan(argplans, sj.mesh)
    by_name = {a.name: i for i, a in enumerate(argplans)}
    per_arg_sh: list[list[Any]] = []
    per_arg_lp: list[list[LeafPlan]] = []
    in_sh: list[Any] = []
    leaf_plans: list[tuple[str, LeafPlan]] = []
    bounds: list[tuple[int, int]] = []
    for s, _, _, _, _, _, arrays in taken:
        if s.name in by_name and s.spec is not NOSPEC:
            i = by_name[s.name]
            sh, lps = plan.flat_shardings(i), argplans[i].leaves
        else:
            sh, lps = [], []
        if len(sh) != len(arrays):
            raise AdapterError(
                f"argument {s.name!r}: the plan has {len(sh)} array leaves but flattening gave "
                f"{len(arrays)}; the container's adapter is not deterministic."
            )
        bounds.append((len(in_sh), len(in_sh) + len(arrays)))
        per_arg_sh.append(sh)
        per_arg_lp.append(lps)
        in_sh.extend(sh)
        leaf_plans.extend((s.name, lp) for lp in lps)
    cell: dict[str, Any] = {}
    flat_fn = _flat_fn(sj, slots, taken, args, kwargs, bounds, cell)
    abstract = [
        _abstract(x, s) for x, s in zip((x for t in taken for x in t[6]), in_sh, strict=True)
    ]
    out_avals = jax.eval_shape(flat_fn, *abstract)
    desc: OutDesc = cell["desc"]
    updates = cell["frozen"] = cell["updates"]
    n = desc.num_arrays
    if sj.out_specs is None:
        out_sh = leaf_shardings(
            desc,
            out_avals[:n],
            lambda j: per_arg_sh[j],
            lambda j: [lp.shape for lp in per_arg_lp[j]],
        )
    else:
        out_sh = _explicit_out(sj, desc, out_avals[:n])
    for k, changed in updates:
        out_sh.extend(per_arg_sh[k][m] for m in changed)
    donate = tuple(
        i for (s, *_), (a, b) in zip(taken, bounds, strict=True) if s.donate for i in range(a, b)
    )
    jitted = jax.jit(
        flat_fn, in_shardings=tuple(in_sh), out_shardings=tuple(out_sh), donate_argnums=donate
    )
    expect = [(tuple(x.shape), canonical_dtype(x.dtype)) for t in taken for x in t[6]]
    plain = not updates and _plain(slots, taken)
    return Entry(jitted, in_sh, leaf_plans, plan, desc, updates, expect, plain)


def _explicit_out(sj: ShardJit, desc: OutDesc, avals: Sequence[Any]) -> list[Any]:
    """Out shardings from ``out_specs``, expanded by the one pipeline on the abstract output."""
    tree = desc.build([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    (ap,) = expand_args([("out", tree, sj.out_specs)], sj.mesh)
    mirror = ap.flat.rebuild(Plan([ap], sj.mesh).flat_shardings(0))
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


def _flat_fn(
    sj: ShardJit,
    slots: tuple[Slot, ...],
    taken: list[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    bounds: list[tuple[int, int]],
    cell: dict[str, Any],
) -> Any:
    """The function ``jax.jit`` sees: flat array leaves in, flat array leaves out."""
    fn = sj.fn
    pos_tmpl: list[Any] = [None] * len(args)
    kw_tmpl: dict[str, Any] = {}
    for s in slots:
        if s.static:
            if s.kw is None:
                pos_tmpl[s.pos] = args[s.pos]  # type: ignore[index]
            else:
                kw_tmpl[s.kw] = kwargs[s.kw]
    dyn = []
    sources: list[tuple[Any, Hashable]] = []
    for s, _, adapter, leaves, aux, index, _ in taken:
        template = None
        if index is not None:
            at = set(index)
            template = tuple(None if i in at else x for i, x in enumerate(leaves))
        dyn.append((s, adapter, aux, template, index))
        sources.append((adapter, aux))
    nnx_args = [
        k for k, (_, adapter, *_rest) in enumerate(dyn) if isinstance(adapter, NnxModuleAdapter)
    ]
    abstract_mesh = sj.mesh.abstract_mesh
    expect = [(tuple(x.shape), canonical_dtype(x.dtype)) for t in taken for x in t[6]]

    def flat_fn(*flat: Any) -> tuple[Any, ...]:
        if [(tuple(x.shape), x.dtype) for x in flat] != expect:
            raise Stale
        pos = list(pos_tmpl)
        kw = dict(kw_tmpl)
        values = []
        for (s, adapter, aux, template, index), (a, b) in zip(dyn, bounds, strict=True):
            if index is None:
                leaves = list(flat[a:b])
            else:
                leaves = list(template)  # type: ignore[arg-type]
                for i, x in zip(index, flat[a:b], strict=True):
                    leaves[i] = x
            v = adapter.unflatten(aux, leaves)
            values.append(v)
            if s.kw is None:
                pos[s.pos] = v
            else:
                kw[s.kw] = v
        with jax.sharding.use_abstract_mesh(abstract_mesh):
            out = fn(*pos, **kw)
        arrays, desc = split_output(out, sources)
        frozen = cell.get("frozen")
        updates: list[tuple[int, tuple[int, ...]]] = []
        for k in nnx_args:
            s, adapter, aux, _, index = dyn[k]
            leaves, aux2 = adapter.flatten(values[k])
            if aux2 != aux:
                raise AdapterError(
                    f"the NNX module argument {s.name!r} changed structure inside "
                    f"{getattr(fn, '__name__', 'the function')} (Variables or submodules were "
                    "added, removed or replaced); shard_jit can only write back value updates."
                )
            new = leaves if index is None else [leaves[i] for i in index]
            a, _ = bounds[k]
            if frozen is not None:
                # The first trace decides; a later trace can only differ by ops that
                # return their input unchanged (a no-op constraint).
                changed = frozen[len(updates)][1]
            else:
                changed = tuple(m for m, x in enumerate(new) if s.donate or x is not flat[a + m])
            arrays.extend(new[m] for m in changed)
            updates.append((k, changed))
        cell["desc"] = desc
        cell["updates"] = tuple(updates)
        return tuple(arrays)

    return flat_fn
