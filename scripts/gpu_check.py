"""modelshard on a real accelerator: the checks CI (CPU only) cannot make.

Run on a machine with a GPU (or TPU), from the repository root, with the stack installed::

    PYTHONPATH=src python scripts/gpu_check.py

It trains a small NNX model with ``shard_jit`` on every device, then saves and restores
through each path (``ms.save``/``ms.restore`` with checksums verified on the accelerator,
an asynchronous ``CheckpointManager``), moves checkpoints between the accelerator and the
CPU both ways, reshards with the CLI, and restores 384 MiB in a fresh process (which must
not import Orbax; run first, in child processes, since one process at a time may hold a
TPU). It also checks that the step compiles once across the first save and restore. Each check prints PASS or FAIL; the results go to
``$OUT/gpu_checks.json`` (``/tmp`` without ``OUT``), and the exit status is 1 if any failed.
The last run is in docs/reliability.md ("On a GPU").
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

names: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda ev, d, **kw: (
        names.append(str(kw.get("fun_name")))
        if ev == "/jax/core/compile/backend_compile_duration"
        else None
    )
)

import flax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import modelshard as ms  # noqa: E402

checks: dict[str, dict[str, Any]] = {}


def ok(name: str, cond: Any, detail: Any = "") -> None:
    checks[name] = {"ok": bool(cond), "detail": str(detail)[:400]}
    print(("PASS " if cond else "FAIL ") + name, detail, flush=True)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(256, 1024, rngs=rngs)
        self.l2 = nnx.Linear(1024, 256, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(jax.nn.relu(self.l1(x)))


# One process at a time may hold a TPU (libtpu's lockfile): the fresh-process restore runs
# first, in children, before this process opens the accelerator.
_SAVE_BIG = """
import sys
import numpy as np
import jax
import modelshard as ms
mesh = ms.make_mesh({"data": len(jax.devices())})
rng = np.random.default_rng(1)
big = {f"l{i}": rng.standard_normal((2048, 1024)).astype(np.float32) for i in range(48)}
ms.save(sys.argv[1], ms.shard(big, ms.fsdp("data"), mesh))
"""

_RESTORE_BIG = """
import sys, time
import jax
t0 = time.perf_counter()
import modelshard as ms
mesh = ms.make_mesh({"data": len(jax.devices())})
jax.block_until_ready(ms.restore(sys.argv[1], specs=ms.fsdp("data"), mesh=mesh))
t1 = time.perf_counter()
jax.block_until_ready(ms.restore(sys.argv[1], specs=ms.fsdp("data"), mesh=mesh))
t2 = time.perf_counter()
print(round(t1 - t0, 3), round(t2 - t1, 3), "orbax.checkpoint" in sys.modules)
"""


def fresh_process_restore(root: str) -> None:
    big_path = os.path.join(root, "big")
    saved = subprocess.run(
        [sys.executable, "-c", _SAVE_BIG, big_path], capture_output=True, text=True
    )
    done = subprocess.run(
        [sys.executable, "-c", _RESTORE_BIG, big_path], capture_output=True, text=True
    )
    ok(
        "384 MiB restored in a fresh process, Orbax not imported (first s, second s, imported)",
        saved.returncode == 0 and done.returncode == 0 and done.stdout.strip().endswith("False"),
        (saved.stderr[-300:] + done.stdout + done.stderr[-300:]).strip(),
    )


def main() -> int:
    t00 = time.perf_counter()
    root = tempfile.mkdtemp()
    fresh_process_restore(root)
    accel = [d for d in jax.devices() if d.platform != "cpu"]
    ok("an accelerator is visible", accel, jax.devices())
    n = len(jax.devices())
    mesh = ms.make_mesh({"data": n})
    spec = ms.fsdp("data")
    model = ms.shard(MLP(nnx.Rngs(0)), spec, mesh)
    opt = ms.shard(nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param), spec, mesh)
    x = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("data")))

    def step(model: MLP, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
        opt.update(model, g)
        return loss

    sj = ms.shard_jit(step, mesh=mesh, in_specs=(spec, spec, P("data")))
    losses = [float(sj(model, opt, x)) for _ in range(3)]
    ok("a shard_jit NNX train step lowers the loss", losses[2] < losses[0], losses)
    kernel = model.l1.kernel[...]
    ok(
        "the parameters live on the accelerator",
        set(kernel.devices()) <= set(accel),
        kernel.devices(),
    )
    ok("nothing imported Orbax before the first save", "orbax.checkpoint" not in sys.modules)
    before = collections.Counter(m for m in names if "step" in m)  # the listener sees compiles
    names.clear()
    state = {"model": model, "opt": opt}
    path = ms.save(os.path.join(root, "ck"), state)
    back = ms.restore(path, like=state)
    same = np.array_equal(np.asarray(back["model"].l1.kernel[...]), np.asarray(kernel))
    ok("save + restore of arrays on the accelerator, checksums verified, bit-exact", same)
    with ms.CheckpointManager(os.path.join(root, "mgr"), async_save=True) as mngr:
        mngr.save(1, state)
        mngr.wait_until_finished()
        got = mngr.restore(1, like=state)
    same = np.array_equal(np.asarray(got["model"].l2.kernel[...]), np.asarray(model.l2.kernel[...]))
    ok("an asynchronous manager step restores bit-exact", same)
    for _ in range(2):
        sj(model, opt, x)
    steps = collections.Counter(m for m in names if "step" in m)
    ok(
        "the step compiled once across the first save and restore (compiles before, after)",
        sum(before.values()) >= 1 and not steps,
        (dict(before), dict(steps)),
    )

    cpu = jax.devices("cpu")[0]
    w = np.random.default_rng(0).standard_normal((512, 768)).astype(np.float32)
    with jax.default_device(cpu):
        from_cpu = ms.save(os.path.join(root, "cpu"), {"w": jax.device_put(w, cpu)})
    g = ms.restore(from_cpu, specs=P("data"), mesh=mesh)["w"]
    ok(
        "a checkpoint saved on the CPU restores onto the accelerator, verified",
        np.array_equal(np.asarray(g), w) and set(g.devices()) <= set(accel),
        g.sharding,
    )
    cpu_mesh = jax.sharding.Mesh(np.array([cpu]), ("data",))
    on_cpu = ms.restore(path, specs=P(), mesh=cpu_mesh)
    plain = ms.restore(path)

    def flat(t: Any) -> np.ndarray:
        return np.concatenate([np.ravel(np.asarray(a)).view(np.uint8) for a in jax.tree.leaves(t)])

    leaves_cpu = all(d.platform == "cpu" for a in jax.tree.leaves(on_cpu) for d in a.devices())
    ok(
        "a checkpoint saved on the accelerator restores onto the CPU, verified",
        np.array_equal(flat(on_cpu), flat(plain)) and leaves_cpu,
        len(jax.tree.leaves(on_cpu)),
    )
    rules = os.path.join(root, "rules.toml")
    with open(rules, "w") as f:
        f.write('[[rules]]\npattern = ".*"\nspec = []\n')
    cmd = [
        sys.executable,
        "-m",
        "modelshard",
        "reshard",
        str(path),
        os.path.join(root, "re"),
        "--mesh",
        f"data={n}",
        "--rules",
        rules,
    ]
    # A second process cannot open the chip this one holds: the CLI runs on the CPU.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    ok("modelshard reshard", done.returncode == 0, (done.stdout + done.stderr)[-300:])

    out = {
        "versions": {
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "flax": flax.__version__,
            "optax": optax.__version__,
        },
        "devices": [str(d) for d in jax.devices()],
        "checks": checks,
        "seconds": round(time.perf_counter() - t00, 1),
    }
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gpu_checks.json"), "w") as f:
        json.dump(out, f, indent=1)
    passed = all(c["ok"] for c in checks.values())
    print("ALL PASS" if passed else "SOME FAILED", out["seconds"], "s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
