"""XLA compilations of a training step over its first 6 calls, for every kind of input.

Two steps, each called 6 times with its own outputs fed back:

- ``dict``: the README's step, a dict of NNX parameters and optax Adam state, one batch;
- ``nnx``: an NNX model and ``nnx.Optimizer`` updated in place, one batch.

The inputs of the first call (the state for ``dict``; the batch of every call for both)
are NumPy arrays (``numpy``), unplaced ``jnp`` arrays (``jnp``), arrays committed to one
device (``device0``) or arrays already in the planned sharding (``planned``; for ``nnx``
the module and optimizer are placed with ``ms.shard`` first); ``planned-state`` places the
state first and feeds unplaced ``jnp`` batches. Each combination runs on a
(2, 4) mesh with Auto and with Explicit axes, with the state donated and kept. For the
``dict`` step, a plain ``jax.jit`` with the same ``in_shardings``/``out_shardings`` is
counted alongside.

Compilations are JAX's own monitoring events (``/jax/core/compile/backend_compile_duration``
with ``fun_name`` ``jit(train_step)``); each cell also gives the seconds the 6 calls took.

Run: ``python benchmarks/compiles.py [--markdown]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import modelshard as ms  # noqa: E402

EVENT = "/jax/core/compile/backend_compile_duration"
NAME = "jit(train_step)"
KINDS = ("numpy", "jnp", "device0", "planned", "planned-state")
CALLS = 6
RULES = ms.Rules([(r"0/kernel$", P(None, "model")), (r".*", P())])

_counts: collections.Counter[str] = collections.Counter()


def _listener(event: str, duration_secs: float, **kwargs: Any) -> None:
    if event == EVENT:
        _counts[str(kwargs.get("fun_name"))] += 1


def _model() -> nnx.Sequential:
    return nnx.Sequential(
        nnx.Linear(64, 256, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(256, 64, rngs=nnx.Rngs(1))
    )


def _state_kind(kind: str) -> str:
    return "planned" if kind == "planned-state" else kind


def _batch_kind(kind: str) -> str:
    return "jnp" if kind == "planned-state" else kind


def _as_kind(tree: Any, kind: str, spec: Any, mesh: Any) -> Any:
    if kind == "numpy":
        return jax.tree_util.tree_map(np.asarray, tree)
    if kind == "device0":
        return jax.device_put(tree, jax.devices()[0])
    if kind == "planned":
        return ms.shard(tree, spec, mesh)
    return tree


def _batch(i: int) -> jax.Array:
    return jax.random.normal(jax.random.key(i), (32, 64))


def dict_step(mesh: Any, kind: str, donate: bool, raw: bool) -> None:
    """The README's step, 6 calls; ``raw``: plain ``jax.jit`` with the planned shardings."""
    graphdef, params = nnx.split(_model())
    tx = optax.adam(1e-3)

    def train_step(state: Any, x: Any) -> Any:
        loss_fn = lambda p: ((nnx.merge(graphdef, p)(x) - x) ** 2).mean()  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    state = {"params": params, "opt": tx.init(params)}
    batches = [_batch(i) for i in range(CALLS)]
    step: Callable[..., Any]
    if raw:
        shardings = ms.plan(state, RULES, mesh).shardings
        data = jax.sharding.NamedSharding(mesh, P("data"))
        step = jax.jit(
            train_step,
            in_shardings=(shardings, data),
            out_shardings=(shardings, None),
            donate_argnums=0 if donate else (),
        )
    else:
        step = ms.shard_jit(
            train_step, mesh=mesh, in_specs=(RULES, P("data")), donate_argnums=0 if donate else ()
        )
    state = _as_kind(state, _state_kind(kind), RULES, mesh)
    for x in batches:
        state, _ = step(state, _as_kind(x, _batch_kind(kind), P("data"), mesh))
    jax.block_until_ready(state)


def nnx_step(mesh: Any, kind: str, donate: bool, raw: bool) -> None:
    """An NNX model and ``nnx.Optimizer`` through ``shard_jit``, 6 calls."""
    model = _model()
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def train_step(model: Any, opt: Any, x: Any) -> Any:
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - x) ** 2).mean())(model)
        opt.update(model, grads)
        return loss

    if _state_kind(kind) == "planned":
        ms.shard(model, RULES, mesh)
        ms.shard(opt, RULES, mesh)
    step = ms.shard_jit(
        train_step,
        mesh=mesh,
        in_specs=(RULES, RULES, P("data")),
        donate_argnums=(0, 1) if donate else (),
    )
    batches = [_batch(i) for i in range(CALLS)]
    losses = [step(model, opt, _as_kind(x, _batch_kind(kind), P("data"), mesh)) for x in batches]
    jax.block_until_ready(losses)


Cell = tuple[int, float] | str  # (compilations, seconds), or the error the calls raised


def run() -> list[tuple[str, str, dict[str, Cell]]]:
    """Rows of (step, input kind, column -> cell)."""
    jax.monitoring.register_event_duration_secs_listener(_listener)
    meshes = {
        t: jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
        for t, kind in (("Auto", AxisType.Auto), ("Explicit", AxisType.Explicit))
    }
    variants: list[tuple[str, Callable[..., None], bool]] = [
        ("dict + optax, shard_jit", dict_step, False),
        ("dict + optax, jax.jit (same shardings)", dict_step, True),
        ("nnx.Module + nnx.Optimizer, shard_jit", nnx_step, False),
    ]
    dict_step(meshes["Auto"], "planned", False, True)  # warm up JAX itself, not counted
    rows = []
    for label, fn, raw in variants:
        for kind in KINDS:
            cells: dict[str, Cell] = {}
            for t, mesh in meshes.items():
                for donate in (False, True):
                    column = f"{t}, {'donated' if donate else 'kept'}"
                    _counts.clear()
                    start = time.perf_counter()
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # device0: "moved ... again"
                        try:
                            fn(mesh, kind, donate, raw)
                        except ValueError as e:  # jax.jit refuses arrays on another device
                            cells[column] = type(e).__name__
                            continue
                    cells[column] = (_counts[NAME], time.perf_counter() - start)
            rows.append((label, kind, cells))
    return rows


def report(rows: list[tuple[str, str, dict[str, Cell]]], markdown: bool) -> str:
    cols = list(rows[0][2])
    env = (
        f"compilations of jit(train_step) over its first {CALLS} calls (seconds for the "
        f"{CALLS} calls); jax {jax.__version__}, flax {__import__('flax').__version__}, "
        f"{os.cpu_count()} CPU cores, (2, 4) mesh of simulated CPU devices."
    )
    fmt = lambda c: f"refused ({c})" if isinstance(c, str) else f"{c[0]} ({c[1]:.2f} s)"  # noqa: E731
    lines = [env, ""]
    if markdown:
        lines += ["| step | input | " + " | ".join(cols) + " |"]
        lines += ["|---|---|" + "---:|" * len(cols)]
        lines += [
            f"| {label} | `{kind}` | " + " | ".join(fmt(c[k]) for k in cols) + " |"
            for label, kind, c in rows
        ]
    else:
        lines += [f"{'step':40s} {'input':13s} " + " ".join(f"{k:>20s}" for k in cols)]
        lines += [
            f"{label:40s} {kind:13s} " + " ".join(f"{fmt(c[k]):>20s}" for k in cols)
            for label, kind, c in rows
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    rows = run()
    print(report(rows, args.markdown))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from results import write_results

    write_results("compiles", figures(rows), argv=sys.argv)
    return 0


def figures(rows: list[tuple[str, str, dict[str, Cell]]]) -> dict[str, Any]:
    """Per step and input kind: the compilations in each column (Auto/Explicit, kept/donated)
    and the seconds the calls took, or the error that refused the input."""
    steps = {
        "dict + optax, shard_jit": "dict_shard_jit",
        "dict + optax, jax.jit (same shardings)": "dict_jax_jit",
        "nnx.Module + nnx.Optimizer, shard_jit": "nnx_shard_jit",
    }
    out: dict[str, Any] = {"calls": CALLS}
    for label, kind, cells in rows:
        name = f"{steps[label]}_{kind.replace('-', '_')}"
        refused = {c for c in cells.values() if isinstance(c, str)}
        if refused:
            out[f"{name}_compiles"] = "refused (" + ", ".join(sorted(refused)) + ")"
            continue
        counted = [c for c in cells.values() if not isinstance(c, str)]
        out[f"{name}_compiles"] = [n for n, _ in counted]
        out[f"{name}_seconds"] = [round(t, 2) for _, t in counted]
    return out


if __name__ == "__main__":
    sys.exit(main())
