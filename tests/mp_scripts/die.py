"""Two JAX processes; process 1 is SIGKILLed mid-run while process 0 waits in a collective.

Usage: ``python die.py DIR``: each process writes its pid to ``DIR/pid<i>`` first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import modelshard as ms

ms.distributed.initialize()

import jax  # noqa: E402

out = sys.argv[1]
me = jax.process_index()
with open(os.path.join(out, f"pid{me}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(out, f"pid{me}.tmp"), os.path.join(out, f"pid{me}"))
ms.distributed.barrier("started")
print(f"process {me} of {jax.process_count()} running", flush=True)
if me == 1:
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
ms.distributed.barrier("never reached by process 1")
time.sleep(300)
