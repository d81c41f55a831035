"""The model, data and training step shared by the multi-process scripts and their tests.

Everything is built from NumPy with fixed seeds, so every process (and the single-process
reference in the test) holds the same values without communicating.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import modelshard as ms

BATCH, D_IN, D_HID, D_OUT = 16, 8, 16, 4
STEPS = 2

# Tensor-parallel rules over (data, model); anchored patterns cover params and Adam moments.
RULES = ms.Rules(
    [(r"w1$", P(None, "model")), (r"b1$", P("model")), (r"w2$", P("model", None)), (r".*", P())]
)
BATCH_SPEC = P("data")


def init_params() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(D_IN, D_HID)) / np.sqrt(D_IN)).astype(np.float32),
        "b1": np.zeros(D_HID, np.float32),
        "w2": (rng.normal(size=(D_HID, D_OUT)) / np.sqrt(D_HID)).astype(np.float32),
        "b2": np.zeros(D_OUT, np.float32),
    }


def optimizer() -> Any:
    import optax

    return optax.adam(1e-2)


def init_state() -> dict[str, Any]:
    params = init_params()
    return {"params": params, "opt": optimizer().init(params)}


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(BATCH, D_OUT)).astype(np.float32)
    return x, y


def local_rows(mesh: Any, n: int) -> slice:
    """The rows of an ``n``-row batch sharded over ``data`` that this process's devices hold."""
    return ms.distributed.local_slice((n,), BATCH_SPEC, mesh)[0]


def train_step(state: dict[str, Any], x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
    import optax

    def loss_fn(params: dict[str, Any]) -> jax.Array:
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = optimizer().update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def flat_values(tree: Any) -> dict[str, np.ndarray]:
    """``{path: full value}`` of every array leaf (all-gathered across processes)."""
    flat = ms.adapters.split(tree)
    host = ms.adapters.split(ms.distributed.to_host(tree)).arrays
    return dict(zip(flat.paths, host, strict=True))


def nnx_losses(mesh: Any) -> list[float]:
    """Two steps of an NNX model updated in place by ``shard_jit``; the losses."""
    from flax import nnx

    model = nnx.Linear(D_IN, D_HID, rngs=nnx.Rngs(0))
    rules = ms.Rules([(r"kernel$", P(None, "model")), (r"bias$", P("model"))])
    ms.shard(model, rules, mesh)

    @ms.shard_jit(mesh=mesh, in_specs=(rules, BATCH_SPEC))
    def step(model: Any, x: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        return loss

    x, _ = batch(0)
    xb = ms.assemble_process_local(x[local_rows(mesh, BATCH)], BATCH_SPEC, mesh)
    return [float(ms.distributed.to_host(step(model, xb))) for _ in range(2)]
