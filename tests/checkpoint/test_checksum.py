"""Per-leaf checksums (``_checkpoint/checksum.py``): the values earlier versions recorded,
independent of sharding and layout, summed on the host block by block (compiled programs of
a few fixed sizes, NumPy for the rest), damage caught, failures raised by ``collect``."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import checksums
from modelshard._checkpoint import checksum as cs

# Checksums as the earlier engines (device programs and host sums alike) recorded them:
# a checkpoint they wrote must still verify.
PINNED = {
    "f32": "e5f3de00:4f2a6236",
    "bf16": "b590bcbe:d4d3c30f",
    "i8": "877e9943:032b19dd",
    "bool": "cf23f9ad:c43a8404",
    "int4": "19583bae:bfcdefaf",
    "c64": "b3400000:ae7b0743",
    "scalar": "65a00000:69102f91",
}


def _pinned_arrays() -> dict[str, jax.Array]:
    return {
        "f32": jnp.asarray((np.arange(1500 * 700) % 65521).reshape(1500, 700), jnp.float32),
        "bf16": jnp.asarray(np.linspace(-3, 3, 64 * 40).reshape(64, 40), jnp.bfloat16),
        "i8": jnp.asarray((np.arange(99) % 250 - 120).astype(np.int8)),
        "bool": jnp.asarray(np.arange(37) % 3 == 0),
        "int4": jnp.asarray((np.arange(64) % 16 - 8).reshape(8, 8), jnp.int4),
        "c64": jnp.asarray(np.arange(24).reshape(4, 6) * (1 + 2j), jnp.complex64),
        "scalar": jnp.float32(3.5),
    }


def _reference(a: np.ndarray) -> str:
    """The checksum's definition, whole-array NumPy: lanes in C order, position hashes."""
    v = cs.lanes(a).reshape(-1)
    idx = np.arange(v.size, dtype=np.uint32)
    t1, t2 = cs.terms(v, idx, np.uint32)
    return cs.format_sums(int(np.sum(t1, dtype=np.uint32)), int(np.sum(t2, dtype=np.uint32)))


@pytest.fixture
def small_blocks(monkeypatch):
    """Programs of 256 and 64 lanes (NumPy below 16): every path of a small leaf's sums."""
    monkeypatch.setattr(cs, "BLOCK", 256)
    monkeypatch.setattr(cs, "MID", 64)
    monkeypatch.setattr(cs, "SMALL", 16)
    monkeypatch.setattr(cs, "_PROGRAMS", {})


def test_checksums_are_the_values_earlier_versions_recorded(mesh24):
    arrays = _pinned_arrays()
    assert dict(zip(arrays, checksums(list(arrays.values())), strict=True)) == PINNED
    w = jax.device_put(arrays["f32"], NamedSharding(mesh24, P("model", "data")))
    assert checksums([w]) == [PINNED["f32"]]


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        "bfloat16",
        "float16",
        "int8",
        "uint32",
        "bool",
        "int4",
        "float8_e4m3fn",
        "complex64",
    ],
)
@pytest.mark.parametrize("blocks", ["default", "small"])
def test_every_layout_sums_to_the_definition(dtype, blocks, mesh24, request):
    """Rows, columns, blocks and replicas of a leaf, each dtype, summed in one piece or in
    pieces of every program size and NumPy: all give the checksum's definition."""
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    values = np.random.default_rng(1).normal(size=(48, 40)) * 20
    if dtype == "complex64":
        values = values + 1j * values[::-1]
    x = jnp.asarray(values).astype(dtype)
    want = _reference(np.asarray(x))
    for spec in (P(), P("data"), P(None, "model"), P("model", "data"), P(None, ("data", "model"))):
        assert checksums([jax.device_put(x, NamedSharding(mesh24, spec))]) == [want], spec


def test_boxes_that_tile_a_leaf_add_up_to_its_checksum(small_blocks):
    """A 3-d leaf cut every way (rows of a plane a stride apart, planes, whole runs), and
    64-bit dtypes the devices cannot hold: the boxes' sums add up to the leaf's."""
    rng = np.random.default_rng(4)
    for a in (
        rng.normal(size=(6, 10, 12)).astype(np.float32),
        rng.normal(size=(6, 10, 12)),
        rng.integers(-(2**62), 2**62, size=(6, 10, 12)),
        rng.normal(size=(6, 10, 12)) + 1j,
    ):
        want = _reference(a)
        assert cs.format_sums(*cs.box_sums(a)) == want
        for cuts in ((3, 5, 12), (6, 10, 5), (2, 3, 7), (1, 10, 12)):
            starts = [range(0, n, c) for n, c in zip(a.shape, cuts, strict=True)]
            s1 = s2 = 0
            for origin in itertools.product(*starts):
                box = tuple(slice(o, o + c) for o, c in zip(origin, cuts, strict=True))
                b1, b2 = cs.box_sums(a[box], origin, a.shape)
                s1, s2 = s1 + b1, s2 + b2
            assert cs.format_sums(s1, s2) == want, (a.dtype, cuts)


def test_damage_changes_the_checksum():
    a = np.random.default_rng(5).normal(size=(64, 300)).astype(np.float32)
    want = checksums([a])[0]
    flipped = a.copy()
    flipped.view(np.uint32)[17, 200] ^= 1 << 7  # one bit
    swapped = a.copy()
    swapped[[3, 40]] = swapped[[40, 3]]  # the same values, two rows moved
    assert len({want, *checksums([flipped, swapped])}) == 3


def test_a_replicated_block_is_summed_once(mesh24, monkeypatch):
    """One replica of each block is summed (on a (2, 4) mesh, ``P(None, "model")`` has two
    copies of each column block): the blocks summed cover the leaf exactly once."""
    seen = []
    real = cs.box_sums

    def spy(a, origin=None, shape=None):
        seen.append((tuple(origin), a.shape))
        return real(a, origin, shape)

    monkeypatch.setattr(cs, "box_sums", spy)
    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
    for spec, blocks in ((P(), 1), (P(None, "model"), 4), (P("data"), 2), (P("data", "model"), 8)):
        seen.clear()
        assert checksums([jax.device_put(x, NamedSharding(mesh24, spec))]) == checksums(
            [np.asarray(x)]
        )
        assert len(seen) == blocks + 1 and sum(np.prod(s) for _, s in seen[:-1]) == x.size, spec


def test_a_leaf_of_any_shape_compiles_nothing_new(count_compiles):
    """The programs are of fixed sizes, not of the leaves' shapes, dtypes or layouts:
    leaves of shapes never seen before compile nothing once those sizes are compiled."""
    rng = np.random.default_rng(6)
    every_size = cs.BLOCK + cs.MID + 3  # a call of each size, then NumPy
    checksums([rng.normal(size=(every_size,)).astype(np.float32)])
    with count_compiles() as n:
        sums = checksums(
            [rng.normal(size=(1031 + i, 260 + 7 * i)).astype(np.float32) for i in range(6)]
        )
    assert sum(n.values()) == 0 and len(set(sums)) == 6


def test_checksums_added_one_by_one_match_and_failures_are_raised_by_collect(mesh8, monkeypatch):
    xs = {
        "a": jax.device_put(jnp.arange(4096.0).reshape(64, 64), NamedSharding(mesh8, P("data"))),
        "b": jnp.ones((3, 5), jnp.bfloat16),
    }
    want = dict(zip(xs, checksums(list(xs.values())), strict=True))
    sums = cs.Checksums(xs)
    sums.add("a", xs["a"])
    sums.add("not checked", xs["a"])
    assert sums.collect({"b": xs["b"]}) == want  # "b" was never added: summed from arrays

    def broken(*args):
        raise RuntimeError("summing failed")

    monkeypatch.setattr(cs, "box_sums", broken)
    sums = cs.Checksums(xs)
    sums.add("a", xs["a"])  # returns: the failure is collect's
    with pytest.raises(RuntimeError, match=r"^summing failed$"):
        sums.collect(xs)


def test_host_bytes_given_are_summed_instead_of_the_arrays(mesh8):
    """A restore hands over the bytes it read: those are summed, the arrays on the devices
    are not copied back."""
    x = jax.device_put(
        jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), NamedSharding(mesh8, P("data"))
    )
    host = {(8 * i, 0): np.asarray(x)[8 * i : 8 * i + 8] for i in range(8)}
    host[(8, 0)] = host[(8, 0)] + 1
    sums = cs.Checksums({"a": x, "b": x})
    sums.add("a", x, host)
    sums.add("b", x)
    got = sums.collect()
    changed = np.asarray(x).copy()
    changed[8:16] += 1
    assert got == {"a": checksums([changed])[0], "b": checksums([x])[0]}


def test_a_restore_compiles_a_few_host_programs_whatever_the_shapes(
    tmp_path, mesh8, monkeypatch, count_compiles
):
    """The sums are host programs of two fixed sizes: a restore of 16 leaves of 16 shapes
    compiles no program per shape (on an accelerator, seconds each in a fresh process)."""
    import modelshard as ms

    state = {
        f"w{i}": jax.device_put(
            jnp.full((128 * (i + 1), 256 + i), i, jnp.float32), NamedSharding(mesh8, P("data"))
        )
        for i in range(16)
    }
    ms.save(tmp_path / "c", state)
    monkeypatch.setattr(cs, "_PROGRAMS", {})
    with count_compiles() as n:
        back = ms.restore(tmp_path / "c", like=state)
    assert all(np.array_equal(np.asarray(back[k]), np.asarray(state[k])) for k in state)
    sums = {name: k for name, k in n.items() if "sums" in name}
    assert set(sums) == {"jit(_sums_of)"} and sum(sums.values()) <= 2, dict(n)
