"""A zygote for crash tests: import JAX, Orbax and modelshard once, then fork one saver per
``fork ROOT`` line on stdin (or, for ``x64 ROOT``, a child running ``x64_round_trip.py``,
which turns on ``jax_enable_x64`` before it uses JAX). Each saver resumes the ``CheckpointManager`` in ROOT at its
latest step + 1 and saves forever, printing ``<pid> START <step>`` once its backend is up
and ``<pid> COMMITTED <step>`` after each step it knows is on disk. The test SIGKILLs savers
at random moments; SIGCHLD is ignored so the zygote never leaves zombies.

Nothing touches a JAX backend before the fork, so every saver initialises its own.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np


def state_arrays(step: int) -> dict[str, np.ndarray]:
    """The values saved as ``step`` (NumPy only, so the test can rebuild them)."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((128, 96)).astype(np.float32),
        "b": rng.standard_normal(96).astype(np.float16),
        "i": rng.integers(-(2**31), 2**31 - 1, (32, 3), dtype=np.int64).astype(np.int32),
        "step": np.asarray(step, np.int32),
        "key_data": np.asarray([step, step ^ 0x5A5A5A5A], np.uint32),
    }


def state(step: int):  # type: ignore[no-untyped-def]
    import jax

    arrays = state_arrays(step)
    key = jax.random.wrap_key_data(arrays.pop("key_data"))
    return {**arrays, "opt": {"key": key, "mu": arrays["w"] * 0.5}}


def saver(root: str) -> None:
    """Asynchronous manager saves of every step; every third step also ``save(overwrite=True)``
    of ``ROOT/plain`` (printed as ``PLAIN <step>`` once it returned)."""
    import modelshard as ms

    with ms.CheckpointManager(f"{root}/mngr", max_to_keep=3, async_save=True) as mngr:
        step = (mngr.latest_step() or 0) + 1
        print(f"{os.getpid()} START {step}", flush=True)
        while True:
            mngr.save(step, state(step))
            if step % 3 == 0:
                ms.save(f"{root}/plain", state(step), overwrite=True)
                print(f"{os.getpid()} PLAIN {step}", flush=True)
            if step % 2 == 0:
                mngr.wait_until_finished()
                print(f"{os.getpid()} COMMITTED {step}", flush=True)
            step += 1


def main() -> None:
    import jax  # noqa: F401  (imported, not initialised: each saver initialises its own)
    import orbax.checkpoint  # noqa: F401

    import modelshard  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd, _, root = line.strip().partition(" ")
        if cmd not in ("fork", "x64"):
            break
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                if cmd == "x64":
                    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                    import x64_round_trip

                    x64_round_trip.main(root)
                    os._exit(0)
                saver(root)
            except BaseException as e:
                print(f"{os.getpid()} FAILED {type(e).__name__}: {e}", flush=True)
            finally:
                os._exit(1)
        print(f"FORKED {pid}", flush=True)


if __name__ == "__main__":
    main()
