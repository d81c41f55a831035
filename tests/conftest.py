"""Shared fixtures: meshes (Auto and Explicit) and real containers of every kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import modelshard as ms

KINDS = ("pytree", "optax", "equinox", "nnx", "linen")


@pytest.fixture(autouse=True)
def _restore_registry():
    """Every test sees the registry as it was; registrations made in a test are undone."""
    with ms.adapters.registry_snapshot():
        yield


@pytest.fixture(params=["auto", "explicit"])
def axis_type(request) -> str:
    return request.param


@pytest.fixture
def mesh8(axis_type):
    """A (8,) mesh named ``data``."""
    return ms.make_mesh({"data": 8}, axis_types=axis_type)


@pytest.fixture
def mesh24(axis_type):
    """A (2, 4) mesh named ``data``, ``model``."""
    return ms.make_mesh({"data": 2, "model": 4}, axis_types=axis_type)


# ---- containers of every kind --------------------------------------------------------


def make_pytree() -> Any:
    return {
        "embed": jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16),
        "layers": [
            {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros((32,))},
            {"kernel": jnp.ones((32, 16)) * 2, "bias": jnp.zeros((16,))},
        ],
        "step": jnp.array(0, jnp.int32),
    }


def make_optax() -> Any:
    import optax

    params = make_pytree()
    params.pop("step")
    return optax.adamw(1e-3).init(params)


def make_equinox() -> Any:
    import equinox as eqx

    return eqx.nn.MLP(16, 8, 32, 2, key=jax.random.key(0))


def make_nnx() -> Any:
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(64, 16, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=4, in_features=16, qkv_features=16, decode=False, rngs=rngs
            )
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.mlp = nnx.Linear(16, 32, rngs=rngs)
            self.bn = nnx.BatchNorm(32, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, ids):
            x = self.norm(self.attn(self.embed(ids)))
            return self.drop(self.bn(self.mlp(x)))

    return Block(nnx.Rngs(0))


def make_linen() -> Any:
    import flax.linen as nn

    def part(*names):
        return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            x = nn.Dense(16, kernel_init=part("embed", "mlp"))(x)
            return nn.relu(x), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, kernel_init=part("embed", "mlp"))(x)
            x = nn.BatchNorm(use_running_average=False)(x)
            x, _ = nn.scan(
                Layer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=4,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )()(x, None)
            return x

    variables = Model().init(jax.random.key(0), jnp.ones((2, 16)))
    return dict(variables)


MAKERS: dict[str, Callable[[], Any]] = {
    "pytree": make_pytree,
    "optax": make_optax,
    "equinox": make_equinox,
    "nnx": make_nnx,
    "linen": make_linen,
}


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def container(kind) -> Any:
    """A real container of each kind (pytree, optax, equinox, nnx, linen)."""
    return MAKERS[kind]()
