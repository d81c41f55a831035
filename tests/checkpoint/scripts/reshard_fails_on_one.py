"""``modelshard.reshard`` on two processes where process 1's writing fails.

Usage: ``python reshard_fails_on_one.py SRC DST OUT``: reshards SRC onto a (data=2,
model=4) mesh into DST; process 1's part fails (an injected ``OSError`` where its arrays
are written). Each process records in ``OUT/result_<process>.json`` what it raised and
after how many seconds.
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
from jax.sharding import PartitionSpec as P  # noqa: E402

from modelshard._checkpoint import stream  # noqa: E402

src, dst, out = sys.argv[1:4]
me = jax.process_index()
if me == 1:

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device (injected)")

    stream._copy_all = full_disk
mesh = ms.make_mesh({"data": 2, "model": 4})
t0 = time.monotonic()
try:
    ms.reshard(src, dst, specs=P("data", "model"), mesh=mesh)
    raised = None
except Exception as e:
    raised = {"type": type(e).__name__, "message": str(e)}
with open(os.path.join(out, f"result_{me}.json"), "w") as f:
    json.dump({"raised": raised, "seconds": time.monotonic() - t0}, f)
ms.distributed.barrier("done")
