"""A run under ``modelshard launch`` that one process's SIGTERM preempts, then resumes.

Usage: preempt_mp.py ROOT [--stop]. With ``--stop`` process 1 sends itself SIGTERM at step
5; JAX's preemption service tells every process, ``should_save`` turns True on all of them
at the same step, they save it and stop. Without it the run resumes from the latest step
(or starts) and saves the final step TOTAL.
"""

import sys
import time

import modelshard as ms

ms.distributed.initialize()

import os  # noqa: E402
import signal  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

root, stop = sys.argv[1], "--stop" in sys.argv
TOTAL = 40
mesh = ms.make_mesh({"data": jax.device_count()})


@jax.jit
def update(w, key):
    return w * 0.99 + jax.random.normal(key, w.shape) * 0.01


mngr = ms.CheckpointManager(root, save_interval_steps=1000)
w = jax.device_put(jnp.zeros((64,), jnp.float32), NamedSharding(mesh, P("data")))
state, key, start = {"w": w}, jax.random.key(0), 0
if mngr.latest_step() is not None:
    start = mngr.latest_step()
    state = mngr.restore(like=state, specs=P("data"), mesh=mesh)
    key = mngr.items()["rng"]
    print(f"RESUMED {start}", flush=True)
for step in range(start, TOTAL):
    if step != start and mngr.should_save(step):
        mngr.save(step, state, items={"rng": key})
    if mngr.reached_preemption(step):
        print(f"PREEMPTED {step}", flush=True)
        sys.exit(0)
    if stop and step == 5 and jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    key, sub = jax.random.split(key)
    state = {"w": update(state["w"], sub)}
    time.sleep(0.05)
mngr.save(TOTAL, state, items={"rng": key}, force=True)
mngr.close()
print("DONE", flush=True)
