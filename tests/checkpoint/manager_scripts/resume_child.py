"""A deterministic training run that resumes from its latest step.

Usage: resume_child.py ROOT. Steps 0..TOTAL update a state from an RNG key and a data
position, both saved as items; a SIGTERM makes the loop save the step it is at and stop.
Run again, it resumes there; the final step TOTAL is the same whether or not it was
stopped. Prints READY once at step 5 (the parent's cue) and DONE at the end.
"""

import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
import jax
import jax.numpy as jnp

import modelshard as ms

root = sys.argv[1]
TOTAL = 30


@jax.jit
def update(w, key, pos):
    return w * 0.99 + jax.random.normal(key, w.shape) * 0.01 + pos * 1e-4


mngr = ms.CheckpointManager(root, max_to_keep=2, save_interval_steps=10)
state = {"w": jnp.zeros((256,), jnp.float32)}
key, data = jax.random.key(0), {"pos": 0}
start = 0
if mngr.latest_step() is not None:
    start = mngr.latest_step()
    state = mngr.restore(like=state)
    items = mngr.items()
    key, data = items["rng"], items["data"]
    print(f"RESUMED {start}", flush=True)
for step in range(start, TOTAL):
    if step != start and mngr.should_save(step):
        mngr.save(step, state, items={"rng": key, "data": data})
    if mngr.reached_preemption(step):
        print(f"PREEMPTED {step}", flush=True)
        sys.exit(0)
    if step == 5:
        print("READY", flush=True)
    key, sub = jax.random.split(key)
    state = {"w": update(state["w"], sub, data["pos"])}
    data = {"pos": data["pos"] + 1}
    time.sleep(0.05)
mngr.save(TOTAL, state, items={"rng": key, "data": data}, force=True)
mngr.close()
print("DONE", flush=True)
