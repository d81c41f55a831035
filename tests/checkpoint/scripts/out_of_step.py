"""Two processes where process 0 raises before a barrier, a gather and a broadcast that
process 1 makes; process 1 gives up on each after its timeout. Every later call must meet
the other process's call of the same name, never the abandoned one.

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

WAIT_S = 3  # process 1's timeout for the calls process 0 skips
AFTER_S = 8  # process 0 goes on once process 1 has given up


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
        else:
            time.sleep(AFTER_S)
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
