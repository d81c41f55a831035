"""The changes ``fit_advice`` tries: to a leaf's spec, to the arguments, or to the step."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from .._containers import split
from .._specs import entry_axes
from .memory import Compiler, StepMemory

# Megatron-style tensor parallelism by parameter name: column-parallel layers shard their
# output dimension, row-parallel ones their input, embeddings their vocabulary.
_COLUMN = re.compile(
    r"(^|/)(q|k|v|query|key|value|wq|wk|wv|wqkv|qkv|q_proj|k_proj|v_proj|qkv_proj|c_attn|"
    r"up|gate|up_proj|gate_proj|wi|wi_0|wi_1|w1|w3|fc1|fc_in|c_fc|dense_h_to_4h)(/|$)"
)
_ROW = re.compile(
    r"(^|/)(o|out|wo|o_proj|out_proj|attn_out|down|down_proj|w2|fc2|fc_out|c_proj|"
    r"dense_4h_to_h)(/|$)"
)
_VOCAB = re.compile(
    r"(^|/)(embed|embedding|embeddings|wte|tok_embeddings|embed_tokens|token_embedder|"
    r"word_embeddings)(/|$)"
)
_HEAD = re.compile(r"(^|/)(lm_head|unembed|unembedding)(/|$)")
# the dimensions each kind shards, in order of preference
_TP_DIMS = ((_VOCAB, [0]), (_HEAD, [-1]), (_COLUMN, [-1, -2]), (_ROW, [-2, -3]))

KINDS = ("donate", "shard_optimizer", "moments_dtype", "fsdp", "tensor_parallel", "remat", "batch")
"""The kinds of change ``fit_advice`` tries, least invasive first."""


def add_axis(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    sizes: Mapping[str, int],
    axis: str,
    dims: Sequence[int] | None = None,
) -> PartitionSpec:
    """``spec`` with ``axis`` on the first of ``dims`` (default: largest first) it divides."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if any(axis in entry_axes(e) for e in entries) or not shape:
        return spec
    ways = [math.prod(sizes[a] for a in entry_axes(e)) for e in entries]
    shard = [n // w for n, w in zip(shape, ways, strict=True)]
    order = sorted(range(len(shape)), key=lambda d: (-shard[d], d))
    if dims is not None:
        order = [d % len(shape) for d in dims if -len(shape) <= d < len(shape)]
    for d in order:
        if shard[d] % sizes[axis] == 0 and shard[d] >= sizes[axis]:
            old = entry_axes(entries[d])
            entries[d] = axis if not old else (*old, axis)
            return PartitionSpec(*entries)
    return spec


def tp_dims(path: str, shape: tuple[int, ...]) -> list[int] | None:
    """The dimensions tensor parallelism may shard a parameter on, known by its name."""
    if len(shape) < 2:
        return None
    return next((dims for rx, dims in _TP_DIMS if rx.search(path)), None)


@dataclasses.dataclass(frozen=True)
class Change:
    """A candidate: new specs for some leaves, new arguments, another step or donation."""

    kind: str
    description: str
    code: str
    specs: Callable[[Any, PartitionSpec, str], PartitionSpec] | None = None
    args: Callable[[list[Any]], list[Any]] | None = None
    step: Callable[..., Any] | None = None
    donate: tuple[int, ...] | None = None
    batch: BatchInfo | None = None  # the batch to halve (``batch_change`` halves it)
    narrowed: frozenset[str] = frozenset()  # leaf paths whose dtype the change narrows


def abstract(x: Any) -> Any:
    return x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(x.shape, x.dtype)


def rebuild(value: Any, fn: Callable[[str, Any], Any]) -> Any:
    """``value`` with each array leaf replaced by ``fn(path, leaf)``."""
    flat = split(value)
    return flat.rebuild(
        [fn(info.path, leaf) for info, leaf in zip(flat.infos, flat.arrays, strict=True)]
    )


def cast_outputs(step: Callable[..., Any], paths: set[str], dtype: Any) -> Callable[..., Any]:
    """``step`` with its outputs at ``paths`` in ``dtype``, as a narrower optimizer writes them."""

    def cast(p: str, x: Any) -> Any:
        hit = any(p == q or p.endswith("/" + q) for q in paths)
        return x.astype(dtype) if hit and jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x

    @functools.wraps(step)
    def narrowed(*a: Any, **k: Any) -> Any:
        return rebuild(step(*a, **k), cast)

    return narrowed


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    positions: tuple[int, ...]  # argument positions of the batch
    per_device: int
    global_size: int
    factor: int


def changes_for(
    c: Compiler, base: StepMemory, remat: Callable[..., Any] | None, kinds: Sequence[str]
) -> list[Change]:
    """Every change of ``kinds`` that applies to the step ``base`` measured, in ``KINDS`` order."""
    plan, leaf_roles, dynamic, batch = base.plan, [r for _, r in base.roles], c.dynamic, c.batch
    sizes = plan.sizes
    axes = [a for a, n in sorted(sizes.items(), key=lambda kv: -kv[1]) if n > 1]
    out: list[Change] = []
    state = ("parameters", "optimizer_state")

    def per_axis(kind: str, text: str, over: Sequence[str], wanted: Any, tp: bool = False) -> None:
        """One change per axis of ``over``: it added to each leaf ``wanted(leaf, role)`` picks."""
        for axis in over if kind in kinds else ():

            def specs(leaf: Any, s: PartitionSpec, r: str, ax: str = axis) -> PartitionSpec:
                if not wanted(leaf, r):
                    return s
                return add_axis(
                    s, leaf.shape, sizes, ax, tp_dims(leaf.path, leaf.shape) if tp else None
                )

            out.append(Change(kind, text.format(repr(axis)), "", specs=specs))

    at = 0
    state_args = []
    for i, a in enumerate(plan.args):
        if set(leaf_roles[at : at + len(a.leaves)]) & set(state):
            state_args.append(dynamic[i])
        at += len(a.leaves)
    if "donate" in kinds and base.parts["outputs"] > 0 and not set(state_args) <= set(c.donated):
        nums = tuple(sorted(set(c.donated) | set(state_args)))
        text = f"donate the state (donate_argnums={nums})"
        code = f"ms.shard_jit(step, ..., donate_argnums={nums})"
        out.append(Change("donate", text, code, donate=nums))
    has_opt = "optimizer_state" in leaf_roles
    per_axis(
        "shard_optimizer",
        "shard the optimizer state over {} (ZeRO-1)",
        axes if has_opt else [],
        lambda leaf, r: r == "optimizer_state" and math.prod(leaf.shape) >= 2**14,
    )
    if "moments_dtype" in kinds and has_opt and (mc := _moments_change(plan, leaf_roles, dynamic)):
        out.append(mc)
    per_axis(
        "fsdp",
        "shard parameters and optimizer state over {} (FSDP)",
        axes,
        lambda leaf, r: r in state and math.prod(leaf.shape) >= 2**14,
    )
    tp = [leaf for leaf, r in zip(plan.leaves, leaf_roles, strict=True) if r in state]
    if any(tp_dims(leaf.path, leaf.shape) for leaf in tp):
        # over the batch's axis the same devices would split both: no tensor parallelism
        batch_axes = {
            a
            for i in batch
            for leaf in plan.args[i].leaves
            if leaf.spec and len(leaf.shape)
            for a in entry_axes(leaf.spec[0])
        }
        per_axis(
            "tensor_parallel",
            "tensor-parallel rules over {} for known parameter names",
            [a for a in axes if a not in batch_axes],
            lambda leaf, r: r in state and tp_dims(leaf.path, leaf.shape),
            tp=True,
        )
    if "remat" in kinds:
        variant, how = _remat_step(c.fn, remat)
        if variant is not None:
            out.append(Change("remat", "rematerialise the step's activations", how, step=variant))
    if "batch" in kinds and batch and (info := _batch_info(plan, batch, dynamic)) is not None:
        out.append(Change("batch", "halve the batch", "", batch=info))
    return out


def _moments_change(plan: Any, leaf_roles: list[str], dynamic: list[int]) -> Change | None:
    """bfloat16 first moments (optax's ``mu_dtype``), else the whole float32 optimizer state."""
    picked: dict[int, set[str]] = {}  # argument position -> the leaf paths narrowed
    cands = [(i, leaf) for i, a in enumerate(plan.args) for leaf in a.leaves]
    opt = [
        (i, leaf)
        for (i, leaf), r in zip(cands, leaf_roles, strict=True)
        if r == "optimizer_state" and str(leaf.dtype) == "float32" and len(leaf.shape)
    ]
    mu = [(i, leaf) for i, leaf in opt if "mu" in leaf.path.split("/")]
    chosen = mu or opt
    if not chosen:
        return None
    for i, leaf in chosen:
        picked.setdefault(dynamic[i], set()).add(leaf.path)
    bf16 = jax.numpy.bfloat16

    def narrow(call: list[Any]) -> list[Any]:
        call = list(call)
        for pos, paths in picked.items():
            call[pos] = rebuild(
                call[pos],
                lambda p, x, ps=paths: (
                    jax.ShapeDtypeStruct(x.shape, bf16) if p in ps else abstract(x)
                ),
            )
        return call

    narrowed = frozenset(set().union(*picked.values()))
    if mu:
        text = "keep the first moments in bfloat16"
        code = "optax.adamw(learning_rate, mu_dtype=jnp.bfloat16)"
    else:
        text = "keep the optimizer state in bfloat16"
        code = "the optimizer's float32 state written in bfloat16"
    return Change("moments_dtype", text, code, args=narrow, narrowed=narrowed)


def _remat_step(
    fn: Callable[..., Any], remat: Callable[..., Any] | None
) -> tuple[Callable[..., Any] | None, str]:
    if remat is not None:
        return remat, "the rematerialised step (remat=...) in place of the step"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None, ""
    if "remat" in params:
        return functools.partial(fn, remat=True), "step(..., remat=True)"
    return None, ""


def _batch_info(plan: Any, batch: list[int], dynamic: list[int]) -> BatchInfo | None:
    leaves = [leaf for i in batch for leaf in plan.args[i].leaves if leaf.shape]
    lead = {leaf.shape[0] for leaf in leaves}
    # how many ways each batch leaf's first dimension is split
    firsts = [entry_axes(leaf.spec[0] if len(leaf.spec) else None) for leaf in leaves]
    factors = {math.prod(plan.sizes[a] for a in axes) for axes in firsts}
    if len(lead) != 1 or len(factors) != 1:
        return None
    (g,), (f,) = lead, factors
    return BatchInfo(tuple(dynamic[i] for i in batch), g // f, g, f)


def batch_change(info: BatchInfo, k: int) -> Change | None:
    """The batch halved ``k`` times, or None once it no longer splits evenly over its devices."""
    size = info.global_size >> k
    if size < info.factor or (info.global_size % (1 << k)) or size % info.factor:
        return None

    def halve(call: list[Any]) -> list[Any]:
        call = list(call)
        for pos in info.positions:
            call[pos] = rebuild(
                call[pos],
                lambda p, x: (
                    jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype)
                    if len(x.shape)
                    else abstract(x)
                ),
            )
        return call

    per = size // info.factor
    text = f"batch per device {info.per_device} -> {per} (global {info.global_size} -> {size})"
    return Change("batch", text, f"a global batch of {size} ({per} per device)", args=halve)
