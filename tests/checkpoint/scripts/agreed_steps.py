"""Two processes whose views of a manager's root differ: process 1 lists it as it was
before step 1 was committed (as an object store's listing can lag, or a listing taken a
moment earlier). ``all_steps``, ``latest_step`` and ``restore`` must answer by process 0's
listing on both, so the two never resume from different steps.

Usage: ``python agreed_steps.py ROOT OUT``. Each process writes ``OUT/result_<process>.json``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

import modelshard as ms

faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a stuck run
ms.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from modelshard._checkpoint import manager  # noqa: E402


def main() -> int:
    root, out = sys.argv[1:3]
    me = jax.process_index()
    with ms.CheckpointManager(root, async_save=False) as mngr:
        for step in (0, 1):
            mngr.save(step, {"w": jnp.full((8,), step, jnp.float32)})
        listing = manager.complete_steps
        if me == 1:  # this process's own listing lags behind: step 1 is not in it yet
            manager.complete_steps = lambda root: [s for s in listing(root) if s < 1]
        result = {
            "own listing": manager.complete_steps(mngr.directory),
            "all_steps": mngr.all_steps(),
            "latest_step": mngr.latest_step(),
            "restored": float(ms.distributed.to_host(mngr.restore())["w"][0]),
        }
    with open(os.path.join(out, f"result_{me}.json"), "w") as f:
        json.dump(result, f)
    ms.distributed.barrier("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
