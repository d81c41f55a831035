"""Save steps 0 and 1 of a manager, then die while step 2 is being committed.

Usage: ``python die_mid_save.py ROOT``. What a host that dies mid-save leaves in the root:
two complete steps and the leftovers of step 2, all of it written but not committed (the
process ends where Orbax would rename the staging folder, or write the commit file).
"""

import os
import sys

import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity

import modelshard as ms

mngr = ms.CheckpointManager(sys.argv[1], handle_signals=False)
for step in (0, 1):
    mngr.save(step, {"w": jnp.arange(4096.0) + step}, items={"data": {"pos": step}})
    mngr.wait_until_finished()


async def die(*args, **kwargs):
    os._exit(0)  # no exit guard, no finishing: the process is gone mid-save


atomicity.AtomicRenameTemporaryPath.finalize = die
atomicity.CommitFileTemporaryPath.finalize = die
mngr.save(2, {"w": jnp.arange(4096.0) + 2}, items={"data": {"pos": 2}})
mngr.wait_until_finished()
sys.exit("the save of step 2 was committed")
