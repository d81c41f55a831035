"""Hypothesis strategies for the fuzz suite, and the suite's own oracle.

Everything here is independent of modelshard: containers are built with their paths known
by construction, specs are generated from *recipes* (plain tuples this module interprets
itself), and :func:`expect` decides validity from first principles (rank, known axes,
repeats, divisibility, prefix coverage, first-match rules). ``tests/journeys/test_fuzz.py`` then
compares that verdict with what ``plan``/``shard``/``expand_args`` do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx  # imported up front: importing Flax touches the `random` module
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms

AXIS_NAMES = ("data", "model", "expert")
UNKNOWN = "nope"
# Sizes include 0, 1 and primes; the rest divide the mesh axis sizes (1, 2, 4, 8).
DIMS = (0, 1, 2, 3, 4, 5, 7, 8, 12, 16)
DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "int8",
    "int32",
    "uint8",
    "bool",
    "complex64",
    "float8_e4m3fn",
    "int4",
    "key",
    "float64",  # as NumPy leaves; placed as float32 without jax_enable_x64
    "int64",
)
KEYS = ("a", "b", "w", "kernel", "bias")
MAX_ELEMENTS = 4096

# ---- meshes --------------------------------------------------------------------------


@functools.cache
def mesh_of(names: tuple[str, ...], sizes: tuple[int, ...], axis_type: str) -> Any:
    return ms.make_mesh(dict(zip(names, sizes, strict=True)), axis_types=axis_type)


@st.composite
def meshes(draw: st.DrawFn) -> Any:
    """1-3 named axes whose sizes multiply to a divisor of 8; Auto or Explicit."""
    n = draw(st.integers(1, 3))
    names = tuple(draw(st.permutations(AXIS_NAMES))[:n])
    sizes: list[int] = []
    for _ in range(n):
        left = 8 // math.prod(sizes)
        sizes.append(draw(st.sampled_from([s for s in (1, 2, 4, 8) if s <= left])))
    return mesh_of(names, tuple(sizes), draw(st.sampled_from(["auto", "explicit"])))


def sizes_of(mesh: Any) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


# ---- containers ----------------------------------------------------------------------


@dataclasses.dataclass
class Leaf:
    """One leaf of a generated container: how to reach it, and its value."""

    access: tuple[tuple[str, Any], ...]  # ("item", key) | ("attr", name) | ("var", None)
    value: Any

    @property
    def path(self) -> str:
        return "/".join(str(k) for kind, k in self.access if kind != "var")

    @property
    def is_node(self) -> bool:
        return self.value is NODE

    @property
    def is_array(self) -> bool:
        return isinstance(self.value, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)


def reach(obj: Any, access: tuple[tuple[str, Any], ...]) -> Any:
    """The value at ``access`` inside ``obj`` (an output of ``shard``)."""
    for kind, key in access:
        if kind == "item":
            obj = obj[key]
        elif kind == "attr":
            obj = getattr(obj, key)
        else:
            obj = obj.get_value()
    return obj


NODE = object()  # marks an inner node (dict, list, module...): prefix entries may name it


class Pair(NamedTuple):
    first: Any
    second: Any


class Box(eqx.Module):
    w: Any
    b: Any
    tag: str = eqx.field(static=True, default="box")


@dataclasses.dataclass
class Container:
    tree: Any
    leaves: list[Leaf]  # array leaves, static leaves and NODE markers, in no particular order

    @property
    def arrays(self) -> list[Leaf]:
        return [x for x in self.leaves if x.is_array]

    @property
    def values(self) -> list[Leaf]:
        """Array and static leaves (no inner-node markers)."""
        return [x for x in self.leaves if not x.is_node]


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "int4":
        return rng.integers(-8, 8, shape).astype(jnp.int4)
    if dtype in ("int8", "int32", "uint8", "int64"):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dtype)
    if dtype == "complex64":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)
    return rng.standard_normal(shape).astype(jnp.dtype(dtype))


@st.composite
def shapes(draw: st.DrawFn, max_rank: int = 4) -> tuple[int, ...]:
    rank = draw(st.integers(0, max_rank))
    shape = tuple(draw(st.sampled_from(DIMS)) for _ in range(rank))
    if math.prod(shape) > MAX_ELEMENTS:
        shape = tuple(min(d, 4) for d in shape)
    return shape


@st.composite
def arrays(draw: st.DrawFn, jax_only: bool = False) -> Any:
    """A NumPy/JAX array, NumPy scalar, typed key array or ShapeDtypeStruct, possibly
    committed to one device or sharded on another mesh already (``jax_only``: a jax.Array)."""
    shape = draw(shapes())
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    forms = ["jax", "committed", "resharded"] if jax_only else ["numpy", "sds"]
    form = draw(st.sampled_from([*forms, "jax", "committed", "resharded"]))
    if dtype == "key":
        x = jax.random.wrap_key_data(
            jax.device_put(rng.integers(0, 2**32, (*shape, 2), dtype=np.uint32))
        )
        if form == "sds":
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        form = "jax" if form == "numpy" else form
    else:
        x = _values(rng, shape, dtype)
        if form == "numpy":
            if draw(st.integers(0, 15)) == 0:  # NumPy leaves JAX refuses to hold
                return draw(st.sampled_from(REFUSED))(x)
            return x[()] if not shape and draw(st.booleans()) else x
        if form == "sds":
            return jax.ShapeDtypeStruct(shape, x.dtype)
        x = jax.device_put(x)
    if form == "committed":
        return jax.device_put(x, jax.devices()[draw(st.integers(0, 7))])
    if form == "resharded":
        other = mesh_of(("other",), (8,), "auto")
        spec = P("other") if shape and shape[0] % 8 == 0 else P()
        return jax.device_put(x, NamedSharding(other, spec))
    return x


REFUSED = (
    lambda x: np.full(x.shape, "s"),
    lambda x: np.full(x.shape, None, dtype=object),
    lambda x: np.zeros(x.shape, "datetime64[s]"),
    lambda x: np.ma.masked_array(np.zeros(x.shape)),
)


def refused(x: Any) -> bool:
    """The oracle's list of NumPy leaves JAX cannot hold (those REFUSED makes)."""
    return isinstance(x, np.ma.MaskedArray) or (
        isinstance(x, np.ndarray) and x.dtype.kind in "USOM"
    )


STATICS = st.sampled_from([3, "tag", 1.5, True])


@st.composite
def _node(draw: st.DrawFn, depth: int) -> tuple[Any, list[Leaf]]:
    kinds = ["array", "array", "static"]
    if depth < 3:
        kinds += ["dict", "dict", "list", "tuple", "pair", "box"]
    kind = draw(st.sampled_from(kinds))
    if kind == "array":
        return (x := draw(arrays())), [Leaf((), x)]
    if kind == "static":
        return (x := draw(STATICS)), [Leaf((), x)]
    if kind == "dict":
        keys = draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True))
        children = {k: draw(_node(depth + 1)) for k in keys}
        return (
            {k: c[0] for k, c in children.items()},
            [Leaf((), NODE), *_prefixed([(("item", k), c[1]) for k, c in children.items()])],
        )
    if kind in ("list", "tuple"):
        children = draw(st.lists(_node(depth + 1), max_size=3))
        obj = [c[0] for c in children]
        return (
            obj if kind == "list" else tuple(obj),
            [Leaf((), NODE), *_prefixed([(("item", i), c[1]) for i, c in enumerate(children)])],
        )
    first, second = draw(_node(depth + 1)), draw(_node(depth + 1))
    if kind == "pair":
        obj = Pair(first[0], second[0])
        names = ("first", "second")
    else:
        obj = Box(first[0], second[0])
        names = ("w", "b")
    steps = [(("attr", names[0]), first[1]), (("attr", names[1]), second[1])]
    return obj, [Leaf((), NODE), *_prefixed(steps)]


def _prefixed(children: list[tuple[tuple[str, Any], list[Leaf]]]) -> list[Leaf]:
    return [Leaf((step, *leaf.access), leaf.value) for step, leaves in children for leaf in leaves]


@st.composite
def _nnx_state(draw: st.DrawFn) -> tuple[Any, list[Leaf]]:
    def param() -> Any:
        x = draw(arrays(jax_only=True))
        return nnx.Param(x), x

    out: dict[str, Any] = {}
    leaves = [Leaf((), NODE)]
    for k in draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()):
            out[k], x = param()
            leaves.append(Leaf((("item", k), ("var", None)), x))
        else:
            inner = {}
            leaves.append(Leaf((("item", k),), NODE))
            for k2 in draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=2, unique=True)):
                inner[k2], x = param()
                leaves.append(Leaf((("item", k), ("item", k2), ("var", None)), x))
            out[k] = inner
    return nnx.State(out), leaves


# Built abstractly and filled from NumPy: their random init compiles once per shape, which
# would make generation, not the pipeline, the cost of each example. Modules are immutable.
def _filled(module: Any) -> Any:
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda x: (
            jax.device_put(rng.standard_normal(x.shape).astype(x.dtype))
            if isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        module,
    )


@functools.cache
def _eqx_linear(fin: int, fout: int, bias: bool) -> Any:
    return _filled(eqx.filter_eval_shape(eqx.nn.Linear, fin, fout, bias, key=jax.random.key(0)))


@functools.cache
def _eqx_mlp(fin: int, fout: int, width: int, depth: int) -> Any:
    return _filled(
        eqx.filter_eval_shape(eqx.nn.MLP, fin, fout, width, depth, key=jax.random.key(1))
    )


@st.composite
def _eqx_builtin(draw: st.DrawFn) -> tuple[Any, list[Leaf]]:
    fin, fout = draw(st.sampled_from([1, 2, 3, 5, 8])), draw(st.sampled_from([1, 2, 4, 7]))
    if draw(st.booleans()):
        bias = draw(st.booleans())
        m = _eqx_linear(fin, fout, bias)
        names = ["weight", "bias"] if bias else ["weight"]
        return m, [Leaf((), NODE), *(Leaf((("attr", n),), getattr(m, n)) for n in names)]
    m = _eqx_mlp(fin, fout, draw(st.sampled_from([2, 7])), draw(st.integers(0, 2)))
    leaves = [
        Leaf((("attr", "layers"), ("item", i), ("attr", n)), getattr(layer, n))
        for i, layer in enumerate(m.layers)
        for n in ("weight", "bias")
    ]
    leaves += [Leaf((("attr", n),), getattr(m, n)) for n in ("activation", "final_activation")]
    leaves += [Leaf((), NODE), Leaf((("attr", "layers"),), NODE)]
    leaves += [Leaf((("attr", "layers"), ("item", i)), NODE) for i in range(len(m.layers))]
    return m, leaves


@st.composite
def containers(draw: st.DrawFn) -> Container:
    """Nested dicts/lists/tuples/NamedTuples/Equinox modules, NNX states, Equinox layers."""
    which = draw(st.sampled_from(["tree", "tree", "tree", "nnx", "eqx"]))
    if which == "nnx":
        return Container(*draw(_nnx_state()))
    if which == "eqx":
        return Container(*draw(_eqx_builtin()))
    return Container(*draw(_node(0)))


# ---- spec recipes --------------------------------------------------------------------
# A recipe is a tuple this module interprets twice: `build` makes the real spec-like
# object, `expect` decides independently what modelshard must do with it.

JUNK = st.sampled_from([3, "data", 1.5, None, b"x", ("data", 3)])


@st.composite
def entries_for(
    draw: st.DrawFn,
    names: tuple[str, ...],
    rank: int | None = None,
    shape: tuple[int, ...] | None = None,
    sizes: dict[str, int] | None = None,
) -> tuple[Any, ...]:
    """Spec entries: mostly mesh axes and None, sometimes unknown names, repeats, junk.

    With ``shape`` and ``sizes`` given, entries are biased to fit that shape."""
    n = draw(st.integers(0, (rank if rank is not None else 3) + (1 if draw(st.booleans()) else 0)))
    out: list[Any] = []
    for d in range(n):
        roll = draw(st.integers(0, 19))
        if shape is not None and sizes is not None and d < len(shape) and roll < 14:
            fits = [a for a in names if shape[d] % sizes[a] == 0 and a not in _used(out)]
            out.append(draw(st.sampled_from([None, *fits])))
        elif roll < 10:
            out.append(draw(st.sampled_from([None, *names])))
        elif roll < 14 and len(names) > 1:
            out.append(tuple(draw(st.permutations(names))[:2]))
        elif roll < 16:
            out.append(UNKNOWN)
        elif roll < 18:
            out.append((names[0], names[0]))
        elif roll < 19:
            out.append(3)
        else:
            out.append(draw(st.sampled_from(names)))
    return tuple(out)


def _used(entries: list[Any]) -> set[str]:
    used: set[str] = set()
    for e in entries:
        if isinstance(e, str):
            used.add(e)
        elif isinstance(e, tuple):
            used.update(x for x in e if isinstance(x, str))
    return used


LOGICAL = ("embed", "mlp", "vocab")


@st.composite
def leaf_recipes(
    draw: st.DrawFn,
    names: tuple[str, ...],
    paths: list[str],
    fit: tuple[tuple[int, ...], dict[str, int]] | None = None,
) -> tuple[Any, ...]:
    """A recipe for one spec-like (PartitionSpec, Rules, fsdp, function or junk)."""
    shape, sizes = fit if fit is not None else (None, None)
    kind = draw(
        st.sampled_from(
            [
                "P",
                "P",
                "rules",
                "fsdp",
                "fn",
                "fn_table",
                "fn_junk",
                "fn_raise",
                "junk",
                "P_partial",
            ]
        )
    )
    if kind == "P":
        return ("P", draw(entries_for(names, None if shape is None else len(shape), shape, sizes)))
    if kind == "rules":
        rules = []
        for _ in range(draw(st.integers(0, 4))):
            pattern = draw(
                st.sampled_from(
                    [
                        *(re.escape(p) + "$" for p in paths),
                        *(p.split("/")[-1] for p in paths),
                        ".*",
                        "zzz",
                        "^a",
                        "kernel$",
                        "(",
                    ]
                    if paths
                    else [".*", "zzz", "("]
                )
            )
            spec = draw(entries_for((*names, *LOGICAL)))
            rules.append((pattern, spec, draw(st.booleans())))
        logical = None
        if draw(st.booleans()):
            logical = {
                name: draw(st.sampled_from([None, *names, UNKNOWN, tuple(names[:2])]))
                for name in draw(st.lists(st.sampled_from(LOGICAL), unique=True))
            }
        return ("rules", tuple(rules), logical, draw(st.booleans()))
    if kind == "fsdp":
        axis = draw(st.sampled_from([*names, UNKNOWN, tuple(names), (names[0], names[0])]))
        return ("fsdp", axis, draw(st.sampled_from([0, 1, 16, 2**14])))
    if kind == "fn":
        return ("fn", draw(entries_for(names)))
    if kind == "fn_table":
        table = {p: draw(entries_for(names)) for p in paths if draw(st.booleans())}
        return ("fn_table", table, draw(entries_for(names)))
    if kind == "fn_junk":
        return ("fn_junk", draw(JUNK))
    if kind == "fn_raise":
        return (
            "fn_raise",
            draw(st.sampled_from([KeyError, IndexError, AttributeError, ZeroDivisionError])),
        )
    if kind == "P_partial":  # unreduced=/reduced= axes: never placeable by device_put
        entries = draw(entries_for(names))
        free = [a for a in names if a not in _used(list(entries))] or ["zzz"]
        return ("P_partial", entries, draw(st.sampled_from(free)), draw(st.booleans()))
    return ("junk", draw(JUNK))


@st.composite
def tree_recipes(
    draw: st.DrawFn, c: Container, names: tuple[str, ...], sizes: dict[str, int]
) -> tuple[Any, ...]:
    """A prefix tree of recipes following the container's paths, sometimes wrong."""
    by_path = {leaf.path: leaf for leaf in c.leaves}
    all_paths = [leaf.path.split("/") if leaf.path else [] for leaf in c.leaves]

    def node(prefix: tuple[str, ...]) -> tuple[Any, ...]:
        below = [p for p in all_paths if tuple(p[: len(prefix)]) == prefix and len(p) > len(prefix)]
        path = "/".join(prefix)
        leaf = by_path.get(path)
        if not below or draw(st.integers(0, 3)) == 0:
            fit = (leaf.shape, sizes) if leaf is not None and leaf.is_array else None
            return draw(leaf_recipes(names, [p for p in by_path if p.startswith(path)], fit))
        keys = list(dict.fromkeys(p[len(prefix)] for p in below))
        children = {k: node((*prefix, k)) for k in keys}
        fault = draw(st.integers(0, 9))
        if fault == 0 and children:
            children.pop(draw(st.sampled_from(sorted(children))))
        elif fault == 1:
            children["zz_extra"] = ("P", ())
        as_list = (
            all(k.isdigit() for k in children)
            and [int(k) for k in children] == list(range(len(children)))
            and draw(st.booleans())
        )
        return ("tree", "list" if as_list else "dict", children)

    return node(())


@st.composite
def spec_recipes(draw: st.DrawFn, c: Container, mesh: Any) -> tuple[Any, ...]:
    sizes = sizes_of(mesh)
    names = tuple(sizes)
    paths = [leaf.path for leaf in c.arrays]
    if draw(st.booleans()):
        return draw(tree_recipes(c, names, sizes))
    return draw(leaf_recipes(names, paths))


# ---- building and judging recipes ----------------------------------------------------


class BuildError(Exception):
    """Raised by the oracle: building this recipe must fail with a SpecError."""


def build(recipe: tuple[Any, ...]) -> Any:
    """The real spec-like object for a recipe (may raise SpecError: Rules/fsdp checks)."""
    kind = recipe[0]
    if kind == "P":
        return P(*recipe[1])
    if kind == "P_partial":
        _, entries, axis, unreduced = recipe
        return P(*entries, **{"unreduced" if unreduced else "reduced": {axis}})
    if kind == "rules":
        _, rules, logical, strict = recipe
        return ms.Rules(
            [(pat, P(*spec) if as_p else spec) for pat, spec, as_p in rules],
            logical=logical,
            strict=strict,
        )
    if kind == "fsdp":
        return ms.fsdp(recipe[1], min_size=recipe[2])
    if kind == "fn":
        spec = P(*recipe[1])
        return lambda path, leaf: spec
    if kind == "fn_table":
        table = {k: P(*v) for k, v in recipe[1].items()}
        default = P(*recipe[2])
        return lambda path, leaf: table.get(path, default)
    if kind == "fn_junk":
        junk = recipe[1]
        return lambda path, leaf: junk
    if kind == "fn_raise":
        exc: type[Exception] = recipe[1]

        def boom(path: str, leaf: Any) -> Any:
            raise exc("boom")

        return boom
    if kind == "junk":
        return recipe[1]
    if kind == "tree":
        children = {k: build(v) for k, v in recipe[2].items()}
        return list(children.values()) if recipe[1] == "list" else children
    raise AssertionError(kind)


@dataclasses.dataclass
class Verdict:
    """What modelshard must do: fail building, raise naming ``bad``, or place by ``specs``."""

    build_fails: bool = False
    bad: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    specs: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)


def _is_entry(e: Any) -> bool:
    return (
        e is None
        or isinstance(e, str)
        or (isinstance(e, tuple) and all(isinstance(x, str) for x in e))
    )


def _build_fails(recipe: tuple[Any, ...]) -> bool:
    kind = recipe[0]
    if kind == "rules":
        for pat, spec, as_p in recipe[1]:
            try:
                re.compile(pat)
            except re.error:
                return True
            if not as_p and not all(_is_entry(e) for e in spec):
                return True
        return False
    if kind == "fsdp":
        axis = recipe[1]
        axes = (axis,) if isinstance(axis, str) else axis
        return len(set(axes)) != len(axes)
    if kind == "tree":
        return any(_build_fails(v) for v in recipe[2].values())
    return False


def fits(entries: tuple[Any, ...], shape: tuple[int, ...], sizes: dict[str, int]) -> bool:
    """The oracle's placement rule: rank, entry kinds, known axes, no repeats, divisibility."""
    if len(entries) > len(shape):
        return False
    seen: set[str] = set()
    for dim, e in enumerate(entries):
        if e is None:
            continue
        if not _is_entry(e):
            return False
        axes = (e,) if isinstance(e, str) else e
        for a in axes:
            if a not in sizes or a in seen:
                return False
            seen.add(a)
        if shape[dim] % math.prod(sizes[a] for a in axes):
            return False
    return True


def _matches_every_path(pattern: str) -> bool:
    """The documented catch-all: a pattern that matches the root path, a name and a nested
    path alike (`.*`, `^`, `$`). A strict `Rules` never reports one as unused."""
    return all(re.search(pattern, p) for p in ("", "a", "a/b/0/c"))


def _logical(entries: tuple[Any, ...], logical: dict[str, Any] | None) -> tuple[Any, ...]:
    if not logical:
        return entries
    out: list[Any] = []
    for e in entries:
        if e is None or not _is_entry(e):
            out.append(e)
            continue
        mapped: list[str] = []
        for n in (e,) if isinstance(e, str) else e:
            if n in logical:
                t = logical[n]
                mapped.extend(() if t is None else (t,) if isinstance(t, str) else t)
            else:
                mapped.append(n)
        out.append(None if not mapped else mapped[0] if len(mapped) == 1 else tuple(mapped))
    return tuple(out)


def _fsdp_entries(
    axis: Any, min_size: int, shape: tuple[int, ...], sizes: dict[str, int]
) -> tuple[Any, ...] | None:
    axes = (axis,) if isinstance(axis, str) else axis
    if not shape:
        return ()
    if any(a not in sizes for a in axes):
        return None
    n = math.prod(sizes[a] for a in axes)
    if math.prod(shape) < min_size:
        return ()
    for d in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        if shape[d] > 0 and shape[d] % n == 0:
            return (*([None] * d), axis)
    return ()


_LEAF_SPECS = ("P", "P_partial", "rules", "fsdp", "fn", "fn_table", "fn_junk", "fn_raise")


def _entries_of(
    recipe: tuple[Any, ...], prefix: tuple[str, ...], out: dict[tuple[str, ...], tuple[Any, ...]]
) -> None:
    if recipe[0] == "tree":
        for k, v in recipe[2].items():
            _entries_of(v, (*prefix, str(k)), out)
    elif recipe[0] == "junk" and isinstance(recipe[1], tuple):
        for i, v in enumerate(recipe[1]):
            _entries_of(("junk", v), (*prefix, str(i)), out)
    else:
        out[prefix] = recipe


def expect(
    recipe: tuple[Any, ...], c: Container, sizes: dict[str, int], arg: str = "tree"
) -> Verdict:
    """The oracle: what modelshard must do with ``recipe`` on container ``c``."""
    v = Verdict()
    if _build_fails(recipe):
        v.build_fails = True
        return v
    entries: dict[tuple[str, ...], tuple[Any, ...]] = {}
    _entries_of(recipe, (), entries)
    rules_used: dict[int, set[int]] = {}
    hit: set[tuple[str, ...]] = set()
    for leaf in c.arrays:
        comps = tuple(leaf.path.split("/")) if leaf.path else ()
        key = next((comps[:n] for n in range(len(comps), -1, -1) if comps[:n] in entries), None)
        if key is None:
            v.bad.add((arg, leaf.path))
            continue
        hit.add(key)
        r = entries[key]
        shape = leaf.shape
        spec: tuple[Any, ...] | None
        kind = r[0]
        if kind in ("P", "fn"):
            spec = r[1]
        elif kind == "fn_table":
            spec = r[1].get(leaf.path, r[2])
        elif kind == "fsdp":
            spec = _fsdp_entries(r[1], r[2], shape, sizes)
        elif kind == "rules":
            _, rules, logical, strict = r
            used = rules_used.setdefault(id(r), set())
            first = next(
                (i for i, (pat, _, _) in enumerate(rules) if re.search(pat, leaf.path)), None
            )
            if first is not None:
                used.add(first)
            if not shape:
                spec = ()
            elif first is not None:
                spec = _logical(rules[first][1], logical)
            else:
                spec = None if strict else ()
        else:  # P_partial, fn_junk, fn_raise, junk
            spec = None
        if spec is None or not fits(spec, shape, sizes) or refused(leaf.value):
            v.bad.add((arg, leaf.path))
        else:
            v.specs[leaf.path] = spec
    if recipe[0] not in _LEAF_SPECS and recipe != ("junk", None):  # a prefix tree
        # An entry must name a node of the container (a leaf, or an inner node even if it
        # holds no leaf, like an optax EmptyState); the root always exists.
        all_paths = [tuple(x.path.split("/")) if x.path else () for x in c.leaves]
        for key in entries:
            if key and key not in hit and not any(p[: len(key)] == key for p in all_paths):
                v.bad.add((arg, "/".join(key)))
    seen_rules: set[int] = set()
    for r in entries.values():
        if r[0] == "rules" and r[3] and id(r) in rules_used and id(r) not in seen_rules:
            seen_rules.add(id(r))
            for i, (pat, _, _) in enumerate(r[1]):
                # A catch-all (it matches every path) is a fallback, never "unused".
                if i not in rules_used[id(r)] and not _matches_every_path(pat):
                    v.bad.add(("Rules", f"rule {i}"))
    return v
