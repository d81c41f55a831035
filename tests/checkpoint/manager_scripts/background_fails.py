"""An asynchronous ``CheckpointManager`` on two processes whose background step fails on
one process only.

Usage: ``python background_fails.py ROOT OUT``. The state ``{"w": [1024, 512]}`` is
sharded over a ``(data=2, model=4)`` mesh (each process writes 1 MiB); each case saves
step 0 into its own folder of ROOT, then step 1, which fails on one process after
``save`` returned, in the background:

- ``disk``: process 1's disk is full: its file size limit (``RLIMIT_FSIZE``, 4 KiB) makes
  TensorStore's write of its arrays fail with ``EFBIG`` ("File too large");
- ``commit``: process 0's commit fails: the merge of every process's OCDBT database into
  the step's one index (``shards._finalize``, run by process 0 alone once every process's
  arrays are written) raises ``OSError`` (injected).

Then the failure is undone and both processes save step 1 again. Each process records in
``OUT/result_<process>.json``, per case, what ``wait_until_finished`` raised and how many
seconds after ``save(1)``, the steps listed then, whether step 0 restored bit-exact, and
the steps after the second save of step 1.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import resource
import signal
import sys
import time

import modelshard as ms

faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a stuck run
ms.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from modelshard._checkpoint import shards  # noqa: E402

FAILS_ON = {"disk": 1, "commit": 0}


@contextlib.contextmanager
def failing(case: str, me: int):
    """The failure of ``case`` on the process it fails on, undone on leaving."""
    if me != FAILS_ON[case]:
        yield
        return
    if case == "disk":
        # a write past the limit fails with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        return
    real = shards._finalize

    def finalize(*args):
        raise OSError("No space left on device (injected)")

    shards._finalize = finalize
    try:
        yield
    finally:
        shards._finalize = real


def main() -> int:
    root, out = sys.argv[1:3]
    me = jax.process_index()
    mesh = ms.make_mesh({"data": 2, "model": 4})
    values = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
    state = ms.shard({"w": values}, P("data", "model"), mesh)
    results = {}
    for case in FAILS_ON:
        mngr = ms.CheckpointManager(f"{root}/{case}", handle_signals=False)
        mngr.save(0, state)
        mngr.wait_until_finished()
        raised = None
        with failing(case, me):
            t0 = time.monotonic()
            try:
                results[f"{case} started"] = mngr.save(1, state)
                mngr.wait_until_finished()
            except Exception as e:
                raised = {"type": type(e).__name__, "message": str(e)}
            seconds = time.monotonic() - t0
        steps = mngr.all_steps()
        restored = mngr.restore(0, like=state)
        exact = all(
            np.array_equal(np.asarray(sh.data), values[sh.index])
            for sh in restored["w"].addressable_shards
        )
        mngr.save(1, state)  # both processes are still in step: the step saves now
        mngr.wait_until_finished()
        results[case] = {
            "raised": raised,
            "seconds": seconds,
            "steps": steps,
            "bit_exact": exact,
            "steps after": mngr.all_steps(),
        }
        mngr.close()
        print(case, results[case], flush=True)
    with open(os.path.join(out, f"result_{me}.json"), "w") as f:
        json.dump(results, f)
    ms.distributed.barrier("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
