"""``step_memory``: a compiled step's memory per device, from XLA, split by part."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from .._base import (
    MeshError,
    current_mesh,
    format_bytes,
    format_mesh,
    make_mesh,
    mesh_sizes,
    spec_error,
    vocabulary,
)
from .._containers import optax_kind, split
from .._jit import ShardJit, shard_jit
from .._place import parse_bytes

PART_TEXT = {
    "parameters": "parameters",
    "optimizer_state": "optimizer state",
    "gradients": "gradients (estimated)",
    "temporaries": "activations and temporaries",
    "batch": "batch",
    "other_inputs": "other inputs",
    "outputs": "outputs (not donated)",
    "layout": "layout (padding, pruned inputs)",
}
PARTS = tuple(PART_TEXT)
"""The parts of a step's memory, in the order tables and JSON list them."""

ROLES = ("parameters", "optimizer_state", "batch", "other_inputs")
"""What an input leaf is: the roles ``roles=`` may name."""

_OPT_NAMES = frozenset({"opt_state", "optimizer", "opt"})


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """The memory one device needs to run a compiled step, from XLA's analysis.

    ``parts`` add up to ``total`` exactly: inputs by role, from the plan; ``gradients``
    estimated as the parameters' bytes (XLA's temporaries do not say which buffer is which);
    ``temporaries`` the rest of XLA's; ``outputs`` those not written over donated inputs;
    ``layout`` what XLA's argument bytes differ from the plan's (padding, pruned inputs).

    Attributes:
        total: bytes per device: XLA's peak where the backend reports the program's (TPU,
            GPU), else argument + output + temporary - alias bytes (CPU).
        parts: part name -> bytes per device (``PARTS`` order).
        argument: XLA's ``argument_size_in_bytes``.
        output: ``output_size_in_bytes``.
        temp: ``temp_size_in_bytes``.
        alias: ``alias_size_in_bytes`` (outputs written in place of donated inputs).
        code: ``generated_code_size_in_bytes`` (not part of ``total``).
        peak: XLA's ``peak_memory_in_bytes`` where it is the program's peak, else None.
        compile_seconds: how long lowering and compiling took.
        platform: the platform compiled for (``tpu``, ``cpu``, ...).
        device_kind: the devices' kind (``TPU v5 lite``, ``cpu``).
        mesh: axis name -> size.
        plan: the [`Plan`][modelshard.Plan] of the step's inputs (its ``memory`` is this).
        roles: ``(displayed path, role)`` of every input leaf.
        refused: XLA's message where it refused the step for needing more memory than the
            device has (the figures are then estimated from it); None when it compiled.
    """

    total: int
    parts: dict[str, int]
    argument: int
    output: int
    temp: int
    alias: int
    code: int
    peak: int | None
    compile_seconds: float
    platform: str
    device_kind: str
    mesh: dict[str, int]
    plan: Any = dataclasses.field(repr=False, compare=False)
    roles: list[tuple[str, str]] = dataclasses.field(repr=False, compare=False)
    refused: str | None = None

    def fits(self, budget: int | float | str) -> bool:
        """Whether ``total`` is at most ``budget`` (bytes or text such as ``"16GiB"``)."""
        return self.total <= parse_bytes(budget)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: ``total``, ``parts``, XLA's figures, compile time, platform, mesh."""
        return {
            "total": self.total,
            "parts": dict(self.parts),
            "xla": {
                "argument": self.argument,
                "output": self.output,
                "temp": self.temp,
                "alias": self.alias,
                "generated_code": self.code,
                "peak": self.peak,
            },
            "compile_seconds": round(self.compile_seconds, 3),
            "platform": self.platform,
            "device_kind": self.device_kind,
            "mesh": dict(self.mesh),
            "refused": self.refused,
        }

    def part_rows(self) -> list[tuple[str, str, int]]:
        """``(part, words, bytes)`` of every nonzero part, in ``PARTS`` order."""
        return [(k, PART_TEXT[k], n) for k, n in self.parts.items() if n != 0]

    def lines(self) -> list[tuple[str, str, str]]:
        """``(part, bytes, share of total)`` rows, the nonzero parts, then the total."""
        out = []
        for name in PARTS:
            n = self.parts.get(name, 0)
            if n == 0 and name not in ("parameters", "temporaries"):
                continue
            share = f"{n / self.total:.0%}" if self.total else ""
            out.append((PART_TEXT[name], format_bytes(n), share))
        out.append(("total per device", format_bytes(self.total), ""))
        return out

    def summary(self) -> str:
        """One line: total per device, the largest parts, the mesh and compile time."""
        source = "XLA peak" if self.peak is not None else "XLA argument+output+temp-alias"
        if self.peak is None and self.refused is not None:
            source = "estimated: XLA refused it, more than the device holds"
        return (
            f"step: {format_bytes(self.total)} per device ({source}; {largest(self)}) on mesh "
            f"({format_mesh(self.mesh)}), {self.platform}, compiled in "
            f"{self.compile_seconds:.1f}s"
        )

    def __str__(self) -> str:
        width = max(len(p) for p, _, _ in self.lines())
        rows = [f"{p:<{width}}  {b:>10}  {s:>4}".rstrip() for p, b, s in self.lines()]
        return "\n".join(["step memory per device", *rows, self.summary()])


def largest(m: StepMemory) -> str:
    """A step's three largest parts in words: ``parameters 1.00 GiB, ...``."""
    big = sorted(((n, k) for k, n in m.parts.items() if n > 0), reverse=True)[:3]
    return ", ".join(f"{PART_TEXT[k]} {format_bytes(n)}" for n, k in big)


def compile_mesh(mesh: Any = None, topology: str | None = None) -> Any:
    """A mesh programs can be compiled for."""
    if mesh is None:
        mesh = current_mesh(concrete=True)
    if isinstance(mesh, jax.sharding.Mesh) and topology is None:
        return mesh
    if isinstance(mesh, Mapping):
        sizes, axis_types = {str(k): int(v) for k, v in mesh.items()}, "auto"
    else:
        sizes = mesh_sizes(mesh)
        axis_types = getattr(mesh, "axis_types", None) or "auto"
    if topology is None:
        n, have = math.prod(sizes.values()), jax.device_count()
        if n > have:
            raise MeshError(too_few_devices(sizes, have))
        return make_mesh(sizes, axis_types=axis_types)
    from jax.experimental import topologies

    platform = jax.devices()[0].platform
    try:
        desc = topologies.get_topology_desc(platform=platform, topology_name=topology)
    except Exception as e:  # JAX raises several types for an unknown name or platform
        raise MeshError(
            f"cannot compile for topology {topology!r} on {platform}: {type(e).__name__}: {e}"
        ) from None
    return make_mesh(sizes, axis_types=axis_types, devices=list(desc.devices))


# v5e slices by chip count: what the hint offers for a mesh of that many devices
_V5E = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


def too_few_devices(sizes: Mapping[str, int], have: int) -> str:
    """Why a mesh of ``sizes`` cannot compile on ``have`` devices, and the ways to get them."""
    n = math.prod(sizes.values())
    head = f"mesh ({format_mesh(sizes)}) needs {n} devices to compile for, this machine has {have}"
    slice_ = _V5E.get(n)
    if vocabulary() == "cli":
        tpu = f"pass --topology v5e:{slice_} to compile for a TPU slice" if slice_ else ""
        if jax.devices()[0].platform != "cpu":  # the command simulates CPU devices only
            return f"{head}; {tpu or 'use a smaller --mesh'}"
        tpu = f"{tpu}, or " if tpu else ""
        return (
            f"{head}: the --step or --state module fixed JAX's device count when imported "
            f"(its own jax_num_cpu_devices, or a JAX computation); {tpu}have that module "
            f"call jax.config.update('jax_num_cpu_devices', {n}) before it uses JAX"
        )
    tpu = f"pass topology='v5e:{slice_}' (TPU) to compile for a slice it does not have, or "
    return (
        f"{head}; {tpu if slice_ else ''}simulate CPU devices: "
        f"jax.config.update('jax_num_cpu_devices', {n}) before JAX starts"
    )


def _optax_arg(value: Any) -> bool:
    """Whether an argument is an optax state (or holds only optax states)."""
    tops = jax.tree_util.tree_leaves(value, is_leaf=lambda x: optax_kind(type(x)))
    return bool(tops) and all(optax_kind(type(t)) for t in tops)


def _float(dtype: Any) -> bool:
    try:
        return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def classify(
    plan: Any,
    values: Sequence[Any],
    batch_args: Sequence[int],
    roles: Mapping[str, str | re.Pattern[str]] | None = None,
) -> list[str]:
    """The role of every leaf of ``plan`` (in ``plan.leaves`` order)."""
    compiled = [(r, re.compile(p) if isinstance(p, str) else p) for r, p in (roles or {}).items()]
    out = []
    named = iter(plan.named())
    for i, a in enumerate(plan.args):
        optax_arg = _optax_arg(values[i]) if i < len(values) else False
        for leaf in a.leaves:
            path = next(named)[0]
            role = next((r for r, rx in compiled if rx.search(path)), None)
            if role is None:
                comps = set(leaf.path.split("/")) | {a.name}
                if i in batch_args:
                    role = "batch"
                elif optax_arg or comps & _OPT_NAMES:
                    role = "optimizer_state"
                elif _float(leaf.dtype):
                    role = "parameters"
                else:
                    role = "other_inputs"
            out.append(role)
    return out


def check_names(what: str, given: Any, allowed: Sequence[str], noun: str = "") -> None:
    """A SpecError naming the first of ``given`` not in ``allowed``."""
    bad = [r for r in given or () if r not in allowed]
    if bad:
        hint = f"{what}s are " + ", ".join(map(repr, allowed))
        what_ = f"{bad[0]!r} is not a {noun or what}"
        raise spec_error(f"{what}s", bad[0], what_, header=f"invalid {what}s:", hint=hint)


def measure(
    jitted: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    values: Sequence[Any],
    batch_args: Sequence[int],
    roles: Mapping[str, Any] | None = None,
) -> StepMemory:
    """Compile ``jitted`` once for abstract ``args`` and split XLA's memory analysis by role
    (``values``: the dynamic arguments; ``batch_args``: the batch's positions among them)."""
    plan = jitted.plan(*args, **kwargs)
    t = time.perf_counter()
    refused = None
    try:
        m: Any = jitted.lower(*args, **kwargs).compile().memory_analysis()
    except Exception as e:  # JaxRuntimeError; its type is not public API
        refused = refused_temporaries(e)
        if refused is None:
            raise
        # the memory analysis of a refused program: planned inputs and the named temporaries
        inputs = sum(plan.bytes_per_device(leaf) for leaf in plan.leaves)
        m = types.SimpleNamespace(
            argument_size_in_bytes=inputs,
            temp_size_in_bytes=refused[0],
            output_size_in_bytes=0,
            alias_size_in_bytes=0,
        )
    seconds = time.perf_counter() - t
    mesh = plan.mesh
    dev = mesh.devices.flat[0]
    platform = str(getattr(dev, "platform", "cpu"))
    leaf_roles = classify(plan, values, batch_args, roles)
    planned: dict[str, int] = dict.fromkeys(ROLES, 0)
    for leaf, role in zip(plan.leaves, leaf_roles, strict=True):
        planned[role] += plan.bytes_per_device(leaf)
    kinds = ("argument", "output", "temp", "alias")
    arg, out, temp, alias = (int(getattr(m, f"{k}_size_in_bytes")) for k in kinds)
    summed = arg + out + temp - alias
    raw_peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    # CPU's peak_memory_in_bytes is not the program's peak (often below its own arguments).
    peak = raw_peak if platform != "cpu" and raw_peak > 0 else None
    total = summed if peak is None else peak
    resident = arg + out - alias
    live_temp = max(0, total - resident)  # what is live beyond inputs and outputs at the peak
    gradients = min(planned["parameters"], live_temp)
    parts = {
        "parameters": planned["parameters"],
        "optimizer_state": planned["optimizer_state"],
        "gradients": gradients,
        "temporaries": total - resident - gradients,
        "batch": planned["batch"],
        "other_inputs": planned["other_inputs"],
        "outputs": out - alias,
        "layout": arg - sum(planned.values()),
    }
    result = StepMemory(
        total=total,
        parts=parts,
        argument=arg,
        output=out,
        temp=temp,
        alias=alias,
        code=int(getattr(m, "generated_code_size_in_bytes", 0) or 0),
        peak=peak,
        compile_seconds=seconds,
        platform=platform,
        device_kind=str(getattr(dev, "device_kind", platform)),
        mesh=mesh_sizes(mesh),
        plan=plan,
        roles=[(p, r) for (p, _), r in zip(plan.named(), leaf_roles, strict=True)],
        refused=None if refused is None else refused[1],
    )
    plan.memory = result
    return result


_REFUSED = re.compile(r"RESOURCE_EXHAUSTED: Ran out of memory")
_TEMPORARIES = re.compile(r"HLO temporaries \((\d+(?:\.\d+)?)([KMGT])\)")


def refused_temporaries(error: BaseException) -> tuple[int, str] | None:
    """``(temporary bytes, XLA's message)`` of a program refused for its size, else None."""
    text = str(error)
    if _REFUSED.search(text) is None:
        return None
    m = _TEMPORARIES.search(text)
    temp = 0
    if m is not None:
        temp = int(float(m.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)])
    return temp, text.strip().splitlines()[0]


@dataclasses.dataclass(frozen=True)
class Compiler:
    """A step as each measurement compiles it: function, specs, donations, abstract arguments."""

    fn: Callable[..., Any]
    in_specs: Any
    donated: tuple[int, ...]
    static: tuple[int, ...]
    args: tuple[Any, ...]
    dynamic: list[int]
    batch: list[int]
    mesh: Any
    kwargs: Mapping[str, Any]
    roles: Mapping[str, Any] | None

    def measure(
        self,
        fn: Callable[..., Any] | None = None,
        specs: Any = None,
        call: Sequence[Any] | None = None,
        donate: tuple[int, ...] | None = None,
    ) -> StepMemory:
        """The step (or ``fn`` with ``specs``, ``call`` and ``donate``) as a ``ShardJit``,
        compiled and measured."""
        fn = self.fn if fn is None else fn
        specs = self.in_specs if specs is None else specs
        call = self.args if call is None else call
        names: tuple[str, ...] = ()
        if isinstance(specs, tuple | list):  # defaulted parameters after the specs: static
            try:
                params = list(inspect.signature(fn).parameters.values())
            except (TypeError, ValueError):  # a callable without a signature: as given
                params = []
            by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            rest = [p for p in params[len(specs) :] if p.kind in by_name]
            if rest and all(p.default is not inspect.Parameter.empty for p in rest):
                names = tuple(p.name for p in rest)
                specs = (*specs, *([None] * sum(p.kind == by_name[0] for p in rest)))
        jitted = shard_jit(
            fn,
            mesh=self.mesh,
            in_specs=specs,
            donate_argnums=self.donated if donate is None else donate,
            static_argnums=self.static,
            static_argnames=names,
        )
        values = [call[i] for i in self.dynamic]
        return measure(jitted, call, self.kwargs, values, self.batch, self.roles)


def compiler(
    step: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    mesh: Any,
    in_specs: Any,
    donate_argnums: int | Sequence[int],
    static_argnums: int | Sequence[int],
    batch_argnums: int | Sequence[int] | None,
    roles: Mapping[str, Any] | None,
    topology: str | None,
) -> Compiler:
    """``step`` (a ``ShardJit``'s settings filling the rest) ready to compile on ``mesh``."""
    check_names("role", roles, ROLES)
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if isinstance(step, ShardJit):
        layout = step._layout  # this package's own wrapper: its settings, read back
        in_specs = step.in_specs if in_specs is None else in_specs
        donate = donate or tuple(layout._donate_nums)
        static = static or tuple(layout._static_nums)
        mesh = step.mesh if mesh is None else mesh
        step = step.fn
    cmesh = compile_mesh(mesh, topology)
    if in_specs is None:
        what = "in_specs is required: one spec-like per argument of the step"
        hint = "in_specs=(rules, P('data')) for step(state, batch)"
        raise spec_error("in_specs", None, what, header="cannot compile the step:", hint=hint)
    dynamic = [i for i in range(len(args)) if i not in static]
    if batch_argnums is None:  # the last of several arguments
        batch_argnums = [len(args) - 1] if len(args) > 1 else []
    wanted = [batch_argnums] if isinstance(batch_argnums, int) else batch_argnums
    batch = [dynamic.index(i) for i in wanted if i in dynamic]
    abstract = abstract_args(args, set(static))
    return Compiler(step, in_specs, donate, static, abstract, dynamic, batch, cmesh, kwargs, roles)


def abstract_args(args: Sequence[Any], statics: set[int]) -> tuple[Any, ...]:
    """``args`` with every concrete array a ``ShapeDtypeStruct``: compiling moves nothing."""
    out = []
    for i, a in enumerate(args):
        flat = split(a) if i not in statics else None
        if flat is None or not any(isinstance(x, jax.Array) for x in flat.arrays):
            out.append(a)
            continue
        arrays = [
            jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
            for x in flat.arrays
        ]
        out.append(flat.rebuild(arrays))
    return tuple(out)


def step_memory(
    step: Callable[..., Any],
    *args: Any,
    mesh: Any = None,
    in_specs: Any = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    batch_argnums: int | Sequence[int] | None = None,
    roles: Mapping[str, str | re.Pattern[str]] | None = None,
    topology: str | None = None,
    **kwargs: Any,
) -> StepMemory:
    """The per-device memory of one call of ``step``, from XLA, before any run.

    The step is compiled once for abstract arguments, as [`shard_jit`][modelshard.shard_jit]
    would compile it, and XLA's memory analysis split by part
    ([`StepMemory`][modelshard.StepMemory]). Nothing is allocated.

    Args:
        step: the training step (a function or a ``ShardJit``).
        *args: its arguments, abstract (concrete arrays are read for their shapes only).
        mesh: a ``Mesh``, an ``AbstractMesh`` or axis sizes; default: a ``ShardJit`` step's
            own, else the active mesh.
        in_specs: one spec-like per argument, as for ``shard_jit``.
        donate_argnums: arguments donated to the step (the state, as in a training loop).
        static_argnums: arguments passed as compile-time constants.
        batch_argnums: the batch's positions; default: the last argument when there are
            several.
        roles: role (``parameters``, ``optimizer_state``, ``batch``, ``other_inputs``) ->
            regex searched in a leaf's ``"arg:path"``, where the default guess is wrong.
        topology: a TPU topology name (``"v5e:4x4"``) to compile for.
        **kwargs: keyword arguments of the step.

    Returns:
        A [`StepMemory`][modelshard.StepMemory]; its ``plan`` is the inputs'.

    Raises:
        SpecError: a spec that cannot be placed, or an unknown role.
        MeshError: a mesh larger than the devices JAX can compile for.
    """
    batch, static, donate = batch_argnums, static_argnums, donate_argnums
    c = compiler(step, args, kwargs, mesh, in_specs, donate, static, batch, roles, topology)
    return c.measure()
