"""``barrier``, ``broadcast`` and ``gather`` of ``modelshard.distributed`` on two processes.

Usage: ``python coordinate.py OUT`` under ``modelshard launch -n 2`` with
``MODELSHARD_BARRIER_TIMEOUT`` set low. Process 0 alone enters a barrier process 1 never
reaches, and must get a DistributedError once the timeout has passed; process 1 meanwhile
waits at the next barrier, where both meet again. Writes ``OUT/result_<process>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import modelshard as ms

ms.distributed.initialize()

import jax  # noqa: E402

out = sys.argv[1]
me = jax.process_index()
result: dict = {
    "broadcast": ms.distributed.broadcast({"from": me, "steps": [1, 2]}, "listing"),
    "again": ms.distributed.broadcast(f"second from {me}", "listing"),
    "gather": ms.distributed.gather({"me": me}, "status"),
}
ms.distributed.barrier("both")
# the last reader of each value removed it: nothing of ours is left in the coordinator
from jax._src import distributed as jax_distributed  # noqa: E402

client = jax_distributed.global_state.client
assert client is not None
result["left"] = client.key_value_dir_get("modelshard/")
if me == 0:
    t0 = time.monotonic()
    try:
        ms.distributed.barrier("only process 0 comes here")
    except ms.DistributedError as e:
        result["error"] = str(e)
        result["waited"] = time.monotonic() - t0
ms.distributed.barrier("after", timeout_s=120)
result["done"] = True
with open(os.path.join(out, f"result_{me}.json"), "w") as f:
    json.dump(result, f)
