"""A two-process run that saves every step and resumes after a host died.

Usage: ``python restart_run.py ROOT OUT --until N [--kill-at K --victim P]``. The state
``{"w": [256, 256], "b": [256]}`` is sharded over a ``(data=2, model=4)`` mesh; step s holds
``initial() + s + 1`` exactly and is saved with ``items={"step": s}`` (``max_to_keep=3``).
At start the run resumes from the latest complete step if there is one (restored
bit-exact, else it exits 3) and saves every following step up to ``N``. With
``--kill-at K`` process P dies (SIGKILL, after writing ``OUT/killed``) in the middle of
step K's background save: its part of the step is written, the commit is not (it dies at
the barrier Orbax waits at before committing), so step K is surely incomplete and leaves
leftovers, as when a host dies mid-save. Each process writes ``OUT/result_<process>.json``:
the step it resumed from and the steps it saved.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys
import time

import modelshard as ms

faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a stuck run
T0 = time.time()


def note(what: str) -> None:
    """A line of what this process does, timed from its start: the outputs of both
    processes, read side by side, say where each one was when a run went wrong."""
    print(f"at {time.time() - T0:.1f} s: {what}", flush=True)


ms.distributed.initialize()
note("initialized")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

SPECS = {"w": P("data", "model"), "b": P("model")}


def initial() -> dict[str, np.ndarray]:
    return {
        # multiples of 1/8 below 512: adding 1 is exact
        "w": (np.arange(256 * 256) % 4096).astype(np.float32).reshape(256, 256) / 8,
        "b": np.arange(256, dtype=np.float32) / -8,
    }


def die_while_saving(step: int, out: str) -> None:
    """SIGKILL this process when its background save of ``step`` has written its part and
    comes to the wait before the commit (``shards.write_and_commit``'s shared outcome)."""
    from modelshard._checkpoint import shards

    shared = shards.raise_shared

    def shared_or_die(failure, name, what):
        if what == f"writing step {step}":
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return shared(failure, name, what)

    shards.raise_shared = shared_or_die


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--until", type=int, required=True)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--victim", type=int, default=1)
    args = ap.parse_args()
    me = jax.process_index()
    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = ms.shard(initial(), SPECS, mesh)
    add_one = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))
    if args.kill_at is not None and me == args.victim:
        die_while_saving(args.kill_at, args.out)
    mngr = ms.CheckpointManager(args.root, max_to_keep=3)
    resumed = None
    with contextlib.suppress(ms.CheckpointError):  # "no checkpoint": a fresh root
        resumed = int(mngr.items()["step"])
    note(f"resuming from {resumed} (complete steps {mngr.all_steps()})")
    if resumed is not None:
        state = mngr.restore(like=state, specs=SPECS, mesh=mesh)
        want = {k: v + np.float32(resumed + 1) for k, v in initial().items()}
        exact = all(
            np.array_equal(np.asarray(sh.data), want[k][sh.index])
            for k, x in state.items()
            for sh in x.addressable_shards
        )
        if not exact:
            print(f"step {resumed} did not restore bit-exact", flush=True)
            return 3
    saved = []
    start = 0 if resumed is None else resumed + 1
    for step in range(start, args.until + 1):
        state = add_one(state)
        note(f"saving {step}")
        mngr.save(step, state, items={"step": step})
        saved.append(step)
        print(f"saved {step}", flush=True)
    note("closing (the last save finishes)")
    mngr.close()
    note(f"closed (complete steps {mngr.all_steps()})")
    with open(os.path.join(args.out, f"result_{me}.json"), "w") as f:
        json.dump({"resumed": resumed, "saved": saved, "steps": mngr.all_steps()}, f)
    ms.distributed.barrier("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
