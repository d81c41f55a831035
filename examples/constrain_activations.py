"""``constrain`` inside model code: pin the layout of activations, not just of parameters.

With tensor-parallel parameters the compiler must still decide how the activations between
layers are laid out. ``ms.constrain(tree, specs)`` puts a sharding constraint on every array
leaf of a container (here a dict of activations) using the same spec language as everything
else; inside ``shard_jit`` the mesh comes from the active context, so model code does not
need the mesh passed around.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import argparse
from typing import Any

import jax.numpy as jnp
from _common import console
from jax.sharding import PartitionSpec as P

import modelshard as ms

# Activations: batch over "data", hidden features over "model"; the residual stream whole.
ACTIVATIONS = ms.Rules([(r"hidden$", P("data", None, "model")), (r"residual$", P("data"))])
PARAMS = ms.Rules([(r"up$", P(None, "model")), (r"down$", P("model", None))])


def mlp_block(params: dict[str, jax.Array], x: jax.Array) -> dict[str, jax.Array]:
    """Model code: no mesh in sight. ``constrain`` finds it in the active context."""
    hidden = jax.nn.gelu(x @ params["up"])
    acts = ms.constrain({"hidden": hidden, "residual": x}, ACTIVATIONS)
    out = acts["residual"] + acts["hidden"] @ params["down"]
    return {"hidden": acts["hidden"], "out": out}


def main(fast: bool = False) -> dict[str, Any]:
    d, batch, seq = (32, 8, 16) if fast else (256, 32, 128)
    mesh = ms.make_mesh({"data": 2, "model": 4})
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "up": jax.random.normal(k1, (d, 4 * d)) / d**0.5,
        "down": jax.random.normal(k2, (4 * d, d)) / (4 * d) ** 0.5,
    }
    x = jax.random.normal(k3, (batch, seq, d))

    step = ms.shard_jit(mlp_block, mesh=mesh, in_specs=(PARAMS, P("data")))
    out = step(params, x)
    console.print(
        f"hidden activations: {out['hidden'].shape} laid out as {out['hidden'].sharding.spec}"
    )
    console.print(f"block output:       {out['out'].shape} laid out as {out['out'].sharding.spec}")

    # The same numbers as the unsharded computation.
    ref = jax.nn.gelu(x @ params["up"]) @ params["down"] + x
    err = float(jnp.max(jnp.abs(out["out"] - ref)))
    console.print(f"max difference from the unsharded block: {err:.2e}")

    # A constraint that cannot hold is a SpecError naming the leaf, raised while tracing.
    bad = ms.Rules([(r"hidden$", P("data", "model", None)), (r"residual$", P("data"))])
    try:
        jax.jit(lambda h: ms.constrain({"hidden": h, "residual": h}, bad, mesh))(
            jnp.zeros((batch, 6, 4 * d))
        )
        raise AssertionError("expected a SpecError")
    except ms.SpecError as e:
        console.print(
            f"[yellow]a constraint that cannot hold:[/] {e.problems[0].path}: {e.problems[0].what}"
        )
        problem = e.problems[0].what
    return {"hidden_spec": str(out["hidden"].sharding.spec), "max_err": err, "problem": problem}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="small arrays")
    main(fast=parser.parse_args().fast)
