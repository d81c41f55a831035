"""Two processes where process 0 raises before a barrier, a gather and a broadcast that
process 1 makes; process 1 gives up on each after its timeout, and process 0 goes on once
it has (a file process 1 writes says so). Every later call must meet the other process's
call of the same name, never the abandoned one.

Usage: ``python out_of_step.py OUT``. Each process writes ``OUT/result_<process>.json``:
what each of its calls returned or raised.
"""

from __future__ import annotations

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

WAIT_S = 1  # process 1's timeout for the calls process 0 skips
GAVE_UP_S = 60  # a bound on process 0's wait for process 1 to give up


def gave_up(out: str, kind: str) -> str:
    """The file process 1 writes once its call ``kind`` has returned or given up."""
    return os.path.join(out, f"gave_up_{kind}")


def wait_for(path: str) -> None:
    deadline = time.monotonic() + GAVE_UP_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> int:
    out = sys.argv[1]
    me = jax.process_index()
    dist = ms.distributed
    results: dict[str, object] = {}
    skipped = {
        "gather": lambda: dist.gather("abandoned", "g", timeout_s=WAIT_S),
        "barrier": lambda: dist.barrier("b", timeout_s=WAIT_S),
        "broadcast": lambda: dist.broadcast("abandoned", "c", timeout_s=WAIT_S),
    }
    for kind, call in skipped.items():
        # process 0 raised before this call (an error of its own, caught by the script);
        # for the broadcast the sender is process 0, so process 1 waits for its value
        if me == 1:
            try:
                call()
                results[f"{kind} skipped"] = "returned"
            except ms.DistributedError as e:
                results[f"{kind} skipped"] = str(e)
            open(gave_up(out, kind), "w").close()
        else:
            wait_for(gave_up(out, kind))
    # the same names again, on both processes: each meets the other's call
    results["gather"] = dist.gather(f"from {me}", "g", timeout_s=60)
    dist.barrier("b", timeout_s=60)
    results["barrier"] = "passed"
    results["broadcast"] = dist.broadcast(f"from {me}", "c", timeout_s=60)
    results["after"] = dist.gather(me, "g", timeout_s=60)
    with open(os.path.join(out, f"result_{me}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier("done", timeout_s=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
