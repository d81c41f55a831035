"""Will it fit? ``ms.step_memory`` and ``ms.fit_advice`` against what the device does.

For three decoder-only language models (Llama-like: SwiGLU MLP, untied embeddings, layers
under ``jax.lax.scan``; float32 parameters, AdamW state, bfloat16-free) and their AdamW
training step, on whatever accelerator JAX sees:

1. ``memory``: the step's memory per device at a batch per device of ``--batch``, from
   ``step_memory`` (one compile, abstract inputs), its parts, and XLA's own
   ``peak_memory_in_bytes`` for the same program (the parts must add up to it);
2. ``batch``: the largest batch per device the advice says fits the device
   (``fit_advice(kinds=("batch",))`` from ``--max-batch`` down, halving), then the step
   run for real at that batch and at twice it (a real state on the device, one step): the
   advice's batch should run and the next one up should not (XLA refuses a program that
   does not fit);
3. ``topology`` (TPU only): a model too big for one chip compiled for TPU slices this
   machine does not have (``v5e:2x2``, ``v5e:4x4``): per-device figures and the smallest
   change that fits the chip. Elsewhere the same on 8 simulated CPU devices.

Writes ``docs/benchmarks/results/fit_<device>.json`` (``<device>``: ``cpu``, or the
device kind such as ``tpu_v5_lite``). ``--small`` runs tiny models (a check on CPU, in
about a minute); ``--parts memory,batch,topology`` and ``--sizes`` run pieces, ``--merge``
keeps the figures an earlier run wrote.

Run: ``python benchmarks/fit.py [--small] [--parts ...] [--sizes 0,1,2] [--merge]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Any

if "--small" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

if os.environ.get("JAX_PLATFORMS") == "cpu":  # before the backend starts
    jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import PartitionSpec as P
from results import RESULTS, write_results

import modelshard as ms

# name -> (d_model, layers, heads, mlp hidden, vocabulary)
SIZES = {
    "0.13b": (768, 12, 12, 2048, 32000),
    "0.28b": (1024, 16, 16, 2816, 32000),
    "0.67b": (1536, 20, 12, 4096, 32000),
}
BIG = ("1.4b", (2048, 24, 16, 5632, 32000))  # state about 17 GB: more than one v5e chip
SMALL = {
    "tiny_a": (64, 2, 4, 128, 512),
    "tiny_b": (96, 2, 4, 192, 512),
    "tiny_c": (128, 3, 4, 256, 512),
}
SMALL_BIG = ("tiny_big", (256, 4, 4, 512, 1024))

TX = optax.adamw(1e-4)


def init(key: jax.Array, cfg: tuple[int, int, int, int, int]) -> dict[str, Any]:
    d, n, _, h, v = cfg
    ks = jax.random.split(key, 9)

    def w(k: jax.Array, *shape: int) -> jax.Array:
        return jax.random.normal(k, shape, jnp.float32) * shape[-2] ** -0.5

    return {
        "embed": {"embedding": jax.random.normal(ks[0], (v, d), jnp.float32) * 0.02},
        "layers": {
            "attn": {
                "q": {"kernel": w(ks[1], n, d, d)},
                "k": {"kernel": w(ks[2], n, d, d)},
                "v": {"kernel": w(ks[3], n, d, d)},
                "o": {"kernel": w(ks[4], n, d, d)},
            },
            "mlp": {
                "gate": {"kernel": w(ks[5], n, d, h)},
                "up": {"kernel": w(ks[6], n, d, h)},
                "down": {"kernel": w(ks[7], n, h, d)},
            },
            "norm": {"scale": jnp.ones((n, 2, d), jnp.float32)},
        },
        "lm_head": {"kernel": w(ks[8], d, v)},
    }


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def make_loss(cfg: tuple[int, int, int, int, int]) -> Any:
    d, _, heads, _, _ = cfg

    def layer(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        b, t, _ = x.shape
        h = _rms(x, p["norm"]["scale"][0])
        q, k, v = ((h @ p["attn"][n]["kernel"]).reshape(b, t, heads, d // heads) for n in "qkv")
        a = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
        a = jnp.where(jnp.tril(jnp.ones((t, t), bool)), a, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(a), v).reshape(b, t, d)
        x = x + o @ p["attn"]["o"]["kernel"]
        h = _rms(x, p["norm"]["scale"][1])
        g = jax.nn.silu(h @ p["mlp"]["gate"]["kernel"]) * (h @ p["mlp"]["up"]["kernel"])
        return x + g @ p["mlp"]["down"]["kernel"], None

    def loss(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
        x = params["embed"]["embedding"][tokens]
        x, _ = jax.lax.scan(layer, x, params["layers"])
        logits = x @ params["lm_head"]["kernel"]
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return loss


def make_step(cfg: tuple[int, int, int, int, int]) -> Any:
    loss = make_loss(cfg)

    def train_step(state: dict[str, Any], tokens: jax.Array) -> tuple[dict[str, Any], Any]:
        value, grads = jax.value_and_grad(loss)(state["params"], tokens)
        updates, opt = TX.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt}, value

    return train_step


def make_state(cfg: tuple[int, int, int, int, int]) -> Any:
    def build(key: jax.Array) -> dict[str, Any]:
        params = init(key, cfg)
        return {"params": params, "opt_state": TX.init(params)}

    return build


def n_params(cfg: tuple[int, int, int, int, int]) -> int:
    shapes = jax.eval_shape(lambda k: init(k, cfg), jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def device_name() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", dev.device_kind.lower()).strip("_")


def device_limit() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def run_for_real(
    cfg: tuple[int, int, int, int, int], batch: int, seq: int, mesh: Any
) -> tuple[bool, str]:
    """One real step at ``batch`` per device: ``(ran, why not)``. The state is built on
    the device, used once and dropped."""
    step = ms.shard_jit(make_step(cfg), mesh=mesh, in_specs=(P(), P("data")), donate_argnums=0)
    state = None
    try:
        state = jax.jit(make_state(cfg))(jax.random.key(0))
        tokens = jnp.zeros((batch * mesh.size, seq), jnp.int32)
        state, value = step(state, tokens)
        jax.block_until_ready(value)
        return True, ""
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED (at compile or at run) among others
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        del state


def part_memory(name: str, cfg: Any, batch: int, seq: int, mesh: Any, out: dict) -> None:
    state = jax.eval_shape(make_state(cfg), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((batch * mesh.size, seq), jnp.int32)
    m = ms.step_memory(
        make_step(cfg), state, tokens, mesh=mesh, in_specs=(P(), P("data")), donate_argnums=0
    )
    out[f"{name}_params"] = n_params(cfg)
    out[f"{name}_batch_per_device"] = batch
    out[f"{name}_total_bytes"] = m.total
    for part, n in m.parts.items():
        out[f"{name}_{part}_bytes"] = n
    out[f"{name}_parts_sum_bytes"] = sum(m.parts.values())
    out[f"{name}_xla_arg_out_temp_minus_alias_bytes"] = m.argument + m.output + m.temp - m.alias
    if m.peak is not None:
        out[f"{name}_xla_peak_bytes"] = m.peak
    out[f"{name}_compile_seconds"] = round(m.compile_seconds, 2)
    if m.refused is not None:
        out[f"{name}_refused"] = m.refused
    print(f"[{name}] {m.summary()}", flush=True)
    if sum(m.parts.values()) != m.total:
        raise SystemExit(f"{name}: the parts do not add up to the total")


def part_batch(
    name: str, cfg: Any, max_batch: int, seq: int, mesh: Any, budget: int | None, out: dict
) -> None:
    state = jax.eval_shape(make_state(cfg), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((max_batch * mesh.size, seq), jnp.int32)
    if budget is None:  # no device limit (CPU): half the step at the largest batch
        budget = (
            ms.step_memory(
                make_step(cfg),
                state,
                tokens,
                mesh=mesh,
                in_specs=(P(), P("data")),
                donate_argnums=0,
            ).total
            * 2
            // 3
        )
    t = time.perf_counter()
    advice = ms.fit_advice(
        make_step(cfg),
        state,
        tokens,
        budget=budget,
        mesh=mesh,
        in_specs=(P(), P("data")),
        donate_argnums=0,
        kinds=("batch",),
    )
    seconds = time.perf_counter() - t
    if advice.fits:
        fits = max_batch
    elif advice.best is None:
        fits = 0
    else:
        fits = advice.best.args[1].shape[0] // mesh.size
    out[f"{name}_budget_bytes"] = budget
    out[f"{name}_advice_batch_per_device"] = fits
    out[f"{name}_advice_compiles"] = advice.compiles
    out[f"{name}_advice_seconds"] = round(seconds, 2)
    print(
        f"[{name}] advice: {fits} per device fits {budget} bytes "
        f"({advice.compiles} compiles, {seconds:.0f}s)",
        flush=True,
    )
    if jax.default_backend() == "cpu" or fits == 0:
        out[f"{name}_runs_checked"] = "no device limit on CPU: runs not checked"
        return
    ran, why = run_for_real(cfg, fits, seq, mesh)
    out[f"{name}_advice_batch_runs"] = "yes" if ran else f"no: {why}"
    up, why_up = run_for_real(cfg, fits * 2, seq, mesh)
    out[f"{name}_next_batch_runs"] = "yes" if up else f"no: {why_up}"
    print(
        f"[{name}] batch {fits}: {'runs' if ran else why}; batch {fits * 2}: "
        f"{'runs' if up else why_up}",
        flush=True,
    )


def part_topology(
    name: str, cfg: Any, batch: int, seq: int, budget: int | None, small: bool, out: dict
) -> None:
    state = jax.eval_shape(make_state(cfg), jax.random.key(0))
    if jax.default_backend() == "tpu" and not small:
        meshes = [("v5e_2x2", {"data": 4}, "v5e:2x2"), ("v5e_4x4", {"data": 16}, "v5e:4x4")]
    else:
        meshes = [("cpu8", {"data": 8}, None)]
    for label, sizes, topology in meshes:
        n = math.prod(sizes.values())
        tokens = jax.ShapeDtypeStruct((batch * n, seq), jnp.int32)
        kw: dict[str, Any] = dict(
            mesh=sizes, in_specs=(P(), P("data")), donate_argnums=0, topology=topology
        )
        m = ms.step_memory(make_step(cfg), state, tokens, **kw)
        limit = budget if budget is not None else m.total * 2 // 3
        advice = ms.fit_advice(
            make_step(cfg),
            state,
            tokens,
            budget=limit,
            first=True,
            kinds=("shard_optimizer", "fsdp", "tensor_parallel", "batch"),
            **kw,
        )
        key = f"{name}_{label}"
        out[f"{key}_devices"] = n
        out[f"{key}_total_bytes"] = m.total
        out[f"{key}_parameters_bytes"] = m.parts["parameters"]
        out[f"{key}_optimizer_state_bytes"] = m.parts["optimizer_state"]
        out[f"{key}_temporaries_bytes"] = m.parts["temporaries"]
        out[f"{key}_fits_as_given"] = "yes" if advice.fits else "no"
        if m.refused is not None:
            out[f"{key}_refused"] = m.refused
        if advice.best is not None and advice.best.memory is not None:
            out[f"{key}_suggestion"] = advice.best.description
            out[f"{key}_suggestion_total_bytes"] = advice.best.memory.total
        out[f"{key}_compiles"] = advice.compiles
        out[f"{key}_compile_seconds"] = round(advice.compile_seconds, 2)
        print(f"[{key}] {m.summary()}", flush=True)
        print("\n".join(advice.lines()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny models (a check on CPU)")
    ap.add_argument("--parts", default="memory,batch,topology")
    ap.add_argument("--sizes", default="0,1,2", help="which of the three decoders")
    ap.add_argument("--batch", type=int, default=None, help="batch per device for memory")
    ap.add_argument("--max-batch", type=int, default=None, help="where the batch search starts")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--merge", action="store_true", help="keep an earlier run's figures")
    args = ap.parse_args()
    sizes = SMALL if args.small else SIZES
    big = SMALL_BIG if args.small else BIG
    seq = args.seq or (32 if args.small else 1024)
    batch = args.batch or (4 if args.small else 1)
    max_batch = args.max_batch or (16 if args.small else 64)
    parts = args.parts.split(",")
    picked = [list(sizes.items())[int(i)] for i in args.sizes.split(",")]
    one = ms.make_mesh({"data": 1})
    limit = device_limit()
    name = "fit_" + device_name() + ("_small" if args.small else "")
    out: dict[str, Any] = {}
    path = RESULTS / f"{name}.json"
    if args.merge and path.is_file():
        out.update(json.loads(path.read_text())["results"])
    out["device"] = f"{jax.devices()[0].device_kind} ({jax.device_count()} here)"
    if limit is not None:
        out["device_bytes_limit"] = limit
    out["seq"] = seq
    for label, cfg in picked:
        if "memory" in parts:
            part_memory(label, cfg, batch, seq, one, out)
        if "batch" in parts:
            part_batch(label, cfg, max_batch, seq, one, limit, out)
    if "topology" in parts:
        part_topology(big[0], big[1], batch, seq, limit, args.small, out)
    notes = (
        "step_memory / fit_advice against the device: parts add up to XLA's total; the "
        "advice's largest batch run for real next to twice it; a model larger than one "
        "device compiled for larger meshes"
    )
    print(write_results(name, out, argv=sys.argv, notes=notes))


if __name__ == "__main__":
    main()
