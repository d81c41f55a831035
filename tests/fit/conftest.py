"""A small decoder-only language model and its AdamW step, abstract (nothing allocated), in
the containers a training loop holds: a dict ``{"params", "opt_state", "step"}`` and Flax's
``TrainState``."""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms

VOCAB, DIM, HIDDEN, LAYERS = 512, 64, 256, 2


def init(key: jax.Array) -> dict[str, Any]:
    ks = iter(jax.random.split(key, 16))

    def dense(i: int, o: int) -> dict[str, jax.Array]:
        return {"kernel": jax.random.normal(next(ks), (i, o)) / i**0.5}

    layers = {
        f"layers_{n}": {
            "attn": {
                "q": dense(DIM, DIM),
                "k": dense(DIM, DIM),
                "v": dense(DIM, DIM),
                "o": dense(DIM, DIM),
            },
            "mlp": {"up": dense(DIM, HIDDEN), "down": dense(HIDDEN, DIM)},
            "norm": {"scale": jnp.ones((DIM,))},
        }
        for n in range(LAYERS)
    }
    return {"embed": {"embedding": jax.random.normal(next(ks), (VOCAB, DIM))}, **layers}


def loss(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    x = params["embed"]["embedding"][tokens]
    t = tokens.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for n in range(LAYERS):
        p = params[f"layers_{n}"]
        h = x * p["norm"]["scale"]
        q, k, v = (h @ p["attn"][n_]["kernel"] for n_ in "qkv")
        a = jnp.where(mask, q @ k.swapaxes(1, 2) / DIM**0.5, -1e9)
        x = x + jax.nn.softmax(a) @ v @ p["attn"]["o"]["kernel"]
        x = x + jax.nn.gelu(x @ p["mlp"]["up"]["kernel"]) @ p["mlp"]["down"]["kernel"]
    logits = x @ params["embed"]["embedding"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


TX = optax.adamw(1e-3)


def dict_step(state: dict[str, Any], tokens: jax.Array) -> tuple[dict[str, Any], jax.Array]:
    value, grads = jax.value_and_grad(loss)(state["params"], tokens)
    updates, opt_state = TX.update(grads, state["opt_state"], state["params"])
    new = {
        "params": optax.apply_updates(state["params"], updates),
        "opt_state": opt_state,
        "step": state["step"] + 1,
    }
    return new, value


def train_state_step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
    value, grads = jax.value_and_grad(loss)(state.params, tokens)
    return state.apply_gradients(grads=grads), value


def _dict_state(key: jax.Array) -> dict[str, Any]:
    params = init(key)
    return {"params": params, "opt_state": TX.init(params), "step": jnp.zeros((), jnp.int32)}


def _train_state(key: jax.Array) -> Any:
    from flax.training import train_state

    return train_state.TrainState.create(apply_fn=None, params=init(key), tx=TX)


@pytest.fixture(params=["dict", "TrainState"])
def decoder(request: pytest.FixtureRequest) -> types.SimpleNamespace:
    """The step, its abstract state and a batch of 16 sequences of 32 tokens."""
    make, step = {"dict": (_dict_state, dict_step), "TrainState": (_train_state, train_state_step)}[
        request.param
    ]
    return types.SimpleNamespace(
        kind=request.param,
        step=step,
        state=jax.eval_shape(make, jax.random.key(0)),
        batch=jax.ShapeDtypeStruct((16, 32), jnp.int32),
    )


@pytest.fixture
def dict_decoder() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        kind="dict",
        step=dict_step,
        state=jax.eval_shape(_dict_state, jax.random.key(0)),
        batch=jax.ShapeDtypeStruct((16, 32), jnp.int32),
    )


@pytest.fixture(scope="module")
def dict_base() -> ms.StepMemory:
    """The dict step's memory on a (data=4, model=2) mesh, the state replicated and donated,
    the batch over 'data': the starting point several tests compare with, compiled once."""
    return ms.step_memory(
        dict_step,
        jax.eval_shape(_dict_state, jax.random.key(0)),
        jax.ShapeDtypeStruct((16, 32), jnp.int32),
        mesh=ms.make_mesh({"data": 4, "model": 2}),
        in_specs=(P(), P("data")),
        donate_argnums=0,
    )
