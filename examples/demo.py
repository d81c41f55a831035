"""modelshard end to end, on 8 simulated CPU devices and text that ships with Python.

1. Build a small decoder-only transformer (Flax NNX), a character-level language model, and
   plan its training state two ways: fully sharded (FSDP) on an (8,) mesh, tensor parallel
   on a (2, 4) mesh.
2. Pretrain it with FSDP (``shard_jit``) on the source code of a standard-library module.
3. Save a sharded checkpoint; reshard it offline with the ``modelshard reshard`` command onto
   the (2, 4) tensor-parallel layout.
4. Restore it there and fine-tune on a different text (the Zen of Python), showing the loss
   fall and the bytes per device before and after.

Run it with ``make demo`` (or ``python examples/demo.py``); ``--fast`` runs a tiny model for
a few steps (what the test suite does).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import optax
from _common import batches, console, finetune_text, human, pretrain_text, train
from flax import nnx
from jax.sharding import PartitionSpec as P

import modelshard as ms


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


# ---- the two layouts --------------------------------------------------------------------------
# FSDP: every leaf of 4,096+ elements sharded 8 ways along its largest divisible dimension.
FSDP = ms.fsdp("data", min_size=2**12)

# Megatron-style tensor parallelism over "model": column-parallel in, row-parallel out. The
# patterns are anchored at the end, so they cover the parameters and the optimizer's moments
# (``opt/0/mu/blocks/0/up/kernel``) alike. The same rules, as a TOML file for the CLI:
TP_RULES_TOML = """
[[rules]]
pattern = "embed/embedding$"
spec = ["model", "none"]

[[rules]]
pattern = "attn/(query|key|value)/kernel$"
spec = ["none", "model", "none"]

[[rules]]
pattern = "attn/(query|key|value)/bias$"
spec = ["model", "none"]

[[rules]]
pattern = "attn/out/kernel$"
spec = ["model", "none", "none"]

[[rules]]
pattern = "up/kernel$"
spec = ["none", "model"]

[[rules]]
pattern = "up/bias$"
spec = ["model"]

[[rules]]
pattern = "down/kernel$"
spec = ["model", "none"]

[[rules]]
pattern = ".*"
spec = []
"""
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


# ---- training ------------------------------------------------------------------------------------
def make_train_step(graphdef: Any, tx: optax.GradientTransformation):
    def train_step(state: dict[str, Any], ids: jax.Array, targets: jax.Array):
        def loss_fn(params: Any) -> jax.Array:
            logits = nnx.merge(graphdef, params)(ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return train_step


def modelshard_cli(*args: str, in_process: bool = False) -> None:
    """Run the ``modelshard`` command installed with the package, as a user would type it
    (``in_process``: call its ``main`` here instead, saving a Python start-up)."""
    console.print(f"[bold]$ modelshard {' '.join(args)}")
    if in_process:
        from modelshard.cli import main as cli_main

        if cli_main(list(args)):
            raise RuntimeError(f"modelshard {args[0]} failed")
        return
    exe = Path(sys.executable).with_name("modelshard")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "modelshard"]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, check=False)
    console.print(out.stdout.rstrip())
    if out.returncode:
        raise RuntimeError(f"modelshard {args[0]} failed:\n{out.stderr}")


# ---- the demo --------------------------------------------------------------------------------------
def main(fast: bool = False, workdir: str | None = None) -> dict[str, Any]:
    cfg = FAST if fast else Config()
    t0 = time.perf_counter()
    console.rule("[bold]modelshard demo")
    console.print(f"{jax.device_count()} simulated {jax.devices()[0].platform} devices; {cfg}")
    tx = optax.adamw(cfg.lr)

    def init_state() -> dict[str, Any]:
        params = nnx.state(CharLM(cfg, nnx.Rngs(0)), nnx.Param)
        return {"params": params, "opt": tx.init(params)}

    # 1. Plan the (abstract) training state two ways. Nothing is allocated yet.
    abstract = jax.eval_shape(init_state)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: CharLM(cfg, nnx.Rngs(0))))
    fsdp_mesh = ms.make_mesh({"data": 8})
    tp_mesh = ms.make_mesh({"data": 2, "model": 4})
    fsdp_plan = ms.plan(abstract, FSDP, fsdp_mesh)
    tp_plan = ms.plan(abstract, TP_RULES, tp_mesh)
    console.print(ms.plan(abstract["params"], FSDP, fsdp_mesh).table(max_rows=14))
    console.print(ms.plan(abstract["params"], TP_RULES, tp_mesh).table(max_rows=14))

    # 2. Pretrain with FSDP on (8,). The state is created directly in its sharded layout.
    state = ms.shard_jit(init_state, mesh=fsdp_mesh, in_specs=(), out_specs=FSDP)()
    step = ms.shard_jit(
        make_train_step(graphdef, tx),
        mesh=fsdp_mesh,
        in_specs=(FSDP, P("data"), P("data")),  # the state by FSDP, each batch over "data"
        donate_argnums=0,
    )
    data = batches(pretrain_text(), cfg.batch, cfg.seq, seed=0)
    state, pre_losses = train(step, state, data, cfg.pretrain_steps, "pretrain (FSDP, data=8)")

    # 3. Save the sharded checkpoint, then reshard it offline onto the tensor-parallel layout.
    work = Path(workdir or tempfile.mkdtemp(prefix="modelshard-demo-"))
    pretrained, resharded, rules_file = work / "pretrained", work / "tp", work / "tp_rules.toml"
    ms.save(pretrained, state, overwrite=True)
    rules_file.write_text(TP_RULES_TOML)
    modelshard_cli("inspect", str(pretrained), "--max-rows", "8", in_process=True)
    shutil.rmtree(resharded, ignore_errors=True)
    modelshard_cli(
        "reshard",
        str(pretrained),
        str(resharded),
        "--mesh",
        "data=2,model=4",
        "--rules",
        str(rules_file),
        in_process=fast,
    )

    # 4. Restore onto the (2, 4) mesh (with the layout the checkpoint now records) and
    #    fine-tune on a different text.
    kernel_before = np.asarray(state["params"]["blocks"][0]["up"]["kernel"][...])
    state = ms.restore(resharded, like=abstract, mesh=tp_mesh)
    kernel = state["params"]["blocks"][0]["up"]["kernel"][...]
    assert np.array_equal(np.asarray(kernel), kernel_before), "restore changed the values"
    placed = [x.sharding for x in ms.adapters.split(state).arrays]
    assert placed == tp_plan.flat_shardings(0), "restored layout differs from the plan"
    console.print(
        f"restored: blocks/0/up/kernel is {kernel.sharding.spec} on "
        f"{dict(tp_mesh.shape)}, values bit-exact"
    )
    step = ms.shard_jit(
        make_train_step(graphdef, tx),
        mesh=tp_mesh,
        in_specs=(TP_RULES, P("data"), P("data")),
        donate_argnums=0,
    )
    data = batches(finetune_text(), cfg.batch, cfg.seq, seed=1)
    state, ft_losses = train(
        step, state, data, cfg.finetune_steps, "fine-tune (TP, data=2 x model=4)"
    )

    before, after = fsdp_plan.bytes_per_device(), tp_plan.bytes_per_device()
    console.print(
        f"training state per device: {human(before)} with FSDP on (8,) -> {human(after)} "
        f"tensor parallel on (2, 4); {human(fsdp_plan.total_bytes)} if replicated"
    )
    console.print(f"done in {time.perf_counter() - t0:.1f} s (checkpoints in {work})")
    if workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "pretrain_losses": pre_losses,
        "finetune_losses": ft_losses,
        "bytes_before": before,
        "bytes_after": after,
        "bytes_replicated": fsdp_plan.total_bytes,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a tiny model for a few steps")
    parser.add_argument("--workdir", help="keep the checkpoints here (default: a temp dir)")
    args = parser.parse_args()
    main(fast=args.fast or os.environ.get("MODELSHARD_DEMO_FAST") == "1", workdir=args.workdir)
