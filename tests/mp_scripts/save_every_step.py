"""A run that saves every step with an asynchronous ``CheckpointManager`` (two processes).

Usage: ``python save_every_step.py ROOT OUT --steps N [--kill-at K [--victim P]]``. The state
``{"w": [512, 512], "b": [512]}`` is sharded over a ``(data=2, model=4)`` mesh; each step
adds 1 and saves (``max_to_keep=3``). At the end the manager is closed, the latest step
restored and compared with the expected values; ``OUT/result_<process>.json`` says what
each process saw. With ``--kill-at K`` process P (default 1) writes ``OUT/killed`` and SIGKILLs
itself right after ``save(K, ...)`` returns (its step K is then being written in the
background); the other process carries on and must fail with an error instead of hanging.
With ``--fail-after K`` process 1's step writer reports a failure (an injected ``OSError``)
when its part of step K has been written; both processes must raise the same error from the next
``save``, which they record in their result (and stop there).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import modelshard as ms

ms.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

SPECS = {"w": P("data", "model"), "b": P("model")}


def initial() -> dict[str, np.ndarray]:
    return {
        # multiples of 1/8 below 512: adding 1 is exact, so step s holds initial + s + 1
        "w": (np.arange(512 * 512) % 4096).astype(np.float32).reshape(512, 512) / 8,
        "b": np.arange(512, dtype=np.float32) / -8,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--fail-after", type=int, default=None)
    args = ap.parse_args()
    me = jax.process_index()
    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = ms.shard(initial(), SPECS, mesh)
    add_one = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))
    mngr = ms.CheckpointManager(args.root, max_to_keep=3)
    if args.fail_after is not None and me == 1:
        from modelshard._checkpoint import manager

        real_write = manager.write_step

        def write(root, step, *rest, **kwargs):
            real_write(root, step, *rest, **kwargs)
            if step == args.fail_after:  # once its part is written, on this process alone
                raise OSError("disk quota exceeded (injected)")

        manager.write_step = write
    t0 = time.monotonic()
    error = None
    for step in range(args.steps):
        state = add_one(state)
        try:
            mngr.save(step, state)
        except ms.CheckpointError as e:
            error = str(e)
            break
        print(f"saved {step}", flush=True)
        if args.kill_at == step and me == args.victim:
            with open(os.path.join(args.out, "killed"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    mngr.close()
    seconds = time.monotonic() - t0
    steps = mngr.all_steps()
    restored = mngr.restore(like=state, specs=SPECS, mesh=mesh)
    last = steps[-1]
    want = {k: v + np.float32(last + 1) for k, v in initial().items()}
    exact = all(
        np.array_equal(np.asarray(sh.data), want[k][sh.index])
        for k, x in restored.items()
        for sh in x.addressable_shards
    )
    with open(os.path.join(args.out, f"result_{me}.json"), "w") as f:
        json.dump({"steps": steps, "bit_exact": exact, "seconds": seconds, "error": error}, f)
    ms.distributed.barrier("done")


if __name__ == "__main__":
    sys.exit(main())
