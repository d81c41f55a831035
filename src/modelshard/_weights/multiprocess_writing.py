"""Safetensors written by this process alone, or by every process of a run: the same files,
byte for byte. Process 0 creates each file's temporary, which every process must see; each
tensor is written in place by a process holding it whole (``LeastLoaded``), block by block
by its owners, or computed in step everywhere and written by one. A failure is raised on
every process once the temporaries are gone; process 0 renames into place. Collectives
never run inside a branch only process 0 takes."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._base import CheckpointError, DistributedError, LeastLoaded, Progress, reporter
from .._runtime import Outcome, broadcast, gather, outcome, require_addressable, shared_error
from .recipe import contiguous
from .writing import (
    Entry,
    FileLayout,
    check_pieces,
    commit_layout,
    encode_header,
    entry_bytes,
    prepare_directory,
    temporary,
)

Block = tuple[tuple[int, int], ...]
"""A block of a tensor: ``(start, stop)`` per dimension."""


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """Who can write one stored tensor: ``holders`` (processes that hold it whole), else
    ``blocks`` (each block and its holders), else neither: computed on every process."""

    holders: frozenset[int] | None
    blocks: list[tuple[Block, frozenset[int]]] | None = None


_HERE = TensorPlan(frozenset({0}))


@dataclasses.dataclass(frozen=True)
class SharedPlan:
    """How processes share an export: ``plans()`` (who can write each stored tensor) and,
    where a plan has blocks, ``read_block(name, block)`` (this process's copy, not cast)."""

    plans: Callable[[], dict[str, TensorPlan]]
    read_block: Callable[[str, Block], np.ndarray] | None = None


def array_plan(x: Any) -> TensorPlan:
    """Who writes ``x``: process 0 (a process-local value), its whole holders, else by blocks."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return _HERE
    shape = tuple(x.shape)
    blocks: dict[Block, set[int]] = {}
    for d, idx in x.sharding.devices_indices_map(shape).items():
        blocks.setdefault(block_of(idx, shape), set()).add(d.process_index)
    covered: dict[int, int] = {}
    for b, procs in blocks.items():
        for p in procs:
            covered[p] = covered.get(p, 0) + volume(b)
    whole = frozenset(p for p, n in covered.items() if n == math.prod(shape))
    if whole:
        return TensorPlan(whole)
    return TensorPlan(None, [(b, frozenset(p)) for b, p in sorted(blocks.items())])


def whole_here(x: Any) -> bool:
    """Whether this process can read all of ``x`` from its own devices (or memory)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return True
    return jax.process_index() in (array_plan(x).holders or ())


def block_of(index: Sequence[slice], shape: Sequence[int]) -> Block:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape, strict=True))


def volume(b: Block) -> int:
    return math.prod(hi - lo for lo, hi in b)


def local_block(x: jax.Array, b: Block) -> np.ndarray:
    """This process's copy of block ``b`` of ``x`` (one device's buffer, on the host)."""
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

    @property
    def nbytes(self) -> int:
        if self.blocks is None:
            return entry_bytes(self.entry)
        return sum(map(volume, self.blocks)) * np.dtype(self.entry[2]).itemsize


def plan_parts(
    layout: FileLayout, plans: Mapping[str, TensorPlan] | None, processes: int
) -> tuple[dict[int, list[_Part]], list[tuple[_Part, int]]]:
    """Each process's parts, and the tensors computed in step with their writers."""
    greedy = LeastLoaded(processes)
    mine: dict[int, list[_Part]] = {p: [] for p in range(processes)}
    step: list[tuple[_Part, int]] = []
    for f, (_, group) in enumerate(layout.files):
        offset = 0
        for entry in group:
            at, nbytes = offset, entry_bytes(entry)
            offset += nbytes
            plan = _HERE if plans is None else plans[entry[0]]
            if nbytes == 0:
                continue
            if plan.holders is not None:
                mine[greedy.pick(nbytes, plan.holders)].append(_Part(f, at, entry, None))
            elif plan.blocks is not None:
                item = np.dtype(entry[2]).itemsize
                chosen: dict[int, list[Block]] = {}
                for b, holders in plan.blocks:
                    chosen.setdefault(greedy.pick(volume(b) * item, holders), []).append(b)
                for w, bs in sorted(chosen.items()):
                    mine[w].append(_Part(f, at, entry, bs))
            else:
                step.append((_Part(f, at, entry, None), greedy.pick(nbytes)))
    return mine, step


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
    out = []
    for lead in itertools.product(*(range(a, z) for a, z in b[: k - 1])):
        off = sum(i * strides[d] for d, i in enumerate(lead)) + lo * strides[k - 1]
        out.append((off, (hi - lo) * inner))
    return out


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while data:
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


def _write_blocks(
    fd: int, base: int, shape: tuple[int, ...], dt: np.dtype[Any], got: dict[Block, np.ndarray]
) -> None:
    """Blocks into the tensor at byte ``base``: whole rows in one write, others run by run."""
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


def _write_whole(fd: int, base: int, entry: Entry, got: Any) -> None:
    for a in check_pieces(entry, got):
        if a.size:
            _pwrite_all(fd, memoryview(a.reshape(-1).view(np.uint8)), base)
            base += a.nbytes


def _remove(paths: Sequence[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def _digest(layout: FileLayout, metadata: Mapping[str, str] | None) -> str:
    doc = [
        str(layout.out),
        [[str(f), [[n, list(s), str(np.dtype(d))] for n, s, d in g]] for f, g in layout.files],
        sorted((str(k), str(v)) for k, v in (metadata or {}).items()),
    ]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


class _Processes:
    """The processes writing one layout: every process of the run, or this one alone (no
    collective then, so a branch only process 0 takes may write)."""

    def __init__(self, several: bool):
        self.several = several
        self.me = jax.process_index() if several else 0
        self.n = jax.process_count() if several else 1

    def gather(self, value: Any, key: str) -> list[Any]:
        return gather(value, f"modelshard:export:{key}") if self.several else [value]

    def broadcast(self, value: Any, key: str) -> Any:
        return broadcast(value, f"modelshard:export:{key}") if self.several else value

    def fail(self, temps: Sequence[Path], key: str, error: BaseException) -> BaseException:
        """``error``, once process 0 removed the temporaries (every process waits for that,
        so no caller sees one after the error; a removal failure is not raised)."""
        if self.me == 0:
            with contextlib.suppress(OSError):
                _remove(temps)
        self.broadcast(None, f"{key}-removed")
        return error


def _shared(own: BaseException | None, ended: Sequence[Outcome], what: str) -> BaseException:
    """The error every process raises (an interrupt stays one on its own process)."""
    if own is not None and not isinstance(own, Exception):
        return own
    return shared_error(own, ended, f"save_safetensors: {what}") or CheckpointError(what)


def write_layout(
    layout: FileLayout,
    compute: Callable[[str], Any],
    metadata: Mapping[str, str] | None,
    *,
    shared: SharedPlan | None = None,
    progress: Progress = False,
    refuse: Callable[[], None] | None = None,
) -> Path:
    """Write ``layout`` (``compute(name)``: an array, or blocks of whole rows): from this
    process, or with ``shared`` from every process (each must call it). ``refuse``: process
    0's check of the destination. ``DistributedError``: the processes would write different
    exports; ``CheckpointError``: a refused destination, unseen temporaries, a failure."""
    run = _Processes(shared is not None and jax.process_count() > 1)
    me = run.me
    digests = run.gather(_digest(layout, metadata), "plan")
    if len(set(digests)) > 1:
        differ = [p for p, d in enumerate(digests) if d != digests[0]]
        raise DistributedError(
            f"save_safetensors: processes {', '.join(map(str, differ))} would write another "
            "export than process 0 (another path, other leaf names, shapes or dtypes, or "
            "other options); every process must call it with the same path, the same "
            "state structure and the same options"
        )
    heads = [encode_header(group, metadata) for _, group in layout.files]
    error: BaseException | None = None
    token = ""
    if me == 0:
        token = uuid.uuid4().hex[:16]
        try:
            if refuse is not None:
                refuse()
            prepare_directory(layout)
            for (final, group), head in zip(layout.files, heads, strict=True):
                with open(temporary(final, token), "xb") as f:
                    f.write(head)
                    f.truncate(len(head) + sum(map(entry_bytes, group)))
        except BaseException as e:
            error = e
    created = run.broadcast({"token": token, "error": outcome(error)}, "created")
    temps = [temporary(final, created["token"]) for final, _ in layout.files]
    if created["error"] is not None:
        ended = [created["error"]]
        raise run.fail(temps, "created", _shared(error, ended, "creating the export's files"))
    unseen = [str(t) for t in temps if not t.is_file()]
    seen = run.gather(unseen[:1], "seen")
    if any(seen):
        p = next(p for p, s in enumerate(seen) if s)
        raise run.fail(
            temps,
            "seen",
            CheckpointError(
                f"save_safetensors: process {p} does not see {seen[p][0]}, which process 0 "
                "created: every process writes its part of one export, so the path must be "
                "on a file system that every process mounts (a shared directory)"
            ),
        )

    plans = shared.plans() if run.several and shared is not None else None
    mine, step = plan_parts(layout, plans, run.n)
    total = sum(p.nbytes for p in mine[me]) + sum(p.nbytes for p, w in step if w == me)
    fds: dict[int, int] = {}

    def place(part: _Part) -> tuple[int, int]:  # (fd, the tensor's first byte)
        if part.file not in fds:
            fds[part.file] = os.open(temps[part.file], os.O_WRONLY)
        return fds[part.file], len(heads[part.file]) + part.offset

    with reporter(progress, total, "Writing safetensors") as report:
        done = 0

        def wrote(part: _Part) -> None:
            nonlocal done
            done += part.nbytes
            if report is not None:
                report(done, total)

        try:
            for part in mine[me]:
                name, shape, dt = part.entry
                if part.blocks is None:
                    _write_whole(*place(part), part.entry, compute(name))
                else:
                    assert shared is not None and shared.read_block is not None
                    dt = np.dtype(dt)
                    got = {
                        b: shared.read_block(name, b).astype(dt, copy=False) for b in part.blocks
                    }
                    _write_blocks(*place(part), shape, dt, got)
                    del got
                wrote(part)
        except BaseException as e:
            error = e
        outcomes = run.gather(outcome(error), "written")
        if step and not any(outcomes):
            for part, writer in step:  # every process in the same order: compute all-gathers
                try:
                    value = compute(part.entry[0])
                    if writer == me and error is None:
                        _write_whole(*place(part), part.entry, value)
                        wrote(part)
                    del value
                except BaseException as e:
                    error = error or e
            outcomes = run.gather(outcome(error), "computed")
    try:
        for fd in fds.values():
            os.fsync(fd)
    except OSError as e:
        error = error or e
    finally:
        for fd in fds.values():
            os.close(fd)
    outcomes = run.gather(outcome(error), "synced")
    if any(outcomes):
        raise run.fail(temps, "written", _shared(error, outcomes, "writing the export"))
    error = None
    if me == 0:
        try:
            commit_layout(layout, temps, token)
        except BaseException as e:
            error = e
    ended = run.broadcast(outcome(error), "committed")
    if ended is not None:
        raise _shared(error, [ended], "renaming the export into place")
    return layout.out


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
        else:  # the spans must tile the first axis: each starts where the one before ends
            spans = sorted(blocks)
            ends = [0] + [hi for _, hi in spans]
            if spans and [lo for lo, _ in spans] == ends[:-1] and ends[-1] == x.shape[0]:
                return [np.asarray(blocks[s]) for s in spans]
    return [host_leaf(x, name)]


def host_leaf(x: Any, name: str = "") -> np.ndarray:
    """One leaf as a fresh array from this process's shards (``np.asarray(x)`` would cache
    the copy on the array); ``DistributedError`` where this process holds only part."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if not whole_here(x):
        require_addressable(x, name or "a leaf")
    out = np.empty(x.shape, x.dtype)
    for shard in {block_of(s.index, x.shape): s for s in x.addressable_shards}.values():
        out[shard.index] = np.asarray(shard.data)  # one replica of each block
    return out


def full_leaf(x: Any, name: str) -> np.ndarray:
    """``host_leaf``, or all-gathered where this process holds only part of ``x`` (a
    collective: every process asks for the same leaves in the same order)."""
    if whole_here(x):
        return host_leaf(x, name)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
