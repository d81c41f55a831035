"""modelshard end to end, on 8 simulated CPU devices and text that ships with Python.

1. Build a small decoder-only transformer (Flax NNX), a character-level language model.
2. Plan it: fully sharded (FSDP) on an (8,) mesh, tensor parallel on a (2, 4) mesh.
3. Pretrain it with FSDP on the source code of a standard-library module.
4. Move the whole training state onto the (2, 4) tensor-parallel layout and fine-tune it on
   a different text (the Zen of Python), showing the loss fall and the bytes per device.

Run it with ``make demo`` (or ``python examples/demo.py``); ``--fast`` runs a few steps only.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import argparse
import codecs
import contextlib
import dataclasses
import inspect
import io
import textwrap
import time
from typing import Any

import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

import modelshard as ms

console = Console(width=max(Console().width, 130))


def human(n: float) -> str:
    """``1.29 MiB``-style text for a byte count."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


# ---- configuration ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128  # ASCII: one token per character
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    seq: int = 64
    batch: int = 32
    pretrain_steps: int = 150
    finetune_steps: int = 60
    lr: float = 3e-3


FAST = Config(d_model=64, layers=1, seq=32, batch=16, pretrain_steps=8, finetune_steps=6)


# ---- the model ------------------------------------------------------------------------------
class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d = cfg.d_model
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.heads, in_features=d, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class CharLM(nnx.Module):
    """A decoder-only transformer over characters; the output layer reuses the embedding."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids) + self.pos[...][: ids.shape[-1]]
        mask = nnx.make_causal_mask(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))


# Megatron-style tensor parallelism over "model": column-parallel in, row-parallel out.
# Anchored patterns cover the parameters and the optimizer's moments (``opt/0/mu/...``).
TP_RULES = ms.Rules(
    [
        (r"embed/embedding$", P("model", None)),
        (r"attn/(query|key|value)/kernel$", P(None, "model", None)),
        (r"attn/(query|key|value)/bias$", P("model", None)),
        (r"attn/out/kernel$", P("model", None, None)),
        (r"up/kernel$", P(None, "model")),
        (r"up/bias$", P("model")),
        (r"down/kernel$", P("model", None)),
        (r".*", P()),
    ]
)


# ---- data: text that ships with Python --------------------------------------------------------
def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("ascii", "replace"), np.uint8).astype(np.int32) % 128


def pretrain_text() -> str:
    return inspect.getsource(textwrap)


def finetune_text() -> str:
    """The Zen of Python, from the ``this`` module (which prints it when imported)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def batches(tokens: np.ndarray, cfg: Config, seed: int):
    """Endless random windows ``(inputs, targets)`` of ``cfg.seq`` characters."""
    rng = np.random.default_rng(seed)
    while True:
        start = rng.integers(0, len(tokens) - cfg.seq - 1, cfg.batch)
        window = np.stack([tokens[s : s + cfg.seq + 1] for s in start])
        yield window[:, :-1], window[:, 1:]


# ---- training -----------------------------------------------------------------------------------
def make_step(graphdef: Any, tx: optax.GradientTransformation):
    def train_step(state: dict[str, Any], ids: jax.Array, targets: jax.Array):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, loss

    return train_step


def compile_step(graphdef: Any, tx: optax.GradientTransformation, state_plan: ms.Plan, mesh: Any):
    batch = NamedSharding(mesh, P("data"))
    return jax.jit(
        make_step(graphdef, tx),
        in_shardings=(state_plan.shardings, batch, batch),
        out_shardings=(state_plan.shardings, None),
        donate_argnums=0,
    )


def train(step, state: Any, data, steps: int, title: str) -> tuple[Any, list[float]]:
    losses: list[float] = []
    with Progress(
        TextColumn(f"[bold]{title}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]}"),
        console=console,
    ) as bar:
        task = bar.add_task(title, total=steps, loss="-")
        for _ in range(steps):
            ids, targets = next(data)
            state, loss = step(state, ids, targets)
            losses.append(float(loss))
            bar.update(task, advance=1, loss=f"{losses[-1]:.3f}")
    return state, losses


def show_losses(name: str, losses: list[float]) -> None:
    k = max(1, len(losses) // 10)
    first, last = np.mean(losses[:k]), np.mean(losses[-k:])
    console.print(f"{name}: loss {first:.3f} -> {last:.3f} (mean of first/last {k} steps)")


# ---- the demo --------------------------------------------------------------------------------------
def main(fast: bool = False) -> dict[str, Any]:
    cfg = FAST if fast else Config()
    t0 = time.perf_counter()
    console.rule("[bold]modelshard demo")
    console.print(f"{jax.device_count()} simulated {jax.devices()[0].platform} devices; {cfg}")

    tx = optax.adamw(cfg.lr)

    def init_state() -> dict[str, Any]:
        params = nnx.state(CharLM(cfg, nnx.Rngs(0)), nnx.Param)
        return {"params": params, "opt": tx.init(params)}

    # 1. Plans: the same (abstract) state, two layouts. Nothing is allocated yet.
    abstract = jax.eval_shape(init_state)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: CharLM(cfg, nnx.Rngs(0))))
    fsdp_mesh = ms.make_mesh({"data": 8})
    tp_mesh = ms.make_mesh({"data": 2, "model": 4})
    fsdp = ms.fsdp("data", min_size=2**12)
    fsdp_plan = ms.plan(abstract, fsdp, fsdp_mesh)
    tp_plan = ms.plan(abstract, TP_RULES, tp_mesh)
    console.print(ms.plan(abstract["params"], fsdp, fsdp_mesh).table(max_rows=12))
    console.print(ms.plan(abstract["params"], TP_RULES, tp_mesh).table(max_rows=12))

    # Initialise straight into the FSDP layout: no device ever holds the whole state.
    state = jax.jit(init_state, out_shardings=fsdp_plan.shardings)()

    # 2. Pretrain with FSDP on (8,).
    step = compile_step(graphdef, tx, fsdp_plan, fsdp_mesh)
    data = batches(encode(pretrain_text()), cfg, seed=0)
    state, pre_losses = train(step, state, data, cfg.pretrain_steps, "pretrain (FSDP, data=8)")
    show_losses("pretraining", pre_losses)

    # 3. Reshard the whole state onto the tensor-parallel layout and fine-tune on new text.
    state = ms.shard(state, TP_RULES, tp_mesh)
    kernel = state["params"]["blocks"][0]["up"]["kernel"][...]
    console.print(f"blocks/0/up/kernel is now {kernel.sharding.spec} on {dict(tp_mesh.shape)}")
    step = compile_step(graphdef, tx, tp_plan, tp_mesh)
    data = batches(encode(finetune_text()), cfg, seed=1)
    state, ft_losses = train(
        step, state, data, cfg.finetune_steps, "fine-tune (TP, data=2 x model=4)"
    )
    show_losses("fine-tuning", ft_losses)

    before, after = fsdp_plan.bytes_per_device(), tp_plan.bytes_per_device()
    console.print(
        f"train state per device: {human(before)} (FSDP on 8) -> {human(after)} "
        f"(tensor parallel on 2x4); replicated it would be {human(fsdp_plan.total_bytes)}"
    )
    console.print(f"done in {time.perf_counter() - t0:.1f} s")
    return {
        "pretrain_losses": pre_losses,
        "finetune_losses": ft_losses,
        "bytes_before": before,
        "bytes_after": after,
        "bytes_replicated": fsdp_plan.total_bytes,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a few steps of a tiny model")
    args = parser.parse_args()
    main(fast=args.fast or os.environ.get("MODELSHARD_DEMO_FAST") == "1")
