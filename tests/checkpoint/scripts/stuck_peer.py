"""Process 1 is stuck before it reaches the first wait of a background step; process 0 saves.

Usage: ``python stuck_peer.py ROOT OUT``. Both open a ``CheckpointManager`` on ROOT and
save step 0 of a state sharded over a ``(data=2, model=4)`` mesh; process 1's step writer
first sleeps (a stuck host). Process 0 records in ``OUT/result_0.json`` what its save and
``wait_until_finished`` raised and after how many seconds, then exits at once (``os._exit``).
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
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from modelshard._checkpoint import manager  # noqa: E402

root, out = sys.argv[1], sys.argv[2]
mesh = ms.make_mesh({"data": 2, "model": 4})
state = ms.shard({"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32)}, P("data"), mesh)
if jax.process_index() == 1:
    real_write = manager.write_step

    def stuck(*args, **kwargs):
        time.sleep(600)
        return real_write(*args, **kwargs)

    manager.write_step = stuck
mngr = ms.CheckpointManager(root, handle_signals=False)
t0 = time.monotonic()
try:
    mngr.save(0, state)
    mngr.wait_until_finished()
    raised = None
except Exception as e:
    raised = {"type": type(e).__name__, "message": str(e)}
with open(os.path.join(out, f"result_{jax.process_index()}.json"), "w") as f:
    json.dump({"raised": raised, "seconds": time.monotonic() - t0}, f)
os._exit(0)
