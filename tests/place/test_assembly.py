"""``global_shape``, ``assemble`` and ``partitions``: local pieces <-> global arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms


@pytest.fixture
def mesh22():
    return ms.make_mesh({"data": 2, "model": 2})


def test_global_shape_is_per_dimension_per_leaf():
    mesh = ms.make_mesh({"data": 2, "model": 4}, abstract=True)
    assert ms.global_shape((3, 5), P("data", "model"), mesh) == (6, 20)
    assert ms.global_shape((3, 5), P(("data", "model"), None), mesh) == (24, 5)
    assert ms.global_shape((3, 5), P(None, "data"), mesh) == (3, 10)
    assert ms.global_shape((3,), P(), mesh) == (3,)
    assert ms.global_shape((), P(), mesh) == ()


def test_global_shape_rejects_bad_specs():
    mesh = ms.make_mesh({"data": 2}, abstract=True)
    with pytest.raises(ms.SpecError) as e:
        ms.global_shape((3,), P("data", "model"), mesh)
    lines = str(e.value).splitlines()
    assert lines[1:3] == [
        "  spec:<root> float32[6]",
        "    problem: spec has 2 entries but the leaf has rank 1",
    ]
    assert "    problem: axis 'model' (dimension 1) is not in the mesh" in lines


def _local(p, shape, offset=0.0):
    """A distinct local block for mesh position ``p``."""
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100 * p + offset


def test_assemble_reproduces_per_partition_x_plus_y(mesh22):
    # x sharded over both axes, y sharded over data only (replicated over model).
    xs = [_local(p, (2, 3)) for p in range(4)]
    ys = [_local(p // 2, (2, 6), offset=0.5) for p in range(4)]  # model-replicated
    specs = {"x": P("data", "model"), "y": P("data", None)}
    pieces = [{"x": jnp.asarray(x), "y": jnp.asarray(y)} for x, y in zip(xs, ys, strict=True)]
    g = ms.assemble(pieces, specs, mesh22)
    assert g["x"].shape == (4, 6) and g["y"].shape == (4, 6)
    assert g["x"].sharding == NamedSharding(mesh22, P("data", "model"))
    # x's global layout: rows by data, columns by model
    np.testing.assert_array_equal(np.asarray(g["x"])[:2, 3:], xs[1])
    np.testing.assert_array_equal(np.asarray(g["x"])[2:, :3], xs[2])
    z = jax.jit(lambda t: t["x"] + t["y"])(g)
    # per partition, the result is the local x plus that partition's part of y
    for p, part in enumerate(ms.partitions({"z": z})):
        col = slice(3 * (p % 2), 3 * (p % 2) + 3)
        np.testing.assert_allclose(part["z"], xs[p] + ys[p][:, col])
    # and partitions is assemble's inverse
    back = ms.partitions(g)
    for p in range(4):
        np.testing.assert_array_equal(back[p]["x"], xs[p])
        np.testing.assert_array_equal(back[p]["y"], ys[p])


def test_inconsistent_pieces_are_all_reported(mesh22):
    good = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    pieces = [
        good,
        {"w": jnp.ones((2, 4)), "b": jnp.ones(3)},
        {"w": jnp.ones((2, 3)), "c": jnp.ones(3)},
        {"w": jnp.ones((2, 3), jnp.int32), "b": jnp.ones(3, jnp.bfloat16)},
    ]
    with pytest.raises(ms.AssembleError) as e:
        ms.assemble(pieces, P("data"), mesh22)
    assert str(e.value).splitlines() == [
        "4 inconsistent pieces (every partition must hold the same structure, dtypes and shapes):",
        "  partition 1, leaf 'w': shape (2, 4) but partition 0 has (2, 3)",
        "  partition 2: structure differs from partition 0 (pytree vs pytree): missing 'b'; "
        "extra 'c'",
        "  partition 3, leaf 'b': dtype bfloat16 but partition 0 has float32",
        "  partition 3, leaf 'w': dtype int32 but partition 0 has float32",
    ]
    assert isinstance(e.value, ValueError)


def test_wrong_number_of_pieces(mesh22):
    with pytest.raises(ms.AssembleError) as e:
        ms.assemble([{"x": jnp.ones(2)}] * 3, P(), mesh22)
    assert str(e.value) == (
        "got 3 pieces for a mesh of 4 devices; give one piece per mesh position in mesh order: 4."
    )
    with pytest.raises(ms.AssembleError, match="no pieces given"):
        ms.assemble({}, P(), mesh22)


def test_pieces_already_on_devices_are_moved(mesh22):
    devices = jax.devices()
    # every piece committed to the wrong device (7 - p), one still on the host
    pieces = [{"x": jax.device_put(jnp.full((1, 2), float(p)), devices[7 - p])} for p in range(3)]
    pieces.append({"x": np.full((1, 2), 3.0, np.float32)})
    g = ms.assemble(pieces, P(("data", "model")), mesh22)
    for shard in g["x"].addressable_shards:
        p = list(mesh22.devices.flat).index(shard.device)
        np.testing.assert_array_equal(shard.data, np.full((1, 2), float(p)))
    np.testing.assert_array_equal(g["x"][:, 0], [0.0, 1.0, 2.0, 3.0])


def test_pieces_keyed_by_device(mesh22):
    devices = list(mesh22.devices.flat)
    pieces = {d: {"x": jnp.full((2,), float(p))} for p, d in enumerate(devices)}
    g = ms.assemble(pieces, P(("model", "data")), mesh22)
    # ('model', 'data') orders blocks model-major: position (data=i, model=j) -> block 2j+i
    np.testing.assert_array_equal(g["x"], [0, 0, 2, 2, 1, 1, 3, 3])
    with pytest.raises(ms.AssembleError, match="no piece for mesh positions"):
        ms.assemble({devices[0]: pieces[devices[0]]}, P(), mesh22)


def _rank2_data(path, leaf):
    return P("data") if len(leaf.shape) >= 2 else P()


def test_round_trip_for_every_container_kind(container, mesh24):
    placed = ms.shard(container, _rank2_data, mesh24)
    parts = ms.partitions(placed)
    assert len(parts) == 8 and all(type(p) is type(container) for p in parts)
    back = ms.assemble(parts, _rank2_data, mesh24)
    assert type(back) is type(container)
    got, want = ms.adapters.split(back).arrays, ms.adapters.split(placed).arrays
    for a, b in zip(got, want, strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(_host(a), _host(b))


def _host(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # NNX RNG streams
        x = jax.random.key_data(x)
    return np.asarray(x)


def test_partitions_needs_sharded_leaves(mesh22):
    with pytest.raises(ms.AssembleError) as e:
        ms.partitions({"a": np.ones(2), "b": ms.shard(jnp.ones(2), P(), mesh22)})
    assert str(e.value).splitlines() == [
        "partitions needs every array leaf sharded on one mesh (place them with "
        "modelshard.shard first):",
        "  a: ndarray with no sharding",
    ]


def test_assemble_process_local_in_one_process_is_shard():
    mesh = ms.make_mesh({"data": 8})
    batch = {"x": np.arange(32.0, dtype=np.float32).reshape(16, 2), "n": np.int32(3)}
    g = ms.assemble_process_local(batch, {"x": P("data"), "n": P()}, mesh)
    assert g["x"].sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(g["x"], batch["x"])
    assert int(g["n"]) == 3
