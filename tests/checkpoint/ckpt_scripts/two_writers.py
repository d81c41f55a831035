"""One of two writers on the same ``CheckpointManager`` directory, for the concurrency test.

``two_writers.py ROOT NAME OFFSET STEPS``: waits for ``ROOT/go``, then saves steps
1..STEPS whose values are ``OFFSET + step`` (so a reader can tell whose step it got, or a
mix), printing ``<NAME> SAVED <step>`` or ``<NAME> REFUSED <step> <error type>: <message>``.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def values(offset: int, step: int):  # type: ignore[no-untyped-def]
    import numpy as np

    return {
        "w": np.full((64, 64), offset + step, np.float32),
        "v": np.arange(4096, dtype=np.int32) + offset + step,
    }


def main() -> None:
    root, name, offset, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    import modelshard as ms

    deadline = time.monotonic() + 120
    while not os.path.exists(f"{root}/go") and time.monotonic() < deadline:
        time.sleep(0.005)
    mngr = ms.CheckpointManager(f"{root}/mngr", async_save=False)
    for step in range(1, steps + 1):
        try:
            mngr.save(step, values(offset, step))
            print(f"{name} SAVED {step}", flush=True)
        except Exception as e:
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            print(f"{name} REFUSED {step} {type(e).__name__}: {msg}", flush=True)
    mngr.close()


if __name__ == "__main__":
    main()
