"""Benchmark: plan 10,000 leaves (a synthetic 200-layer model + its adam state).

Prints the median time of ``modelshard.plan`` with path rules and with fsdp, against a
baseline measured in the same run: ``jax.tree_util.tree_flatten_with_path`` plus one
``NamedSharding`` per leaf (the least any sharding helper must do). Targets: a cold plan
(new structure, new ``Rules``) <= 30 ms, with and without Flax imported; every plan < 50 ms.

Run: ``.venv/bin/python benchmarks/expand.py``; writes ``docs/benchmarks/results/expand.json``.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
from results import write_results

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import modelshard as ms  # noqa: E402

D, F, V = 1024, 4096, 32000


def layer() -> dict:
    def s(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    return {
        "attn": {
            "q": {"kernel": s(D, D), "bias": s(D)},
            "k": {"kernel": s(D, D), "bias": s(D)},
            "v": {"kernel": s(D, D), "bias": s(D)},
            "o": {"kernel": s(D, D), "bias": s(D)},
        },
        "mlp": {"up": {"kernel": s(D, F), "bias": s(F)}, "down": {"kernel": s(F, D), "bias": s(D)}},
        "ln1": {"scale": s(D), "bias": s(D)},
        "ln2": {"scale": s(D), "bias": s(D)},
        "gate": {"kernel": s(D, F)},
    }


def model(n_layers: int = 200) -> dict:
    return {
        "embed": {"embedding": jax.ShapeDtypeStruct((V, D), jnp.float32)},
        "layers": [layer() for _ in range(n_layers)],
        "final_ln": {"scale": jax.ShapeDtypeStruct((D,), jnp.float32)},
    }


def state(n_layers: int = 200):
    import optax

    params = model(n_layers)
    opt = jax.eval_shape(optax.adam(1e-3).init, params)
    return {"params": params, "opt_state": opt}


RULES = ms.Rules(
    [
        (r"embedding$", P("model", "data")),
        (r"(q|k|v)/kernel$", P("data", "model")),
        (r"o/kernel$", P("model", "data")),
        (r"(up|gate)/kernel$", P("data", "model")),
        (r"down/kernel$", P("model", "data")),
        (r"bias$", P()),
        (r"scale$", P()),
        (r"count$", P()),
    ]
)


SCALAR = jax.ShapeDtypeStruct((), jnp.int32)


def median_ms(fn, repeat: int) -> float:
    """Median CPU time of ``fn`` in ms (process time: steadier than wall time on a busy box)."""
    fn()  # warm caches and imports
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) * 1e3)
    return statistics.median(times)


def main(repeat: int = 15) -> int:
    tree = state()
    mesh = ms.make_mesh({"data": 32, "model": 8}, abstract=True)
    n = len(ms.adapters.split(tree).arrays)

    def baseline():
        items = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [
            (jax.tree_util.keystr(k, simple=True, separator="/"), NamedSharding(mesh, P()))
            for k, _ in items
        ]

    # Rules cache their matches per path, and leaf paths are cached per tree structure:
    # "cold" plans a structure never seen before (one extra scalar leaf with a new name
    # each call) with a fresh Rules, as a script's first plan does.
    fresh = iter(
        [{**tree, f"tag_{chr(97 + i // 26)}{chr(97 + i % 26)}": SCALAR} for i in range(repeat + 1)]
    )

    def cold_rules():
        return ms.plan(next(fresh), ms.Rules(RULES.rules), mesh)

    results = {
        "baseline (flatten_with_path + NamedSharding)": median_ms(baseline, repeat),
        "plan(Rules), cold (new structure, new Rules)": median_ms(cold_rules, repeat),
        "plan(Rules), warm": median_ms(lambda: ms.plan(tree, RULES, mesh), repeat),
        "plan(fsdp)": median_ms(lambda: ms.plan(tree, ms.fsdp("data"), mesh), repeat),
        "plan(P())": median_ms(lambda: ms.plan(tree, P(), mesh), repeat),
    }
    # Most users have Flax imported, which registers nested container types (NNX
    # Variables): flattening then stops at them, at a cost per node.
    import flax.linen
    import flax.nnx  # noqa: F401

    fresh = iter(
        [{**tree, f"flax_{chr(97 + i // 26)}{chr(97 + i % 26)}": SCALAR} for i in range(repeat + 1)]
    )
    results["plan(Rules), cold, Flax imported"] = median_ms(cold_rules, repeat)
    results["plan(Rules), warm, Flax imported"] = median_ms(
        lambda: ms.plan(tree, RULES, mesh), repeat
    )
    base = results["baseline (flatten_with_path + NamedSharding)"]
    print(f"{n} array leaves, abstract mesh data=32 x model=8, median CPU time of {repeat} runs")
    for name, ms_ in results.items():
        print(f"  {name:<48} {ms_:8.1f} ms   {ms_ / base:5.2f}x baseline")
    cold = max(v for k, v in results.items() if "cold" in k)
    worst = max(v for k, v in results.items() if k.startswith("plan"))
    print(
        f"targets: cold plan <= 30 ms -> {'OK' if cold <= 30 else 'MISSED'} "
        f"(worst cold {cold:.1f} ms); every plan < 50 ms -> "
        f"{'OK' if worst < 50 else 'MISSED'} (worst {worst:.1f} ms)"
    )
    figures: dict[str, float | int] = {"leaves": n, "repeats": repeat}
    for name, key in FIGURES.items():
        figures[f"{key}_ms"] = round(results[name], 1)
        if key != "baseline":
            figures[f"{key}_vs_baseline"] = round(results[name] / base, 2)
    write_results("expand", figures, argv=sys.argv)
    return 0


# The results file's figure names for the rows above.
FIGURES = {
    "baseline (flatten_with_path + NamedSharding)": "baseline",
    "plan(Rules), cold (new structure, new Rules)": "cold",
    "plan(Rules), warm": "warm",
    "plan(fsdp)": "fsdp",
    "plan(P())": "replicated",
    "plan(Rules), cold, Flax imported": "cold_flax",
    "plan(Rules), warm, Flax imported": "warm_flax",
}


if __name__ == "__main__":
    sys.exit(main())
