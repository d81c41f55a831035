"""``plan``: per-leaf placement, bytes per device, mirrors, tables; abstract trees and meshes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from conftest import MAKERS

SDS = jax.ShapeDtypeStruct


def test_bytes_per_device_and_totals(mesh24):
    tree = {"w": SDS((64, 32), jnp.float32), "b": SDS((32,), jnp.bfloat16)}
    p = ms.plan(tree, ms.Rules([("w", P("data", "model")), ("b", P())]), mesh24)
    assert p.shard_shape(p["w"]) == (32, 8)
    assert p.bytes_per_device(p["w"]) == 32 * 8 * 4
    assert p.bytes_per_device(p["b"]) == 32 * 2
    assert p.bytes_per_device() == 32 * 8 * 4 + 64
    assert p.total_bytes == 64 * 32 * 4 + 64
    assert len(p) == 2 and p.num_devices == 8
    assert p.rows()[1] == {
        "path": "w",
        "shape": [64, 32],
        "dtype": "float32",
        "spec": ["data", "model"],
        "rule": "rule 0 'w'",
        "bytes_per_device": 1024,
        "bytes": 8192,
    }


def test_plan_a_27b_model_on_256_abstract_chips():
    """Nothing is allocated: abstract leaves from eval_shape, an AbstractMesh bigger than us."""
    layers, d, f, v = 46, 4608, 36864, 256000

    def model():
        return {
            "embed": jnp.zeros((v, d), jnp.bfloat16),
            "layers": {
                "up": jnp.zeros((layers, d, f), jnp.bfloat16),
                "gate": jnp.zeros((layers, d, f), jnp.bfloat16),
                "down": jnp.zeros((layers, f, d), jnp.bfloat16),
                "qkv": jnp.zeros((layers, d, 3 * d), jnp.bfloat16),
                "out": jnp.zeros((layers, d, d), jnp.bfloat16),
            },
        }

    abstract = jax.eval_shape(model)
    mesh = ms.make_mesh({"data": 32, "model": 8}, abstract=True)
    rules = ms.Rules(
        [
            ("embed", P("model", "data")),
            ("up|gate|qkv", P(None, "data", "model")),
            ("down|out", P(None, "model", "data")),
        ]
    )
    p = ms.plan(abstract, rules, mesh)
    params = sum(math.prod(leaf.shape) for leaf in p)
    assert params > 27e9
    assert p.bytes_per_device() * 256 == p.total_bytes
    assert "256 devices" in p.summary()
    assert isinstance(p.shardings["embed"], NamedSharding)


def test_shardings_and_specs_mirror_the_container(kind, container, mesh8):
    p = ms.plan(container, ms.fsdp("data", min_size=0), mesh8)
    shardings, specs = p.shardings, p.specs
    expected_type = type(container)
    if kind == "nnx":
        from flax import nnx

        expected_type = nnx.State
    assert type(shardings) is expected_type and type(specs) is expected_type
    s_flat = ms.adapters.split(shardings)
    got = [x for x in s_flat.leaves if isinstance(x, NamedSharding)]
    assert got == p.flat_shardings(0)
    assert [x.spec for x in got] == [leaf.spec for leaf in p]


def test_equinox_mirror_keeps_static_fields(mesh8):
    mlp = MAKERS["equinox"]()
    mirror = ms.plan(mlp, P(), mesh8).shardings
    assert mirror.activation is mlp.activation
    assert isinstance(mirror.layers[0].weight, NamedSharding)


def test_plan_table_and_str(mesh24):
    tree = {"w": SDS((64, 32), jnp.float32), "b": SDS((32,), jnp.float32)}
    p = ms.plan(tree, ms.Rules([("w", P("data", "model")), ("b", P())]), mesh24)
    text = str(p)
    assert "modelshard plan" in text
    assert "P('data', 'model')" in text and "rule 0 'w'" in text
    assert "2 array leaves on mesh (data=2, model=4), 8 devices: 1.12 KiB per device" in text
    assert "replicated 8.12 KiB" in text
    assert repr(p).startswith("<Plan: 2 array leaves")
    many = ms.plan({f"x{i}": SDS((8,), jnp.float32) for i in range(70)}, P(), mesh24)
    assert "... 10 more leaves" in str(many)


def test_getitem_unknown_path(mesh24):
    p = ms.plan({"w": SDS((4,), jnp.float32)}, P(), mesh24)
    with pytest.raises(ms.SpecError, match="no array leaf has this path"):
        p["nope"]


def test_plan_of_concrete_arrays_moves_nothing(mesh8):
    x = jnp.ones((16, 4))
    before = x.sharding
    ms.plan({"x": x}, ms.fsdp("data", min_size=0), mesh8)
    assert x.sharding == before


def test_plan_typed_prng_keys_and_zero_size(mesh8):
    tree = {
        "key": jax.random.key(0),
        "keys": jax.random.split(jax.random.key(1), 8),
        "empty": jnp.zeros((0, 8)),
    }
    p = ms.plan(
        tree, ms.Rules([("keys", P("data")), ("empty", P(None, "data")), ("key", P())]), mesh8
    )
    assert p.bytes_per_device(p["keys"]) == 8  # one key (2 x uint32) per device
    assert p.bytes_per_device(p["empty"]) == 0
