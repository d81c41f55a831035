"""One safetensors export written by every process of a run: the files a one-process
export writes, byte for byte, each tensor written in place by a process holding it.

1. Every process computes the layout; a digest is gathered (processes that would write
   different exports are refused before anything is written).
2. Process 0 decides about the destination and creates each file's temporary under a
   token it broadcasts; the others check they see it (a shared file system is needed).
3. The plan comes from the shardings alone, the same on every process: a tensor held
   whole somewhere is written by one holder, one split across processes block by block
   by its owners (``LeastLoaded`` by bytes); mapped tensors no process holds whole are
   computed on every process in step (all-gathered) and written by one.
4. Positioned writes, fsync; outcomes gathered (a failure raised everywhere once process
   0 removed the temporaries); process 0 renames into place, index last.

Collectives never run inside a branch only process 0 takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._base import CheckpointError, DistributedError, LeastLoaded
from .._runtime import Outcome, broadcast, gather, outcome, require_addressable, shared_error
from .recipe import contiguous
from .writing import (
    Entry,
    FileLayout,
    check_pieces,
    commit_layout,
    encode_header,
    new_token,
    prepare_directory,
    temporary,
    write_index,
)

Block = tuple[tuple[int, int], ...]
"""A block of a tensor: ``(start, stop)`` per dimension."""


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """Who can write one stored tensor: ``holders`` (processes that hold it whole), else
    ``blocks`` (each block and its holders), else neither: computed on every process."""

    holders: frozenset[int] | None
    blocks: list[tuple[Block, frozenset[int]]] | None = None


def array_plan(x: Any) -> TensorPlan:
    """How one leaf can be written: a process-local value by process 0, a global array by
    the processes holding it whole, else block by block."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return TensorPlan(frozenset({0}))
    shape = tuple(x.shape)
    blocks: dict[Block, set[int]] = {}
    for d, idx in x.sharding.devices_indices_map(shape).items():
        blocks.setdefault(block_of(idx, shape), set()).add(d.process_index)
    size = math.prod(shape)
    covered: dict[int, int] = {}
    for b, procs in blocks.items():
        for p in procs:
            covered[p] = covered.get(p, 0) + volume(b)
    whole = frozenset(p for p, n in covered.items() if n == size)
    if whole:
        return TensorPlan(whole)
    return TensorPlan(None, [(b, frozenset(p)) for b, p in sorted(blocks.items())])


def whole_here(x: Any) -> bool:
    """Whether this process can read all of ``x`` from its own devices (or memory)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return True
    holders = array_plan(x).holders
    return holders is not None and jax.process_index() in holders


def block_of(index: Sequence[slice], shape: Sequence[int]) -> Block:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def volume(b: Block) -> int:
    return math.prod(hi - lo for lo, hi in b)


def local_block(x: jax.Array, b: Block) -> np.ndarray:
    """This process's copy of block ``b`` of ``x`` (one device's buffer, copied to the host)."""
    for shard in x.addressable_shards:
        if block_of(shard.index, x.shape) == b:
            return np.asarray(shard.data)
    raise DistributedError(  # a plan bug, not the user's: the plan named a block held here
        f"process {jax.process_index()} holds no device with block {list(b)} of a "
        f"{x.dtype}{list(x.shape)} array"
    )


@dataclasses.dataclass
class _Part:
    file: int
    offset: int  # of the tensor's first byte after the file's header
    entry: Entry
    blocks: list[Block] | None  # None: the whole tensor


def plan_parts(
    layout: FileLayout, plans: Mapping[str, TensorPlan], processes: int
) -> tuple[dict[int, list[_Part]], list[tuple[_Part, int]]]:
    """Every process's parts, and the tensors computed in step with their writers."""
    greedy = LeastLoaded(processes)
    mine: dict[int, list[_Part]] = {p: [] for p in range(processes)}
    step: list[tuple[_Part, int]] = []
    for f, (_, group) in enumerate(layout.files):
        offset = 0
        for name, shape, dt in group:
            item = np.dtype(dt).itemsize
            nbytes = math.prod(shape) * item
            at, offset = offset, offset + nbytes
            plan = plans[name]
            entry = (name, tuple(shape), dt)
            if nbytes == 0:
                continue
            if plan.holders is not None:
                w = greedy.pick(nbytes, plan.holders)
                mine[w].append(_Part(f, at, entry, None))
            elif plan.blocks is not None:
                chosen: dict[int, list[Block]] = {}
                for b, holders in plan.blocks:
                    chosen.setdefault(greedy.pick(volume(b) * item, holders), []).append(b)
                for w, bs in sorted(chosen.items()):
                    mine[w].append(_Part(f, at, entry, bs))
            else:
                step.append((_Part(f, at, entry, None), greedy.pick(nbytes)))
    return mine, step


def bytes_of(
    process: int, layout: FileLayout, plans: Mapping[str, TensorPlan], processes: int
) -> int:
    """How many bytes ``process`` writes of ``layout`` (what its progress counts)."""
    mine, step = plan_parts(layout, plans, processes)
    return sum(map(_nbytes, mine[process])) + sum(_nbytes(p) for p, w in step if w == process)


def _nbytes(part: _Part) -> int:
    _, shape, dt = part.entry
    n = math.prod(shape) if part.blocks is None else sum(volume(b) for b in part.blocks)
    return n * np.dtype(dt).itemsize


def _runs(shape: tuple[int, ...], b: Block) -> list[tuple[int, int]]:
    """Block ``b`` of a C-order tensor as ``(element offset, count)`` runs, in C order."""
    k = len(shape)
    while k > 0 and b[k - 1] == (0, shape[k - 1]):
        k -= 1
    inner = math.prod(shape[k:])
    if k == 0:
        return [(0, inner)]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    lo, hi = b[k - 1]
    run = (hi - lo) * inner
    out = []
    for lead in itertools.product(*(range(a, z) for a, z in b[: k - 1])):
        off = sum(i * strides[d] for d, i in enumerate(lead)) + lo * strides[k - 1]
        out.append((off, run))
    return out


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while data:
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


def _write_blocks(
    fd: int, base: int, shape: tuple[int, ...], dt: np.dtype[Any], got: dict[Block, np.ndarray]
) -> None:
    """Blocks at their places in a tensor at byte ``base``: blocks that together form
    whole rows in one write, any other run by run."""
    item = dt.itemsize
    rows: dict[tuple[int, int], list[Block]] = {}
    for b in got:
        rows.setdefault(b[0], []).append(b)
    rest = math.prod(shape[1:])
    for (lo, hi), bs in rows.items():
        if len(bs) > 1 and sum(volume(b) for b in bs) == (hi - lo) * rest:
            band = np.empty((hi - lo, *shape[1:]), dt)
            for b in bs:
                band[(slice(0, hi - lo), *(slice(a, z) for a, z in b[1:]))] = got[b]
            _pwrite_all(fd, memoryview(band.reshape(-1).view(np.uint8)), base + lo * rest * item)
            continue
        for b in bs:
            flat = contiguous(got[b]).reshape(-1).view(np.uint8)
            at = 0
            for off, n in _runs(shape, b):
                _pwrite_all(fd, memoryview(flat[at : at + n * item]), base + off * item)
                at += n * item


def _raise_shared(own: BaseException | None, ended: Sequence[Outcome], what: str) -> None:
    error = shared_error(own, ended, f"save_safetensors: {what}")
    if error is not None:
        raise error


def _digest(layout: FileLayout, metadata: Mapping[str, str] | None) -> str:
    doc = [
        str(layout.out),
        [[str(f), [[n, list(s), str(np.dtype(d))] for n, s, d in g]] for f, g in layout.files],
        sorted((str(k), str(v)) for k, v in (metadata or {}).items()),
    ]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def write_shared(
    layout: FileLayout,
    plans: Mapping[str, TensorPlan],
    compute: Callable[[str], Any],
    read_block: Callable[[str, Block], np.ndarray],
    metadata: Mapping[str, str] | None,
    check_destination: Callable[[FileLayout], None],
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write ``layout`` from every process of the run (each must call it, see the module
    doc). ``DistributedError``: the processes would write different exports;
    ``CheckpointError``: a refused destination, unseen temporaries, a failed process."""
    me, n = jax.process_index(), jax.process_count()
    digests = gather(_digest(layout, metadata), "modelshard:export:plan")
    if len(set(digests)) > 1:
        differ = [p for p, d in enumerate(digests) if d != digests[0]]
        raise DistributedError(
            f"save_safetensors: processes {', '.join(map(str, differ))} would write another "
            "export than process 0 (another path, other leaf names, shapes or dtypes, or "
            "other options); every process must call it with the same path, the same "
            "state structure and the same options"
        )
    heads = [encode_header(group, metadata)[0] for _, group in layout.files]
    error: BaseException | None = None
    token = ""
    if me == 0:
        token = new_token()
        try:
            check_destination(layout)
            prepare_directory(layout)
            for (final, group), head in zip(layout.files, heads, strict=True):
                with open(temporary(final, token), "xb") as f:
                    f.write(head)
                    f.truncate(
                        len(head) + sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in group)
                    )
        except Exception as e:
            error = e
    shared = broadcast({"token": token, "error": outcome(error)}, "modelshard:export:created")
    token = shared["token"]
    temps = [temporary(final, token) for final, _ in layout.files]
    if shared["error"] is not None:
        _remove_everywhere(temps, me, "modelshard:export:created-removed")
        _raise_shared(error, [shared["error"]], "creating the export's files")

    unseen = [str(t) for t in temps if not t.is_file()]
    seen = gather(unseen[:1], "modelshard:export:seen")
    if any(seen):
        _remove_everywhere(temps, me, "modelshard:export:seen-removed")
        p = next(p for p, s in enumerate(seen) if s)
        raise CheckpointError(
            f"save_safetensors: process {p} does not see {seen[p][0]}, which process 0 "
            "created: every process writes its part of one export, so the path must be on "
            "a file system that every process mounts (a shared directory)"
        )

    mine, step = plan_parts(layout, plans, n)
    error = None
    fds: dict[int, int] = {}

    def place(part: _Part) -> tuple[int, int]:  # (fd, the tensor's first byte)
        if part.file not in fds:
            fds[part.file] = os.open(temps[part.file], os.O_WRONLY)
        return fds[part.file], len(heads[part.file]) + part.offset

    try:
        for part in mine[me]:
            name, shape, dt = part.entry
            if part.blocks is None:
                _write_whole(*place(part), part.entry, compute(name))
            else:
                got = {b: _cast(read_block(name, b), np.dtype(dt)) for b in part.blocks}
                _write_blocks(*place(part), shape, np.dtype(dt), got)
                del got
            if progress is not None:
                progress(_nbytes(part))
    except Exception as e:
        error = e
    outcomes = gather(outcome(error), "modelshard:export:written")
    if step and not any(outcomes):
        for part, writer in step:  # every process in the same order: compute all-gathers
            try:
                value = compute(part.entry[0])
                if writer == me and error is None:
                    _write_whole(*place(part), part.entry, value)
                    if progress is not None:
                        progress(_nbytes(part))
                del value
            except Exception as e:
                error = error or e
        outcomes = gather(outcome(error), "modelshard:export:computed")
    try:
        for fd in fds.values():
            os.fsync(fd)
    except OSError as e:
        error = error or e
    finally:
        for fd in fds.values():
            os.close(fd)
    outcomes = gather(outcome(error), "modelshard:export:synced")
    if any(outcomes):
        _remove_everywhere(temps, me, "modelshard:export:written-removed")
        _raise_shared(error, outcomes, "writing the export")

    error = None
    if me == 0:
        index_tmp = None
        try:
            index_tmp = write_index(layout, token)
            commit_layout(layout, temps, index_tmp)
        except Exception as e:
            error = e
            _remove([*temps, *([] if index_tmp is None else [index_tmp])])
    ended = broadcast(outcome(error), "modelshard:export:committed")
    if ended is not None:
        _raise_shared(error, [ended], "renaming the export into place")
    return layout.out


def _cast(a: np.ndarray, dt: np.dtype[Any]) -> np.ndarray:
    return a if a.dtype == dt else a.astype(dt)


def _write_whole(fd: int, base: int, entry: Entry, got: Any) -> None:
    pos = base
    for a in check_pieces(entry, got):
        if a.size:
            _pwrite_all(fd, memoryview(a.reshape(-1).view(np.uint8)), pos)
            pos += a.nbytes


def _remove_everywhere(temps: Sequence[Path], me: int, key: str) -> None:
    """Process 0 removes the temporaries; every process returns once they are gone (so no
    caller sees a ``.partial`` after the error). A removal failure is not raised."""
    if me == 0:
        with contextlib.suppress(OSError):
            _remove(temps)
    broadcast(None, key)


def _remove(paths: Sequence[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class SharedPlan:
    """How processes share an export's writing: ``plans()`` (who can write each stored
    tensor) and ``read_block(name, block)`` (this process's copy of a block, not cast)."""

    plans: Callable[[], dict[str, TensorPlan]]
    read_block: Callable[[str, Block], np.ndarray]


def host_rows(x: Any, name: str = "") -> list[np.ndarray]:
    """One leaf on the host as blocks of whole rows, in order: a leaf sharded along its
    first axis only as its shards' own buffers (never assembled), else ``[host_leaf(x)]``."""
    if isinstance(x, jax.Array) and x.ndim > 0 and whole_here(x):
        blocks: dict[tuple[int, int], Any] = {}
        for shard in x.addressable_shards:
            idx = block_of(shard.index, x.shape)
            if idx[1:] != tuple((0, d) for d in x.shape[1:]):
                break
            blocks.setdefault(idx[0], shard.data)
        else:
            spans = sorted(blocks)
            if (
                spans
                and spans[0][0] == 0
                and spans[-1][1] == x.shape[0]
                and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            ):
                return [np.asarray(blocks[s]) for s in spans]
    return [host_leaf(x, name)]


def host_leaf(x: Any, name: str = "") -> np.ndarray:
    """One leaf as a fresh NumPy array from this process's shards (each block once):
    ``np.asarray(x)`` would cache the copy on the array and keep every written leaf alive.
    ``DistributedError`` where this process holds only part of it."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if not whole_here(x):
        require_addressable(x, name or "a leaf")
    out = np.empty(x.shape, x.dtype)
    done: set[Block] = set()
    for shard in x.addressable_shards:
        key = block_of(shard.index, x.shape)
        if key not in done:
            done.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


def full_leaf(x: Any, name: str) -> np.ndarray:
    """``host_leaf``, or all-gathered where this process holds only part of ``x`` (a
    collective: every process asks for the same leaves in the same order)."""
    if whole_here(x):
        return host_leaf(x, name)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
