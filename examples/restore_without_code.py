"""Restore a checkpoint without the model code that wrote it.

A modelshard checkpoint records every leaf's canonical path, shape, dtype and the layout it
was saved with. That is enough to load it as a nested dict of arrays, plan it onto another
mesh, reshard it, or look inside, with no model class in sight: useful for evaluation
scripts, conversion tools and "what is in this checkpoint?".
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
import numpy as np
from _common import console
from jax.sharding import PartitionSpec as P

import modelshard as ms


def write_checkpoint(path: Path, d: int) -> dict[str, float]:
    """Stands in for a training job elsewhere: an NNX model saved with FSDP on (8,)."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(256, d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, rngs=rngs)

    model = MLP(nnx.Rngs(0))
    ms.shard(model, ms.fsdp("data", min_size=0), ms.make_mesh({"data": 8}))
    ms.save(path, model)
    return {
        p: float(jnp.linalg.norm(x))
        for p, x in zip(
            ms.adapters.split(model).paths, ms.adapters.split(model).arrays, strict=True
        )
    }


def main(fast: bool = False) -> dict[str, Any]:
    d = 32 if fast else 256
    work = Path(tempfile.mkdtemp(prefix="modelshard-nocode-"))
    try:
        norms = write_checkpoint(work / "ckpt", d)

        # 1. No model code: a nested dict of arrays, in the layout it was saved with.
        tree = ms.restore(work / "ckpt")
        console.print({k: sorted(v) for k, v in tree.items()})
        kernel = tree["up"]["kernel"]
        console.print(f"up/kernel: {kernel.shape} {kernel.dtype}, saved as {kernel.sharding.spec}")
        for path, x in zip(
            ms.adapters.split(tree).paths, ms.adapters.split(tree).arrays, strict=True
        ):
            assert np.isclose(float(jnp.linalg.norm(x)), norms[path]), path

        # 2. Onto another mesh and layout, still without the model: rules over the paths.
        rules = ms.Rules(
            [
                (r"embedding$", P("model", None)),
                (r"up/kernel$", P(None, "model")),
                (r"down/kernel$", P("model", None)),
                (r".*", P()),
            ]
        )
        mesh = ms.make_mesh({"data": 2, "model": 4})
        console.print(ms.plan(jax.eval_shape(lambda: tree), rules, mesh).summary())
        tp = ms.restore(work / "ckpt", specs=rules, mesh=mesh)
        console.print(f"restored onto (2, 4): up/kernel is {tp['up']['kernel'].sharding.spec}")
        assert bool(jnp.array_equal(tp["up"]["kernel"], kernel))

        # 3. A damaged or mismatched target is a CheckpointError that names the leaves.
        wrong = jax.eval_shape(lambda: {**tree, "up": {"kernel": jnp.zeros((d, 3 * d))}})
        try:
            ms.restore(work / "ckpt", like=wrong)
            raise AssertionError("expected a CheckpointError")
        except ms.CheckpointError as e:
            first = str(e).splitlines()[:4]
            console.print("[yellow]restoring into the wrong structure:[/]\n" + "\n".join(first))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "paths": ms.adapters.split(tree).paths,
        "tp_spec": str(tp["up"]["kernel"].sharding.spec),
        "error": "\n".join(first),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="small arrays")
    main(fast=parser.parse_args().fast)
