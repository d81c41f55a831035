"""A training script that ends in one of many ways while a CheckpointManager saves.

Usage: exit_child.py ROOT MODE. Each step's state is ``arange(N) + step`` (and an RNG key
folded with the step), so the parent can check a restored step bit-exactly. The last
save of most modes is held back (the finish of its arrays sleeps) so that it is still in flight
when the script ends; ``READY`` on stdout says the script reached its ending.
"""

import os
import signal
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
import jax
import jax.numpy as jnp

import modelshard as ms
from modelshard._checkpoint import shards

root, mode = sys.argv[1], sys.argv[2]
# As a script started at a terminal: Python's own SIGINT handler. A run started in the
# background by a shell (a CI runner, `make test &`) inherits SIGINT ignored, and Python
# then installs no handler, so the "sigint" ending would never see the signal.
signal.signal(signal.SIGINT, signal.default_int_handler)
N = 1 << 16


def state(step):
    return {
        "w": jnp.arange(N, dtype=jnp.float32) + step,
        "k": jax.random.fold_in(jax.random.key(0), step),
    }


slow = shards._finalize  # a step's arrays finished: metadata, merge


def slow_finalize(*args):
    time.sleep(1.5)
    return slow(*args)


def failing_finalize(*args):
    raise OSError(28, "No space left on device")


if mode == "cooperative":
    # the loop polls should_save every step; SIGTERM makes the current step a saving one
    mngr = ms.CheckpointManager(root, save_interval_steps=1000)
    for step in range(100000):
        if mngr.should_save(step):
            mngr.save(step, state(step))
        if mngr.reached_preemption(step):
            print(f"PREEMPTED {step}", flush=True)
            break
        if step == 3:
            print("READY", flush=True)
        time.sleep(0.02)
    sys.exit(0)  # the guard turns this into 128 + SIGTERM: the run did not finish

mngr = ms.CheckpointManager(root)
for step in range(2):
    mngr.save(step, state(step))
mngr.wait_until_finished()
if mode == "fails":
    shards._finalize = failing_finalize
elif mode == "stall":  # the parent SIGKILLs the process while step 2 is written
    shards._finalize = lambda *args: time.sleep(60)
else:
    shards._finalize = slow_finalize
if mode == "lost":
    # as in an embedding or a REPL: no __main__ module end to finish the save at
    tool = next(t for t in range(6) if sys.monitoring.get_tool(t) == "modelshard-exit-guard")
    sys.monitoring.set_local_events(tool, sys._getframe().f_code, 0)
    sys.monitoring.set_events(tool, 0)
if mode == "with_raises":
    with mngr:
        mngr.save(2, state(2))
        print("READY", flush=True)
        raise RuntimeError("the training step failed")
mngr.save(2, state(2))
print("READY", flush=True)
if mode in ("sigterm", "sigint", "stall"):
    time.sleep(60)  # the parent's signal arrives while step 2 is in flight
if mode == "raises":
    raise RuntimeError("the training step failed")
if mode == "exit3":
    sys.exit(3)
if mode == "kill_self":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
