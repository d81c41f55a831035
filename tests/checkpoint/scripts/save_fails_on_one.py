"""``ms.save`` on two processes where one process's part fails.

Usage: ``python save_fails_on_one.py ROOT OUT [S3_ROOT]``. Saves a ``[64, 32]`` array
sharded over a ``(data=2, model=4)`` mesh, case by case, each into its own folder of ROOT
(or of S3_ROOT for the ``s3`` case):

- ``arrays``: process 1's arrays cannot be written (an injected ``OSError`` where they are
  written: a full disk on one host);
- ``commit``: process 0 cannot rename the complete checkpoint into place (an injected
  ``OSError``);
- ``s3``: as ``arrays``, to object storage (only with S3_ROOT; there the arrays are the
  ``state`` item, written in place);
- ``manager``: as ``arrays``, in a synchronous ``CheckpointManager``'s save of step 0;
  both processes then save step 1 with it;
- ``background``: process 1's arrays fail while they are written in the background, in an
  asynchronous ``CheckpointManager``'s save of step 0 (an injected ``OSError`` after a
  moment): ``save`` returns on both, ``wait_until_finished`` raises on both; both
  processes then save step 1 with it;
- ``background checksums``: process 1's checksums of its blocks (summed from the host copy
  in the background) fail, an injected ``OSError``, in an asynchronous manager's step 0;
- ``manager checksums``: the same in a synchronous manager's step 0;
- ``after``: nothing injected: the processes are still in step and save.

Each process records in ``OUT/result_<process>.json``, for every case, what it raised
(type and message) and after how many seconds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import time

import modelshard as ms

faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a stuck run
ms.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from modelshard._checkpoint import checksum, shards, write  # noqa: E402


def injected(what: str, delay: float = 0.0):
    def fail(*args, **kwargs):
        time.sleep(delay)  # in the background: the other process is waiting by now
        raise OSError(f"{what} (injected)")

    return fail


def main() -> int:
    root, out = sys.argv[1:3]
    s3 = sys.argv[3] if len(sys.argv) > 3 else None
    me = jax.process_index()
    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = ms.shard(
        {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32)}, P("data", "model"), mesh
    )
    cases = {
        "arrays": (f"{root}/arrays", 1, shards.BlockWriter, "write", "No space left on device"),
        "commit": (f"{root}/commit", 0, write, "_commit", "Read-only file system"),
    }
    if s3 is not None:
        cases["s3"] = (f"{s3}/arrays", 1, shards.BlockWriter, "write", "No space left on device")
    # a synchronous CheckpointManager's step, process 1's arrays failing
    cases["manager"] = (
        f"{root}/manager",
        1,
        shards.BlockWriter,
        "write",
        "No space left on device",
    )
    # an asynchronous manager's step 0, failing in the background
    cases["background"] = (
        f"{root}/background",
        1,
        shards.BlockWriter,
        "write",
        "No space left on device",
    )
    cases["background checksums"] = (
        f"{root}/background_checksums",
        1,
        checksum,
        "box_sums",
        "Input/output error",
    )
    cases["manager checksums"] = (
        f"{root}/manager_checksums",
        1,
        checksum,
        "box_sums",
        "Input/output error",
    )
    cases["after"] = (f"{root}/after", None, None, None, None)
    results = {}
    for case, (path, who, owner, attr, what) in cases.items():
        real = None if owner is None else getattr(owner, attr)
        if me == who:
            setattr(owner, attr, injected(what, delay=0.5 if case == "background" else 0.0))
        t0 = time.monotonic()
        try:
            if case in ("manager", "manager checksums"):
                with ms.CheckpointManager(path, async_save=False, handle_signals=False) as mngr:
                    mngr.save(0, state)
            elif case in ("background", "background checksums"):
                mngr = ms.CheckpointManager(path, handle_signals=False)
                try:
                    results[f"{case} started"] = mngr.save(0, state)
                    mngr.wait_until_finished()
                finally:
                    with contextlib.suppress(Exception):
                        mngr.close()
            else:
                ms.save(path, state)
            raised = None
        except Exception as e:
            raised = {"type": type(e).__name__, "message": str(e)}
        finally:
            if real is not None:
                setattr(owner, attr, real)
        results[case] = {"raised": raised, "seconds": time.monotonic() - t0}
        print(case, results[case], flush=True)
    # after the manager's failed step both processes are still in step: the next one saves
    with ms.CheckpointManager(f"{root}/manager", async_save=False, handle_signals=False) as mngr:
        mngr.save(1, state)
        results["manager"]["steps after"] = mngr.all_steps()
    with ms.CheckpointManager(f"{root}/background", handle_signals=False) as mngr:
        mngr.save(1, state)
        mngr.wait_until_finished()
        results["background"]["steps after"] = mngr.all_steps()
    restored = ms.restore(f"{root}/after", like=state)
    results["after"]["bit_exact"] = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for a, b in zip(
            restored["w"].addressable_shards, state["w"].addressable_shards, strict=True
        )
    )
    with open(os.path.join(out, f"result_{me}.json"), "w") as f:
        json.dump(results, f)
    ms.distributed.barrier("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
