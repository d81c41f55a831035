"""Process 1 is stuck before it reaches Orbax's first barrier of a save; process 0 saves.

Usage: ``python stuck_peer.py ROOT OUT``. Both open a ``CheckpointManager`` on ROOT and
save step 0 of a state sharded over a ``(data=2, model=4)`` mesh; process 1's Orbax
``save`` first sleeps (a stuck host). Process 0 records in ``OUT/result_0.json`` what its
save raised and after how many seconds, then exits at once (``os._exit``).
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
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

root, out = sys.argv[1], sys.argv[2]
mesh = ms.make_mesh({"data": 2, "model": 4})
state = ms.shard({"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32)}, P("data"), mesh)
if jax.process_index() == 1:
    real_save = ocp.AsyncCheckpointer.save

    def stuck(self, *args, **kwargs):
        time.sleep(600)
        return real_save(self, *args, **kwargs)

    ocp.AsyncCheckpointer.save = stuck
mngr = ms.CheckpointManager(root, handle_signals=False)
t0 = time.monotonic()
try:
    mngr.save(0, state)
    raised = None
except Exception as e:
    raised = {"type": type(e).__name__, "message": str(e)}
with open(os.path.join(out, f"result_{jax.process_index()}.json"), "w") as f:
    json.dump({"raised": raised, "seconds": time.monotonic() - t0}, f)
os._exit(0)
