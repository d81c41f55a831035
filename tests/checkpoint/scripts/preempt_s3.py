"""A training loop on two processes that saves every step to object storage until stopped.

Usage: ``python preempt_s3.py ROOT OUT`` under ``modelshard launch -n 2
--devices-per-process 4``. The state ``{"w": [1024, 1024], "b": [1024]}`` is sharded over a
``(data=2, model=4)`` mesh; step s holds ``initial() + s + 1`` exactly and is saved
asynchronously (the manager's defaults: signals handled). Once step 1 is saved each process
writes ``OUT/ready_<process>``. The loop polls ``should_save`` and ``reached_preemption``
every step, as a preemptible training loop does: on SIGTERM every process saves the same
step, writes it to ``OUT/preempted_<process>`` and ends (the manager makes the exit status
``128 + SIGTERM``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import modelshard as ms

faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a stuck run
ms.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

SPECS = {"w": P("data", "model"), "b": P("model")}


def initial() -> dict[str, np.ndarray]:
    return {
        # multiples of 1/8 below 512: adding 1 is exact for the steps a test runs
        "w": (np.arange(1024 * 1024) % 2048).astype(np.float32).reshape(1024, 1024) / 8,
        "b": np.arange(1024, dtype=np.float32) / -8,
    }


def main() -> int:
    root, out = sys.argv[1:3]
    me = jax.process_index()
    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = ms.shard(initial(), SPECS, mesh)
    add_one = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))
    mngr = ms.CheckpointManager(root)
    for step in range(100_000):
        state = add_one(state)
        if mngr.should_save(step):
            mngr.save(step, state)
            print(f"saved {step}", flush=True)
        if step == 1:
            with open(os.path.join(out, f"ready_{me}"), "w") as f:
                f.write("1")
        if mngr.reached_preemption(step):
            with open(os.path.join(out, f"preempted_{me}"), "w") as f:
                f.write(str(step))
            print(f"preempted at {step}", flush=True)
            return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
