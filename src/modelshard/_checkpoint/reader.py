"""Every stored array of a checkpoint read one way: straight from its TensorStore store, with
the spec and context Orbax would use. ``read_arrays`` places each distinct shard once, from
a host buffer a CPU device adopts, under ``RESTORE_CONCURRENT_BYTES`` in flight;
``ArrayReader`` reads boxes to the host; ``read_checked`` names the leaves and file at fault.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import mmap
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .._base import CheckpointError, canonical_dtype
from .checksum import Checksums, checksum_mismatch_message
from .codec import empty, is_empty, parse_dtype, stored_struct
from .ocdbt import array_keys
from .record import LeafRecord, some
from .sources import Source, array_spec, reader_context
from .storage import TREE_METADATA, orbax_name

# Read buffers held at once: two 16 MiB arrays', so one's reads overlap the next's opening
RESTORE_CONCURRENT_BYTES = 32 << 20

# XLA's CPU client adopts a host buffer aligned so as its device buffer instead of copying it
HOST_ALIGN = 64

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


def aligned_empty(shape: tuple[int, ...], dtype: Any, *, adopted: bool = False) -> Any:
    """An uninitialised C-order NumPy array whose data starts on a ``HOST_ALIGN`` boundary;
    ``adopted`` (a CPU device will hold it as its buffer): its pages faulted in at once
    (``populate``) when it is large. A staging buffer, freed once copied, is not: its pages
    come back from the heap for the next read."""
    import numpy as np

    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    raw = np.empty(n + HOST_ALIGN, np.uint8)
    if adopted and n >= POPULATED_BYTES:
        populate(raw)
    start = -raw.ctypes.data % HOST_ALIGN
    return raw[start : start + n].view(dt).reshape(shape)


# A buffer this large is faulted in by a call per part, on parallel threads, before it is
# filled: a fresh process's pages cost less so than a fault at a time.
POPULATED_BYTES = 1 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


@functools.cache
def _madvise() -> Any:
    if sys.platform != "linux":
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


POPULATING_THREADS = max(1, min(4, os.cpu_count() or 1))


@functools.cache
def _populating() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(POPULATING_THREADS, thread_name_prefix="modelshard-populate")


def populate(buf: Any) -> bool:
    """Fault in the whole pages of the writable NumPy array ``buf`` at once, in parts on
    parallel threads; whether the system did (older kernels and other systems leave them
    to be faulted one by one)."""
    madvise, page = _madvise(), mmap.PAGESIZE
    start = -(-buf.ctypes.data // page) * page
    end = (buf.ctypes.data + buf.nbytes) // page * page
    if madvise is None or end <= start:
        return False
    parts = min(POPULATING_THREADS, max(1, (end - start) // POPULATED_BYTES))
    step = -(-(end - start) // parts // page) * page
    done = [
        _populating().submit(madvise, a, min(step, end - a), _MADV_POPULATE_WRITE)
        for a in range(start, end, step)
    ]
    return all(f.result() == 0 for f in done)


def start_read(view: Any, *, adopted: bool = False) -> tuple[Any, Any]:
    """Start reading ``view`` into a new ``aligned_empty`` array: the array, the read's future."""
    import tensorstore as ts

    buf = aligned_empty(tuple(view.shape), view.dtype.numpy_dtype, adopted=adopted)
    return buf, ts.array(buf).write(view)


def shard_boxes(sharding: Any, shape: tuple[int, ...]) -> dict[Box, list[Any]]:
    """Each distinct shard this process holds of an array of ``shape``, with its devices."""
    groups: dict[Box, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        whole = index or (slice(None),) * len(shape)
        bounds = tuple(sl.indices(n)[:2] for sl, n in zip(whole, shape, strict=True))
        groups.setdefault(bounds, []).append(device)
    return groups


def place_boxes(bufs: Sequence[Any], devices: Sequence[Sequence[Any]], sharding: Any) -> list[Any]:
    """Host buffers placed on their devices by one ``device_put``: a CPU device adopts the
    buffer, so each other CPU device gets a copy (no two device buffers share memory)."""
    import jax

    hosts, targets = [], []
    for buf, devs in zip(bufs, devices, strict=True):
        for i, device in enumerate(devs):
            copy = buf
            if i and device.platform == "cpu":
                copy = aligned_empty(buf.shape, buf.dtype, adopted=True)
                copy[...] = buf
            hosts.append(copy)
            targets.append(
                jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
            )
    return jax.device_put(hosts, targets)


def open_arrays(source: Source, recs: Sequence[LeafRecord], ctx: Any) -> list[Any]:
    """The open stores of ``recs``' arrays, opened together; ``ValueError`` for an array of
    ours ``_METADATA`` does not list (damaged metadata) or one stored unlike its record. A
    number plain Orbax stored 64-bit is read as recorded."""
    import numpy as np
    import tensorstore as ts

    ours = source.record.source != "orbax"
    if ours:
        meta = source.tree_dir / TREE_METADATA
        try:
            listed = set(array_keys(source.tree_metadata()))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{meta}: not Orbax's tree metadata ({type(e).__name__}: {e})") from e
        for rec in recs:
            if rec.key not in listed:
                raise ValueError(f"{meta} does not list the stored array {orbax_name(rec.key)}")
    opening = [ts.open(array_spec(source, orbax_name(r.key)), open=True, context=ctx) for r in recs]
    stores = []
    for rec, op in zip(recs, opening, strict=True):
        store = op.result()
        want = (tuple(rec.stored_shape), np.dtype(parse_dtype(rec.stored_dtype)))
        got = (tuple(store.shape), np.dtype(store.dtype.numpy_dtype))
        if not ours and got[0] == want[0] and got[1] != want[1]:
            store, got = ts.cast(store, want[1]), want
        if got != want:
            raise ValueError(
                f"stored array {orbax_name(rec.key)} is {got[1]}{list(got[0])}, "
                f"the record says {want[1]}{list(want[0])}"
            )
        stores.append(store)
    return stores


def read_arrays(
    source: Source,
    targets: Mapping[str, Any],
    on_read: Callable[[str, Any, dict[tuple[int, ...], Any]], None] | None = None,
) -> dict[str, Any]:
    """Each of ``targets`` (path -> sharded ``ShapeDtypeStruct`` of the stored array) read
    into its sharding, handed to ``on_read(path, array, host)`` on this thread as each is
    in, ``host`` the bytes read on the host by box origin."""
    import jax

    recs = source.record.by_path()
    out = {p: empty(t) for p, t in targets.items() if is_empty(t.shape)}
    paths = [p for p in targets if p not in out]
    stores = open_arrays(source, [recs[p] for p in paths], reader_context(source))
    # reserved whole where it fits (a chunk its reads share is decoded once), else by shard
    units: list[tuple[_Array, list[int], int]] = []
    for p, store in zip(paths, stores, strict=True):
        a = _Array(p, targets[p], store)
        sizes = [math.prod(hi - lo for lo, hi in b) * a.target.dtype.itemsize for b in a.boxes]
        if 0 < sum(sizes) < RESTORE_CONCURRENT_BYTES:
            units.append((a, list(range(len(a.boxes))), sum(sizes)))
        else:
            units += [(a, [i], n) for i, n in enumerate(sizes)]

    in_flight: collections.deque[tuple[_Array, list[int], int, list[Any]]] = collections.deque()
    reserved = 0

    def finish_oldest() -> None:
        nonlocal reserved
        a, idx, n, reads = in_flight.popleft()
        for _, done in reads:
            done.result()
        reserved -= n
        bufs = [buf for buf, _ in reads]
        placed = iter(place_boxes(bufs, [a.devices[i] for i in idx], a.target.sharding))
        for i, buf in zip(idx, bufs, strict=True):  # one array per device, box after box
            a.placed[i] = [next(placed) for _ in a.devices[i]]
            if on_read is not None:
                a.host[tuple(lo for lo, _ in a.boxes[i])] = buf
        a.left -= len(idx)
        if a.left == 0:
            flat = [x for group in a.placed for x in group]
            out[a.path] = x = jax.make_array_from_single_device_arrays(
                a.target.shape, a.target.sharding, flat
            )
            if on_read is not None:
                on_read(a.path, x, a.host)
            a.host = {}

    for a, idx, n in units:
        while in_flight and reserved + n >= RESTORE_CONCURRENT_BYTES:
            finish_oldest()
        cpu = a.devices[idx[0]][0].platform == "cpu"  # a CPU device keeps the buffer read
        reads = [
            start_read(a.store[tuple(slice(*b) for b in a.boxes[i])], adopted=cpu) for i in idx
        ]
        in_flight.append((a, idx, n, reads))
        reserved += n
    while in_flight:
        finish_oldest()
    return out


class _Array:
    """One array being read: its open store, its shards and what is placed so far."""

    def __init__(self, path: str, target: Any, store: Any):
        self.path, self.target, self.store = path, target, store
        groups = shard_boxes(target.sharding, tuple(target.shape))
        self.boxes, self.devices, self.left = list(groups), list(groups.values()), len(groups)
        self.placed: list[list[Any]] = [[] for _ in groups]
        self.host: dict[tuple[int, ...], Any] = {}  # the bytes read, by box origin


class ArrayReader:
    """``reader(box)``: that box of ``rec``'s stored array on the host, unverified; a failure
    is a CheckpointError naming the leaf. ``context``: one shared by a checkpoint's readers."""

    def __init__(self, source: Source, rec: LeafRecord, context: Any = None):
        self.source, self.rec = source, rec
        self.context = reader_context(source) if context is None else context
        self.store: Any = None

    def __call__(self, box: tuple[slice, ...]) -> Any:
        if is_empty(self.rec.stored_shape):
            return empty(stored_struct(self.rec))[box]
        try:
            if self.store is None:
                (self.store,) = open_arrays(self.source, [self.rec], self.context)
            out, done = start_read(self.store[box])
            done.result()
            return out
        except Exception as e:
            failure = read_failure(e, self.source.tree_dir)
            raise unreadable(self.source.path, [(self.rec.path, failure)]) from e


_STATUS = re.compile(r"^[A-Z_]+: ")  # TensorStore's status codes: "DATA_LOSS: ..."
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')
# TensorStore appends the whole spec it failed on, JSON with its context: noise to a reader
_SPEC = re.compile(r"\s*\[tensorstore_spec='(?:[^'\\]|\\.)*'\]")
_MAX_TEXT = 300  # characters of one failure shown
_MAX_NAMED = 8  # leaves named per failure before "and N more"


def _json_unreadable(tree_dir: Path) -> str | None:
    """The first of Orbax's JSON metadata files in ``tree_dir`` that does not parse."""
    import json

    names = ["_METADATA", "_sharding", "_CHECKPOINT_METADATA"]
    for f in [*(tree_dir / n for n in names), *sorted(tree_dir.glob("array_metadatas/*"))]:
        try:
            if f.is_file():
                json.loads(f.read_bytes())
        except (ValueError, RecursionError):
            return str(f)
    return None


def read_failure(e: BaseException, tree_dir: Path | None = None) -> str:
    """One leaf's read failure: TensorStore's innermost status (wrappers say less) names
    the chunk and the file; a JSON error is pinned on the file that fails."""
    chain: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and len(chain) < 16:
        chain.append(x)
        x = x.__cause__ or x.__context__
    best = next((c for c in reversed(chain) if _STATUS.match(str(c))), e)
    text = _SPEC.sub("", (str(best).strip().splitlines() or [""])[0])
    files = _LOCAL_FILE.findall(text)
    where = files[-1] if files else None
    if (
        where is None
        and tree_dir is not None
        and any(type(c).__name__ == "JSONDecodeError" for c in chain)
    ):
        where = _json_unreadable(tree_dir)
    if len(text) > _MAX_TEXT:  # cut between words
        text = text[: _MAX_TEXT - 1].rsplit(" ", 1)[0] + " …"
    return f"{type(best).__name__}: {text}" + (f"\n    file: {where}" if where else "")


def unreadable(where: Any, failures: Sequence[tuple[str, str]], alone: str = "") -> CheckpointError:
    """The error for the leaves of ``where`` that could not be read (none: ``alone`` says why)."""
    n = len(failures)
    what = f"{n} lea{'ves' if n != 1 else 'f'}" if n else "the checkpoint"
    lines = _grouped(failures) if n else [f"  {alone}"]
    return CheckpointError(
        f"cannot read {what} of {where} (damaged or incomplete checkpoint):\n"
        + "\n".join(lines)
        + "\nhint: a file of the checkpoint is damaged or missing (a copy cut short, a disk "
        "fault); use a complete copy of it, or an earlier checkpoint."
    )


def _grouped(failures: Sequence[tuple[str, str]]) -> list[str]:
    """One line per distinct failure naming its leaves: the same kind of error in the same
    file (OCDBT shares files between arrays) is one failure, shown by its first text."""
    groups: dict[str, tuple[str, list[str]]] = {}
    for path, text in failures:
        head, _, file = text.partition("\n    file: ")
        key = f"{head.split(':', 2)[:2]}|{file}" if file else text
        groups.setdefault(key, (text, []))[1].append(path or "<root>")
    return [f"  {some(paths, _MAX_NAMED)}: {text}" for text, paths in groups.values()]


def check_holdable(source: Source, paths: Sequence[str]) -> None:
    """Refuse the leaves of ``paths`` stored 64-bit while x64 is off: read, they would be
    narrowed and fail their checksums as if damaged."""
    recs = source.record.by_path()
    bad = []
    for p in paths:
        dt = parse_dtype(recs[p].stored_dtype)
        if canonical_dtype(dt) != dt:
            bad.append(f"  {p or '<root>'}: {recs[p].stored_dtype}{list(recs[p].stored_shape)}")
    if bad:
        n = len(bad)
        raise CheckpointError(
            f"cannot restore {n} lea{'ves' if n != 1 else 'f'} of {source.path} in this "
            "process: their 64-bit dtypes need jax_enable_x64, which is off (the checkpoint "
            "is fine):\n"
            + "\n".join(bad)
            + "\nhint: jax.config.update('jax_enable_x64', True) before using JAX."
        )


def verify_checksums(source: Source, values: Mapping[str, Any], sums: Mapping[str, str]) -> None:
    """Raise CheckpointError naming every leaf whose stored bits changed since saving."""
    recs = source.record.by_path()
    bad = [(recs[p], recs[p].checksum, sums[p]) for p in values if recs[p].checksum is not None]
    bad = [b for b in bad if b[1] != b[2]]
    if bad:
        raise CheckpointError(checksum_mismatch_message(str(source.path), bad))


def read_verified(source: Source, targets: Mapping[str, Any], verify: bool) -> dict[str, Any]:
    """``read_checked``; with ``verify``, each leaf's checksum summed from the bytes read as it
    arrives, while later leaves are read, then checked (CheckpointError naming the bad)."""
    recs = source.record.by_path()
    sums = Checksums({p: t for p, t in targets.items() if verify and recs[p].checksum})
    try:
        values = read_checked(source, targets, sums.add)
    except BaseException:
        sums.close()
        raise
    if verify:
        verify_checksums(source, values, sums.collect(values))
    return values


def read_checked(
    source: Source,
    targets: Mapping[str, Any],
    on_read: Callable[[str, Any, dict[tuple[int, ...], Any]], None] | None = None,
) -> dict[str, Any]:
    """``read_arrays``, a failure said with the bad leaves (each read again alone)."""
    try:
        return read_arrays(source, targets, on_read)
    except Exception as e:
        bad = []
        for p, t in targets.items():
            try:
                if len(targets) == 1:
                    raise e
                read_arrays(source, {p: t})
            except Exception as e1:
                bad.append((p, read_failure(e1, source.tree_dir)))
        raise unreadable(source.path, bad, read_failure(e, source.tree_dir)) from e
