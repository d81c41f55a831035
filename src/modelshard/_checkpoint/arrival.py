"""Orbax reads that hand over each array as soon as it is read, under a fair cap on bytes.

Orbax reads every array of a restore in one batch and returns them together, so work on
the restored arrays (checksums) could only start once the last byte was in. The type
handler here reads each array as its own request, all still concurrent, and calls back
with every array as it completes: a restore dispatches each leaf's checksum while the
next leaves are being read.

The cap on the bytes Orbax reads at once (``restore_concurrent_bytes``) is Orbax's
``LimitInFlightBytes``, an ``asyncio.Condition`` that wakes every waiting read whenever one
finishes: the wake-ups grow with the square of the shard reads waiting, and with the
hundreds of reads of a sharded state they take much of the event loop's time (restore
against raw Orbax: docs/benchmarks/checkpoint.md). ``FairLimiter`` keeps the same
contract (at most ``max_bytes`` reserved; a request must leave some to spare, as Orbax's
does) with a first-come queue that wakes only the reads that now fit.

An array whose reads fit under the cap together is reserved as one (``group_bytes``) and
its reads then all run at once: on a new layout several of them touch the same stored
chunks (each column block of row-chunked data touches every row chunk), and TensorStore
decodes a chunk once for all the reads in flight that want it, where reads queued one
after another decoded it once each (the zstd chunks of older checkpoints cost far more
CPU time that way; the relayout rows of docs/benchmarks/checkpoint.md).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from .write import registry_with


class FairLimiter:
    """At most ``max_bytes`` reserved at once, granted first come, first served (Orbax's
    ``ByteLimiter`` protocol; one instance serves one event loop)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"Must provide positive `num_bytes`. Found: {max_bytes}")
        self.max_bytes = max_bytes
        self._free = max_bytes
        self._queue: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def wait_for_bytes(self, requested_bytes: int) -> None:
        if requested_bytes >= self.max_bytes:
            raise ValueError(
                "Requested more bytes than we reserved space for: "
                f"{requested_bytes} > {self.max_bytes}"
            )
        if not self._queue and self._free > requested_bytes:
            self._free -= requested_bytes
            return
        entry = (requested_bytes, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                await self.release_bytes(requested_bytes)  # granted, then cancelled
            else:
                self._queue.remove(entry)
                await self.release_bytes(0)  # those behind it may fit now
            raise

    async def release_bytes(self, requested_bytes: int) -> None:
        self._free += requested_bytes
        while self._queue and self._free > self._queue[0][0]:
            n, granted = self._queue.popleft()
            self._free -= n
            granted.set_result(None)


@functools.cache
def _store_class() -> type:
    from .._internals import ArrayMetadataStore

    class ReadOnce(ArrayMetadataStore):
        """Orbax's array metadata store, each file read once: Orbax reads (and parses)
        every array's metadata file at each ``deserialize`` call, once per restore in its
        own batch but once per array here, where each array is its own request (a 64-leaf
        restore parsed 64 x 64 entries). What it returns is only read by Orbax."""

        def __init__(self) -> None:
            super().__init__()
            self._reads: dict[tuple[str, int | None], asyncio.Future[Any]] = {}

        async def read(self, checkpoint_dir: Any, process_index: int | None = None) -> Any:
            key = (str(checkpoint_dir), process_index)
            if key not in self._reads:
                self._reads[key] = asyncio.ensure_future(
                    super().read(checkpoint_dir, process_index)
                )
            return await asyncio.shield(self._reads[key])

    return ReadOnce


def chunk_cache(infos: Sequence[Any], max_bytes: int) -> Callable[[Any], Any]:
    """``info`` -> the same ``ParamInfo`` reading through a TensorStore context whose chunk
    cache holds up to ``max_bytes`` decoded chunks (one context per Orbax context among
    ``infos``, made for this restore and dropped with it); with ``max_bytes`` 0, ``info``
    itself (no cache: ``chunks.shares_chunks``).

    Orbax's context caches no chunk data, so a stored chunk that two of a process's devices
    each need part of (a 256-row chunk restored onto 128-row shards) was read from storage
    once per device unless both reads happened to be in flight together. Cached, it is read
    once per process; the bytes a restore reads are measured in ``benchmarks/read_share.py``.
    """
    import tensorstore as ts

    if max_bytes <= 0:
        return _as_is
    spec = ts.Context.Spec({"cache_pool": {"total_bytes_limit": int(max_bytes)}})
    contexts: dict[int, Any] = {}
    for info in infos:
        parent = info.ts_context
        if parent is not None and id(parent) not in contexts:
            contexts[id(parent)] = ts.Context(spec, parent=parent)

    def cached(info: Any) -> Any:
        parent = info.ts_context
        return info if parent is None else info.replace(ts_context=contexts[id(parent)])

    return cached


def _as_is(info: Any) -> Any:
    return info


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised C-order NumPy array whose data starts on a ``HOST_ALIGN`` boundary."""
    import numpy as np

    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    raw = np.empty(n + HOST_ALIGN, np.uint8)
    start = -raw.ctypes.data % HOST_ALIGN
    return raw[start : start + n].view(dt).reshape(shape)


# XLA's CPU client adopts a host buffer aligned so as its device buffer instead of copying it
HOST_ALIGN = 64


def start_read(view: Any) -> tuple[Any, Any]:
    """Start reading ``view`` (an open TensorStore, indexed) into a new ``aligned_empty``
    array: the array, and TensorStore's future of the read (await it, or ``result()``)."""
    import tensorstore as ts

    buf = aligned_empty(tuple(view.shape), view.dtype.numpy_dtype)
    return buf, ts.array(buf).write(view)


async def read_box(store: Any, bounds: tuple[tuple[int, int], ...]) -> Any:
    """The box ``bounds`` (``(start, stop)`` per dimension) of the open TensorStore
    ``store``, read into a new ``aligned_empty`` array."""
    buf, done = start_read(store[tuple(slice(lo, hi) for lo, hi in bounds)])
    await done
    return buf


async def read_placed(info: Any, arg: Any, metadata_store: Any = None) -> Any:
    """The array of ``info`` read into its sharding ``arg.sharding``, or None where Orbax's
    own read must do it (restore arguments of another kind, a dtype to cast to, a PRNG key,
    a shape that differs from the stored one, extension metadata, a checkpoint not in OCDBT).

    Orbax's read (``serialization._read_and_create_array``) fills a zeroed buffer per
    distinct shard, then copies it onto each device with its own ``jax.device_put``: two
    copies of every byte after TensorStore's and much Python per shard (a restore spent
    more time so than reading; docs/benchmarks/checkpoint.md). Here TensorStore writes each
    distinct shard, through the same spec and context, into an uninitialised buffer aligned
    for the host (``aligned_empty``: on CPU devices it becomes the device buffer as it is),
    and one ``device_put`` places them all; a shard several devices hold is copied for
    each further device, so that no two device buffers share memory.
    """
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import tensorstore as ts

    from .._internals import ArrayReadSpec

    sharding = getattr(arg, "sharding", None)
    if (
        type(arg) is not ocp.ArrayRestoreArgs
        or not isinstance(sharding, jax.sharding.Sharding)
        or arg.dtype is None
        or jax.dtypes.issubdtype(arg.dtype, jax.dtypes.prng_key)
        or arg.strict is False
        or info.name is None
        or info.parent_dir is None
        or not info.is_ocdbt_checkpoint
    ):
        return None
    metas = None if metadata_store is None else await metadata_store.read(info.parent_dir)
    if metas and any(
        m.param_name == info.name and m.ext_metadata for m in next(iter(metas.values()))
    ):
        return None  # Orbax acts on it (PRNG key data is wrapped)
    spec = ArrayReadSpec(
        directory=info.parent_dir.as_posix(),
        relative_array_filename=info.name,
        use_zarr3=info.use_zarr3,
        use_ocdbt=True,
        raise_array_data_missing_error=info.raise_array_data_missing_error,
    )
    t = await ts.open(spec.json, open=True, context=info.ts_context)
    shape = tuple(t.shape)
    dtype = np.dtype(arg.dtype)
    wanted = arg.global_shape
    if (wanted is not None and tuple(wanted) != shape) or np.dtype(t.dtype.numpy_dtype) != dtype:
        return None
    groups = shard_boxes(sharding, shape)
    bufs = await asyncio.gather(*(read_box(t, b) for b in groups))
    placed = place_boxes(bufs, list(groups.values()), sharding)
    return jax.make_array_from_single_device_arrays(shape, sharding, placed)


def shard_boxes(
    sharding: Any, shape: tuple[int, ...]
) -> dict[tuple[tuple[int, int], ...], list[Any]]:
    """Each distinct shard of this process (``(start, stop)`` per dimension) of an array of
    ``shape`` laid out by ``sharding``, with the devices that hold it."""
    groups: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        whole = index or (slice(None),) * len(shape)
        bounds = tuple(sl.indices(n)[:2] for sl, n in zip(whole, shape, strict=True))
        groups.setdefault(bounds, []).append(device)
    return groups


def place_boxes(bufs: Sequence[Any], devices: Sequence[Sequence[Any]], sharding: Any) -> list[Any]:
    """Host buffers read by ``read_box``, each placed on its devices by one ``device_put``
    (the first device adopts the buffer on CPU; each further one gets its own copy, so that
    no two device buffers share memory): the single-device arrays, buffer by buffer."""
    import jax

    hosts, targets = [], []
    for buf, devs in zip(bufs, devices, strict=True):
        for i, device in enumerate(devs):
            copy = buf if i == 0 else aligned_empty(buf.shape, buf.dtype)
            if i:
                copy[...] = buf
            hosts.append(copy)
            targets.append(
                jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
            )
    return jax.device_put(hosts, targets)


@functools.cache
def _handler_class() -> type:
    import orbax.checkpoint as ocp

    class EachArrayHandler(ocp.type_handlers.ArrayHandler):
        """``ArrayHandler`` reading each array as its own request (all concurrently)
        under one ``FairLimiter``, calling ``on_read(info, array)`` as each completes."""

        def __init__(
            self,
            on_read: Callable[[Any, Any], None],
            max_bytes: int,
            group_bytes: Callable[[Any], int] | None,
            cache_bytes: int,
        ) -> None:
            # as Orbax's default jax.Array handler is made (the store wraps PRNG key data),
            # with the store's file read once per restore rather than once per array
            super().__init__(array_metadata_store=_store_class()())
            self._on_read = on_read
            self._max_bytes = max_bytes
            self._group_bytes = group_bytes
            self._cache_bytes = cache_bytes

        async def deserialize(
            self, infos: Sequence[Any], args: Sequence[Any] | None = None
        ) -> Sequence[Any]:
            if args is None:
                return await super().deserialize(infos, args)
            from .._internals import UnlimitedInFlightBytes

            limiter = FairLimiter(self._max_bytes)
            unlimited = UnlimitedInFlightBytes()
            base = super().deserialize
            cached = chunk_cache(infos, self._cache_bytes)

            async def one(info: Any, arg: Any) -> Any:
                group = 0 if self._group_bytes is None else self._group_bytes(info)
                if 0 < group < self._max_bytes:
                    # the whole array reserved at once: its reads run together
                    await limiter.wait_for_bytes(group)
                    try:
                        x = await read_placed(cached(info), arg, self._array_metadata_store)
                        if x is None:
                            (x,) = await base([cached(info).replace(byte_limiter=unlimited)], [arg])
                    finally:
                        await limiter.release_bytes(group)
                else:
                    (x,) = await base([cached(info).replace(byte_limiter=limiter)], [arg])
                self._on_read(info, x)
                return x

            return await asyncio.gather(*(one(i, a) for i, a in zip(infos, args, strict=True)))

    return EachArrayHandler


def each_array_registry(
    on_read: Callable[[Any, Any], None],
    max_bytes: int,
    group_bytes: Callable[[Any], int] | None,
    cache_bytes: int,
) -> Any:
    """An Orbax type-handler registry holding the global one's handlers, except that
    ``jax.Array``'s reads each array on its own and calls ``on_read(param_info, array)`` as
    it arrives, at most ``max_bytes`` being read at once (as Orbax counts a read).

    ``group_bytes(param_info)``: the bytes all of an array's reads reserve together (0: each
    read reserves its own); an array whose group is under ``max_bytes`` is reserved whole
    and its reads run at once. ``cache_bytes``: the decoded-chunk cache (``chunk_cache``;
    0 for none)."""
    return registry_with(_handler_class()(on_read, max_bytes, group_bytes, cache_bytes))
