"""Recipes: a target leaf as a tree of ``Node`` over stored tensors (``Read``), shapes known
before any read; ``read(index, fetch)`` passes the block down, so a device reads only its
part. ``invert`` runs recipes backwards for an export."""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._base import dtype_name

Index = tuple[slice, ...]
Fetch = Callable[[str, Index], np.ndarray]
"""``fetch(key, index)``: that part of the stored tensor ``key`` as a NumPy array."""

# Buffers this large get their own anonymous map, returned to the system when freed: a
# load's freed device slices would otherwise stay resident as heap fragments.
OWN_MAP_BYTES = 1 << 20


def host_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialised C-order array; a large one in its own memory map."""
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    if n < OWN_MAP_BYTES:
        return np.empty(tuple(shape), dt)
    return np.frombuffer(mmap.mmap(-1, n), dt).reshape(tuple(shape))


def contiguous(a: Any) -> np.ndarray:
    """``a`` as a C-contiguous array, rank kept (``np.ascontiguousarray`` makes 0-d 1-d)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else copy_of(a)


def copy_of(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``a`` in a buffer of its own."""
    out = host_empty(a.shape, a.dtype)
    copy_tiled(out, a)
    return out


def unaliased(a: Any) -> np.ndarray:
    """``a`` to hand to JAX: a C-contiguous read-only view (of a map, of a shard) copied, as
    JAX could alias it and keep all the viewed memory alive."""
    a = np.asarray(a)
    return copy_of(a) if a.flags.c_contiguous and not a.flags.writeable else a


# A transposing copy in TILE x TILE blocks keeps both sides of a block in cache.
TILE = 128


def copy_tiled(out: np.ndarray, a: np.ndarray, casting: Any = "same_kind") -> None:
    """``out[...] = a`` for a C-contiguous ``out``, in tiles when ``a`` is transposed."""
    moving = [i for i in range(a.ndim) if a.shape[i] > 1]
    inner = min(moving, key=lambda i: abs(a.strides[i]), default=None)
    if len(moving) < 2 or inner == moving[-1]:
        np.copyto(out, a, casting=casting)
        return
    assert inner is not None
    last = moving[-1]
    whole = [slice(None)] * a.ndim
    for i in range(0, a.shape[inner], TILE):
        for j in range(0, a.shape[last], TILE):
            idx = list(whole)
            idx[inner], idx[last] = slice(i, i + TILE), slice(j, j + TILE)
            t = tuple(idx)
            np.copyto(out[t], a[t], casting=casting)


def norm_index(index: Index | None, shape: Sequence[int]) -> Index:
    """``index`` as plain ``slice(start, stop)`` bounds (``None``: the whole array)."""
    if index is None:
        return tuple(slice(0, d) for d in shape)
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape, strict=True))


class Node:
    """One step of a recipe: its ``shape`` and ``dtype`` are known before any read."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        """The block ``index`` of the value (``None``: all), maybe a view of a stored tensor."""
        raise NotImplementedError

    def read_into(self, index: Index | None, fetch: Fetch, out: np.ndarray) -> None:
        """``out[...] = self.read(index, fetch)``, straight into ``out`` where it can."""
        copy_tiled(out, self.read(index, fetch))

    def reads(self) -> list[str]:
        """The stored tensors this node reads, in order."""
        raise NotImplementedError

    def describe(self) -> str:
        """The recipe as text: ``transpose(1, 0) of model.w``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.describe()}: {dtype_name(self.dtype)}{list(self.shape)}>"


class _OneChild(Node):
    child: Node

    def reads(self) -> list[str]:
        return self.child.reads()


class _Children(Node):
    children: list[Node]
    axis: int

    def reads(self) -> list[str]:
        return [k for c in self.children for k in c.reads()]

    def describe(self) -> str:
        first = self.children[0].describe()
        verb = "stack" if isinstance(self, Stacked) else "concat"
        return f"{verb}(axis {self.axis}) of {len(self.children)}: {first}, ..."


@dataclasses.dataclass(repr=False)
class Read(Node):
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        return fetch(self.key, norm_index(index, self.shape))

    def read_into(self, index: Index | None, fetch: Fetch, out: np.ndarray) -> None:
        if getattr(fetch, "reads_into", False) and out.flags.c_contiguous:
            got = fetch(self.key, norm_index(index, self.shape), out)  # type: ignore[call-arg]
            if got is not out:
                copy_tiled(out, got)
        else:
            copy_tiled(out, self.read(index, fetch))

    def reads(self) -> list[str]:
        return [self.key]

    def describe(self) -> str:
        return self.key


@dataclasses.dataclass(repr=False)
class Permuted(_OneChild):
    child: Node
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        self.shape = tuple(self.child.shape[p] for p in self.perm)
        self.dtype = self.child.dtype

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        index = norm_index(index, self.shape)
        inner = tuple(index[self.perm.index(p)] for p in range(len(self.perm)))
        return self.child.read(inner, fetch).transpose(self.perm)

    def describe(self) -> str:
        return f"transpose{self.perm} of {self.child.describe()}"


@dataclasses.dataclass(repr=False)
class Reshaped(_OneChild):
    """``child`` in another shape (C order). A block of the result that is one block of the
    child (a range of ``h`` of ``(h d) -> h, d``) reads only that; any other reads the whole
    child, once per leaf where ``fetch`` has a ``wholes`` dict to keep it in."""

    child: Node
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        self.dtype = self.child.dtype
        self._groups = reshape_groups(self.child.shape, self.shape)

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        if index is not None and self._groups is not None:
            index = norm_index(index, self.shape)
            inner = child_block(self._groups, self.child.shape, self.shape, index)
            if inner is not None:
                block = tuple(s.stop - s.start for s in index)
                return self.child.read(inner, fetch).reshape(block)
        wholes: dict[int, np.ndarray] = getattr(fetch, "wholes", {})  # one read per leaf
        if id(self) not in wholes:
            wholes[id(self)] = self.child.read(None, fetch).reshape(self.shape)
        whole = wholes[id(self)]
        return whole if index is None else whole[index]

    def describe(self) -> str:
        return f"reshape{self.shape} of {self.child.describe()}"


Groups = list[tuple[tuple[int, int], tuple[int, int]]]


def reshape_groups(a: Sequence[int], b: Sequence[int]) -> Groups | None:
    """A reshape as groups of consecutive axes of equal products (``(6, 4) -> (2, 3, 4)``:
    ``[((0, 1), (0, 2)), ((1, 2), (2, 3))]``); ``None`` for empty shapes."""
    if 0 in a or 0 in b:
        return None
    groups: Groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        i0, j0, pa, pb = i, j, 1, 1
        if i < len(a):
            pa, i = a[i], i + 1
        if j < len(b):
            pb, j = b[j], j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
            else:
                return None
        groups.append(((i0, i), (j0, j)))
    return groups


def child_block(groups: Groups, a: Sequence[int], b: Sequence[int], index: Index) -> Index | None:
    """The block of the input (shape ``a``) holding exactly the block ``index`` of the
    output (shape ``b``), or ``None`` where that is not one block."""
    out: list[slice] = []
    for (i0, i1), (j0, j1) in groups:
        flat = _flat_range(b[j0:j1], index[j0:j1])
        if flat is None:
            return None
        part = _block_of(a[i0:i1], *flat)
        if part is None:
            return None
        out.extend(part)
    return tuple(out)


def _flat_range(sizes: Sequence[int], index: Sequence[slice]) -> tuple[int, int] | None:
    """``index`` over ``sizes`` as one range of their C-order flattening, or ``None``."""
    t = len(sizes)
    while t > 0 and index[t - 1].start == 0 and index[t - 1].stop == sizes[t - 1]:
        t -= 1
    if t == 0:
        return 0, math.prod(sizes)
    t -= 1  # the one axis that may be a range
    if any(index[q].stop - index[q].start != 1 for q in range(t)):
        return None
    inner = math.prod(sizes[t + 1 :])
    base = sum(index[q].start * math.prod(sizes[q + 1 :]) for q in range(t))
    return base + index[t].start * inner, base + index[t].stop * inner


def _block_of(sizes: Sequence[int], lo: int, hi: int) -> list[slice] | None:
    """``[lo, hi)`` of the C-order flattening of ``sizes`` as a block (points, then one
    range, then whole axes), or ``None``."""
    if hi <= lo:
        return None
    if not sizes:
        return [] if (lo, hi) == (0, 1) else None
    for t in range(len(sizes)):
        inner = math.prod(sizes[t + 1 :])
        if lo % inner or hi % inner:
            continue
        q_lo, q_hi = lo // inner, hi // inner
        outer = q_lo // sizes[t]
        if (q_hi - 1) // sizes[t] != outer:
            continue
        points: list[slice] = []
        for q in reversed(range(t)):
            outer, c = divmod(outer, sizes[q])
            points.insert(0, slice(c, c + 1))
        rng = slice(q_lo % sizes[t], (q_hi - 1) % sizes[t] + 1)
        return [*points, rng, *(slice(0, d) for d in sizes[t + 1 :])]
    return None


@dataclasses.dataclass(repr=False)
class Take(_OneChild):
    """Index ``i`` of axis ``axis`` of ``child`` (the axis is dropped)."""

    child: Node
    axis: int
    i: int

    def __post_init__(self) -> None:
        s = self.child.shape
        self.shape = s[: self.axis] + s[self.axis + 1 :]
        self.dtype = self.child.dtype

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        index = norm_index(index, self.shape)
        inner = (*index[: self.axis], slice(self.i, self.i + 1), *index[self.axis :])
        return np.squeeze(self.child.read(inner, fetch), axis=self.axis)

    def describe(self) -> str:
        return f"[{self.i}] of axis {self.axis} of {self.child.describe()}"


@dataclasses.dataclass(repr=False)
class Stacked(_Children):
    """``children`` stacked along a new axis ``axis``."""

    children: list[Node]
    axis: int

    def __post_init__(self) -> None:
        s = self.children[0].shape
        self.shape = (*s[: self.axis], len(self.children), *s[self.axis :])
        self.dtype = self.children[0].dtype

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        index = norm_index(index, self.shape)
        rest = index[: self.axis] + index[self.axis + 1 :]
        out = host_empty([s.stop - s.start for s in index], self.dtype)
        for i, c in enumerate(self.children[index[self.axis]]):
            c.read_into(rest, fetch, out[(slice(None),) * self.axis + (i,)])
        return out


@dataclasses.dataclass(repr=False)
class Joined(_Children):
    """``children`` joined along their existing axis ``axis`` (fused q, k, v)."""

    children: list[Node]
    axis: int

    def __post_init__(self) -> None:
        s = self.children[0].shape
        n = sum(c.shape[self.axis] for c in self.children)
        self.shape = (*s[: self.axis], n, *s[self.axis + 1 :])
        self.dtype = self.children[0].dtype

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        index = norm_index(index, self.shape)
        ax = self.axis
        lo, hi = index[ax].start, index[ax].stop
        parts, start = [], 0
        for c in self.children:
            a, b = max(lo, start), min(hi, start + c.shape[ax])
            if a < b:  # the child's part, and where it goes in the block
                sub = (*index[:ax], slice(a - start, b - start), *index[ax + 1 :])
                parts.append((c, sub, slice(a - lo, b - lo)))
            start += c.shape[ax]
        if len(parts) == 1:
            return parts[0][0].read(parts[0][1], fetch)
        out = host_empty([s.stop - s.start for s in index], self.dtype)
        for c, sub, at in parts:
            c.read_into(sub, fetch, out[(slice(None),) * ax + (at,)])
        return out


@dataclasses.dataclass(repr=False)
class Slice(_OneChild):
    """Indices ``[lo, hi)`` of axis ``axis`` of ``child`` (one part of a fused tensor)."""

    child: Node
    axis: int
    lo: int
    hi: int

    def __post_init__(self) -> None:
        s = self.child.shape
        self.shape = (*s[: self.axis], self.hi - self.lo, *s[self.axis + 1 :])
        self.dtype = self.child.dtype

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        index = norm_index(index, self.shape)
        ax, lo = self.axis, self.lo
        inner = (*index[:ax], slice(index[ax].start + lo, index[ax].stop + lo), *index[ax + 1 :])
        return self.child.read(inner, fetch)

    def describe(self) -> str:
        return f"[{self.lo}:{self.hi}] of axis {self.axis} of {self.child.describe()}"


@dataclasses.dataclass(repr=False)
class Cast(_OneChild):
    child: Node
    dtype: np.dtype[Any]

    def __post_init__(self) -> None:
        self.shape = self.child.shape

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        x = self.child.read(index, fetch)
        out = host_empty(x.shape, self.dtype)
        copy_tiled(out, x, casting="unsafe")
        return out

    def read_into(self, index: Index | None, fetch: Fetch, out: np.ndarray) -> None:
        copy_tiled(out, self.child.read(index, fetch), casting="unsafe")

    def describe(self) -> str:
        return f"cast({dtype_name(self.dtype)}) of {self.child.describe()}"


ARITH_INVERSE = {"add": "sub", "sub": "add", "mul": "div", "div": "mul"}
_UFUNCS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


@dataclasses.dataclass(repr=False)
class Arith(_OneChild):
    """``child`` ``op`` (``add``, ``sub``, ``mul``, ``div``) the constant ``value``, elementwise,
    computed in float32 at least and rounded to ``child``'s dtype."""

    child: Node
    op: str
    value: float

    def __post_init__(self) -> None:
        self.shape = self.child.shape
        self.dtype = self.child.dtype

    def read(self, index: Index | None, fetch: Fetch) -> np.ndarray:
        wide = np.promote_types(np.dtype(self.dtype), np.float32)
        out = Cast(self.child, wide).read(index, fetch)
        with np.errstate(all="ignore"):
            _UFUNCS[self.op](out, np.asarray(self.value, wide), out=out)
        if wide == self.dtype:
            return out
        narrow = host_empty(out.shape, self.dtype)
        np.copyto(narrow, out, casting="unsafe")
        return narrow

    def describe(self) -> str:
        return f"{self.op}({self.value!r}) of {self.child.describe()}"


def invert(targets: Mapping[str, Node]) -> dict[str, Node]:
    """The recipes run backwards: each stored tensor that ``targets`` (path -> recipe) read,
    computed from the targets (``Read(path)``); the pieces ``Take``s and ``Slice``s cut are
    stacked or concatenated back."""
    out: dict[str, Node] = {}
    pieces: dict[int, dict[str, Any]] = {}
    for target, node in targets.items():
        _invert(node, Read(target, node.shape, node.dtype), out, pieces)
    for slot in pieces.values():
        parts, child = slot["parts"], slot["node"]
        values = [parts[k] for k in sorted(parts)]
        join = Stacked if len(values[0].shape) < len(child.shape) else Joined
        _invert(child, join(values, slot["axis"]), out, {})
    return out


def _invert(
    node: Node, value: Node, out: dict[str, Node], pieces: dict[int, dict[str, Any]]
) -> None:
    if isinstance(node, Read):
        out[node.key] = value
    elif isinstance(node, Cast):
        _invert(node.child, Cast(value, node.child.dtype), out, pieces)
    elif isinstance(node, Arith):
        _invert(node.child, Arith(value, ARITH_INVERSE[node.op], node.value), out, pieces)
    elif isinstance(node, Permuted):
        back = tuple(int(i) for i in np.argsort(node.perm))
        _invert(node.child, Permuted(value, back), out, pieces)
    elif isinstance(node, Reshaped):
        _invert(node.child, Reshaped(value, node.child.shape), out, pieces)
    elif isinstance(node, Stacked):
        for i, c in enumerate(node.children):
            _invert(c, Take(value, node.axis, i), out, pieces)
    elif isinstance(node, Joined):
        start = 0
        for c in node.children:
            n = c.shape[node.axis]
            _invert(c, Slice(value, node.axis, start, start + n), out, pieces)
            start += n
    elif isinstance(node, Take | Slice):
        child = node.child
        slot = pieces.setdefault(id(child), {"node": child, "axis": node.axis, "parts": {}})
        slot["parts"][node.i if isinstance(node, Take) else node.lo] = value
    else:  # pragma: no cover - every node type is handled above
        raise TypeError(type(node).__name__)


def as_dtype(dtype: Any) -> Any:
    """``np.dtype(dtype)``, or ``dtype`` itself for JAX's extended dtypes (``key<fry>``)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype."""
    import jax

    return not isinstance(dtype, np.dtype) and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def on_key_data(node: Node, data: Callable[[str], tuple[tuple[int, ...], Any]]) -> Node:
    """A PRNG key leaf's recipe over the stored key data (``data(key)``: its shape and
    dtype, ``[..., 2]`` uint32 for threefry): the same steps on the leading axes."""

    def rw(n: Node) -> Node:
        if isinstance(n, Read):
            shape, dtype = data(n.key)
            return Read(n.key, tuple(shape), np.dtype(dtype))
        if isinstance(n, Permuted):
            child = rw(n.child)
            k = len(n.perm)
            return Permuted(child, (*n.perm, *range(k, len(child.shape))))
        if isinstance(n, Reshaped):
            child = rw(n.child)
            return Reshaped(child, (*n.shape, *child.shape[len(n.child.shape) :]))
        if isinstance(n, Take | Slice):  # the same cut of the leading axes
            return dataclasses.replace(n, child=rw(n.child))
        if isinstance(n, Stacked | Joined):
            return dataclasses.replace(n, children=[rw(c) for c in n.children])
        raise TypeError(f"a PRNG key leaf cannot be computed by {n.describe()}")

    return rw(node)


Spec = tuple[Any, ...]
"""A partition spec as a tuple of entries, one per dimension (``None``: not split)."""


def needed_specs(node: Node, spec: Spec, out: dict[str, list[Spec]]) -> None:
    """Into ``out``, for each stored tensor ``node`` reads, a spec under which each device's
    shard holds what its block of ``node`` (placed with ``spec``) reads; an axis a step
    cannot follow (a reshape's, a slice's cut) is not split."""
    spec = tuple(spec) + (None,) * (len(node.shape) - len(spec))
    if isinstance(node, Read):
        out.setdefault(node.key, []).append(spec)
    elif isinstance(node, Cast | Arith):
        needed_specs(node.child, spec, out)
    elif isinstance(node, Permuted):
        inner = tuple(spec[node.perm.index(p)] for p in range(len(node.perm)))
        needed_specs(node.child, inner, out)
    elif isinstance(node, Take):
        needed_specs(node.child, (*spec[: node.axis], None, *spec[node.axis :]), out)
    elif isinstance(node, Slice | Joined):
        cut = (*spec[: node.axis], None, *spec[node.axis + 1 :])
        for c in node.children if isinstance(node, Joined) else [node.child]:
            needed_specs(c, cut, out)
    elif isinstance(node, Stacked):
        for c in node.children:
            needed_specs(c, spec[: node.axis] + spec[node.axis + 1 :], out)
    elif isinstance(node, Reshaped):
        needed_specs(node.child, reshape_spec_back(node, spec), out)
    else:  # pragma: no cover - every node type is handled above
        raise TypeError(type(node).__name__)


def reshape_spec_back(node: Reshaped, spec: Spec) -> Spec:
    """A reshape's input spec: an axis left alone keeps its entry, one split into several
    (``(h d) -> h, d``) the first's when the others are not split; any other is whole."""
    inner: list[Any] = [None] * len(node.child.shape)
    if node._groups is None:
        return tuple(inner)
    for (i0, i1), (j0, j1) in node._groups:
        entries = spec[j0:j1]
        if i1 - i0 == 1 and all(e is None for e in entries[1:]):
            inner[i0] = entries[0] if entries else None
    return tuple(inner)


def carried_spec(node: Node, spec_of: Callable[[str], Spec | None]) -> Spec | None:
    """The spec of ``node``'s result when each stored tensor keeps its own (``spec_of``);
    ``None`` where unknown, where the parts' specs disagree or a reshape intervenes."""
    if isinstance(node, Read):
        s = spec_of(node.key)
        return None if s is None else tuple(s) + (None,) * (len(node.shape) - len(s))
    if isinstance(node, Reshaped):
        return None  # the stored spec does not carry over
    if isinstance(node, _Children):
        parts = {carried_spec(c, spec_of) for c in node.children}
        s = parts.pop() if len(parts) == 1 else None
        if s is None:
            return None
        rest = s[node.axis :] if isinstance(node, Stacked) else s[node.axis + 1 :]
        return (*s[: node.axis], None, *rest)
    assert isinstance(node, _OneChild)
    s = carried_spec(node.child, spec_of)
    if s is None or isinstance(node, Cast | Arith):
        return s
    if isinstance(node, Permuted):
        return tuple(s[p] for p in node.perm)
    if isinstance(node, Take):
        return s[: node.axis] + s[node.axis + 1 :]
    assert isinstance(node, Slice)
    return (*s[: node.axis], None, *s[node.axis + 1 :])
