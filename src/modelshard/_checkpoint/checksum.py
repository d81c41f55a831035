"""Per-leaf checksums of a checkpoint (``fmix32x2``): where each leaf is summed, and the
device programs that sum it.

The sums themselves are ``fmix``'s; integer sums do not depend on reduction order, so a
leaf's checksum is the same whatever sharding it has when it is computed. Leaves are
reduced where they live, each device summing its own blocks: a save's in one program per
mesh (``dispatch_sums``), a restore's with a program per shape and layout (``leaf_sums``,
``dispatch_leaf_sums``), and a streamed checkpoint's slab by slab on one device
(``box_sums``: ``reshard``, ``modelshard convert``). Leaves too small to be worth compiling
for are summed on the host instead (``host_sums``: nothing compiled,
nothing gathered); both give the same numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .._base import is_abstract
from . import lazy_orbax  # noqa: F401  (settles JAX's options before any program is traced)
from .fmix import CHECKSUM as CHECKSUM
from .fmix import bits, terms
from .host_sums import np_checksum, shard_checksum

K = TypeVar("K", bound=Hashable)

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _lanes(x: jax.Array) -> jax.Array:
    """The bits of a real ``x`` as uint32 values (64-bit elements become two lanes)."""
    dt = x.dtype
    if dt == jnp.bool_:
        return x.astype(jnp.uint32)
    size = dt.itemsize
    if bits(dt) < size * 8:
        # sub-byte types (int4, float4): widen exactly, then take the wide bits
        wide = jnp.float32 if jnp.issubdtype(dt, jnp.floating) else jnp.int32
        return jax.lax.bitcast_convert_type(x.astype(wide), jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _checksum_one(x: jax.Array, origin: Any = None, strides: Any = None) -> jax.Array:
    """The two sums over the lanes of ``x`` (complex: real and imaginary lanes interleaved,
    as ``_np_lanes`` stacks them), in one variadic reduction: XLA fuses every term into
    it, so no temporary as large as ``x`` is materialised (two separate sums would each
    need their terms written out first).

    With ``origin`` and ``strides`` (``uint32`` vectors, one entry per dimension), ``x``
    is the box at ``origin`` of a larger leaf whose element strides (C order, modulo
    2**32) are ``strides``: its terms are the leaf's own for those elements."""
    parts = [x.real, x.imag] if jnp.issubdtype(x.dtype, jnp.complexfloating) else [x]
    lanes = [_lanes(p) for p in parts]
    shape = lanes[0].shape
    idx = jnp.zeros(shape, jnp.uint32)
    if origin is None:
        stride = len(lanes)
        for d in range(len(shape) - 1, -1, -1):
            idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
            stride *= shape[d]
    else:
        # lanes per element: complex parts, times two for 64-bit ones (a trailing axis)
        wide = len(shape) > x.ndim
        per = len(lanes) * (2 if wide else 1)
        if wide:
            idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, x.ndim) * jnp.uint32(len(lanes))
        for d in range(x.ndim):
            pos = origin[d] + jax.lax.broadcasted_iota(jnp.uint32, shape, d)
            idx = idx + pos * (strides[d] * jnp.uint32(per))
    parts = [t for k, v in enumerate(lanes) for t in terms(v, idx + jnp.uint32(k), jnp.uint32)]
    zero = jnp.uint32(0)
    sums = jax.lax.reduce(
        tuple(parts),
        (zero,) * len(parts),
        lambda a, b: tuple(p + q for p, q in zip(a, b, strict=True)),
        tuple(range(len(shape))),
    )
    return jnp.stack([sum(sums[0::2], zero), sum(sums[1::2], zero)])


_checksum_jit = jax.jit(_checksum_one)


def box_sums(x: jax.Array, origin: Sequence[int], shape: Sequence[int]) -> jax.Array:
    """The two sums (a ``uint32[2]`` device array, not waited for) over ``x``, the box at
    ``origin`` of a leaf of ``shape``. The sums of boxes that tile a leaf add up (modulo
    2**32) to the leaf's own; ``format_sums`` writes them as its checksum."""
    strides = [math.prod(shape[d + 1 :]) % 2**32 for d in range(len(shape))]
    return _checksum_jit(x, np.asarray(origin, np.uint32), np.asarray(strides, np.uint32))


def warm_box_sums(boxes: Sequence[tuple[tuple[int, ...], Any]], device: Any) -> None:
    """Compile ``box_sums``'s program for each ``(box shape, dtype)`` of ``boxes`` on
    ``device`` (a writer calls this on a thread of its own while its first reads run:
    the calls that follow compile nothing)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    for shape, dtype in boxes:
        x = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        index = np.zeros(len(shape), np.uint32)
        _checksum_jit.lower(x, index, index).compile()


def format_sums(s1: int, s2: int) -> str:
    """Two sums (each taken modulo 2**32) as a checksum, ``"xxxxxxxx:yyyyyyyy"``."""
    return f"{s1 & 0xFFFFFFFF:08x}:{s2 & 0xFFFFFFFF:08x}"


# Leaves are checksummed on the host when all the leaves sharing their shape, dtype and
# sharding (one compiled program) hold at most this many elements together: then compiling
# costs more than summing with NumPy. Otherwise they are reduced where they live, one
# compilation shared by the whole group (a device reduction is much faster than NumPy's;
# docs/benchmarks/checkpoint.md).
HOST_MAX_ELEMENTS = 1 << 20


def _spans_processes(x: Any) -> bool:
    """Whether summing ``x`` (an array or a sharded abstract one) on devices is a
    collective of several processes."""
    return jax.process_count() > 1 and not _addressable(x)


def _addressable(x: Any) -> bool:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.sharding is None or x.sharding.is_fully_addressable
    return x.is_fully_addressable if isinstance(x, jax.Array) else True


@functools.cache
def _replica_sharding(mesh: Any, spec: Any, memory_kind: str | None = None) -> Any:
    """The sharding of one replica of an array laid out by ``NamedSharding(mesh, spec)``:
    ``spec`` on the sub-mesh of the axes it shards over (index 0 along the others), or
    one device for a replicated spec; None where ``spec`` uses every axis (no replicas)."""
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

    used = set()
    for entry in spec:
        if isinstance(entry, str):
            used.add(entry)
        elif isinstance(entry, tuple):
            used.update(a for a in entry if isinstance(a, str))
        elif entry is not None:
            return None  # UNCONSTRAINED and the like: left as it is
    names = tuple(mesh.axis_names)
    if used >= set(names):
        return None
    if not used:
        return SingleDeviceSharding(mesh.devices.flat[0], memory_kind=memory_kind)
    devices = mesh.devices[tuple(slice(None) if n in used else 0 for n in names)]
    types = tuple(t for n, t in zip(names, mesh.axis_types, strict=True) if n in used)
    sub = Mesh(devices, tuple(n for n in names if n in used), axis_types=types)
    return NamedSharding(sub, spec, memory_kind=memory_kind)


def one_replica(x: Any) -> Any:
    """``x`` on the devices of one replica of each of its shards (the same buffers, nothing
    copied; a sharded abstract array: its sharding so), or ``x`` itself where it has no
    replicas or is not all on this process. A device checksum of a leaf replicated over
    some mesh axes would otherwise sum every replica (twice the work on a (2, 4) mesh for
    ``P(None, "model")``), one program per device."""
    from jax.sharding import NamedSharding

    s = getattr(x, "sharding", None)
    if not isinstance(s, NamedSharding) or not _addressable(x) or is_abstract(s.mesh):
        return x
    try:
        sub = _replica_sharding(s.mesh, s.spec, s.memory_kind)
    except (TypeError, ValueError):
        return x
    if sub is None:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sub)
    by_device = {shard.device: shard.data for shard in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, sub, [by_device[d] for d in sub.addressable_devices]
    )


def _program(x: Any) -> tuple[Any, ...]:
    """What one compiled checksum program is specialised on."""
    return (tuple(x.shape), np.dtype(x.dtype).str, getattr(x, "sharding", None))


def on_accelerator(x: Any) -> bool:
    """Whether ``x`` (an array or a sharded abstract one) lives on devices other than CPUs.

    Its checksum is then summed on the host: on an accelerator every distinct shape,
    dtype and layout is a program compiled for about a second (a TPU v5e), which a job
    that saves once pays on its first save, while NumPy sums the shards as they come to
    the host in threads beside the writes (docs/benchmarks/accelerator.md)."""
    devices = getattr(getattr(x, "sharding", None), "device_set", None)
    return bool(devices) and next(iter(devices)).platform != "cpu"


def on_host(arrays: Sequence[Any], limit: int) -> list[bool]:
    """For each array, whether its checksum is summed on the host: a small group (see
    ``HOST_MAX_ELEMENTS``) or a leaf on an accelerator, held whole by this process."""
    total: dict[tuple[Any, ...], int] = {}
    keys = []
    for x in arrays:
        key = _program(x)
        keys.append(key)
        total[key] = total.get(key, 0) + math.prod(x.shape)
    return [
        (total[k] <= limit or on_accelerator(x)) and _addressable(x)
        for k, x in zip(keys, arrays, strict=True)
    ]


def host_checksum(x: Any) -> tuple[int, int]:
    """The host sums of one array: shard by shard where it has shards (one replica of
    each, nothing gathered), else the whole of it."""
    if isinstance(x, jax.Array):
        return shard_checksum(x)
    return np_checksum(np.asarray(x))


def warm_checksums(targets: Sequence[jax.ShapeDtypeStruct]) -> None:
    """Compile the device checksum programs ``targets`` (sharded abstract arrays) will need:
    ``leaf_sums``'s for the leaves this process holds whole, ``dispatch_leaf_sums``'s for
    those spanning processes (``Checksums.collect`` sums them together).

    A restore calls this before reading, so that compiling (tens of MiB for a moment)
    happens while little is resident rather than on top of the restored state.
    """
    seen = set()
    spanning = []
    for t, host in zip(targets, on_host(targets, HOST_MAX_ELEMENTS), strict=True):
        key = _program(t)
        if _spans_processes(t):
            spanning.append(t)
        elif key not in seen and not host:
            seen.add(key)
            placed = _mesh_spec(t)
            if placed is None:
                _checksum_jit.lower(one_replica(t)).compile()
            else:
                _mesh_program(placed[0], (placed[1],), (tuple(t.shape),)).lower(t).compile()
    _warm_leaf_plan(spanning)


def checksums(
    arrays: Sequence[jax.Array], *, host_max_elements: int | None = None, host: bool = False
) -> list[str]:
    """One ``"xxxxxxxx:yyyyyyyy"`` checksum per array, independent of its sharding.

    Leaves are reduced where they live (one compiled program for all the leaves on one set
    of devices, cached by JAX), so nothing large is gathered to one device; those whose
    shape, dtype and sharding would serve fewer than ``host_max_elements`` elements in all
    are summed on the host instead (compiling would cost more). With ``host``, every array
    this process holds whole is summed on the host shard by shard instead: no compilation
    (which costs tens of MiB of resident compiler code), slower than a device reduction;
    ``reshard`` uses it.
    """
    return start_checksums(arrays, host_max_elements=host_max_elements, host=host)()


def _checksum_many(xs: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.stack([_checksum_one(x) for x in xs])


@functools.cache
def _batched(devices: tuple[Any, ...]) -> Any:
    """The jitted checksums of a tuple of arrays on ``devices`` (in that order), as one
    ``uint32[n, 2]`` replicated on all of them: every process can read it."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    everywhere = NamedSharding(Mesh(np.array(devices), ("checksums",)), PartitionSpec())
    return jax.jit(_checksum_many, out_shardings=everywhere)


def _devices(x: Any) -> tuple[Any, ...]:
    s = getattr(x, "sharding", None)
    assignment = getattr(s, "_device_assignment", None)
    if assignment is None:
        return (jax.devices()[0],) if s is None else tuple(sorted(s.device_set, key=id))
    return tuple(assignment)


def _entry_axes(entry: Any) -> tuple[str, ...] | None:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return entry
    return None  # UNCONSTRAINED and the like


def _mesh_spec(x: Any) -> tuple[Any, Any] | None:
    """``(mesh, spec padded to x's rank)`` where ``x`` can be summed block by block on its
    mesh (a concrete mesh, every dimension split evenly), else None."""
    from jax.sharding import NamedSharding, PartitionSpec

    s = getattr(x, "sharding", None)
    if not isinstance(s, NamedSharding) or is_abstract(s.mesh) or len(s.spec) > x.ndim:
        return None
    entries = (*s.spec, *([None] * (x.ndim - len(s.spec))))
    sizes = dict(s.mesh.shape)
    for entry, dim in zip(entries, x.shape, strict=True):
        axes = _entry_axes(entry)
        if axes is None or dim % math.prod(sizes[a] for a in axes):
            return None
    return s.mesh, PartitionSpec(*entries)


def _block_sums(mesh: Any, spec: Any, shape: tuple[int, ...], x: jax.Array) -> jax.Array:
    """Inside ``shard_map``: this device's block of a leaf of ``shape`` laid out by
    ``spec``, summed at its origin, its replicas sharing the work.

    The replicas of a block (the devices along the mesh axes ``spec`` does not use) each sum
    an equal slice of it, along the first dimension they divide, so that their sums add up
    to the block's; where no dimension divides, the first replica sums the whole block and
    the others give zero. (The first replica alone summed every replicated leaf: a state
    replicated over 8 devices was summed on one, the other seven waiting at the all-reduce,
    in a save or a restore alike.)"""
    sizes = dict(mesh.shape)
    origin = []
    used: set[str] = set()
    for entry, block in zip(spec, x.shape, strict=True):
        axes = _entry_axes(entry) or ()
        used.update(axes)
        origin.append(_position(axes, sizes) * jnp.uint32(block % 2**32))
    strides = [math.prod(shape[d + 1 :]) % 2**32 for d in range(len(shape))]
    strides_v = jnp.asarray(np.asarray(strides, np.uint32))
    replicas = [a for a in mesh.axis_names if a not in used]
    count = math.prod(sizes[a] for a in replicas)
    split = next((d for d, n in enumerate(x.shape) if n >= count and n % count == 0), None)
    if count > 1 and split is not None:
        piece = x.shape[split] // count
        start = _position(replicas, sizes) * jnp.uint32(piece)
        part = jax.lax.dynamic_slice_in_dim(x, start.astype(jnp.int32), piece, axis=split)
        origin[split] = origin[split] + start
        return _checksum_one(part, jnp.stack(origin), strides_v)
    origin_v = jnp.stack(origin) if origin else jnp.zeros((0,), jnp.uint32)
    return jax.lax.cond(
        _position(replicas, sizes) == 0,  # the first replica
        lambda: _checksum_one(x, origin_v, strides_v),
        lambda: jnp.zeros((2,), jnp.uint32),
    )


def _position(axes: Sequence[str], sizes: Mapping[str, int]) -> jax.Array:
    """Inside ``shard_map``: this device's index along ``axes`` taken together, the first
    major (as a spec entry of several axes splits a dimension), as ``uint32``."""
    index = jnp.uint32(0)
    for a in axes:
        index = index * jnp.uint32(sizes[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
    return index


@functools.lru_cache(maxsize=256)
def _leaf_blocks(mesh: Any, spec: Any, shape: tuple[int, ...]) -> Any:
    """``_block_sums`` for leaves of ``shape`` laid out by ``spec``, jitted: called inside a
    ``shard_map`` for many leaves alike, it is traced once per dtype and lowered to one
    function they all call (unrolled, a program of 64 leaves took 0.47 s to trace and
    lower and 0.56 s to compile; so, 0.03 s and 0.35 s)."""
    return jax.jit(functools.partial(_block_sums, mesh, spec, shape))


@functools.lru_cache(maxsize=64)
def _mesh_program(mesh: Any, specs: tuple[Any, ...], shapes: tuple[tuple[int, ...], ...]) -> Any:
    """The jitted checksums of leaves on ``mesh``: each device sums its own blocks, then
    one all-reduce adds the blocks' sums (a ``uint32[n, 2]`` every process can read).
    Left to XLA's partitioner, the position-hashed reductions gathered every leaf whole."""
    from jax.sharding import PartitionSpec

    def _checksum_blocks(*blocks: jax.Array) -> jax.Array:
        rows = [
            _leaf_blocks(mesh, spec, shape)(x)
            for x, spec, shape in zip(blocks, specs, shapes, strict=True)
        ]
        return jax.lax.psum(jnp.stack(rows), tuple(mesh.axis_names))

    mapped = jax.shard_map(
        _checksum_blocks, mesh=mesh, in_specs=specs, out_specs=PartitionSpec(), check_vma=False
    )
    return jax.jit(mapped)


def _groups(
    arrays: Sequence[Any],
) -> tuple[dict[Any, list[tuple[int, Any]]], dict[tuple[Any, ...], list[tuple[int, Any]]]]:
    """``arrays`` (concrete or sharded abstract) by where their sums run: per mesh, each
    index with its padded spec, for leaves laid out evenly on one (``_mesh_spec``); per set
    of devices, each index with one replica of the leaf, for the others."""
    on_mesh: dict[Any, list[tuple[int, Any]]] = {}
    others: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
    for i, x in enumerate(arrays):
        placed = _mesh_spec(x)
        if placed is not None:
            on_mesh.setdefault(placed[0], []).append((i, placed[1]))
        else:
            rep = one_replica(x)
            others.setdefault(_devices(rep), []).append((i, rep))
    return on_mesh, others


def _fetcher(
    n: int, running: list[tuple[list[int], jax.Array]]
) -> Callable[[], list[tuple[int, int]]]:
    """Fetch dispatched sums (one ``uint32[k, 2]`` per program, for the indices beside it)
    in one transfer, as ``n`` pairs."""

    def fetch() -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = [(0, 0)] * n
        fetched = jax.device_get([sums for _, sums in running])
        for (idx, _), host in zip(running, fetched, strict=True):
            for i, (a, b) in zip(idx, np.asarray(host).tolist(), strict=True):
                out[i] = (int(a), int(b))
        return out

    return fetch


def dispatch_sums(arrays: Sequence[Any]) -> Callable[[], list[tuple[int, int]]]:
    """Start the device sums of ``arrays``: one program per mesh (or, for leaves not laid
    out evenly on one, per set of devices), dispatched now, in this order. Call the result
    to fetch them (one transfer per program).

    Summing an array that spans several processes is a collective: every process calls
    this, with the same arrays in the same order, on its main thread (never only one
    process, never a background thread). Fetching the sums is not a collective.

    One program of every leaf compiles in time linear in their number (about 15 ms a leaf
    on a CPU): a save, whose programs run again at every save, pays that once; a restore,
    whose programs run once, uses ``dispatch_leaf_sums``.
    """
    on_mesh, others = _groups(arrays)
    running = []
    for mesh, members in on_mesh.items():
        specs = tuple(spec for _, spec in members)
        shapes = tuple(tuple(arrays[i].shape) for i, _ in members)
        program = _mesh_program(mesh, specs, shapes)
        running.append(([i for i, _ in members], program(*(arrays[i] for i, _ in members))))
    for devs, members in others.items():
        program = _batched(devs)
        running.append(([i for i, _ in members], program(tuple(x for _, x in members))))
    return _fetcher(len(arrays), running)


def dispatch_leaf_sums(arrays: Sequence[Any]) -> Callable[[], list[tuple[int, int]]]:
    """``dispatch_sums`` for sums taken once (a restore's): each leaf laid out evenly on a
    mesh is summed block by block by a program of its own shape, dtype and layout
    (compiled once per distinct one, not once per leaf), and one collective per mesh adds
    the blocks' sums of all of them. The same contract as ``dispatch_sums``."""
    running = []
    for idx, blocks, final, args in _leaf_plan(arrays):
        parts = [program(x) for program, x in blocks] if args is None else args
        running.append((idx, final(*parts)))
    return _fetcher(len(arrays), running)


Step = tuple[list[int], list[tuple[Any, Any]], Any, tuple[Any, ...] | None]


def _leaf_plan(arrays: Sequence[Any]) -> list[Step]:
    """``dispatch_leaf_sums``'s programs for ``arrays`` (concrete or sharded abstract):
    per mesh, the indices, each leaf with its block program, and the program adding their
    blocks' sums (its arguments: the block programs' outputs, ``None`` here); per set of
    devices for leaves not laid out evenly, ``dispatch_sums``'s program with its argument."""
    on_mesh, others = _groups(arrays)
    plan: list[Step] = []
    for mesh, members in on_mesh.items():
        blocks = [
            (_block_program(mesh, spec, tuple(arrays[i].shape)), arrays[i]) for i, spec in members
        ]
        plan.append(([i for i, _ in members], blocks, _add_blocks(mesh, len(members)), None))
    for devs, members in others.items():
        reps = (tuple(x for _, x in members),)
        plan.append(([i for i, _ in members], [], _batched(devs), reps))
    return plan


def _warm_leaf_plan(targets: Sequence[jax.ShapeDtypeStruct]) -> None:
    """Compile ``dispatch_leaf_sums``'s programs for ``targets`` (each distinct one once)."""
    from jax.sharding import NamedSharding, PartitionSpec

    seen: set[Any] = set()
    for _, blocks, final, args in _leaf_plan(targets):
        parts = []
        for program, t in blocks:
            key = (program, _program(t))
            if key not in seen:
                seen.add(key)
                program.lower(t).compile()
            mesh = t.sharding.mesh
            rows = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
            parts.append(jax.ShapeDtypeStruct((mesh.size, 2), jnp.uint32, sharding=rows))
        final.lower(*(parts if args is None else args)).compile()


@functools.lru_cache(maxsize=256)
def _block_program(mesh: Any, spec: Any, shape: tuple[int, ...]) -> Any:
    """The jitted block sums of one leaf of ``shape`` laid out by ``spec`` on ``mesh``:
    ``uint32[devices, 2]``, each device's row its own block's sums (no collective)."""
    from jax.sharding import PartitionSpec

    def _leaf_block_rows(x: jax.Array) -> jax.Array:
        return _leaf_blocks(mesh, spec, shape)(x)[None]

    mapped = jax.shard_map(
        _leaf_block_rows,
        mesh=mesh,
        in_specs=(spec,),
        out_specs=PartitionSpec(tuple(mesh.axis_names)),
        check_vma=False,
    )
    return jax.jit(mapped)


@functools.lru_cache(maxsize=64)
def _add_blocks(mesh: Any, n: int) -> Any:
    """The jitted sum of ``n`` leaves' block sums (``_block_program``'s outputs): one
    all-reduce, a ``uint32[n, 2]`` every process can read."""
    from jax.sharding import PartitionSpec

    axes = tuple(mesh.axis_names)

    def _add_block_rows(*rows: jax.Array) -> jax.Array:
        return jax.lax.psum(jnp.concatenate(rows), axes)

    mapped = jax.shard_map(
        _add_block_rows,
        mesh=mesh,
        in_specs=(PartitionSpec(axes),) * n,
        out_specs=PartitionSpec(),
        check_vma=False,
    )
    return jax.jit(mapped)


def leaf_sums(x: jax.Array) -> jax.Array:
    """The two sums of one array this process holds whole, dispatched and not waited for
    (``uint32`` device array of two elements; its shape is not fixed).

    Laid out evenly on a mesh, each device sums its own block in place (``_mesh_program``,
    compiled once per shape and layout): about three times less work than ``_checksum_jit``
    of the whole leaf, which XLA's partitioner runs by gathering the leaf
    (``benchmarks/ckpt_save_restore.py``, restore verified against ``verify=False``)."""
    placed = _mesh_spec(x)
    if placed is None:
        return _checksum_jit(one_replica(x))
    return _mesh_program(placed[0], (placed[1],), (tuple(x.shape),))(x)


_HOST_WORKERS: list[Any] = []


def host_workers() -> Any:
    """The threads that take host checksums while a save writes or a restore reads, a leaf
    each at a time (NumPy releases the GIL while it sums), made once: a pool per save
    would be started and torn down every step."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    if not _HOST_WORKERS:
        n = max(1, min(8, os.cpu_count() or 1))
        _HOST_WORKERS.append(ThreadPoolExecutor(n, thread_name_prefix="modelshard-checksum"))
    return _HOST_WORKERS[0]


def start_checksums(
    arrays: Sequence[jax.Array], *, host_max_elements: int | None = None, host: bool = False
) -> Callable[[], list[str]]:
    """Dispatch ``checksums`` without waiting; call the result to collect them.

    The device reductions (one program for all the leaves on one set of devices, a
    collective for those spanning processes: see ``dispatch_sums``) are dispatched here,
    and the host sums handed to a worker thread, so both run while the caller goes on
    (``save`` writes the data meanwhile).
    """
    limit = HOST_MAX_ELEMENTS if host_max_elements is None else host_max_elements
    small = on_host(arrays, limit)
    on_cpu = [
        i
        for i, x in enumerate(arrays)
        if small[i] or (host and isinstance(x, jax.Array) and x.is_fully_addressable)
    ]
    elsewhere = set(on_cpu)
    on_devices = [i for i in range(len(arrays)) if i not in elsewhere]
    fetch = dispatch_sums([arrays[i] for i in on_devices])

    done = [host_workers().submit(host_checksum, arrays[i]) for i in on_cpu]

    def collect() -> list[str]:
        sums: list[tuple[int, int]] = [(0, 0)] * len(arrays)
        for i, s in zip(on_devices, fetch(), strict=True):
            sums[i] = s
        for i, f in zip(on_cpu, done, strict=True):
            sums[i] = f.result()
        return [format_sums(a, b) for a, b in sums]

    return collect


class Checksums(Generic[K]):
    """``checksums`` of arrays handed over one at a time, as a restore reads them.

    ``like`` maps each key to the array, or the sharded abstract array, that will be
    added under it: which leaves are summed on the host is decided from all of them at
    once, as ``checksums`` decides. ``add`` returns at once: device reductions are started
    by one worker thread (a device reduction on CPU devices can run in the thread that
    starts it, which inside Orbax's reads would hold up its event loop), host sums by
    ``host_workers``, while the caller reads the next leaves. ``collect`` waits for them;
    ``close`` abandons them.
    """

    def __init__(
        self,
        like: Mapping[K, Any],
        *,
        host_max_elements: int | None = None,
        host: bool = False,
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        limit = HOST_MAX_ELEMENTS if host_max_elements is None else host_max_elements
        self._keys = list(like)
        self._small = dict(zip(self._keys, on_host(list(like.values()), limit), strict=True))
        self._host = host
        self._pending: dict[K, Any] = {}
        self._later: dict[K, Any] = {}  # arrays spanning processes, summed by collect
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="modelshard-checksum")
        self._first: Future[Any] | None = None

    def first(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the checksums' thread before any sum (a restore compiles its
        programs so, while its first reads run); ``collect`` waits for it and raises what
        it raised. Compiling is no collective: any thread may do it."""
        self._first = self._worker.submit(fn)

    def _sum(self, key: K, x: Any) -> Any:
        return leaf_sums(x)

    def _on_host(self, key: K, x: Any) -> bool:
        return self._small[key] or (self._host and isinstance(x, jax.Array) and _addressable(x))

    def add(self, key: K, x: jax.Array) -> None:
        """Start the checksum of ``x``, the array of ``key`` (a key not in ``like`` is not
        checked). A failure is raised by ``collect``, not here: ``add`` runs inside
        Orbax's reads, which would report it as a read error.

        An array that spans devices of other processes is summed by a collective, which
        every process must issue in the same order and not from a background thread: its
        sum is left to ``collect`` (arrival order differs from process to process)."""
        if key not in self._small or key in self._pending:
            return
        if _spans_processes(x):
            self._later[key] = x
        elif self._on_host(key, x):
            self._pending[key] = host_workers().submit(host_checksum, x)
        else:
            self._pending[key] = self._worker.submit(self._sum, key, x)

    def collect(self, arrays: Mapping[K, Any] | None = None) -> dict[K, str]:
        """Every key's ``"xxxxxxxx:yyyyyyyy"``, in ``like``'s order; the keys never added
        (``arrays`` must hold them) are summed now."""
        try:
            if self._first is not None:
                self._first.result()  # the programs compiled: none is compiled twice
            spanning: dict[K, Any] = {}
            for key in self._keys:
                if key in self._pending:
                    continue
                x = self._later.pop(key, None)
                if x is None and arrays is not None:
                    x = arrays[key]
                if x is None:
                    continue
                if _spans_processes(x):  # a collective: summed below, in like's order
                    spanning[key] = x
                else:
                    self.add(key, x)
            if spanning:
                fetch = dispatch_leaf_sums(list(spanning.values()))
                for key, s in zip(spanning, fetch(), strict=True):
                    done: Future[Any] = Future()
                    done.set_result(s)
                    self._pending[key] = done
            sums = [self._pending[k].result() for k in self._keys]
        finally:
            self.close()
        fetched = iter(jax.device_get([s for s in sums if isinstance(s, jax.Array)]))
        out = {}
        for k, s in zip(self._keys, sums, strict=True):
            a, b = np.asarray(next(fetched)).reshape(2) if isinstance(s, jax.Array) else s
            out[k] = format_sums(int(a), int(b))
        return out

    def close(self) -> None:
        """Stop the worker (sums still queued are dropped, host sums too)."""
        for f in self._pending.values():
            f.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)


class StoredLeaf(Protocol):
    """What an error needs of a leaf's record (``record.LeafRecord`` is one)."""

    @property
    def path(self) -> str: ...
    @property
    def stored_dtype(self) -> str: ...
    @property
    def stored_shape(self) -> Sequence[int]: ...


def checksum_mismatch_message(
    where: str, bad: Sequence[tuple[StoredLeaf, str | None, str]], anyway: str = "load it anyway"
) -> str:
    """The error for the leaves of ``where`` whose checksum is not the recorded one:
    ``bad`` holds ``(record, recorded checksum, checksum read)`` per leaf; ``anyway``: what
    ``verify=False`` would do with it."""
    n = len(bad)
    return (
        f"checksum mismatch in {where}: the stored bytes of {n} lea"
        f"{'ves' if n != 1 else 'f'} changed since they were saved:\n"
        + "\n".join(
            f"  {r.path or '<root>'} {r.stored_dtype}{list(r.stored_shape)}: recorded {want}, "
            f"read {got}"
            for r, want, got in bad
        )
        + "\nhint: the checkpoint is damaged; restore an earlier one, or pass verify=False "
        f"to {anyway}."
    )
