"""Per-leaf checksums (``fmix32x2``): two sums modulo 2**32 over a leaf's bits as ``uint32``
lanes (each lane times a hashed odd weight of its position; a hash of lane and position).
The sums ignore order, so a checksum does not depend on sharding and boxes tiling a leaf
add up to its own. They are summed on the host, where a save's and a restore's bytes pass
anyway (fixed-size XLA programs on ``host_workers``, NumPy for short runs): a program per
shard shape on an accelerator cost seconds of compiling in each fresh process. Processes
add theirs in ``Checksums.collect``.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .._runtime import gather, outcome, shared_error
from . import lazy_orbax  # noqa: F401  (settles JAX's options before any program is traced)

CHECKSUM = "fmix32x2"
K = TypeVar("K", bound=Hashable)

# Lanes per call of a host program: ``BLOCK``, or ``MID`` for a rest under a quarter of it,
# a plane's last call masked past its lanes; NumPy under ``SMALL``. Two sizes keep what a
# fresh process compiles to a program or two; a masked rest sums at most four times its lanes.
BLOCK = 1 << 20
MID = 1 << 16
SMALL = 1 << 12


def bits(dt: Any) -> int:
    """The significant bits of one element of ``dt`` (4 for ``int4``, 8 for ``float8``)."""
    try:
        info = jnp.finfo(dt) if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo(dt)
        return int(info.bits)
    except (TypeError, ValueError):
        return dt.itemsize * 8


def fmix(h: Any, u32: Any) -> Any:
    """MurmurHash3's 32-bit finaliser: a bijective, non-linear mix (jnp or np uint32)."""
    h = h ^ (h >> 16)
    h = h * u32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * u32(0xC2B2AE35)
    return h ^ (h >> 16)


def terms(v: Any, idx: Any, u32: Any) -> tuple[Any, Any]:
    """Per-lane terms of the two sums (``v`` the lanes, ``idx`` their positions, ``u32`` the
    ``uint32`` of ``jnp`` or ``np``)."""
    w = fmix(idx ^ u32(0x9E3779B9), u32) | u32(1)
    h = fmix(idx + u32(0x7F4A7C15), u32)
    return v * w, fmix(v ^ h, u32)


def lanes(a: np.ndarray) -> np.ndarray:
    """The bits of ``a`` as ``uint32`` lanes: ``a``'s shape, with a trailing axis of 2 for
    64-bit elements and another for complex ones (real, imaginary)."""
    dt = a.dtype
    if dt == np.bool_:
        return a.astype(np.uint32)
    if np.issubdtype(dt, np.complexfloating):
        return np.stack([lanes(np.real(a)), lanes(np.imag(a))], axis=-1)
    size = dt.itemsize
    if bits(dt) < size * 8:  # sub-byte types (int4, float4): widened exactly, the wide bits
        wide = np.float32 if jnp.issubdtype(dt, jnp.floating) else np.int32
        return a.astype(wide).view(np.uint32)
    a = np.ascontiguousarray(a)
    if size == 8:
        return a.view(np.uint32).reshape(*a.shape, 2)
    u = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])
    return u if size == 4 else u.astype(np.uint32)


def _positions(at: Any, k: Any, u32: Any, rows: bool) -> Any:
    """The leaf positions of a piece's lanes ``k``: with ``at = (base, offset, row, stride)``,
    the ``offset + k``-th lane of rows of ``row`` lanes ``stride`` apart (else ``base + k``)."""
    if not rows:
        return u32(at[0]) + k
    k = k + u32(at[1])
    return u32(at[0]) + (k // u32(at[2])) * u32(at[3]) + k % u32(at[2])


def _sums_of(v: jax.Array, at: jax.Array, *, rows: bool) -> jax.Array:
    """The two sums over the first ``at[4]`` lanes of ``v``, by one variadic reduction: every
    term fused into it, none written out."""
    k = jax.lax.iota(jnp.uint32, v.shape[0])
    t1, t2 = terms(v, _positions(at, k, jnp.uint32, rows), jnp.uint32)
    zero = jnp.uint32(0)
    keep = k < at[4]
    sums = jax.lax.reduce(
        (jnp.where(keep, t1, zero), jnp.where(keep, t2, zero)),
        (zero, zero),
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
        (0,),
    )
    return jnp.stack(sums)


_PROGRAMS: dict[tuple[int, bool], Any] = {}
_PROGRAMS_LOCK = threading.Lock()
_PADDED = threading.local()  # a worker's buffer for a masked call's lanes


def _program(size: int, rows: bool) -> Any:
    """The compiled sums of ``size`` lanes of one row (or of rows) on the host's CPU."""
    with _PROGRAMS_LOCK:
        if (size, rows) not in _PROGRAMS:
            from jax.sharding import SingleDeviceSharding

            cpu = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
            v = jax.ShapeDtypeStruct((size,), jnp.uint32, sharding=cpu)
            at = jax.ShapeDtypeStruct((5,), jnp.uint32, sharding=cpu)
            fn = jax.jit(functools.partial(_sums_of, rows=rows))
            _PROGRAMS[size, rows] = (fn.lower(v, at).compile(), cpu.device_set)
        return _PROGRAMS[size, rows]


def _padded(v: np.ndarray, size: int) -> np.ndarray:
    """``v`` at the start of ``size`` lanes of this thread's buffer (the rest masked)."""
    buf = getattr(_PADDED, "buf", None)
    if buf is None or buf.size < size:
        buf = _PADDED.buf = np.empty(size, np.uint32)
    buf[: v.size] = v
    return buf[:size]


def _plane_sums(plane: np.ndarray, per: int, base: int, row: int, stride: int) -> list[int]:
    """The two sums over ``plane``'s lanes (``per`` an element), in rows of ``row`` lanes
    ``stride`` apart from ``base`` (``row`` 0: one row), by compiled programs then NumPy."""
    flat = plane.reshape(-1)
    total = flat.size * per
    sums = [0, 0]
    start = 0
    while start < total:
        rest = total - start
        size = rest if rest < SMALL else BLOCK if rest >= BLOCK // 4 else MID
        count = min(size, rest)
        r0, c0 = divmod(start, row) if row else (start, 0)
        at = [(base + r0 * (stride if row else 1)) & 0xFFFFFFFF, c0, row, stride & 0xFFFFFFFF]
        v = lanes(flat[start // per : (start + count) // per]).reshape(-1)
        if rest >= SMALL:
            program, (cpu,) = _program(size, row > 0)
            x = v if count == size else _padded(v, size)
            out = program(*jax.device_put([x, np.asarray([*at, count], np.uint32)], cpu))
            got = np.asarray(out).tolist()  # done before the buffer is used again
        else:
            idx = _positions(at, np.arange(v.size, dtype=np.uint32), np.uint32, row > 0)
            got = [int(np.sum(t, dtype=np.uint32)) for t in terms(v, idx, np.uint32)]
        sums = [sums[0] + got[0], sums[1] + got[1]]
        start += count
    return sums


def box_sums(
    a: Any, origin: Sequence[int] | None = None, shape: Sequence[int] | None = None
) -> tuple[int, int]:
    """The two sums over ``a`` (host data), the box at ``origin`` of a leaf of ``shape``
    (``a`` itself by default); ``format_sums`` writes them as a checksum."""
    a = np.asarray(a)
    start = (0,) * a.ndim if origin is None else tuple(origin)
    full = a.shape if shape is None else tuple(shape)
    if a.size == 0:
        return 0, 0
    if a.ndim == 0:
        a, start, full = a.reshape(1), (0,), (1,)
    a = np.ascontiguousarray(a)
    per = lanes(a.reshape(-1)[:1]).size
    strides = [math.prod(full[d + 1 :]) * per for d in range(a.ndim)]
    # rows of consecutive positions from the last dimension the box does not span whole
    last = max((d for d in range(a.ndim) if a.shape[d] != full[d]), default=0)
    row = math.prod(a.shape[last:]) * per if last else 0
    stride = strides[last - 1] if last else 0
    outer = max(last - 1, 0)
    corner = sum(o * s for o, s in zip(start[outer:], strides[outer : last + 1], strict=False))
    s1 = s2 = 0
    for at in itertools.product(*(range(n) for n in a.shape[:outer])):
        base = corner + sum((o + i) * s for o, i, s in zip(start, at, strides, strict=False))
        b1, b2 = _plane_sums(a[at], per, base, row, stride)
        s1, s2 = s1 + b1, s2 + b2
    return s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF


def format_sums(s1: int, s2: int) -> str:
    """Two sums (each taken modulo 2**32) as a checksum, ``"xxxxxxxx:yyyyyyyy"``."""
    return f"{s1 & 0xFFFFFFFF:08x}:{s2 & 0xFFFFFFFF:08x}"


@functools.cache
def host_workers() -> ThreadPoolExecutor:
    """The threads that sum blocks while a save writes or a restore reads (NumPy and XLA
    release the GIL), made once for the process."""
    return ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="modelshard-checksum")


def _addressable(x: Any) -> bool:
    return not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or (
        x.sharding is None or x.sharding.is_fully_addressable
    )


def _blocks(x: Any) -> list[tuple[Any, list[int]]]:
    """``(block, origin)`` this process sums: the first replica of each shard it holds."""
    if not isinstance(x, jax.Array):
        return [(x, [0] * np.ndim(x))]
    return [
        (s.data, [sl.indices(n)[0] for sl, n in zip(s.index, x.shape, strict=True)])
        for s in x.addressable_shards
        if s.replica_id == 0
    ]


class Checksums(Generic[K]):
    """Checksums of the arrays ``like`` names, handed over one at a time (as a save copies
    them off the devices or a restore reads them); ``collect`` waits for them, a collective
    under ``name`` where a leaf spans processes (every leaf with ``spanning_all``)."""

    def __init__(
        self, like: Mapping[K, Any], name: str = "modelshard.checksums", spanning_all: bool = False
    ) -> None:
        self._keys = list(like)
        self._spanning = [k for k, x in like.items() if spanning_all or not _addressable(x)]
        self._name = name
        self._parts: dict[K, list[Future[Any]]] = {}

    def add(self, key: K, x: Any, host: Mapping[tuple[int, ...], Any] | None = None) -> None:
        """Start the checksum of ``x`` under ``key``; a failure is raised by ``collect``.
        ``host``: the bytes of ``x``'s blocks already on the host, by origin (a restore's
        reads), summed instead of copying them back off the devices."""
        if key in self._parts or key not in self._keys:
            return
        for data, origin in _blocks(x):
            block = (host or {}).get(tuple(origin), data)
            self.add_block(key, tuple(np.shape(x)), block, origin)

    def add_block(self, key: K, shape: Sequence[int], data: Any, origin: Any) -> Future[Any]:
        """Start summing one more block of ``key`` (a leaf of ``shape``): ``data`` at
        ``origin``. The future holds ``data`` until it is summed."""
        f = host_workers().submit(lambda: box_sums(np.asarray(data), origin, shape))
        self._parts.setdefault(key, []).append(f)
        return f

    def collect(self, arrays: Mapping[K, Any] | None = None) -> dict[K, str]:
        """Every key's checksum in ``like``'s order; keys never added are summed from
        ``arrays`` (a key with no blocks, a zero-size leaf, sums to zero). Where this
        process's or another's summing failed, every process raises at once."""
        failure: BaseException | None = None
        sums: dict[K, tuple[int, int]] = {}
        try:
            for key in self._keys:
                if key not in self._parts and arrays is not None and key in arrays:
                    self.add(key, arrays[key])
            for key in self._keys:
                got = [f.result() for f in self._parts.get(key, [])]
                sums[key] = (sum(p[0] for p in got), sum(p[1] for p in got))
        except Exception as e:
            failure = e
        finally:
            self.close()
        if self._spanning and jax.process_count() > 1:
            mine = None if failure else [sums[k] for k in self._spanning]
            every = gather({"sums": mine, "failed": outcome(failure)}, self._name)
            error = shared_error(failure, [e["failed"] for e in every], "summing the checksums")
            if error is not None:
                raise error
            for i, key in enumerate(self._spanning):
                sums[key] = (
                    sum(e["sums"][i][0] for e in every),
                    sum(e["sums"][i][1] for e in every),
                )
        if failure is not None:
            raise failure
        return {k: format_sums(*sums[k]) for k in self._keys}

    def close(self) -> None:
        """Drop the sums still queued."""
        for f in itertools.chain.from_iterable(self._parts.values()):
            f.cancel()


def checksum_mismatch_message(
    where: str, bad: Sequence[tuple[Any, str | None, str]], anyway: str = "load it anyway"
) -> str:
    """The error for the leaves of ``where`` whose checksum changed: ``bad`` holds ``(leaf
    record, recorded, read)``; ``anyway``: what ``verify=False`` would do."""
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
