"""A checkpoint of one code base read by another: a linen model with ``nn.scan``-stacked
layers, saved, restored into the equivalent NNX model with unscanned layers, and back.

1. Initialise and save a linen model whose block is stacked by ``nn.scan``
   (``params/layers/up/kernel`` has shape ``[layers, embed, mlp]``).
2. Restore it with ``ms.restore(..., mapping=SCAN_TO_LIST)`` into an NNX model whose
   blocks are an ``nnx.List`` (``layers/0/up/kernel`` is ``[embed, mlp]``), planned for
   tensor parallelism; both models give the same logits.
3. Map the NNX model back into the linen layout with ``ms.unmap`` (the same mapping,
   backwards), save that, and restore it with the linen code: bit-exact.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import shutil
import tempfile
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from _common import VOCAB, console
from flax import nnx
from jax.sharding import PartitionSpec as P

import modelshard as ms

# ---- the same architecture twice ----------------------------------------------------------


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        d = x.shape[-1]
        h = nn.LayerNorm(name="norm")(x)
        h = nn.Dense(4 * d, name="up")(h)
        return x + nn.Dense(d, name="down")(nn.gelu(h)), None


class LinenLM(nn.Module):
    d: int
    layers: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, self.d, name="embed")
        stack = nn.scan(
            LinenBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = stack(name="layers")(embed(ids), None)
        return embed.attend(nn.LayerNorm(name="final_norm")(x))


class NnxBlock(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(nn.gelu(self.up(self.norm(x))))


class NnxLM(nnx.Module):
    def __init__(self, d: int, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.layers = nnx.List([NnxBlock(d, rngs) for _ in range(layers)])
        self.final_norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.embed.attend(self.final_norm(x))


# linen's scanned leaves -> one NNX leaf per layer; every other leaf keeps its path.
SCAN_TO_LIST = ms.WeightMap(
    [
        ms.MapRule(r"params/layers/(.+)", "layers/{i}/{1}", unstack=ms.Unstack("i")),
        ms.MapRule(r"params/(.+)", "{1}"),
    ]
)

TP = ms.Rules(
    [
        (r"up/kernel$", P(None, "model")),
        (r"down/kernel$", P("model", None)),
        (r"embed/embedding$", P("model", None)),
        (r".*", P()),
    ]
)


def main(fast: bool = False, workdir: str | None = None) -> dict[str, Any]:
    d, layers = (32, 2) if fast else (128, 6)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 16))
    linen = LinenLM(d, layers)
    variables = linen.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
    work = Path(workdir or tempfile.mkdtemp(prefix="modelshard-linen-nnx-"))
    try:
        ms.save(work / "linen", variables)
        console.print(
            f"saved the linen model: params/layers/up/kernel is "
            f"{variables['params']['layers']['up']['kernel'].shape}"
        )

        mesh = ms.make_mesh({"data": 2, "model": 4})
        like = nnx.eval_shape(lambda: NnxLM(d, layers, nnx.Rngs(0)))
        model = ms.restore(work / "linen", like=like, mapping=SCAN_TO_LIST, specs=TP, mesh=mesh)
        up = model.layers[1].up.kernel[...]
        console.print(f"restored into NNX: layers/1/up/kernel {up.shape} {up.sharding.spec}")
        want = np.asarray(linen.apply(variables, ids))
        got = np.asarray(nnx.jit(lambda m, i: m(i))(model, ids))
        max_err = float(np.abs(got - want).max())
        console.print(f"logits, NNX vs linen: max abs difference {max_err:.2e}")

        # and back: the NNX state in linen's layout, saved and restored by linen's code
        abstract = jax.eval_shape(lambda: variables)
        back = ms.unmap(model, reference=abstract, mapping=SCAN_TO_LIST)
        ms.save(work / "back", back)
        again = ms.restore(work / "back", like=abstract)
        same = all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(variables), strict=True)
        )
        console.print(f"NNX -> linen layout -> restored by linen: bit-exact {same}")
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return {"max_err": max_err, "bit_exact": same, "up_spec": str(up.sharding.spec)}


if __name__ == "__main__":
    print(main())
