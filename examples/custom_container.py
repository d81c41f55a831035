"""Your own container class, shardable as one value with ``register_container``.

``Experiment`` is a plain Python class (not a JAX pytree) holding weights, optimizer state, a
step counter and a name. Two callbacks tell modelshard its children; after that it works
everywhere a container does: ``plan``, ``shard``, ``shard_jit`` (in and out),
``save``/``restore``, with paths in its own vocabulary (``weights/w1``, ``opt/0/mu/w1``).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import optax
from _common import console
from jax.sharding import PartitionSpec as P

import modelshard as ms


class Experiment:
    """Everything a training run carries, in one object."""

    def __init__(self, name: str, weights: dict[str, Any], opt: Any, step: Any):
        self.name, self.weights, self.opt, self.step = name, weights, opt, step


ms.register_container(
    Experiment,
    flatten=lambda e: {"name": e.name, "weights": e.weights, "opt": e.opt, "step": e.step},
    unflatten=lambda c: Experiment(c["name"], c["weights"], c["opt"], c["step"]),
    kind="Experiment",
)

RULES = ms.Rules([(r"w1$", P(None, "model")), (r"w2$", P("model", None)), (r".*", P())])
TX = optax.adam(1e-2)


def new_experiment(d: int) -> Experiment:
    k1, k2 = jax.random.split(jax.random.key(0))
    weights = {
        "w1": jax.random.normal(k1, (d, 4 * d)) / d**0.5,
        "w2": jax.random.normal(k2, (4 * d, 1)) / (4 * d) ** 0.5,
    }
    return Experiment("regression", weights, TX.init(weights), jnp.zeros((), jnp.int32))


def train_step(exp: Experiment, x: jax.Array, y: jax.Array) -> tuple[Experiment, jax.Array]:
    def loss_fn(w: dict[str, Any]) -> jax.Array:
        return jnp.mean((jnp.tanh(x @ w["w1"]) @ w["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(exp.weights)
    updates, opt = TX.update(grads, exp.opt, exp.weights)
    return Experiment(exp.name, optax.apply_updates(exp.weights, updates), opt, exp.step + 1), loss


def main(fast: bool = False) -> dict[str, Any]:
    d, steps = (16, 10) if fast else (128, 100)
    mesh = ms.make_mesh({"data": 2, "model": 4})
    exp = new_experiment(d)
    console.print(ms.plan(exp, RULES, mesh))

    exp = ms.shard(exp, RULES, mesh)
    step = ms.shard_jit(
        train_step, mesh=mesh, in_specs=(RULES, P("data"), P("data")), donate_argnums=0
    )
    x = jax.random.normal(jax.random.key(1), (64, d))
    y = jnp.sin(x[:, :1])
    losses = []
    for _ in range(steps):
        exp, loss = step(exp, x, y)
        losses.append(float(loss))
    assert isinstance(exp, Experiment) and exp.name == "regression"
    console.print(
        f"{exp.name}: {int(exp.step)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
        f"opt/0/mu/w1 is {exp.opt[0].mu['w1'].sharding.spec}"
    )

    work = Path(tempfile.mkdtemp(prefix="modelshard-custom-"))
    try:
        ms.save(work / "exp", exp)
        back = ms.restore(work / "exp", like=new_experiment(d), specs=RULES, mesh=mesh)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert isinstance(back, Experiment)
    assert bool(jnp.array_equal(back.weights["w1"], exp.weights["w1"]))
    console.print(f"saved and restored as {type(back).__name__} at step {int(back.step)}")
    return {"losses": losses, "paths": ms.adapters.split(exp).paths, "step": int(back.step)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a few steps")
    main(fast=parser.parse_args().fast)
