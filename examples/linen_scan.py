"""The demo's flow for Flax linen: logical axis names in the model, an ``nn.scan``-stacked
block, and two sets of logical rules that turn the same model into two layouts.

The model names every kernel's dimensions with logical names
(``nn.with_logical_partitioning``); ``nn.scan`` adds a ``layers`` dimension to the stacked
block's parameters. modelshard reads those names from the ``LogicallyPartitioned`` boxes
(in the parameters *and* in the optimizer's moments, which keep the boxes) and maps them to
mesh axes with ``Rules([], logical=...)``:

- FSDP on (8,): ``embed -> data``, everything else replicated;
- tensor parallel on (2, 4): ``mlp, heads, vocab -> model``.

1. Pretrain a ``TrainState`` with the FSDP rules; save it.
2. Restore it onto the tensor-parallel layout and fine-tune on a different text.
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

import flax.linen as nn
import jax.numpy as jnp
import optax
from _common import VOCAB, batches, console, finetune_text, human, pretrain_text, train
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

import modelshard as ms


def part(*names: str | None) -> Any:
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        d = x.shape[-1]
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(
            self.heads,
            kernel_init=part("embed", "heads", "kv"),
            out_kernel_init=part("heads", "kv", "embed"),
        )(h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(4 * d, kernel_init=part("embed", "mlp"))(h))
        return x + nn.Dense(d, kernel_init=part("mlp", "embed"))(h), None


class CharLM(nn.Module):
    d: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        embed = nn.Embed(
            VOCAB,
            self.d,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(0.02), ("vocab", "embed")
            ),
        )
        x = embed(ids)
        # One set of Block parameters with a leading "layers" dimension, applied in a loop.
        stack = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = stack(self.heads)(x, None)
        return embed.attend(nn.LayerNorm()(x))


# Two layouts of the same model, as logical axis rules. Leaves with no logical names
# (biases, norms) replicate: strict=False.
FSDP_RULES = ms.Rules(
    [],
    logical={
        "embed": "data",
        "vocab": None,
        "mlp": None,
        "heads": None,
        "kv": None,
        "layers": None,
    },
    strict=False,
)
TP_RULES = ms.Rules(
    [],
    logical={
        "embed": None,
        "vocab": "model",
        "mlp": "model",
        "heads": "model",
        "kv": None,
        "layers": None,
    },
    strict=False,
)


def main(fast: bool = False) -> dict[str, Any]:
    d, layers, seq, batch = (64, 2, 32, 16) if fast else (128, 3, 64, 32)
    pre_steps, ft_steps = (8, 6) if fast else (120, 60)
    model = CharLM(d, 4, layers)
    tx = optax.adamw(3e-3)
    console.rule("[bold]linen: logical axis rules, nn.scan, TrainState")

    def init() -> TrainState:
        variables = model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
        state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)
        return state.replace(step=jnp.zeros((), jnp.int32))  # an array, not a Python int

    def train_step(state: TrainState, ids: jax.Array, targets: jax.Array):
        def loss_fn(params: Any) -> jax.Array:
            logits = state.apply_fn({"params": params}, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    fsdp_mesh = ms.make_mesh({"data": 8})
    tp_mesh = ms.make_mesh({"data": 2, "model": 4})
    abstract = jax.eval_shape(init)
    tp_plan = ms.plan(abstract, TP_RULES, tp_mesh)
    console.print(ms.plan(abstract.params, TP_RULES, tp_mesh).table(max_rows=10))
    kernel = tp_plan["opt_state/0/mu/ScanBlock_0/Dense_0/kernel"]
    console.print(
        f"the adam moment of the scanned up-projection: {kernel.shape} -> "
        f"{kernel.spec} ({kernel.rule})"
    )

    # Initialise directly into the FSDP layout.
    state = ms.shard_jit(init, mesh=fsdp_mesh, in_specs=(), out_specs=FSDP_RULES)()
    step = ms.shard_jit(
        train_step, mesh=fsdp_mesh, in_specs=(FSDP_RULES, P("data"), P("data")), donate_argnums=0
    )
    data = batches(pretrain_text(), batch, seq, seed=0)
    state, pre = train(step, state, data, pre_steps, "pretrain (FSDP, data=8)")

    work = Path(tempfile.mkdtemp(prefix="modelshard-linen-"))
    try:
        ms.save(work / "pretrained", state)
        state = ms.restore(work / "pretrained", like=abstract, specs=TP_RULES, mesh=tp_mesh)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert isinstance(state, TrainState)

    step = ms.shard_jit(
        train_step, mesh=tp_mesh, in_specs=(TP_RULES, P("data"), P("data")), donate_argnums=0
    )
    data = batches(finetune_text(), batch, seq, seed=1)
    state, ft = train(step, state, data, ft_steps, "fine-tune (TP, data=2 x model=4)")

    before = ms.plan(abstract, FSDP_RULES, fsdp_mesh).bytes_per_device()
    console.print(
        f"TrainState per device: {human(before)} (FSDP) -> "
        f"{human(tp_plan.bytes_per_device())} (tensor parallel)"
    )
    up = state.params["ScanBlock_0"]["Dense_0"]["kernel"]
    return {
        "pretrain_losses": pre,
        "finetune_losses": ft,
        "step": int(state.step),
        "up_spec": str(nn.unbox(up).sharding.spec),
        "moment_spec": str(kernel.spec),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a tiny model for a few steps")
    main(fast=parser.parse_args().fast)
