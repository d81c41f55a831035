"""A ``CheckpointManager`` on two processes, opened on a root where Orbax's own manager saved
steps 10, 15 and 20: Orbax's step 20 restored with its items, a loop over steps 5..25
(``max_to_keep=2``) that asks ``should_save`` every step, then ``save(20)`` called anyway,
then ``delete(20)`` and ``save(20)``.

Usage: ``python foreign_steps.py ROOT OUT``. Each process records in
``OUT/result_<process>.json`` the warnings it gave when opening, what it restored of
Orbax's step 20, the steps it saved, what ``save(20)`` raised, and the steps listed at the
end.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import warnings

import modelshard as ms

faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a stuck run
ms.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main() -> int:
    root, out = sys.argv[1:3]
    me = jax.process_index()
    mesh = ms.make_mesh({"data": 2, "model": 4})

    def state(step: int) -> dict:
        return ms.shard({"w": np.full((8, 8), float(step), np.float32)}, P("data"), mesh)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mngr = ms.CheckpointManager(root, max_to_keep=2, keep_steps=[20], handle_signals=False)
    warned = [type(w.message).__name__ for w in said if issubclass(w.category, UserWarning)]
    orbax = mngr.restore(20, like={"w": np.zeros(4, np.float32)}, specs=P(), mesh=mesh)
    orbax_items = mngr.items(20)
    saved = []
    for step in range(5, 26):
        if mngr.should_save(step):
            mngr.save(step, state(step))
            saved.append(step)
    mngr.wait_until_finished()
    try:
        mngr.save(20, state(20), force=True)
        raised = None
    except ms.CheckpointError as e:
        raised = {"type": type(e).__name__, "message": str(e), "step": getattr(e, "step", None)}
    steps = mngr.all_steps()
    mngr.delete(20)
    mngr.save(20, state(99))
    mngr.wait_until_finished()
    restored = mngr.restore(20, like=state(0))
    value = float(np.asarray(restored["w"].addressable_shards[0].data)[0, 0])
    result = {
        "warned": warned,
        "orbax 20": float(np.asarray(orbax["w"].addressable_shards[0].data)[0]),
        "items 20": orbax_items,
        "saved": saved,
        "raised": raised,
        "steps": steps,
        "steps after": mngr.all_steps(),
        "restored 20": value,
    }
    mngr.close()
    with open(os.path.join(out, f"result_{me}.json"), "w") as f:
        json.dump(result, f)
    ms.distributed.barrier("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
