"""The demo's flow for Equinox: an ``eqx.Module`` language model, sharded as one value.

Equinox modules hold static leaves (activation functions, sizes) next to their arrays; plain
``jax.jit`` rejects them and ``eqx.filter_jit`` takes no shardings. ``shard_jit`` takes the
module (and the optax state) as arguments, places only the arrays, and carries the rest.

1. Pretrain a small character-level transformer with FSDP on an (8,) mesh.
2. Save it; restore it directly onto a (2, 4) tensor-parallel layout (resharding on restore,
   with ``like=`` an abstract module, so an ``eqx.Module`` comes back).
3. Fine-tune on a different text.
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

import equinox as eqx
import jax.numpy as jnp
import optax
from _common import VOCAB, batches, console, finetune_text, human, pretrain_text, train
from jax.sharding import PartitionSpec as P

import modelshard as ms


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d: int, heads: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.up = eqx.nn.Linear(d, 4 * d, key=k2)
        self.down = eqx.nn.Linear(4 * d, d, key=k3)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, mask=mask)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(h)


class CharLM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm

    def __init__(self, d: int, heads: int, layers: int, key: jax.Array):
        keys = jax.random.split(key, layers + 1)
        self.embed = eqx.nn.Embedding(VOCAB, d, key=keys[0])
        self.blocks = [Block(d, heads, k) for k in keys[1:]]
        self.norm = eqx.nn.LayerNorm(d)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Logits for one sequence of token ids (vmap over the batch)."""
        x = jax.vmap(self.embed)(ids)
        x = x + _positions(ids.shape[0], x.shape[1])
        mask = jnp.tril(jnp.ones((ids.shape[0], ids.shape[0]), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.norm)(x) @ self.embed.weight.T / jnp.sqrt(x.shape[-1])


def _positions(n: int, d: int) -> jax.Array:
    """Sinusoidal positions: no parameters, so nothing to shard."""
    pos = jnp.arange(n)[:, None] / (10_000 ** (jnp.arange(0, d, 2) / d))
    return jnp.concatenate([jnp.sin(pos), jnp.cos(pos)], axis=-1)


# Equinox's Linear stores (out, in): column-parallel "up" shards dim 0, row-parallel "down" dim 1.
TP_RULES = ms.Rules(
    [
        (r"embed/weight$", P("model", None)),
        (r"attn/(query|key|value)_proj/weight$", P("model", None)),
        (r"attn/output_proj/weight$", P(None, "model")),
        (r"up/weight$", P("model", None)),
        (r"up/bias$", P("model")),
        (r"down/weight$", P(None, "model")),
        (r".*", P()),
    ]
)
FSDP = ms.fsdp("data", min_size=2**12)


def main(fast: bool = False) -> dict[str, Any]:
    d, layers, seq, batch = (64, 1, 32, 16) if fast else (128, 2, 64, 32)
    pre_steps, ft_steps = (8, 6) if fast else (120, 60)
    tx = optax.adamw(3e-3)
    console.rule(
        "[bold]Equinox: pretrain (FSDP) -> save -> restore as tensor parallel -> fine-tune"
    )

    def init() -> tuple[CharLM, Any]:
        model = CharLM(d, 4, layers, jax.random.key(0))
        return model, tx.init(eqx.filter(model, eqx.is_array))

    def train_step(state: tuple[CharLM, Any], ids: jax.Array, targets: jax.Array):
        model, opt = state

        def loss_fn(m: CharLM) -> jax.Array:
            logits = jax.vmap(m)(ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt = tx.update(grads, opt, eqx.filter(model, eqx.is_array))
        return (eqx.apply_updates(model, updates), opt), loss

    fsdp_mesh = ms.make_mesh({"data": 8})
    tp_mesh = ms.make_mesh({"data": 2, "model": 4})
    abstract = eqx.filter_eval_shape(init)  # static leaves kept, arrays abstract
    console.print(ms.plan(abstract[0], TP_RULES, tp_mesh).table(max_rows=10))

    # Equinox builds modules eagerly; shard the finished state onto the FSDP layout.
    state = ms.shard(init(), FSDP, fsdp_mesh)
    step = ms.shard_jit(
        train_step, mesh=fsdp_mesh, in_specs=(FSDP, P("data"), P("data")), donate_argnums=0
    )
    data = batches(pretrain_text(), batch, seq, seed=0)
    state, pre = train(step, state, data, pre_steps, "pretrain (FSDP, data=8)")

    work = Path(tempfile.mkdtemp(prefix="modelshard-eqx-"))
    try:
        ms.save(work / "pretrained", state)
        # Restore straight into the tensor-parallel layout: each leaf is read into its new
        # sharding; the module and optimizer state come back as themselves.
        state = ms.restore(work / "pretrained", like=abstract, specs=TP_RULES, mesh=tp_mesh)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    model = state[0]
    assert isinstance(model, CharLM) and model.blocks[0].attn.num_heads == 4
    console.print(
        f"restored as {type(model).__name__}; blocks/0/up/weight is "
        f"{model.blocks[0].up.weight.sharding.spec}"
    )

    step = ms.shard_jit(
        train_step, mesh=tp_mesh, in_specs=(TP_RULES, P("data"), P("data")), donate_argnums=0
    )
    data = batches(finetune_text(), batch, seq, seed=1)
    state, ft = train(step, state, data, ft_steps, "fine-tune (TP, data=2 x model=4)")

    before = ms.plan(abstract, FSDP, fsdp_mesh).bytes_per_device()
    after = ms.plan(abstract, TP_RULES, tp_mesh).bytes_per_device()
    console.print(f"per device: {human(before)} (FSDP) -> {human(after)} (tensor parallel)")
    return {
        "pretrain_losses": pre,
        "finetune_losses": ft,
        "up_spec": str(state[0].blocks[0].up.weight.sharding.spec),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a tiny model for a few steps")
    main(fast=parser.parse_args().fast)
