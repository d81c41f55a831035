"""Checkpoints and a training step on whatever accelerator JAX sees, at a real size.

Run from the repository root on a machine with an accelerator (a TPU, a GPU)::

    python benchmarks/accelerator.py                 # 3.4 GB, 484 leaves, 3 repeats
    python benchmarks/accelerator.py --cpu --layers 1 --width 256 --vocab 1000 --repeats 1 --skip-step

(the last: a look on the CPU, 20 MB, under a minute; the step row adds a minute or more).

The state is a decoder's parameters with AdamW moments filled with random values (zeros
would compress and flatter a codec): ``--layers`` blocks of width ``--width`` (attention
projections, MLP, two norms) and an embedding, float32, all in device memory. Each row is
timed in a fresh process, as a job that saves once and restores once meets it, with every
first-call cost (compiles, handler set-up) included; a job saves in one process and
restores in another:

- ``modelshard``: a process that builds the state and calls ``ms.save`` twice (first,
  later), then saves twice with an asynchronous ``CheckpointManager`` (the time ``save``
  blocks the loop); then a fresh process that calls ``ms.restore(like=...)`` twice onto the
  same shardings (checksums verified, as by default);
- ``orbax``: the same with plain Orbax: ``StandardCheckpointer`` save (until written) and
  restore onto the same sharded targets, and ``CheckpointManager`` with ``StandardSave``;
- ``step``: one process, a decoder training step (``--step-*``) under ``ms.shard_jit`` and
  ``jax.jit`` on the split state, interleaved, median milliseconds per step.

One process at a time holds an accelerator, so the rows run one after another, the methods
interleaved repeat by repeat; the parent itself never touches the device. Medians and every
repeat go to ``docs/benchmarks/results/accelerator.json`` with the device's name (not for a
``--cpu`` run: that file is the accelerator's record).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _state_fn(layers: int, width: int, vocab: int) -> Any:
    """A function building ``{"params", "opt": {"mu", "nu", "count"}}`` on the device."""
    import jax
    import jax.numpy as jnp

    def block(key: Any) -> dict[str, Any]:
        k = jax.random.split(key, 6)
        d, f = width, 4 * width
        n = jax.random.normal
        return {
            "attn": {
                "q": n(k[0], (d, d)),
                "k": n(k[1], (d, d)),
                "v": n(k[2], (d, d)),
                "o": n(k[3], (d, d)),
            },
            "mlp": {"up": n(k[4], (d, f)), "down": n(k[5], (f, d))},
            "norm1": jnp.ones((d,)),
            "norm2": jnp.ones((d,)),
        }

    def build(seed: int) -> dict[str, Any]:
        keys = jax.random.split(jax.random.key(seed), layers + 3)
        params = {
            "embed": jax.random.normal(keys[0], (vocab, width)),
            "layers": {str(i): block(keys[i + 1]) for i in range(layers)},
        }
        leaves, tree = jax.tree.flatten(params)
        mk = jax.random.split(keys[-1], 2 * len(leaves))
        mu = [1e-3 * jax.random.normal(mk[2 * i], x.shape) for i, x in enumerate(leaves)]
        nu = [
            1e-6 * jnp.abs(jax.random.normal(mk[2 * i + 1], x.shape)) for i, x in enumerate(leaves)
        ]
        opt = {
            "mu": jax.tree.unflatten(tree, mu),
            "nu": jax.tree.unflatten(tree, nu),
            "count": jnp.asarray(7, jnp.int32),
        }
        return {"params": params, "opt": opt}

    return build


def _placed_state(args: argparse.Namespace) -> Any:
    """The state on the device, FSDP over every device (one chip: all of it there), random
    in every float leaf. Leaf by leaf: one program building all 484 leaves compiled for
    2.5 minutes on a TPU v5e."""
    import jax
    import jax.numpy as jnp

    like = _like(args)
    normal = jax.jit(lambda k, scale, shape: scale * jax.random.normal(k, shape), static_argnums=2)
    leaves, tree = jax.tree.flatten(like)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    out = []
    for (path, a), k in zip(jax.tree_util.tree_flatten_with_path(like)[0], keys, strict=True):
        scale = {"mu": 1e-3, "nu": 1e-6}.get(str(getattr(path[1], "key", "")), 1.0)
        if jnp.issubdtype(a.dtype, jnp.floating):
            x = normal(k, scale, tuple(a.shape))
            x = jnp.abs(x) if scale == 1e-6 else x
        else:
            x = jnp.full(a.shape, 7, a.dtype)
        out.append(jax.device_put(x, a.sharding))
    state = jax.tree.unflatten(tree, out)
    jax.block_until_ready(state)
    return state


def _fresh(state: Any) -> Any:
    """A copy of ``state`` in new device buffers, as a training step hands over each time (an
    array copied to the host once keeps that copy: saving it again would not copy it)."""
    import jax
    import jax.numpy as jnp

    return jax.block_until_ready(jax.tree.map(jnp.copy, state))


def _like(args: argparse.Namespace) -> Any:
    """The abstract state with its shardings (what a restoring job has: no arrays)."""
    import jax

    import modelshard as ms

    mesh = ms.make_mesh({"data": len(jax.devices())})
    abstract = jax.eval_shape(_state_fn(args.layers, args.width, args.vocab), 0)
    shardings = ms.plan(abstract, ms.fsdp("data"), mesh).shardings
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _timed(fn: Any) -> tuple[float, Any]:
    import jax

    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def _compile_listener(into: list[tuple[str, float]]) -> None:
    import jax

    def on(event: str, duration: float, **kw: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            into.append((str(kw.get("fun_name")), duration))

    jax.monitoring.register_event_duration_secs_listener(on)


def child_modelshard_save(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    compiles: list[tuple[str, float]] = []
    _compile_listener(compiles)
    import modelshard as ms

    out: dict[str, Any] = {}
    out["build_s"], state = _timed(lambda: _placed_state(args))
    state = _fresh(state)
    before = len(compiles)
    out["save_first"], _ = _timed(lambda: ms.save(work / "a", state))
    out["save_first_compile_s"] = sum(d for _, d in compiles[before:])
    state = _fresh(state)
    out["save_later"], _ = _timed(lambda: ms.save(work / "b", state))
    with ms.CheckpointManager(work / "m") as mgr:
        for i, name in ((1, "async_blocked_first"), (2, "async_blocked_later")):
            state = _fresh(state)
            t0 = time.perf_counter()
            mgr.save(i, state)
            out[name] = time.perf_counter() - t0
            mgr.wait_until_finished()
    out["save_programs"] = sorted({n for n, _ in compiles[before:]})
    return out


def child_modelshard_restore(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    compiles: list[tuple[str, float]] = []
    _compile_listener(compiles)
    import modelshard as ms

    like = _like(args)
    before = len(compiles)
    out: dict[str, Any] = {}
    out["restore_first"], got = _timed(lambda: ms.restore(work / "a", like=like))
    out["restore_first_compile_s"] = sum(d for _, d in compiles[before:])
    del got
    out["restore_later"], _ = _timed(lambda: ms.restore(work / "b", like=like))
    out["restore_programs"] = sorted({n for n, _ in compiles[before:]})
    return out


def child_orbax_save(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    out: dict[str, Any] = {}
    out["build_s"], state = _timed(lambda: _placed_state(args))
    ckptr = ocp.StandardCheckpointer()

    def save(path: Path) -> None:
        ckptr.save(path, state)
        ckptr.wait_until_finished()

    state = _fresh(state)
    out["save_first"], _ = _timed(lambda: save(work / "a"))
    state = _fresh(state)
    out["save_later"], _ = _timed(lambda: save(work / "b"))
    mgr = ocp.CheckpointManager(work / "m", options=ocp.CheckpointManagerOptions())
    for i, name in ((1, "async_blocked_first"), (2, "async_blocked_later")):
        state = _fresh(state)
        t0 = time.perf_counter()
        mgr.save(i, args=ocp.args.StandardSave(state))
        out[name] = time.perf_counter() - t0
        mgr.wait_until_finished()
    mgr.close()
    return out


def child_orbax_restore(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    like = _like(args)
    out: dict[str, Any] = {}
    ckptr = ocp.StandardCheckpointer()
    out["restore_first"], got = _timed(lambda: ckptr.restore(work / "a", like))
    del got
    out["restore_later"], _ = _timed(lambda: ckptr.restore(work / "b", like))
    return out


def child_step(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A decoder's AdamW step: ``ms.shard_jit`` on the nested state against ``jax.jit`` on
    its flat leaves, the same program, interleaved."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import modelshard as ms

    d, layers, heads, seq, batch = args.step_width, args.step_layers, 8, 512, 8
    vocab = args.vocab
    build = _state_fn(layers, d, vocab)
    mesh = ms.make_mesh({"data": len(jax.devices())})
    spec = ms.fsdp("data")
    tx = optax.adamw(1e-4)

    def init() -> Any:
        params = build(1)["params"]
        return {"params": params, "opt": tx.init(params)}

    def loss_fn(params: Any, ids: Any) -> Any:
        x = params["embed"][ids] * 0.02
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        for i in range(layers):
            p = params["layers"][str(i)]
            h = x * p["norm1"] * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
            q, k, v = (
                (h @ p["attn"][n] * 0.03).reshape(batch, seq, heads, d // heads) for n in "qkv"
            )
            a = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d / heads)
            a = jax.nn.softmax(jnp.where(mask, a, -1e9), -1)
            x = (
                x
                + (jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(batch, seq, d) @ p["attn"]["o"])
                * 0.03
            )
            h = x * p["norm2"] * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
            x = x + (jax.nn.gelu(h @ p["mlp"]["up"] * 0.03) @ p["mlp"]["down"]) * 0.03
        logits = x @ params["embed"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    def step(state: Any, ids: Any) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(state["params"], ids)
        updates, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    abstract = jax.eval_shape(init)
    shardings = ms.plan(abstract, spec, mesh).shardings
    ids = jax.random.randint(jax.random.key(2), (batch, seq), 0, vocab)
    ms_step = ms.shard_jit(step, mesh=mesh, in_specs=(spec, P()), donate_argnums=0)
    state_a = jax.jit(init, out_shardings=shardings)()
    tree = jax.tree.structure(state_a)
    flat_shardings = jax.tree.leaves(shardings)

    def flat_step(leaves: list[Any], ids: Any) -> Any:
        new, loss = step(jax.tree.unflatten(tree, leaves), ids)
        return jax.tree.leaves(new), loss

    jit_step = jax.jit(flat_step, out_shardings=(flat_shardings, None), donate_argnums=0)
    state_b = jax.tree.leaves(jax.jit(init, out_shardings=shardings)())
    for _ in range(3):  # compile and warm both
        state_a, la = ms_step(state_a, ids)
        state_b, lb = jit_step(state_b, ids)
    jax.block_until_ready((la, lb))
    times: dict[str, list[float]] = {"shard_jit": [], "jax_jit": []}
    for _ in range(args.step_repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            state_a, la = ms_step(state_a, ids)
        jax.block_until_ready(la)
        times["shard_jit"].append((time.perf_counter() - t0) / 10 * 1e3)
        t0 = time.perf_counter()
        for _ in range(10):
            state_b, lb = jit_step(state_b, ids)
        jax.block_until_ready(lb)
        times["jax_jit"].append((time.perf_counter() - t0) / 10 * 1e3)
    n_params = sum(x.size for x in jax.tree.leaves(abstract["params"]))
    return {
        "step_params": n_params,
        "shard_jit_ms": statistics.median(times["shard_jit"]),
        "jax_jit_ms": statistics.median(times["jax_jit"]),
        "shard_jit_ms_each": times["shard_jit"],
        "jax_jit_ms_each": times["jax_jit"],
    }


CHILDREN = {
    "modelshard_save": child_modelshard_save,
    "modelshard_restore": child_modelshard_restore,
    "orbax_save": child_orbax_save,
    "orbax_restore": child_orbax_restore,
    "step": child_step,
}


def run_child(args: argparse.Namespace) -> None:
    import jax

    work = Path(args.work)
    out = CHILDREN[args.child](args, work)
    leaves = None
    if args.child != "step":
        leaves = len(
            jax.tree.leaves(jax.eval_shape(_state_fn(args.layers, args.width, args.vocab), 0))
        )
    out["device"] = jax.devices()[0].device_kind
    out["devices"] = len(jax.devices())
    out["leaves"] = leaves
    print("RESULT " + json.dumps(out), flush=True)


def _spawn(args: argparse.Namespace, child: str, work: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", child, "--work", str(work)]
    for k in ("layers", "width", "vocab", "step_layers", "step_width", "step_repeats"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = dict(os.environ)
    if args.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    print(f"  {child}: {time.perf_counter() - t0:.1f} s in its process", flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{child}: exit {proc.returncode}")
    return json.loads(lines[-1][len("RESULT ") :])


ROWS = (
    "save_first",
    "save_later",
    "restore_first",
    "restore_later",
    "async_blocked_first",
    "async_blocked_later",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--layers", type=int, default=20, help="decoder blocks in the state")
    p.add_argument("--width", type=int, default=1024, help="model width of the state")
    p.add_argument("--vocab", type=int, default=32000, help="embedding rows")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each method")
    p.add_argument("--step-layers", type=int, default=6, help="blocks of the step's decoder")
    p.add_argument("--step-width", type=int, default=512, help="width of the step's decoder")
    p.add_argument("--step-repeats", type=int, default=5, help="timed rounds of 10 steps")
    p.add_argument("--skip-step", action="store_true", help="no training-step row")
    p.add_argument(
        "--cpu", action="store_true", help="run on the CPU (a look; writes no results file)"
    )
    p.add_argument("--timeout", type=float, default=500, help="seconds each child may run")
    p.add_argument("--runs", help="a JSON file of earlier repeats to add to (and to keep these in)")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run_child(args)
        return
    runs: dict[str, list[dict[str, Any]]] = {"modelshard": [], "orbax": []}
    kept = Path(args.runs) if args.runs else None
    if kept is not None and kept.is_file():
        runs = json.loads(kept.read_text())
    root = Path(tempfile.mkdtemp(prefix="modelshard-accel-"))
    try:
        for r in range(len(runs["modelshard"]), len(runs["modelshard"]) + args.repeats):
            order = ["modelshard", "orbax"] if r % 2 == 0 else ["orbax", "modelshard"]
            for method in order:
                work = root / f"{method}-{r}"
                work.mkdir()
                got = _spawn(args, f"{method}_save", work)
                got.update(_spawn(args, f"{method}_restore", work))
                runs[method].append(got)
                if kept is not None:
                    kept.write_text(json.dumps(runs))
                shutil.rmtree(work, ignore_errors=True)
                print(method, r, {k: round(got[k], 3) for k in ROWS}, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not runs["modelshard"] or not runs["orbax"]:
        raise SystemExit("no repeat of both methods to report (--repeats 0 needs --runs FILE)")
    results: dict[str, Any] = {}
    first = runs["modelshard"][0]
    results["device"] = f"{first['devices']} x {first['device']}"
    results["leaves"] = first["leaves"]
    results["state_gb"] = round(
        (args.vocab * args.width + args.layers * (12 * args.width**2 + 2 * args.width))
        * 3
        * 4
        / 1e9,
        2,
    )
    print(f"{results['device']}, state {results['state_gb']} GB in {results['leaves']} leaves")
    for row in ROWS:
        a = [x[row] for x in runs["modelshard"]]
        b = [x[row] for x in runs["orbax"]]
        ratio = statistics.median(a) / statistics.median(b)
        results[f"{row}_modelshard_s"] = a
        results[f"{row}_orbax_s"] = b
        results[f"{row}_ratio"] = round(ratio, 3)
        print(
            f"{row:22s} modelshard {statistics.median(a):7.3f} s  orbax "
            f"{statistics.median(b):7.3f} s  ratio {ratio:.2f}"
        )
    results["repeats"] = len(runs["modelshard"])
    results["orbax_repeats"] = len(runs["orbax"])
    results["save_first_compile_s"] = [x["save_first_compile_s"] for x in runs["modelshard"]]
    results["restore_first_compile_s"] = [x["restore_first_compile_s"] for x in runs["modelshard"]]
    results["modelshard_programs"] = ", ".join(first["save_programs"] + first["restore_programs"])
    sys.path.insert(0, str(HERE))
    from results import write_results

    def write() -> None:  # the file is the accelerator's record: a CPU look leaves it alone
        if not args.cpu:
            print("wrote", write_results("accelerator", results, argv=sys.argv), flush=True)

    write()
    if args.skip_step:
        return
    work = Path(tempfile.mkdtemp(prefix="modelshard-accel-"))
    try:
        step = _spawn(args, "step", work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if step is not None:
        results["step_params"] = step["step_params"]
        results["step_shard_jit_ms"] = step["shard_jit_ms_each"]
        results["step_jax_jit_ms"] = step["jax_jit_ms_each"]
        results["step_ratio"] = round(step["shard_jit_ms"] / step["jax_jit_ms"], 4)
        print(
            f"step ({step['step_params'] / 1e6:.0f}M params): shard_jit {step['shard_jit_ms']:.2f} ms"
            f"  jax.jit {step['jax_jit_ms']:.2f} ms  ratio {results['step_ratio']:.3f}"
        )
    write()


if __name__ == "__main__":
    main()
