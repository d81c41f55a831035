"""Save steps 0 and 1 of a manager, then die while step 2 is being committed.

Usage: ``python die_mid_save.py ROOT``. What a host that dies mid-save leaves in the root:
two complete steps and the leftovers of step 2: its arrays, record and items written, not
committed (the process ends before the step's metadata, its commit file and the rename).
"""

import os
import sys

import jax.numpy as jnp

import modelshard as ms
from modelshard._checkpoint import step_writer

mngr = ms.CheckpointManager(sys.argv[1], handle_signals=False)
for step in (0, 1):
    mngr.save(step, {"w": jnp.arange(4096.0) + step}, items={"data": {"pos": step}})
    mngr.wait_until_finished()


def die(*args, **kwargs):
    os._exit(0)  # no exit guard, no finishing: the process is gone mid-save


step_writer.checkpoint_metadata = die
mngr.save(2, {"w": jnp.arange(4096.0) + 2}, items={"data": {"pos": 2}})
mngr.wait_until_finished()
sys.exit("the save of step 2 was committed")
